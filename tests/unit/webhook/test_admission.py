"""The AdmissionReview envelope, skips, and totality under arbitrary input."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpufence.webhook.core.admission import InvalidReview, ReviewResult, review
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings, NamespaceInfo
from tests.support.examples import examples

S = InjectionSettings()
NS = AllNamespacesOptedIn()


def request(obj: Any, **extra: Any) -> dict[str, Any]:
    req = {
        "uid": "u-1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "ns",
        "operation": "CREATE",
        "object": obj,
    }
    req.update(extra)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def gpu_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "annotations": {"gpufence.io/memory": "1Gi"}},
        "spec": {"containers": [{"name": "c", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }


def check_well_formed(result: ReviewResult, uid: Any = "u-1") -> list[dict[str, Any]] | None:
    answer = result.review
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == uid
    assert isinstance(response["allowed"], bool)
    json.dumps(answer)  # serialisable
    assert result.outcome in ("mutated", "unchanged", "denied", "skipped")
    for warning in response.get("warnings", []):
        assert isinstance(warning, str) and len(warning) <= 256
    if not response["allowed"]:
        assert result.outcome == "denied"
        assert response["status"]["code"] == 400 and response["status"]["message"]
        assert "patch" not in response
        return None
    assert result.outcome != "denied"
    if "patch" in response:
        assert result.outcome == "mutated" and response["patchType"] == "JSONPatch"
        return json.loads(base64.b64decode(response["patch"], validate=True))
    assert result.outcome != "mutated"
    return None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([], "JSON object"),
        ("x", "JSON object"),
        ({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u"}}, "apiVersion"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "Pod", "request": {"uid": "u"}}, "kind"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "request"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": []}, "request"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}, "uid"),
        ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 7}}, "uid"),
    ],
)
def test_invalid_envelopes(payload: Any, message: str) -> None:
    with pytest.raises(InvalidReview, match=message):
        review(payload, S, NS)


@pytest.mark.parametrize(
    "extra",
    [
        {"operation": "UPDATE"},
        {"operation": "DELETE", "object": None},
        {"kind": {"group": "apps", "version": "v1", "kind": "Deployment"}},
        {"kind": {"group": "", "version": "v1", "kind": "Pod"}, "subResource": "ephemeralcontainers"},
        {"kind": None, "resource": {"group": "", "version": "v1", "resource": "services"}},
    ],
)
def test_non_pod_creations_are_skipped(extra: dict[str, Any]) -> None:
    result = review(request(gpu_pod(), **extra), S, NS)
    assert result.outcome == "skipped"
    assert result.review["response"] == {"uid": "u-1", "allowed": True}


def test_kind_missing_falls_back_to_resource() -> None:
    result = review(request(gpu_pod(), kind=None), S, NS)
    assert result.outcome == "mutated"


def test_namespace_not_opted_in_is_skipped_and_unknown_is_injected_with_warning() -> None:
    class Lookup:
        def __init__(self, info: NamespaceInfo | None) -> None:
            self.info = info

        def get(self, name: str) -> NamespaceInfo | None:
            assert name == "ns"
            return self.info

    assert review(request(gpu_pod()), S, Lookup(NamespaceInfo(name="ns"))).outcome == "skipped"
    unknown = review(request(gpu_pod()), S, Lookup(None))
    assert unknown.outcome == "mutated"
    assert any("not in the webhook's cache" in w for w in unknown.review["response"]["warnings"])


class _NotCached:
    def get(self, name: str) -> NamespaceInfo | None:
        return None


@pytest.mark.parametrize("mutate", [
    lambda p: p["metadata"]["annotations"].update({"gpufence.io/memory": "lots"}),  # a share's denial
    lambda p: p["spec"]["containers"][0].update(env=5),  # the shape's
    lambda p: p["spec"].update(hostPID=True),  # the desired pod's
])
def test_a_denial_carries_the_warnings_said_before_it(mutate: Any) -> None:
    """The review's stages return their warnings; one that denies does not lose those of the
    stages before it (here: the namespace not yet in the webhook's cache)."""
    pod = gpu_pod()
    mutate(pod)
    result = review(request(pod), S, _NotCached())
    response = result.review["response"]
    assert result.outcome == "denied" and response["allowed"] is False, response
    assert [w for w in response["warnings"] if "not in the webhook's cache" in w], response


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda p: p["spec"]["containers"][0].update(env="x"), "spec.containers[0].env must be a list"),
        (lambda p: p["spec"]["containers"].append({"name": "c"}), 'container name "c" is used more than once'),
        (lambda p: p["spec"]["containers"][0].update(name="gpufence-enforcer"), "reserved"),
        (lambda p: p["metadata"]["annotations"].update(x=1), "must be a string"),
        (lambda p: p["spec"].update(volumes={}), "spec.volumes must be a list"),
        (lambda p: p["spec"].update(shareProcessNamespace="yes"), "must be a boolean"),
        (lambda p: p["spec"].update(securityContext=[]), "spec.securityContext must be an object"),
        (lambda p: p["spec"].update(securityContext={"runAsUser": "0"}), "runAsUser must be an integer"),
        (lambda p: p["spec"].update(securityContext={"runAsUser": True}), "runAsUser must be an integer"),
        (lambda p: p["spec"].update(securityContext={"runAsNonRoot": "true"}), "runAsNonRoot must be a boolean"),
        (
            lambda p: p["spec"]["containers"][0].update(securityContext={"runAsGroup": 1.5}),
            "spec.containers[0].securityContext.runAsGroup must be an integer",
        ),
    ],
)
def test_malformed_gpu_pods_are_denied(mutate, fragment: str) -> None:
    pod = gpu_pod()
    mutate(pod)
    result = review(request(pod), S, NS)
    check_well_formed(result)
    assert result.outcome == "denied"
    assert fragment in result.review["response"]["status"]["message"]


