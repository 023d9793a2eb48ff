"""KAI-Scheduler's fractions: which container KAI hands a GPU, the share its annotations mean, and
the one form of NVIDIA_VISIBLE_DEVICES accepted in that container (gpufence/webhook/core/kai.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpufence.contract import MemoryShare
from gpufence.webhook.core.denial import Denial
from gpufence.webhook.core.gpu_paths import PodGpuPaths
from gpufence.webhook.core.kai import KaiFraction, kai_fraction, kai_memory
from gpufence.webhook.core.namespace_policy import namespace_policy
from gpufence.webhook.core.podshape import nvidia_side_door
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import resolve_shares

DEFAULTS = InjectionSettings()


def kai_pod(annotations: dict[str, str], *containers: str, init: tuple[str, ...] = (),
            scheduler: str | None = "kai-scheduler", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"containers": [{"name": n, "image": "x"} for n in containers], **spec}
    if init:
        body["initContainers"] = [{"name": n, "image": "x"} for n in init]
    if scheduler is not None:
        body["schedulerName"] = scheduler
    return {"metadata": {"name": "p", "annotations": annotations}, "spec": body}


@pytest.mark.parametrize(("pod", "container"), [
    (kai_pod({"gpu-fraction": "0.5"}, "main", "logs"), "main"),
    (kai_pod({"gpu-memory": "2000"}, "main"), "main"),
    (kai_pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "gpu"}, "logs", "gpu"), "gpu"),
    (kai_pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "warm"}, "main", init=("warm",)), "warm"),
    # KAI's webhook and binder act only on pods of its scheduler.
    (kai_pod({"gpu-fraction": "0.5"}, "main", scheduler=None), None),
    (kai_pod({"gpu-fraction": "0.5"}, "main", scheduler="default-scheduler"), None),
    # A pod that names its node is never scheduled: no binder fills its ConfigMap.
    (kai_pod({"gpu-fraction": "0.5"}, "main", nodeName="gpu-node-1"), None),
    # KAI refuses a pod whose named container does not exist.
    (kai_pod({"gpu-fraction": "0.5", "gpu-fraction-container-name": "nope"}, "main"), None),
    (kai_pod({"gpu-fraction-num-devices": "2"}, "main"), None),
    (kai_pod({}, "main"), None),
])
def test_the_container_kai_hands_a_fraction(pod: dict[str, Any], container: str | None) -> None:
    found = kai_fraction(pod, DEFAULTS)
    assert (found.container if found else None) == container


def test_the_scheduler_names_are_the_policy_s() -> None:
    pod = kai_pod({"gpu-fraction": "0.5"}, "main", scheduler="team-kai")
    assert kai_fraction(pod, DEFAULTS) is None
    assert kai_fraction(pod, InjectionSettings(kai_scheduler_names=("kai-scheduler", "team-kai"))) is not None


@pytest.mark.parametrize(("annotations", "share"), [
    ({"gpu-fraction": "0.5"}, MemoryShare(percent=50.0)),
    ({"gpu-fraction": "0.29"}, MemoryShare(percent=29.0)),  # exact: not 28.999999999999996
    ({"gpu-fraction": "5e-1"}, MemoryShare(percent=50.0)),
    ({"gpu-fraction": ".25"}, MemoryShare(percent=25.0)),
    ({"gpu-memory": "2000"}, MemoryShare(bytes=2000 << 20)),
    ({"gpu-memory": "1"}, MemoryShare(bytes=1 << 20)),
])
def test_the_share_a_request_means(annotations: dict[str, str], share: MemoryShare) -> None:
    assert KaiFraction("main", annotations).memory_share() == share


@pytest.mark.parametrize(("annotations", "needles"), [
    ({"gpu-fraction": "1"}, ['gpu-fraction="1"', "between 0 and 1", '"0.5"']),
    ({"gpu-fraction": "0"}, ['gpu-fraction="0"', "between 0 and 1"]),
    ({"gpu-fraction": "50%"}, ['gpu-fraction="50%"', "between 0 and 1"]),
    ({"gpu-fraction": "half"}, ['gpu-fraction="half"']),
    ({"gpu-memory": "2Gi"}, ['gpu-memory="2Gi"', "whole number of MiB", '"2000"']),
    ({"gpu-memory": "0"}, ['gpu-memory="0"', "above 0"]),
    ({"gpu-fraction": "0.5", "gpu-memory": "2000"}, ["both", "remove one"]),
    ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "0"}, ['gpu-fraction-num-devices="0"', '"2"']),
])
def test_an_invalid_request_is_denied_by_name_value_rule_and_example(annotations: dict[str, str],
                                                                     needles: list[str]) -> None:
    with pytest.raises(Denial) as raised:
        KaiFraction("main", annotations).memory_share()
    for needle in needles:
        assert needle in str(raised.value)


def test_the_gpu_count_is_kai_s_number_of_devices() -> None:
    for asked, gpus in (({"gpu-fraction": "0.5"}, 1), ({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "3"}, 3)):
        pod = kai_pod(asked, "main", "logs")
        paths = PodGpuPaths(pod["spec"], DEFAULTS, kai_fraction(pod, DEFAULTS))
        assert paths.gpu_container_names() == ["main"]
        assert paths.gpu_counts() == {"main": gpus}
        assert [paths.gets_device(c) for c in pod["spec"]["containers"]] == [True, False]


@pytest.mark.parametrize(("ceiling", "annotations", "denied"), [
    ("50%", {"gpu-fraction": "0.5"}, None),
    ("50%", {"gpu-fraction": "0.51"}, 'e.g. gpu-fraction: "0.5"'),
    ("8Gi", {"gpu-memory": "8192"}, None),
    ("8Gi", {"gpu-memory": "8193"}, 'e.g. gpu-memory: "8192"'),
    ("8Gi", {"gpu-fraction": "0.9"}, None),  # other units: both apply (the smaller on each GPU)
    ("10%", {"gpu-memory": "100000"}, None),
])
def test_the_namespace_ceiling_bounds_kai_s_request(ceiling: str, annotations: dict[str, str],
                                                    denied: str | None) -> None:
    policy = namespace_policy("team-a", {"gpufence.io/max-memory": ceiling}, DEFAULTS)
    kai = KaiFraction("main", annotations)
    if denied is None:
        assert kai_memory(kai, policy) == {"main": (kai.memory_share(), kai.origin())}
        return
    with pytest.raises(Denial) as raised:
        kai_memory(kai, policy)
    message = str(raised.value)
    assert kai.origin() in message and "gpufence.io/max-memory" in message and denied in message


def test_kai_s_share_wins_over_gpufence_memory_and_says_so() -> None:
    kai = KaiFraction("main", {"gpu-fraction": "0.3"})
    fixed = {"main": (kai.memory_share(), kai.origin())}
    plan = resolve_shares({"gpufence.io/memory": "80%", "gpufence.io/compute": "30"}, {}, DEFAULTS,
                          ["main", "other"], ["main", "other"], scheduler_memory=fixed)
    shares = dict(plan.containers)
    assert shares["main"].memory == MemoryShare(percent=30.0) and shares["main"].compute_percent == 30.0
    assert shares["other"].memory == MemoryShare(percent=80.0)
    assert any("gpufence.io/memory" in w and "gpu-fraction" in w for w in plan.warnings)
    # A namespace default is no request of the pod's: it yields silently.
    plan = resolve_shares({}, {"gpufence.io/default-memory": "10%"}, DEFAULTS, ["main"], ["main"],
                          scheduler_memory=fixed)
    assert dict(plan.containers)["main"].memory == MemoryShare(percent=30.0) and plan.warnings == ()


def _env(**entries: Any) -> list[dict[str, Any]]:
    return [{"name": k, **v} for k, v in entries.items()]


@pytest.mark.parametrize(("entry", "allowed"), [
    ({"valueFrom": {"configMapKeyRef": {"name": "p-shared-gpu-0", "key": "NVIDIA_VISIBLE_DEVICES"}}}, True),
    ({"valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}, False),
    ({"valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}, False),
    ({"value": "all"}, False),
])
def test_only_kai_s_form_of_the_variable_passes_and_only_in_its_container(entry: dict[str, Any],
                                                                           allowed: bool) -> None:
    spec = {"containers": [{"name": "main", "env": _env(NVIDIA_VISIBLE_DEVICES=entry)}, {"name": "logs"}]}
    assert (nvidia_side_door(spec, None, "nvidia.com/gpu", "main") is None) is allowed
    assert nvidia_side_door(spec, None, "nvidia.com/gpu") is not None  # not a KAI pod
    other = {"containers": [{"name": "main"}, {"name": "logs", "env": _env(NVIDIA_VISIBLE_DEVICES=entry)}]}
    assert nvidia_side_door(other, None, "nvidia.com/gpu", "main") is not None
    capabilities = {"containers": [{"name": "main", "env": _env(NVIDIA_DRIVER_CAPABILITIES=entry)}]}
    assert nvidia_side_door(capabilities, None, "nvidia.com/gpu", "main") is not None


# --- KAI-Scheduler v0.18's NvFractions mode and its HamiCore mode -----------------------------------

def reviewed_pod(pod: dict[str, Any], settings: InjectionSettings = DEFAULTS, groups: list[str] | None = None,
                 ) -> tuple[str, dict[str, Any] | str]:
    """The review's outcome and the patched pod (or the denial's message)."""
    import base64
    import json

    import jsonpatch

    from gpufence.webhook.client import pod_admission_review
    from gpufence.webhook.core.admission import review
    from gpufence.webhook.core.settings import AllNamespacesOptedIn

    pod = {"apiVersion": "v1", "kind": "Pod", **pod}
    payload = pod_admission_review(pod, uid="u", namespace="team-a")
    if groups is not None:
        payload["request"]["userInfo"]["groups"] = groups
    result = review(payload, settings, AllNamespacesOptedIn())
    response = result.review["response"]
    if result.outcome == "denied":
        return result.outcome, response["status"]["message"]
    patch = json.loads(base64.b64decode(response["patch"])) if "patch" in response else []
    return result.outcome, jsonpatch.apply_patch(pod, patch)


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for key in ("initContainers", "containers") for c in pod["spec"].get(key, []) if c["name"] == name)


def _env_names(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in _container(pod, name).get("env", [])}


NV = {"nvidia.com/container.trainer.gpu-memory.request": "8Gi",
      "nvidia.com/container.trainer.gpu-memory.limit": "16Gi"}


@pytest.mark.parametrize(("annotations", "containers", "gpu"), [
    (NV, ("trainer", "logs"), ["trainer"]),
    ({"nvidia.com/container.trainer.gpu-memory.limit": "16Gi"}, ("logs", "trainer"), ["trainer"]),
    ({"nvidia.com/container.trainer.gpu-memory.request": "8Gi"}, ("trainer",), ["trainer"]),
    ({"nvidia.com/container.nope.gpu-memory.request": "8Gi"}, ("trainer",), []),  # KAI refuses that pod
    ({"nvidia.com/container.trainer.gpu-compute.mode": "sm-sharing"}, ("trainer",), []),  # no memory asked
    ({"nvidia.com/container.Trainer.gpu-memory.request": "8Gi"}, ("Trainer",), []),  # not KAI's key
])
def test_the_containers_nvfractions_names_are_gpu_containers(annotations: dict[str, str],
                                                             containers: tuple[str, ...], gpu: list[str]) -> None:
    from gpufence.webhook.core.kai import nv_fractions

    pod = kai_pod(annotations, *containers, scheduler=None)
    assert [f.container for f in nv_fractions(pod)] == gpu
    assert PodGpuPaths(pod["spec"], DEFAULTS, None, nv_fractions(pod)).gpu_container_names() == gpu


@pytest.mark.parametrize(("annotations", "share", "denied"), [
    (NV, 16 << 30, None),
    ({"nvidia.com/container.trainer.gpu-memory.request": "7680Mi"}, 7680 << 20, None),
    ({**NV, "nvidia.com/container.trainer.gpu-memory.request": "32Gi"}, None, "KAI-Scheduler requires the request"),
    ({"nvidia.com/container.trainer.gpu-memory.limit": "50%"}, None, "is not a KAI-Scheduler GPU memory request"),
    ({"nvidia.com/container.trainer.gpu-memory.limit": "500m"}, None, 'such as "8Gi" or "7680Mi"'),
    ({**NV, "gpufence.io/memory": "4Gi"}, 16 << 30, None),  # KAI's request wins, said in a warning
])
def test_the_nvfractions_share_is_the_limit_else_the_request(annotations: dict[str, str], share: int | None,
                                                             denied: str | None) -> None:
    outcome, result = reviewed_pod(kai_pod(annotations, "trainer", scheduler=None))
    if denied is not None:
        assert outcome == "denied" and isinstance(result, str) and denied in result
        return
    assert outcome == "mutated" and isinstance(result, dict)
    config = _env_names(result, "gpufence-enforcer")["GPUFENCE_CONFIG"]
    assert f'"trainer":{{"gpus":1,"memoryBytes":{share}}}' in config
    assert "NVIDIA_VISIBLE_DEVICES" not in _env_names(result, "trainer")  # never void


def test_gpufence_writes_none_of_its_limit_variables_where_kai_s_runtime_holds_the_limit() -> None:
    settings = InjectionSettings(driver_memory_limits="on", mps_limits=True,
                                 preload_library_host_path="/usr/local/vgpu/libvgpu.so")
    pod = kai_pod(NV, "trainer", scheduler=None)
    pod["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "81920"}]
    outcome, result = reviewed_pod(pod, settings)
    assert outcome == "mutated" and isinstance(result, dict)
    env = _env_names(result, "trainer")
    for name in ("NVIDIA_GPU_MEMORY_LIMIT", "NVIDIA_GPU_MEMORY_REQUEST", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                 "CUDA_DEVICE_MEMORY_LIMIT", "LD_PRELOAD"):
        assert name not in env  # the author's limit is removed, none written
    # A container of the same pod by the device plugin gets them as before.
    pod["spec"]["containers"].append({"name": "whole", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}})
    pod["metadata"]["annotations"] = {**NV, "gpufence.io/memory": "8Gi"}
    outcome, result = reviewed_pod(pod, settings)
    assert isinstance(result, dict) and _env_names(result, "whole")["NVIDIA_GPU_MEMORY_LIMIT"] == "8192"


@pytest.mark.parametrize(("groups", "denied"), [
    (["system:serviceaccounts", "team-a-devs"], True),
    (None, True),
    (["system:masters"], False),  # admin-groups may (a restored pod, a test)
])
def test_a_gpus_devices_annotation_at_creation_is_a_side_door(groups: list[str] | None, denied: bool) -> None:
    annotations = {"nvidia.com/container.trainer.gpus.devices": "GPU-1"}
    outcome, result = reviewed_pod(kai_pod(annotations, "trainer", scheduler=None), groups=groups)
    assert (outcome == "denied") == denied
    if denied:
        assert "nvidia.com/container.trainer.gpus.devices is written by KAI-Scheduler's binder" in str(result)


def _cm(key: str) -> dict[str, Any]:
    return {"name": key, "valueFrom": {"configMapKeyRef": {"name": "p-shared-gpu-0", "key": key}}}


@pytest.mark.parametrize(("entry", "kept"), [
    (_cm("CUDA_DEVICE_MEMORY_LIMIT"), True),  # KAI's HamiCore form
    ({"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "80000m"}, False),  # the author's: removed, as before
])
def test_kai_s_hami_core_limit_is_kept_in_its_fraction_container_only(entry: dict[str, Any], kept: bool) -> None:
    pod = kai_pod({"gpu-memory": "4096"}, "main")
    pod["spec"]["containers"][0]["env"] = [_cm("NVIDIA_VISIBLE_DEVICES"), entry]
    outcome, result = reviewed_pod(pod)
    assert outcome == "mutated" and isinstance(result, dict)
    assert ("CUDA_DEVICE_MEMORY_LIMIT" in _env_names(result, "main")) == kept
