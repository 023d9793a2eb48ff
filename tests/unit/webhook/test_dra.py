"""DRA claims resolved through their DeviceClasses (gpufence/webhook/core/dra.py): the CEL reading, the
resolution of a pod's claims, and what the review says about them. The watch cache that feeds the
resolution in a cluster is exercised on the real API server (tests/e2e/test_dra.py)."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufence.contract import ANNOTATION_STATUS, ENV_POD_STATUS, SIDECAR_NAME
from gpufence.webhook.cluster.dra_cache import DraCache
from gpufence.webhook.core.admission import ReviewResult, review
from gpufence.webhook.core.dra import (
    DraSnapshot,
    MemoryAsk,
    claim_classes,
    claim_memory,
    claim_memory_asks,
    claim_warnings,
    class_drivers,
    driver_name,
    resolve_pod_claims,
    selector_drivers,
)
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings
from tests.support.examples import examples
from tests.unit.webhook.test_admission import good_pods, pods, request

GPU = ("gpu.nvidia.com",)


@pytest.mark.parametrize(("expression", "drivers"), [
    # NVIDIA's classes (dra-driver-nvidia-gpu): the driver, then the device type.
    ("device.driver == 'gpu.nvidia.com'", {"gpu.nvidia.com"}),
    ("device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'", {"gpu.nvidia.com"}),
    ('device.driver == "gpu.nvidia.com"', {"gpu.nvidia.com"}),
    ("  device . driver=='nic.example.com'  ", {"nic.example.com"}),
    ("'nic.example.com' == device.driver", {"nic.example.com"}),
    ("(device.driver == 'nic.example.com')", {"nic.example.com"}),
    ("device.driver in ['a.example.com', \"b.example.com\"]", {"a.example.com", "b.example.com"}),
    ("device.driver == 'a.example.com' || device.driver == 'b.example.com'", {"a.example.com", "b.example.com"}),
    ("device.capacity['x'].memory > 1 && device.driver == 'nic.example.com'", {"nic.example.com"}),
    ("(device.driver == 'a' || device.driver == 'b') && device.driver == 'b'", {"b"}),
    ("device.driver == 'a' && device.driver == 'b'", set()),  # matches nothing
    ("device.driver == 'a&&b || c'", {"a&&b || c"}),  # operators inside a string are text
    # What pins nothing: the class may select any driver's devices, GPUs included.
    ("true", None),
    ("", None),
    ("device.driver != 'nic.example.com'", None),
    ("!(device.driver == 'nic.example.com')", None),
    ("device.driver == 'nic.example.com' || true", None),
    ("device.driver.startsWith('nic')", None),
    ("device.driver == r'nic.example.com'", None),
    ("device.driver == 'nic\\x2eexample.com'", None),
    ("x ? device.driver == 'a' : true && device.driver == 'b'", None),  # the ternary binds loosest
    ("device.driver == 'nic.example.com' && true // comment\n || true", None),
    ("device.driver == 'nic.example.com' && (", None),
    ("device.driver == 'nic.example.com' && )(", None),
])
def test_which_drivers_a_selector_pins(expression: str, drivers: set[str] | None) -> None:
    assert selector_drivers(expression) == (None if drivers is None else frozenset(drivers))


@given(st.text(alphabet="device.r=!'\"()&|?[], abc/\n\\", max_size=60))
def test_the_reading_is_total(expression: str) -> None:
    result = selector_drivers(expression)
    assert result is None or isinstance(result, frozenset)


def device_class(name: str, *expressions: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"selectors": [{"cel": {"expression": e}} for e in expressions]}}


def test_a_class_selects_what_all_its_selectors_allow() -> None:
    assert class_drivers(device_class("c")) is None  # no selector: every device
    assert class_drivers(device_class("c", "true", "device.driver == 'nic'")) == frozenset({"nic"})
    assert class_drivers(device_class("c", "device.driver in ['a', 'b']", "device.driver == 'b'")) == frozenset({"b"})
    assert class_drivers({"metadata": {"name": "c"}, "spec": {"selectors": [{"cel": None}, "x"]}}) is None


def test_the_classes_of_a_claim_spec() -> None:
    spec = {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu"}},
        {"name": "any", "firstAvailable": [{"name": "big", "deviceClassName": "mig"},
                                           {"name": "whole", "deviceClassName": "gpu"}]},
        "garbage", {"exactly": {"deviceClassName": 3}}]}}
    assert claim_classes(spec) == ("gpu", "mig")
    assert claim_classes(None) == () and claim_classes({"devices": {"requests": "x"}}) == ()


@pytest.mark.parametrize("name", ["gpu.nvidia.com", "gpu-1.example.com", "x"])
def test_driver_names(name: str) -> None:
    assert driver_name(f" {name} ") == name


@pytest.mark.parametrize("name", ["", "GPU.nvidia.com", "gpu.nvidia.com.", "a" * 64, "gpu/nvidia"])
def test_bad_driver_names(name: str) -> None:
    with pytest.raises(ValueError, match=r"gpu\.nvidia\.com"):
        driver_name(name)


def template(namespace: str, name: str, *classes: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}, "spec": {"spec": {"devices": {"requests": [
        {"name": f"r{i}", "exactly": {"deviceClassName": c}} for i, c in enumerate(classes)]}}}}


def claim(namespace: str, name: str, *classes: str) -> dict[str, Any]:
    spec = template(namespace, name, *classes)["spec"]["spec"]
    return {"metadata": {"namespace": namespace, "name": name}, "spec": spec}


OBJECTS = DraSnapshot.of(
    classes=[device_class("gpu", "device.driver == 'gpu.nvidia.com'"),
             device_class("mig", "device.driver == 'gpu.nvidia.com' && "
                                 "device.attributes['gpu.nvidia.com'].type == 'mig'"),
             device_class("nic", "device.driver == 'nic.example.com'"),
             device_class("fpga", "device.driver == 'fpga.example.com'"),
             device_class("anything")],
    templates=[template("team", "single-gpu", "gpu"), template("team", "nic-t", "nic"),
               template("team", "nic-fpga", "nic", "fpga"), template("team", "nic-or-mig", "nic", "mig"),
               template("team", "anything-t", "anything"), template("team", "unknown-class", "nope"),
               template("team", "empty")],
    claims=[claim("team", "shared-gpu", "gpu"), claim("team", "nic-claim", "nic"), claim("other", "elsewhere", "gpu")],
)


@pytest.mark.parametrize(("pod_claim", "verdict", "detail"), [
    ({"resourceClaimTemplateName": "single-gpu"}, "gpu", 'driver "gpu.nvidia.com"'),
    ({"resourceClaimName": "shared-gpu"}, "gpu", 'DeviceClass "gpu"'),
    ({"resourceClaimTemplateName": "nic-or-mig"}, "gpu", 'DeviceClass "mig"'),
    ({"resourceClaimTemplateName": "anything-t"}, "gpu", "does not pin a driver"),
    ({"resourceClaimTemplateName": "nic-t"}, "not-gpu", 'DeviceClass "nic" (nic.example.com)'),
    ({"resourceClaimTemplateName": "nic-fpga"}, "not-gpu", '"nic" (nic.example.com), "fpga" (fpga.example.com)'),
    ({"resourceClaimName": "nic-claim"}, "not-gpu", "nic.example.com"),
    ({"resourceClaimTemplateName": "empty"}, "not-gpu", "requests no device"),
    ({"resourceClaimTemplateName": "absent"}, "unresolved", 'ResourceClaimTemplate "absent" in namespace "team"'),
    ({"resourceClaimName": "elsewhere"}, "unresolved", "does not know ResourceClaim"),  # another namespace's
    ({"resourceClaimTemplateName": "unknown-class"}, "unresolved", 'does not know DeviceClass "nope"'),
])
def test_a_pod_claim_resolves_through_its_classes(pod_claim: dict[str, str], verdict: str, detail: str) -> None:
    spec = {"resourceClaims": [{"name": "c", **pod_claim}, {"name": "no-object"}, "garbage"]}
    resolved = resolve_pod_claims("team", spec, OBJECTS, GPU)
    assert list(resolved) == ["c"]
    assert resolved["c"].verdict == verdict
    assert detail in resolved["c"].detail


def test_the_gpu_drivers_are_policy() -> None:
    spec = {"resourceClaims": [{"name": "c", "resourceClaimTemplateName": "nic-t"}]}
    assert resolve_pod_claims("team", spec, OBJECTS, ("nic.example.com",))["c"].verdict == "gpu"
    assert resolve_pod_claims("team", spec, OBJECTS, ())["c"].verdict == "not-gpu"


def test_nothing_resolves_while_the_cache_cannot_answer() -> None:
    unavailable = DraSnapshot(OBJECTS.classes, OBJECTS.claims, OBJECTS.templates,
                              why_unavailable="the API server does not serve resource.k8s.io/v1")
    spec = {"resourceClaims": [{"name": "c", "resourceClaimTemplateName": "single-gpu"}]}
    (resolution,) = resolve_pod_claims("team", spec, unavailable, GPU).values()
    assert (resolution.verdict, resolution.detail) == ("unresolved", "the API server does not serve resource.k8s.io/v1")


def claim_pod(*pod_claims: tuple[str, str, str], used: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A pod with ``(name, kind, object)`` claims, used by its one container (all, or ``used``)."""
    names = [n for n, _, _ in pod_claims] if used is None else list(used)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "annotations": {"gpufence.io/memory": "1Gi"}},
        "spec": {"containers": [{"name": "c", "image": "i", "resources": {"claims": [{"name": n} for n in names]}}],
                 "resourceClaims": [{"name": n, kind: obj} for n, kind, obj in pod_claims]},
    }


