"""The guard and the GPU containers' hard-limit variables while the webhook is down.

The webhook writes the driver's limit (NVIDIA_GPU_MEMORY_LIMIT / _REQUEST) where
driver-memory-limits applies to the pod, and MPS's and the preload limiter's variables where those
are on, from the share in the sidecar's GPUFENCE_CONFIG; it replaces or removes an author's values
(gpufence/webhook/container_env.py). The guard cannot mutate: it must admit exactly the webhook's
output and refuse a pod whose variables are missing, different, from a reference, or present where
the webhook writes none. ``LIMIT_FORGERIES`` is shared with tests/e2e/test_driver_limit_guard.py,
where the real kube-apiserver judges them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from gpufence.contract import DRIVER_LIMITS_NODE_LABEL, ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST
from gpufence.webhook.cluster_policy import parse_policy
from tests.unit.guard.test_forged_sidecar import gpu_pod, injected
from tests.unit.guard.test_policy import GUARD, POLICY, SHIPPED_POLICY, Guard
from tests.unit.webhook.test_driver_limits import PIN_CASES

SHARES = {"gpufence.io/memory": "4Gi", "gpufence.io/compute": "50"}


def pinned_gpu_pod() -> dict[str, Any]:
    """A GPU pod that driver-memory-limits=auto (as shipped) gives the driver's limit."""
    pod = gpu_pod(dict(SHARES))
    pod["spec"]["nodeSelector"] = {DRIVER_LIMITS_NODE_LABEL: "true"}
    return pod


def workload_env(pod: dict[str, Any]) -> list[dict[str, Any]]:
    (trainer,) = [c for c in pod["spec"]["containers"] if c["name"] == "trainer"]
    return trainer.setdefault("env", [])


def _set(name: str, value: str) -> Callable[[dict[str, Any]], None]:
    def change(pod: dict[str, Any]) -> None:
        for entry in workload_env(pod):
            if entry["name"] == name:
                entry["value"] = value
    return change


def _drop(name: str) -> Callable[[dict[str, Any]], None]:
    def change(pod: dict[str, Any]) -> None:
        workload_env(pod)[:] = [e for e in workload_env(pod) if e["name"] != name]
    return change


def _add(entry: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda pod: workload_env(pod).append(copy.deepcopy(entry))


def _from_configmap(pod: dict[str, Any]) -> None:
    for i, entry in enumerate(workload_env(pod)):
        if entry["name"] == ENV_DRIVER_MEMORY_REQUEST:
            workload_env(pod)[i] = {"name": ENV_DRIVER_MEMORY_REQUEST,
                                    "valueFrom": {"configMapKeyRef": {"name": "limits", "key": "request"}}}


def _unpinned(pod: dict[str, Any]) -> None:
    """The variables kept, the pin dropped: the pod could land where the hook fails its start."""
    pod["spec"].pop("nodeSelector")


# name -> (forgery of the webhook's output for ``pinned_gpu_pod``, what the refusal says)
LIMIT_FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "driver limit left out": (_drop(ENV_DRIVER_MEMORY_LIMIT),
                              'container "trainer" lacks NVIDIA_GPU_MEMORY_LIMIT=4096, which the webhook writes'),
    "driver limits left out": (lambda p: (_drop(ENV_DRIVER_MEMORY_LIMIT)(p), _drop(ENV_DRIVER_MEMORY_REQUEST)(p)),
                               'container "trainer" lacks NVIDIA_GPU_MEMORY_LIMIT=4096'),
    "driver limit raised": (_set(ENV_DRIVER_MEMORY_LIMIT, "81920"),
                            'container "trainer" has NVIDIA_GPU_MEMORY_LIMIT=81920 where the webhook writes '
                            "NVIDIA_GPU_MEMORY_LIMIT=4096"),
    "soft limit from a ConfigMap": (
        _from_configmap,
        'container "trainer" has NVIDIA_GPU_MEMORY_REQUEST from valueFrom where the webhook writes '
        "NVIDIA_GPU_MEMORY_REQUEST=4096"),
    "a second, higher limit": (_add({"name": ENV_DRIVER_MEMORY_LIMIT, "value": "81920"}),
                               'container "trainer" has NVIDIA_GPU_MEMORY_LIMIT=81920, which the webhook does not '
                               "write for it"),
    "the same limit twice": (_add({"name": ENV_DRIVER_MEMORY_LIMIT, "value": "4096"}),
                             'container "trainer" repeats a variable the webhook writes once'),
    "an MPS limit the policy does not set": (
        _add({"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=80000M"}),
        'container "trainer" has CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=80000M, which the webhook does not write'),
    "limits on a pod not pinned to capable nodes": (
        _unpinned, 'container "trainer" has NVIDIA_GPU_MEMORY_LIMIT=4096, which the webhook does not write for it'),
}


