"""DRA claims resolved through their DeviceClasses (gpufence/webhook/dra.py): the CEL reading, the
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
from gpufence.webhook.admission import ReviewResult, review
from gpufence.webhook.dra import (
    DraSnapshot,
    claim_classes,
    claim_warnings,
    class_drivers,
    driver_name,
    resolve_pod_claims,
    selector_drivers,
)
from gpufence.webhook.dra_cache import DraCache
from gpufence.webhook.settings import AllNamespacesOptedIn, InjectionSettings
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
    if ANNOTATION_STATUS not in annotations:
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


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(good_pods, pods))
def test_the_resolution_never_changes_the_pod(pod: dict[str, Any]) -> None:
    """For any pod, the review with the DRA objects answers as the review without them, warnings aside."""
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