T, C = "resourceClaimTemplateName", "resourceClaimName"


def reviewed(pod: dict[str, Any], result: ReviewResult) -> tuple[dict[str, Any], list[str]]:
    """The pod as the review leaves it, without the warnings of its status annotation (nor the
    sidecar's variable that hands them to the enforcer, written only when there are some), and those
    warnings."""
    response = result.review["response"]
    patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"]))) \
        if "patch" in response else pod
    annotations = (patched.get("metadata") or {}).get("annotations") or {}
    brought = (pod.get("metadata") or {}).get("annotations") or {}
    if annotations.get(ANNOTATION_STATUS, brought.get(ANNOTATION_STATUS)) == brought.get(ANNOTATION_STATUS):
        # No status, or the pod's own (any string, on a pod the review gives no share): not the webhook's.
        return patched, []
    status = json.loads(annotations[ANNOTATION_STATUS])
    recorded = status.pop("warnings", [])
    patched = {**patched, "metadata": {**patched["metadata"], "annotations": {
        **annotations, ANNOTATION_STATUS: json.dumps(status, sort_keys=True)}}}
    spec = patched["spec"]
    patched["spec"] = {**spec, **{key: [
        {**c, "env": [e for e in c.get("env") or () if e.get("name") != ENV_POD_STATUS]}
        if c.get("name") == SIDECAR_NAME else c for c in spec[key]]
        for key in ("initContainers", "containers") if spec.get(key)}}
    return patched, recorded