@pytest.fixture(scope="module")
def webhook_output() -> dict[str, Any]:
    pod = injected(pinned_gpu_pod(), {})
    assert {e["name"]: e.get("value") for e in workload_env(pod)}[ENV_DRIVER_MEMORY_LIMIT] == "4096"
    return pod


def test_the_webhooks_output_passes(webhook_output: dict[str, Any]) -> None:
    assert GUARD.admit(copy.deepcopy(webhook_output), namespace_annotations={}) == (True, "allowed")


@pytest.mark.parametrize("name", list(LIMIT_FORGERIES))
def test_wrong_limit_variables_are_refused(webhook_output: dict[str, Any], name: str) -> None:
    forge, expected = LIMIT_FORGERIES[name]
    pod = copy.deepcopy(webhook_output)
    forge(pod)
    allowed, message = GUARD.admit(pod, namespace_annotations={})
    assert not allowed and expected in message, message
    assert "driver-memory-limits auto" in message and "retry once the gpufence-webhook pods" in message


@pytest.mark.parametrize(("spec", "pinned"), PIN_CASES)
def test_the_guard_reads_the_pin_as_the_webhook_does(spec: dict[str, Any], pinned: bool) -> None:
    pod = gpu_pod(dict(SHARES))
    pod["spec"].update(copy.deepcopy(spec))
    assert bool(GUARD.variables_for(pod)["pinnedToDriverLimitNodes"]) is pinned


POLICIES: list[dict[str, str]] = [
    {"driver-memory-limits": "on"},
    {"driver-memory-limits": "off"},
    {"driver-memory-limits": "on", "mps-limits": "true"},
    {"driver-memory-limits": "auto", "preload-library": "/usr/local/lib/libvgpu.so"},
]
SHARE_VARIANTS: list[dict[str, str]] = [
    {"gpufence.io/memory": "5G", "gpufence.io/compute": "33.5"},
    {"gpufence.io/memory": "25%"},  # no GPU size known: no driver limit
    {"gpufence.io/compute": "0.5"},  # compute only: no memory variables, one thread percent
]


@pytest.mark.parametrize("shares", SHARE_VARIANTS, ids=["bytes", "percent", "compute"])
@pytest.mark.parametrize("data", POLICIES, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
def test_the_guard_agrees_with_the_webhook_under_each_policy(data: dict[str, str], shares: dict[str, str]) -> None:
    """The webhook's output passes; the same pod without its limit variables (the webhook down, and
    the author copied the sidecar but not those) is refused whenever the webhook wrote any."""
    policy = {**SHIPPED_POLICY, **data}
    guard = Guard(POLICY, policy)
    pod = pinned_gpu_pod()
    pod["metadata"]["annotations"] = dict(shares)
    output = injected(pod, {}, parse_policy(policy))
    assert guard.admit(copy.deepcopy(output), namespace_annotations={}) == (True, "allowed")
    limits = [e for e in workload_env(output) if e["name"].startswith(("NVIDIA_GPU_MEMORY", "CUDA_MPS", "CUDA_DEVICE"))]
    stripped = copy.deepcopy(output)
    workload_env(stripped)[:] = [e for e in workload_env(stripped) if e not in limits]
    allowed, message = guard.admit(stripped, namespace_annotations={})
    assert allowed == (not limits), message
    if limits:
        assert f"lacks {limits[0]['name']}={limits[0]['value']}" in message