def test_garbage_object_is_denied() -> None:
    result = review(request([1, 2]), S, NS)
    assert result.outcome == "denied"


def test_deeply_nested_garbage_in_a_gpu_pod() -> None:
    pod = gpu_pod()
    deep: Any = "x"
    for _ in range(500):
        deep = {"a": [deep]}
    pod["spec"]["containers"][0]["args"] = deep
    pod["spec"]["affinity"] = deep
    result = review(request(pod), S, NS)
    patch = check_well_formed(result)
    assert patch is not None


def test_huge_strings() -> None:
    pod = gpu_pod()
    pod["metadata"]["annotations"]["gpufence.io/memory"] = "9" * 1_000_000
    result = review(request(pod), S, NS)
    assert result.outcome == "denied"
    assert len(result.review["response"]["status"]["message"]) < 400


# --- hypothesis: review is total ----------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=12,
)


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return strategy | json_values


def fresh(value: Any) -> st.SearchStrategy:
    """A new copy of ``value`` for every draw. ``st.just`` hands out one shared object, and a pod
    that holds the same dict in two places (which no decoded AdmissionReview can) makes
    ``jsonpatch.apply_patch``'s deep copy keep the aliasing: patching one place changes the other,
    and the idempotency pass then fails on the test's own input."""
    return st.builds(lambda: copy.deepcopy(value))


