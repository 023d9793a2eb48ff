"""The guard and the webhook agree on which containers get a GPU, and by which path.

The webhook's definition is gpufence/webhook/gpu_paths.py; the guard's is its CEL variables
``gpuContainerNames``, ``deviceContainerNames``, ``gpuCounts`` and ``gpuClaimNames``
(k8s/base/guard-policy.yaml), evaluated here with cel-python on a table of resources, claims and
policies, and on generated pods. The real kube-apiserver evaluates the same policy in
tests/e2e/test_gpu_paths.py.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufence.webhook.cluster_policy import parse_policy
from gpufence.webhook.gpu_paths import PodGpuPaths
from gpufence.webhook.kai import kai_fraction
from tests.unit.guard.test_policy import POLICY, SHIPPED_POLICY, Guard

RESOURCES = [
    "nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb",
    "nvidia.com/mig-3g.40gb.shared", "nvidia.com/gpumem", "nvidia.com/gpu-x", "amd.com/gpu", "example.com/fpga",
    "cpu", "memory",
]
POLICIES: dict[str, dict[str, str]] = {
    "shipped": {},
    "no keys": {"gpu-resource-name": "", "exclusive-gpu-resource-name": "", "non-gpu-resource-claims": ""},
    "exact only": {"gpu-resource-name": "nvidia.com/gpu"},
    "exclusive mig": {"exclusive-gpu-resource-name": "nvidia.com/mig-3g.40gb"},
    "exclusive mig prefix": {"exclusive-gpu-resource-name": "nvidia.com/mig-3g.*, example.com/fpga"},
    "every nvidia resource": {"gpu-resource-name": "nvidia.com/*, amd.com/gpu"},
    "non-gpu claims": {"non-gpu-resource-claims": "nic-template, fpga"},
}
CLAIMS = [{"name": "gpu", "resourceClaimTemplateName": "single-gpu"},
          {"name": "shared", "resourceClaimName": "team-gpu"},
          {"name": "nic", "resourceClaimTemplateName": "nic-template"},
          {"name": "fpga", "resourceClaimName": "fpga"}]


def decisions(pod: dict[str, Any], data: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the webhook's, the guard's) answers for ``pod`` under the policy ConfigMap data ``data``."""
    full = {**SHIPPED_POLICY, **data}
    settings = parse_policy(full)
    paths = PodGpuPaths(pod["spec"], settings, kai_fraction(pod, settings))
    containers = [c for key in ("initContainers", "containers") for c in pod["spec"].get(key, [])]
    gpu = paths.gpu_container_names()
    counts = paths.gpu_counts()
    webhook = {
        "gpu": gpu,
        "device": [c["name"] for c in containers if paths.gets_device(c)],
        # The guard writes "name=" where the config has no count; containers outside the config aside.
        "counts": sorted(f"{n}={counts.get(n, '')}" for n in gpu),
        "sidecar claims": paths.sidecar_claims(gpu),
    }
    variables = _guard(tuple(sorted(full.items()))).variables_for(pod)
    guard = {
        "gpu": [str(n) for n in variables["gpuContainerNames"]],
        "device": [str(n) for n in variables["deviceContainerNames"]],
        "counts": sorted(str(g) for g in variables["gpuCounts"] if str(g).split("=")[0] in gpu),
        "sidecar claims": [str(n) for n in variables["gpuClaimNames"]],
    }
    return webhook, guard


@functools.lru_cache(maxsize=16)
def _guard(data: tuple[tuple[str, str], ...]) -> Guard:
    return Guard(POLICY, dict(data))


