"""KAI-Scheduler's fractions: which container KAI hands a GPU, the share its annotations mean, and
the one form of NVIDIA_VISIBLE_DEVICES accepted in that container (gpufence/webhook/kai.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpufence.contract import MemoryShare
from gpufence.webhook.gpu_paths import PodGpuPaths
from gpufence.webhook.kai import KaiFraction, kai_fraction, kai_memory
from gpufence.webhook.namespace_policy import namespace_policy
from gpufence.webhook.podshape import nvidia_side_door
from gpufence.webhook.settings import InjectionSettings
from gpufence.webhook.shares import ShareError, resolve_shares

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
    with pytest.raises(ShareError) as raised:
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
    with pytest.raises(ShareError) as raised:
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