names = st.sampled_from(["a", "b", "c", "gpufence-enforcer", "LD_PRELOAD", ""]) | st.text(max_size=4)
quantities = st.sampled_from(["1", "0", "2", "-1", "1Gi", "x", "500m"]) | json_values
annotation_values = st.sampled_from(
    ["8Gi", "25%", "50", "lots", "0", "150%", "audit", "enforce", "30", "-1", "1E999999999", "1.5Gi"]
)
annotation_keys = st.sampled_from(
    [
        "gpufence.io/memory",
        "gpufence.io/compute",
        "gpufence.io/mode",
        "gpufence.io/grace-period",
        "gpufence.io/memory.a",
        "gpufence.io/compute.b",
        "gpufence.io/memory.zz",
        "gpufence.io/status",
        "kubernetes.io/config.mirror",
        "x/y~z",
    ]
)
env_entries = st.fixed_dictionaries(
    {"name": maybe(st.sampled_from(["LD_PRELOAD", "GPUFENCE_CONTAINER", "TF_FORCE_GPU_ALLOW_GROWTH", "X"]))},
    optional={"value": maybe(st.text(max_size=10)), "valueFrom": json_values},
)
containers = st.fixed_dictionaries(
    {"name": maybe(names)},
    optional={
        "image": st.just("i"),
        "resources": maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "limits": maybe(st.dictionaries(st.sampled_from(["nvidia.com/gpu", "cpu"]), quantities)),
                    "requests": maybe(st.dictionaries(st.sampled_from(["nvidia.com/gpu", "memory"]), quantities)),
                },
            )
        ),
        "env": maybe(st.lists(maybe(env_entries), max_size=3)),
        "volumeMounts": maybe(
            st.lists(maybe(st.fixed_dictionaries({"name": names, "mountPath": st.text(max_size=5)})), max_size=2)
        ),
        "ports": maybe(
            st.lists(maybe(st.fixed_dictionaries({"containerPort": st.sampled_from([9401, 80])})), max_size=2)
        ),
        "restartPolicy": maybe(st.just("Always")),
    },
)
pods = st.fixed_dictionaries(
    {},
    optional={
        "apiVersion": st.just("v1"),
        "kind": st.just("Pod"),
        "metadata": maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "name": maybe(st.text(max_size=5)),
                    "namespace": maybe(st.just("ns")),
                    "labels": maybe(
                        st.dictionaries(
                            st.sampled_from(["gpufence.io/inject", "app"]), maybe(st.sampled_from(["false", "true"]))
                        )
                    ),
                    "annotations": maybe(st.dictionaries(annotation_keys, maybe(annotation_values), max_size=4)),
                },
            )
        ),
        "spec": maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "containers": maybe(st.lists(maybe(containers), max_size=3)),
                    "initContainers": maybe(st.lists(maybe(containers), max_size=2)),
                    "volumes": maybe(
                        st.lists(
                            maybe(st.fixed_dictionaries({"name": names}, optional={"emptyDir": fresh({})})),
                            max_size=2,
                        )
                    ),
                    "shareProcessNamespace": maybe(st.booleans()),
                    "hostPID": maybe(st.booleans()),
                },
            )
        ),
    },
)
# Mostly well-formed GPU pods, so the injection paths (not only the skips) are exercised.
good_env = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from(["X", "LD_PRELOAD", "TF_FORCE_GPU_ALLOW_GROWTH", "GPUFENCE_MEMORY_LIMIT"])},
        optional={"value": st.sampled_from(["", "/a.so", "v"]), "valueFrom": fresh({"fieldRef": {"fieldPath": "x"}})},
    ),
    max_size=3,
)


security_contexts = st.fixed_dictionaries(
    {},
    optional={
        "runAsUser": st.sampled_from([0, 1000, 2000]),
        "runAsGroup": st.sampled_from([0, 1000]),
        "runAsNonRoot": st.booleans(),
    },
)


def good_containers(pool: list[str], max_size: int) -> st.SearchStrategy:
    container = st.builds(
        lambda name, gpu, env, mounts, ports, context: {
            "name": name,
            "image": "i",
            "resources": {"limits": {"nvidia.com/gpu": gpu}},
            **({"env": env} if env is not None else {}),
            **({"volumeMounts": mounts} if mounts is not None else {}),
            **({"ports": ports} if ports else {}),
            **({"securityContext": context} if context is not None else {}),
        },
        st.sampled_from(pool),
        st.sampled_from(["1", "2", "0"]),
        st.none() | good_env,
        st.none()
        | st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["v", "gpufence-preload"]), "mountPath": st.sampled_from(["/x", "/y"])}
            ),
            max_size=1,
        ),
        st.lists(st.fixed_dictionaries({"containerPort": st.sampled_from([80, 9401])}), max_size=1),
        st.none() | security_contexts,
    )
    return st.lists(container, max_size=max_size, unique_by=lambda c: c["name"])