def pod_with(*containers: dict[str, Any], claims: list[dict[str, str]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if claims:
        spec["resourceClaims"] = claims
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-a"}, "spec": spec}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("resource", RESOURCES)
@pytest.mark.parametrize("field", ["limits", "requests"])
def test_the_guard_and_the_webhook_agree_on_a_resource(policy: str, resource: str, field: str) -> None:
    pod = pod_with({"name": "main", "image": "x", "resources": {field: {resource: "2"}}},
                   {"name": "logs", "image": "y"})
    webhook, guard = decisions(pod, POLICIES[policy])
    assert guard == webhook


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("used", [["gpu"], ["shared"], ["nic"], ["fpga"], ["nic", "gpu"], ["nic", "fpga"]])
def test_the_guard_and_the_webhook_agree_on_a_claim(policy: str, used: list[str]) -> None:
    pod = pod_with({"name": "main", "image": "x", "resources": {"claims": [{"name": n} for n in used]}},
                   {"name": "other", "image": "x", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}},
                   {"name": "logs", "image": "y"}, claims=CLAIMS)
    webhook, guard = decisions(pod, POLICIES[policy])
    assert guard == webhook


def test_the_table_covers_every_path() -> None:
    """The table above is not vacuous: under the shipped policy it has shared GPUs by each path, and
    the exclusive policy turns a MIG slice into a device without a share."""
    shared = pod_with({"name": "a", "image": "x", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}},
                      {"name": "b", "image": "x", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}},
                      {"name": "c", "image": "x", "resources": {"claims": [{"name": "gpu"}]}},
                      {"name": "d", "image": "x", "resources": {"claims": [{"name": "nic"}]}},
                      {"name": "e", "image": "x"}, claims=CLAIMS)
    webhook, guard = decisions(shared, {"non-gpu-resource-claims": "nic-template"})
    assert guard == webhook == {"gpu": ["a", "b", "c"], "device": ["a", "b", "c", "d"],
                                "counts": ["a=1", "b=1", "c="], "sidecar claims": ["gpu"]}
    exclusive = pod_with({"name": "a", "image": "x", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}})
    webhook, guard = decisions(exclusive, POLICIES["exclusive mig"])
    assert guard == webhook == {"gpu": [], "device": ["a"], "counts": [], "sidecar claims": []}


def test_the_sidecar_holding_claims_is_no_gpu_container_beside_one() -> None:
    sidecar = {"name": "gpufence-enforcer", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}
    beside = pod_with(sidecar, {"name": "main", "image": "x", "resources": {"claims": [{"name": "gpu"}]}},
                      claims=CLAIMS[:1])
    alone = pod_with(sidecar, claims=CLAIMS[:1])
    for pod, gpu in ((beside, ["main"]), (alone, ["gpufence-enforcer"])):
        webhook, guard = decisions(pod, {})
        assert guard == webhook and webhook["gpu"] == gpu


_NAMES = st.sampled_from(RESOURCES)
_AMOUNTS = st.sampled_from(["0", "1", "2"])
_CONTAINER = st.fixed_dictionaries({
    "limits": st.dictionaries(_NAMES, _AMOUNTS, max_size=3),
    "requests": st.dictionaries(_NAMES, _AMOUNTS, max_size=3),
    "claims": st.lists(st.sampled_from([c["name"] for c in CLAIMS] + ["undeclared"]), max_size=2, unique=True),
})


@given(st.lists(_CONTAINER, min_size=1, max_size=3), st.sampled_from(list(POLICIES)), st.booleans())
def test_the_guard_and_the_webhook_agree_on_generated_pods(shapes: list[dict[str, Any]], policy: str,
                                                           init: bool) -> None:
    containers = []
    for i, shape in enumerate(shapes):
        resources = {k: v for k, v in (("limits", shape["limits"]), ("requests", shape["requests"])) if v}
        if shape["claims"]:
            resources["claims"] = [{"name": n} for n in shape["claims"]]
        containers.append({"name": f"c{i}", "image": "x", **({"resources": resources} if resources else {})})
    pod = pod_with(*containers[1:] or [{"name": "plain", "image": "x"}], claims=CLAIMS)
    if init:
        pod["spec"]["initContainers"] = containers[:1]
    else:
        pod["spec"]["containers"].insert(0, containers[0])
    webhook, guard = decisions(pod, POLICIES[policy])
    assert guard == webhook