@pytest.mark.parametrize(("pod_claims", "listed", "warned"), [
    ([("gpu", T, "single-gpu")], (), []),
    ([("gpu", C, "shared-gpu")], (), []),
    ([("nic", T, "nic-t")], ("nic-t",), []),
    ([("nic", T, "nic-t")], (), ['claim "nic" (ResourceClaimTemplate "nic-t") holds no GPU (DeviceClass "nic" '
                                 '(nic.example.com)) but gets the enforcer: only the policy\'s list exempts a claim; '
                                 'an admin can list "nic-t" in non-gpu-resource-claims']),
    ([("gpu", T, "absent")], (), ['claim "gpu" (ResourceClaimTemplate "absent") is taken for a GPU (share and '
                                  'enforcer): it could not be resolved: the webhook does not know '
                                  'ResourceClaimTemplate "absent" in namespace "team"']),
    ([("gpu", T, "absent")], ("absent",), []),  # the admin's word, whatever it holds
    ([("gpu", T, "single-gpu")], ("single-gpu",), ['claim "gpu" (ResourceClaimTemplate "single-gpu") is listed in '
                                                   'non-gpu-resource-claims, so it runs without the enforcer, but '
                                                   'DeviceClass "gpu" selects devices of driver "gpu.nvidia.com"']),
])
def test_the_review_says_what_the_claims_hold_and_gives_the_pod_what_the_admins_list_decides(
    pod_claims: list[tuple[str, str, str]], listed: tuple[str, ...], warned: list[str],
) -> None:
    settings_ = InjectionSettings(non_gpu_resource_claims=listed)
    pod = claim_pod(*pod_claims)
    without = review(request(pod, namespace="team"), settings_, AllNamespacesOptedIn())
    result = review(request(pod, namespace="team"), settings_, AllNamespacesOptedIn(), OBJECTS)
    before = without.review["response"].get("warnings", [])
    assert [w.removeprefix("gpufence: ") for w in result.review["response"].get("warnings", [])
            if w not in before] == warned
    # The same pod either way (the enforcer's Events aside): a cache that lags behind a claim just
    # created must not change what the pod gets, nor make /validate refuse what /mutate made.
    assert result.outcome == without.outcome
    (pod_with, recorded), (pod_without, recorded_before) = reviewed(pod, result), reviewed(pod, without)
    assert pod_with == pod_without
    # Where the enforcer is injected it posts them as Events: a controller's pods show no admission warnings.
    assert [w.removeprefix("gpufence: ") for w in recorded if w not in recorded_before] == \
        (warned if result.outcome == "mutated" else [])
    if "patch" in result.review["response"]:  # a reinvocation finds nothing to change
        patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(result.review["response"]["patch"])))
        again = review(request(patched, namespace="team"), settings_, AllNamespacesOptedIn(), OBJECTS)
        assert again.outcome == "unchanged"
    assert result.outcome == ("mutated" if not listed else "unchanged")  # no sidecar, no void (a device)