good_annotations = st.fixed_dictionaries(
    {},
    optional={
        "gpufence.io/memory": st.sampled_from(["8Gi", "25%", "1", "lots"]),
        "gpufence.io/memory.a": st.sampled_from(["1Gi", "50%"]),
        "gpufence.io/compute": st.sampled_from(["50", "10%", "0"]),
        "gpufence.io/compute.i1": st.sampled_from(["20"]),
        "gpufence.io/mode": st.sampled_from(["enforce", "audit", "x"]),
        "gpufence.io/grace-period": st.sampled_from(["5", "-1"]),
        "gpufence.io/status": st.just("{}"),
    },
)
good_pods = st.builds(
    lambda annotations, inits, main, volumes, share, context: {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", **({"annotations": annotations} if annotations is not None else {})},
        "spec": {
            "containers": main,
            **({"initContainers": inits} if inits is not None else {}),
            **({"volumes": volumes} if volumes is not None else {}),
            **({"shareProcessNamespace": share} if share is not None else {}),
            **({"securityContext": context} if context is not None else {}),
        },
    },
    st.none() | good_annotations,
    st.none() | good_containers(["i1", "i2", "gpufence-enforcer"], 2),
    good_containers(["a", "b", "c"], 3).filter(bool),
    st.none()
    | st.lists(
        st.fixed_dictionaries({"name": st.sampled_from(["v", "gpufence-state"])}, optional={"emptyDir": fresh({})}),
        max_size=2,
    ),
    st.none() | st.sampled_from([True, False]),
    st.none() | security_contexts,
)
setting_variants = st.builds(
    InjectionSettings,
    native_sidecar=st.booleans(),
    mps_limits=st.booleans(),
    mount_host_proc=st.booleans(),
    preload_library_host_path=st.sampled_from([None, "/node/libvgpu.so"]),
    default_memory=st.sampled_from([None, "1Gi", "bad"]),
    default_compute=st.sampled_from([None, "10"]),
)


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(good_pods, good_pods, pods), setting_variants)
def test_review_is_total_for_arbitrary_pods(pod: dict[str, Any], settings_: InjectionSettings) -> None:
    result = review(request(pod), settings_, NS)
    event(result.outcome)
    patch = check_well_formed(result)
    if patch is None:
        return
    patched = jsonpatch.apply_patch(pod, patch)
    # The webhook's output is a fixed point.
    again = review(request(patched), settings_, NS)
    assert again.outcome == "unchanged", again.review


@settings(max_examples=examples(200), deadline=None)
@given(json_values | st.fixed_dictionaries({"apiVersion": json_values, "kind": json_values, "request": json_values}))
def test_review_raises_only_invalid_review_for_arbitrary_payloads(payload: Any) -> None:
    try:
        result = review(payload, S, NS)
    except InvalidReview:
        return
    check_well_formed(result, payload["request"]["uid"])


@settings(max_examples=examples(200), deadline=None)
@given(
    st.fixed_dictionaries(
        {"uid": st.text(max_size=5)},
        optional={
            "kind": maybe(fresh({"group": "", "version": "v1", "kind": "Pod"})),
            "resource": json_values,
            "subResource": json_values,
            "operation": maybe(st.just("CREATE")),
            "namespace": json_values,
            "object": maybe(pods),
        },
    )
)
def test_review_is_total_for_arbitrary_requests(req: dict[str, Any]) -> None:
    payload = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}
    check_well_formed(review(payload, S, NS), req["uid"])