@pytest.mark.parametrize("case", ["dra-template-claim", "dra-named-claim", "dra-mixed-claims"])
def test_the_webhooks_output_passes_the_guard_with_the_claims_dropped(case: str) -> None:
    """An API server with DRA off (1.30's default) drops spec.resourceClaims and every
    resources.claims after the mutating webhooks and before validation: the guard must still admit
    what the webhook made of the pod (tests/e2e/test_gpu_paths.py sees it on the real 1.30)."""
    import yaml

    from tests.unit.guard.test_policy import policy_data_for
    from tests.unit.webhook.test_golden import GOLDEN, load_case

    _, settings, _, _ = load_case(case)
    mutated = yaml.safe_load((GOLDEN / f"{case}.out.yaml").read_text())["pod"]
    guard = Guard(POLICY, policy_data_for(settings))
    assert guard.admit(mutated) == (True, "allowed")
    mutated["spec"].pop("resourceClaims")
    for c in mutated["spec"].get("initContainers", []) + mutated["spec"]["containers"]:
        c.get("resources", {}).pop("claims", None)
    assert guard.admit(mutated) == (True, "allowed")


def test_a_status_annotation_naming_a_container_only_makes_the_guard_stricter() -> None:
    """The guard takes the containers the webhook's status names for GPU containers too (the claims
    may be gone by validation); a status forged onto a plain pod makes it a GPU pod to refuse."""
    from tests.unit.guard.test_policy import GUARD

    plain = pod_with({"name": "web", "image": "nginx", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]})
    assert GUARD.admit(plain) == (True, "allowed")
    plain["metadata"]["annotations"] = {
        "gpufence.io/status": '{"containers":["web"],"mode":"enforce","version":"x"}'}
    allowed, message = GUARD.admit(plain)
    assert not allowed and "has no gpufence-enforcer sidecar" in message


# --- KAI-Scheduler's fraction (gpufence/webhook/kai.py) ------------------------------------------

def kai_pod(annotations: dict[str, str], *containers: dict[str, Any], scheduler: str = "kai-scheduler",
            init: list[dict[str, Any]] | None = None, node: str | None = None) -> dict[str, Any]:
    pod = pod_with(*containers)
    pod["metadata"]["annotations"] = annotations
    pod["spec"]["schedulerName"] = scheduler
    if init:
        pod["spec"]["initContainers"] = init
    if node:
        pod["spec"]["nodeName"] = node
    return pod


_MAIN = {"name": "main", "image": "x"}
_LOGS = {"name": "logs", "image": "y"}
_GPU = {"name": "gpu", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
KAI_CASES = {
    "fraction": (kai_pod({"gpu-fraction": "0.5"}, _MAIN, _LOGS), ["main"]),
    "memory": (kai_pod({"gpu-memory": "2000"}, _MAIN, _LOGS), ["main"]),
    "named": (kai_pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "logs"}, _MAIN, _LOGS), ["logs"]),
    "init": (kai_pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "warm"}, _MAIN,
                     init=[{"name": "warm", "image": "x"}]), ["warm"]),
    "named but absent": (kai_pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "nope"}, _MAIN), []),
    "two devices": (kai_pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}, _MAIN), ["main"]),
    "bad device count": (kai_pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "x"}, _MAIN), ["main"]),
    "another scheduler": (kai_pod({"gpu-fraction": "0.5"}, _MAIN, scheduler="default-scheduler"), []),
    "a named node": (kai_pod({"gpu-fraction": "0.5"}, _MAIN, node="gpu-node-1"), []),
    "no fraction": (kai_pod({"gpu-fraction-num-devices": "2"}, _MAIN), []),
    "beside a whole gpu": (kai_pod({"gpu-fraction": "0.5"}, _MAIN, _GPU), ["main", "gpu"]),
    "fraction and a gpu in one": (kai_pod({"gpu-memory": "100"}, {**_GPU, "name": "main"}), ["main"]),
}


@pytest.mark.parametrize("policy", [{}, {"kai-scheduler-name": "team-kai, kai-scheduler"},
                                    {"kai-scheduler-name": "team-kai"}])