def test_only_claims_a_container_uses_are_said() -> None:
    pod = claim_pod(("gpu", T, "single-gpu"), ("nic", T, "nic-t"), used=("gpu",))
    assert claim_warnings("team", pod["spec"], OBJECTS, GPU, ()) == []


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(good_pods, pods))
def test_the_resolution_never_changes_the_pod(pod: dict[str, Any]) -> None:
    """For any pod, the review with DRA objects whose claims ask no consumable capacity (so which
    GPU containers there are is all they could change) answers as the review without them, warnings
    aside."""
    without = review(request(pod), InjectionSettings(), AllNamespacesOptedIn())
    result = review(request(pod), InjectionSettings(), AllNamespacesOptedIn(), OBJECTS)
    assert result.outcome == without.outcome
    if result.review["response"]["allowed"]:
        assert reviewed(pod, result)[0] == reviewed(pod, without)[0]
    else:
        assert result.review["response"]["status"] == without.review["response"]["status"]


class RefusingApi:
    """The Kubernetes client's CustomObjectsApi where every list fails with ``status`` (the boundary)."""

    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason

    def list_cluster_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client import ApiException

        raise ApiException(status=self.status, reason=self.reason)


@pytest.mark.parametrize(("status", "reason", "why"), [
    (404, "Not Found", "the API server does not serve resource.k8s.io/v1"),
    (403, "Forbidden", "the webhook cannot list deviceclasses (HTTP 403 Forbidden)"),
])
def test_the_cache_says_why_it_cannot_answer(status: int, reason: str, why: str) -> None:
    cache = DraCache(RefusingApi(status, reason), min_backoff=60)
    assert cache.unavailable() == "the webhook's DRA cache has not synced yet"
    cache.start()
    try:
        for watch in (cache.classes, cache.claims, cache.templates):
            assert watch.wait_for(lambda w: w.failure is not None, timeout=10)
        assert cache.unavailable() == why
        assert not cache.has_synced()
    finally:
        cache.stop(5)