@pytest.mark.parametrize("case", KAI_CASES)
def test_the_guard_and_the_webhook_agree_on_kai_fractions(case: str, policy: dict[str, str]) -> None:
    pod, gpu = KAI_CASES[case]
    webhook, guard = decisions(pod, policy)
    assert guard == webhook
    # Not vacuous: KAI's container is a GPU container where KAI's scheduler name is configured.
    by_resource = [c["name"] for c in pod["spec"]["containers"] if "resources" in c]
    assert webhook["gpu"] == (gpu if "kai-scheduler" in policy.get("kai-scheduler-name", "kai-scheduler")
                              else by_resource)


def test_kai_s_device_count_is_the_enforcer_s() -> None:
    webhook, guard = decisions(KAI_CASES["two devices"][0], {})
    assert guard["counts"] == webhook["counts"] == ["main=2"]
    webhook, guard = decisions(KAI_CASES["fraction and a gpu in one"][0], {})
    assert guard["counts"] == webhook["counts"] == ["main=2"]


def _kai_output(case: str) -> tuple[Guard, dict[str, Any]]:
    import yaml

    from tests.unit.guard.test_policy import policy_data_for
    from tests.unit.webhook.test_golden import GOLDEN, load_case

    _, settings, _, _ = load_case(case)
    mutated = yaml.safe_load((GOLDEN / f"{case}.out.yaml").read_text())["pod"]
    return Guard(POLICY, policy_data_for(settings)), mutated


def _with_config(pod: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    for c in pod["spec"]["initContainers"]:
        for e in c.get("env", []):
            if e["name"] == "GPUFENCE_CONFIG":
                assert old in e["value"]
                e["value"] = e["value"].replace(old, new)
    return pod


@pytest.mark.parametrize(("case", "old", "new"), [
    ("kai-gpu-fraction", '"memoryPercent":50', '"memoryPercent":90'),
    ("kai-gpu-fraction", '"gpus":1,"memoryPercent":50', '"gpus":1'),
    ("kai-gpu-memory", '"memoryBytes":2097152000', '"memoryBytes":2097152001'),
    ("kai-gpu-memory", '"memoryBytes":2097152000', '"memoryPercent":10'),
])
def test_a_sidecar_made_while_the_webhook_is_down_cannot_give_more_than_kai_s_request(case: str, old: str,
                                                                                     new: str) -> None:
    guard, mutated = _kai_output(case)
    assert guard.admit(mutated) == (True, "allowed")
    allowed, message = guard.admit(_with_config(mutated, old, new))
    assert not allowed and "within its KAI-Scheduler request" in message


def test_a_sidecar_made_while_the_webhook_is_down_must_hold_kai_s_gpu_count() -> None:
    guard, mutated = _kai_output("kai-num-devices")
    assert guard.admit(mutated) == (True, "allowed")
    allowed, message = guard.admit(_with_config(mutated, '"gpus":2', '"gpus":1'))
    assert not allowed and "not the number of GPUs it requested" in message


def test_kai_s_variable_passes_the_guard_only_in_its_container_and_form() -> None:
    guard, mutated = _kai_output("kai-after-kai-webhook")
    assert guard.admit(mutated) == (True, "allowed")
    main = mutated["spec"]["containers"][0]
    kai_entry = next(e for e in main["env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES")
    kai_entry["valueFrom"] = {"secretKeyRef": {"name": "mine", "key": "NVIDIA_VISIBLE_DEVICES"}}
    allowed, message = guard.admit(mutated)
    assert not allowed and 'container "gpu-workload" sets NVIDIA_VISIBLE_DEVICES' in message
    kai_entry.pop("valueFrom")
    kai_entry["value"] = "all"
    assert not guard.admit(mutated)[0]
    # The same ConfigMap form in a pod that is no KAI pod (another scheduler) is a side door.
    guard, mutated = _kai_output("kai-after-kai-webhook")
    mutated["spec"]["schedulerName"] = "default-scheduler"
    allowed, message = guard.admit(mutated)
    assert not allowed and "NVIDIA_VISIBLE_DEVICES" in message