# --- consumable capacity: what a claim reserved on a shareable GPU is the share ----------------

def capacity_template(name: str, *requests: dict[str, Any], namespace: str = "team") -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}, "spec": {"spec": {"devices": {"requests":
                                                                                              list(requests)}}}}


def asks(name: str, device_class: str, memory: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": device_class, "capacity": {"requests": {"memory": memory}}}}


def test_the_memory_a_claim_spec_asks() -> None:
    spec = {"devices": {"requests": [
        asks("a", "gpu", "30Gi"),
        {"name": "b", "firstAvailable": [
            {"name": "small", "deviceClassName": "gpu", "capacity": {"requests": {"memory": "10Gi"}}},
            {"name": "whole", "deviceClassName": "gpu"}]},
        {"name": "c", "exactly": {"deviceClassName": "gpu", "capacity": {"requests": {"cores": "10"}}}},
        asks("d", "gpu", "-1Gi"), asks("e", "gpu", "lots"), asks("f", "gpu", True), "garbage"]}}
    assert claim_memory_asks(spec) == (MemoryAsk("a", "gpu", "30Gi", 30 << 30),
                                       MemoryAsk("b/small", "gpu", "10Gi", 10 << 30))
    assert claim_memory_asks(None) == () and claim_memory_asks({"devices": {"requests": [{"exactly": 3}]}}) == ()


CAPACITY = DraSnapshot.of(
    classes=[device_class("gpu", "device.driver == 'gpu.nvidia.com'"),
             device_class("nic", "device.driver == 'nic.example.com'"), device_class("anything")],
    templates=[capacity_template("gpu-30g", asks("gpu", "gpu", "30Gi")),
               capacity_template("gpu-10g", asks("gpu", "gpu", "10Gi")),
               capacity_template("two", asks("big", "gpu", "30Gi"), asks("small", "anything", "20Gi")),
               capacity_template("either", {"name": "gpu", "firstAvailable": [
                   {"name": "big", "deviceClassName": "gpu", "capacity": {"requests": {"memory": "40Gi"}}},
                   {"name": "small", "deviceClassName": "gpu", "capacity": {"requests": {"memory": "20Gi"}}}]}),
               capacity_template("nic-mem", asks("nic", "nic", "1Gi")),
               capacity_template("unknown-class", asks("gpu", "nope", "1Gi")),
               capacity_template("whole", {"name": "gpu", "exactly": {"deviceClassName": "gpu"}})],
    claims=[{"metadata": {"namespace": "team", "name": "named-8g"},
             "spec": capacity_template("x", asks("gpu", "gpu", "8Gi"))["spec"]["spec"]}],
)


@pytest.mark.parametrize(("template", "share", "warned"), [
    ("gpu-30g", 30 << 30, []),
    ("two", 20 << 30, ['container "c": its claims ask different amounts of GPU memory, so the smallest ("20Gi") '
                       "is its share on each GPU"]),
    ("either", 20 << 30, ['container "c": its claims ask different amounts of GPU memory, so the smallest '
                          '("20Gi") is its share on each GPU']),
    ("nic-mem", None, []),  # another driver's devices: no GPU memory
    ("unknown-class", None, []),  # said as unresolved by claim_warnings
    ("whole", None, []),  # no capacity asked: gpufence's annotations and defaults
    ("absent", None, []),
])
def test_a_containers_share_is_the_smallest_memory_its_gpu_claims_ask(template: str, share: int | None,
                                                                     warned: list[str]) -> None:
    spec = {"resourceClaims": [{"name": "g", "resourceClaimTemplateName": template}]}
    shares, warnings = claim_memory("team", spec, CAPACITY, GPU, {"c": ["g"]})
    assert (shares["c"].share.bytes if "c" in shares else None) == share
    assert [w.removeprefix("gpufence: ") for w in warnings] == warned


def test_a_claim_two_containers_use_is_divided_between_them() -> None:
    spec = {"resourceClaims": [{"name": "g", "resourceClaimTemplateName": "gpu-30g"},
                               {"name": "n", "resourceClaimName": "named-8g"}]}
    shares, warnings = claim_memory("team", spec, CAPACITY, GPU, {"a": ["g"], "b": ["g"], "c": ["n"]})
    assert {k: v.share.bytes for k, v in shares.items()} == {"a": 15 << 30, "b": 15 << 30, "c": 8 << 30}
    assert "shared by 2 containers" in shares["a"].origin and shares["a"].accepted == str(15 << 30)
    assert shares["c"].origin == ('claim "n" (ResourceClaim "named-8g") request "gpu" '
                                  'capacity.requests.memory="8Gi"')
    assert warnings == ['gpufence: claim "g" is used by 2 containers, so its GPU memory is divided between them as '
                        "their shares; give each container its own claim for another split"]


def test_no_capacity_share_while_the_cache_cannot_answer() -> None:
    unavailable = DraSnapshot(CAPACITY.classes, CAPACITY.claims, CAPACITY.templates, "not synced",
                              CAPACITY.claim_asks, CAPACITY.template_asks)
    spec = {"resourceClaims": [{"name": "g", "resourceClaimTemplateName": "gpu-30g"}]}
    assert claim_memory("team", spec, unavailable, GPU, {"c": ["g"]}) == ({}, [])


def capacity_review(template: str, annotations: dict[str, str], **policy: Any) -> ReviewResult:
    pod = claim_pod(("gpu", T, template))
    pod["metadata"]["annotations"] = annotations
    return review(request(pod, namespace="team"), InjectionSettings(**policy), AllNamespacesOptedIn(), CAPACITY)


@pytest.mark.parametrize(("annotations", "policy", "memory", "denied"), [
    ({}, {}, {"memoryBytes": 30 << 30}, None),
    ({"gpufence.io/memory": "20Gi"}, {}, {"memoryBytes": 20 << 30}, None),
    ({"gpufence.io/memory.c": "30Gi"}, {}, {"memoryBytes": 30 << 30}, None),
    ({"gpufence.io/memory": "25%"}, {}, {"memoryBytes": 30 << 30, "memoryPercent": 25}, None),
    ({}, {"default_memory": "8Gi"}, {"memoryBytes": 30 << 30}, None),  # a default is no request of the pod's
    ({}, {"default_memory": "typo"}, {"memoryBytes": 30 << 30}, None),  # not parsed where it does not apply
    ({}, {"max_memory": "25%"}, {"memoryBytes": 30 << 30, "memoryPercent": 25}, None),  # both apply
    ({"gpufence.io/memory": "31Gi"}, {}, None, 'annotation gpufence.io/memory="31Gi" is above what container "c"'),
    ({}, {"max_memory": "16Gi"}, None, 'container "c": claim "gpu" (ResourceClaimTemplate "gpu-30g") request '
                                       '"gpu" capacity.requests.memory="30Gi" is above the memory ceiling'),
    ({"gpufence.io/memory": "50%"}, {"max_memory": "25%"}, None, 'annotation gpufence.io/memory="50%" is above'),
])
def test_the_claims_memory_is_the_share_within_the_ceilings_and_an_annotation_only_lowers_it(
        annotations: dict[str, str], policy: dict[str, Any], memory: dict[str, Any] | None, denied: str | None) -> None:
    result = capacity_review("gpu-30g", annotations, **policy)
    response = result.review["response"]
    if denied is not None:
        assert result.outcome == "denied" and denied in response["status"]["message"]
        return
    assert result.outcome == "mutated", response.get("status")
    patched, _ = reviewed(claim_pod(("gpu", T, "gpu-30g")) | {"metadata": {"name": "p", "annotations": annotations}},
                          result)
    sidecar = next(c for c in patched["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    config = json.loads(next(e["value"] for e in sidecar["env"] if e["name"] == "GPUFENCE_CONFIG"))
    assert {k: v for k, v in config["containers"]["c"].items() if k.startswith("memory")} == memory
    assert config.get("mode", "enforce") == "enforce"
