"""NVIDIA's real ``apply-cuda-memory-limits`` hook on the real node (kubelet, containerd, runc).

The hook is the toolkit's own ``nvidia-cdi-hook`` (v1.20.2, built from its pinned Go module by
``tests.e2e.binaries``), run by runc as a ``createRuntime`` hook from the OCI spec containerd wrote
for the pod (``tests.node.driver_hook``: containerd 1.6 has no CDI, so a runtime handler's base spec
carries the hook, chosen by a RuntimeClass). Its driver library is the simulated
``libnvidia-ml.so.1``; the workloads allocate through the same library and its state.

The GPU containers carry ``NVIDIA_GPU_MEMORY_LIMIT`` / ``NVIDIA_GPU_MEMORY_REQUEST`` in their own
spec here: these tests are about what the node does with the two variables, whoever wrote them.

This machine mounts cgroup v1 with an empty cgroup2 at /sys/fs/cgroup/unified (hybrid). There the
hook as the toolkit generates it stops at its cgroup v2 check, and the container does not start:
the reason gpufence writes the variables only where a node can apply them. runc already puts each
container into the unified hierarchy at the path of its v1 cgroups, so in a private mount namespace
with the unified hierarchy on /sys/fs/cgroup (a v2 node's view) the same binary goes on to NVML and
sets the limit on the container's own cgroup.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from gpufence.simnvml import SimLimit, read_limits
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.node.driver_hook import (
    GPU_UUID,
    HANDLERS,
    HOOK_HANDLER,
    OLD_DRIVER_HANDLER,
    V2_VIEW_HANDLER,
    runtime_classes,
)
from tests.node.node import Node, cgroup_version
from tests.node.workloads import (
    container_log,
    events,
    get_pod,
    gpu_pod,
    host_pid,
    statuses,
    wait_record,
    wait_running,
    workload_container,
)
from tests.support.prerequisites import skip_by_design

MIB = 1 << 20
GIB = 1 << 30
LIMIT_ENV = [{"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "2048"},
             {"name": "NVIDIA_GPU_MEMORY_REQUEST", "value": "1024"}]
# The hook's own message when /sys/fs/cgroup is not cgroup2
# (cmd/nvidia-cdi-hook/apply-cuda-memory-limits/apply-cuda-memory-limits.go).
V2_ONLY = "setting GPU memory limits is only supported in cgroup v2"

# A CUDA-like workload: holds the device, then allocates each size in argv through the simulated
# driver (simnvmlAllocate: 0 or NVML_ERROR_MEMORY, 20, which a CUDA program sees as
# cudaErrorMemoryAllocation) and reports; standard library only (the image's python3).
ALLOCATOR = f"""
import ctypes, os, sys, time
device = open("/dev/nvidia0")
lib = ctypes.CDLL("libnvidia-ml.so.1")
lib.simnvmlAllocate.argtypes = (ctypes.c_char_p, ctypes.c_ulonglong)
print(f"gpu process {{os.getpid()}}", flush=True)
for n in map(int, sys.argv[1:]):
    code = lib.simnvmlAllocate(b"{GPU_UUID}", n)
    print(f"allocated {{n}}" if code == 0 else f"out of memory {{n}} (nvml {{code}})", flush=True)
while True:
    time.sleep(3600)
"""


@pytest.fixture(scope="module")
def runtime_class(cluster: ControlPlane, node: Node) -> Any:
    cluster.kubectl("apply", "-f", "-", input=runtime_classes())
    yield
    cluster.kubectl("delete", "runtimeclass", *HANDLERS, "--ignore-not-found", check=False)


def _create(admin: client.ApiClient, namespace: str, pod: dict) -> dict:
    created = kube.create_pod(admin, namespace, pod)
    assert created.admitted, created.message
    return created.obj


def _start_failure(status: dict[str, Any]) -> str | None:
    """The runtime's message for a container that could not start (kubelet: RunContainerError
    while waiting, StartError once terminated), None while none is known."""
    for state in (status.get("state") or {}, status.get("lastState") or {}):
        for kind in ("waiting", "terminated"):
            detail = state.get(kind) or {}
            if detail.get("reason") in ("RunContainerError", "StartError") and detail.get("message"):
                return f"{detail['reason']}: {detail['message']}"
    return None


def _bundle_spec(node: Node, container_id: str) -> dict[str, Any]:
    """The OCI spec containerd wrote (and the simulated driver's wrapper edited) for a container."""
    cid = container_id.split("://", 1)[-1]
    path = node.workdir / "containerd-state" / "io.containerd.runtime.v2.task" / "k8s.io" / cid / "config.json"
    return json.loads(path.read_text())


def _cgroups(pid: int) -> dict[str, str]:
    """/proc/<pid>/cgroup as hierarchy -> path ("" is the unified one, "memory" the v1 memory controller)."""
    found = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            found[name] = path
    return found


def _failed_start(cluster: ControlPlane, node: Node, namespace: str, name: str, container: str) -> str:
    """The runtime's message once ``container`` failed to start (the test fails if it starts)."""
    def failed() -> str | None:
        return _start_failure(statuses(get_pod(cluster, namespace, name)).get(container, {}))

    try:
        return kube.wait_for(failed, f"the {container} container's start to fail", 90, 0.5)
    except AssertionError:
        raise AssertionError(f"statuses: {statuses(get_pod(cluster, namespace, name))}\n"
                             f"events: {events(cluster, namespace, name)}\n"
                             f"kubelet: {node.log('kubelet')[-3000:]}") from None


def test_the_real_hook_fails_the_start_where_it_cannot_apply_the_limit(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str,
        runtime_class: Any):
    """The safety decision: on a node that cannot apply the variables, a GPU container that carries
    them does not start at all (an OCI createRuntime hook that fails fails runc's create), and the
    same pod without them runs. Hence the webhook's default writes them only where the node can."""
    if cgroup_version() == "v2":
        skip_by_design("cgroup-v2-node", "on a cgroup v2 node the hook applies the limit: nothing fails here")
    limited = gpu_pod([workload_container("limited", env=LIMIT_ENV)], {"gpufence.io/memory": "2Gi"},
                      runtimeClassName=HOOK_HANDLER)
    pod = _create(admin, gpu_namespace, limited)
    name = pod["metadata"]["name"]
    message = _failed_start(cluster, node, gpu_namespace, name, "limited")
    # runc: "error running hook #0: error running hook: exit status 1, stdout: , stderr: ...", with
    # the hook's own log line in it; the container never ran.
    assert "error running hook" in message and V2_ONLY in message, message
    current = get_pod(cluster, gpu_namespace, name)
    assert "running" not in (statuses(current)["limited"].get("state") or {}), statuses(current)["limited"]
    # The sidecar and the sandbox went through the same hook: without the variables it does nothing.
    assert "running" in (statuses(current)[SIDECAR_NAME].get("state") or {}), statuses(current)[SIDECAR_NAME]
    assert any(V2_ONLY in (e.get("message") or "") for e in events(cluster, gpu_namespace, name))

    plain = gpu_pod([workload_container("plain")], {"gpufence.io/memory": "2Gi"}, runtimeClassName=HOOK_HANDLER)
    plain_pod = _create(admin, gpu_namespace, plain)
    running = wait_running(cluster, node, gpu_namespace, plain_pod["metadata"]["name"])
    spec = _bundle_spec(node, statuses(running)["plain"]["containerID"])
    hooks = spec["hooks"]["createRuntime"]
    assert [h["args"][:2] for h in hooks] == [["nvidia-cdi-hook", "apply-cuda-memory-limits"]], hooks
    assert hooks[0]["args"][-2:] == ["--gpu-id", GPU_UUID]


def test_the_real_hook_sets_the_limit_on_the_containers_cgroup_in_a_v2_view(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str,
        runtime_class: Any):
    """The same binary, given the v2 node's view (see the module's docstring), reads the variables
    from the real OCI spec, calls nvmlDeviceSetMemoryLimits_v1 on the workload container's cgroup,
    and the simulated driver refuses the allocation past it; the neighbour without the variables
    allocates freely and the enforcer reports the driver as the mechanism."""
    pod = _create(admin, gpu_namespace, gpu_pod([
        workload_container("limited", ALLOCATOR, env=LIMIT_ENV, args=[str(GIB), str(3 * GIB // 2)]),
        workload_container("neighbour", ALLOCATOR, args=[str(3 * GIB // 2)]),
    ], {"gpufence.io/memory": "2Gi"}, runtimeClassName=V2_VIEW_HANDLER))
    running = wait_running(cluster, node, gpu_namespace, pod["metadata"]["name"])
    found = statuses(running)

    # The OCI spec the runtime got from containerd carries the pod's variables and the hook.
    spec = _bundle_spec(node, found["limited"]["containerID"])
    assert {"NVIDIA_GPU_MEMORY_LIMIT=2048", "NVIDIA_GPU_MEMORY_REQUEST=1024"} <= set(spec["process"]["env"])
    assert spec["hooks"]["createRuntime"][0]["args"][2] == "apply-cuda-memory-limits"

    # The hook set request/limit (MiB -> bytes) on the container's own cgroup, named as it names it.
    # runc put each container into the unified hierarchy too, at the path of its v1 cgroups: the
    # hook's /proc/<pid>/cgroup rule finds the container's own cgroup, as on a v2 node.
    limited_groups = _cgroups(host_pid(node, running, "limited"))
    limited_cg, neighbour_cg = limited_groups[""], _cgroups(host_pid(node, running, "neighbour"))[""]
    assert limited_cg.endswith(found["limited"]["containerID"].split("://", 1)[-1]), limited_cg
    if cgroup_version() == "hybrid":
        assert limited_groups["memory"] == limited_cg, limited_groups
    limits = read_limits(node.state_file)
    assert SimLimit(GPU_UUID, "/sys/fs/cgroup" + limited_cg, 1024 * MIB, 2048 * MIB) in limits, limits
    assert not [x for x in limits if x.namespace == "/sys/fs/cgroup" + neighbour_cg], limits

    # In the container: 1 GiB fits, 1.5 GiB more would pass 2 GiB and is refused; the neighbour,
    # in its own cgroup, gets its 1.5 GiB.
    kube.wait_for(lambda: "out of memory" in container_log(running, "limited"), "the refused allocation", 30, 0.3)
    log = container_log(running, "limited")
    assert f"allocated {GIB}" in log and f"out of memory {3 * GIB // 2} (nvml 20)" in log, log
    kube.wait_for(lambda: f"allocated {3 * GIB // 2}" in container_log(running, "neighbour"),
                  "the neighbour's allocation", 30, 0.3)

    report = wait_record(running, lambda r: r.get("event") == "memory_enforcement"
                         and r.get("container") == "limited", "the enforcer's mechanism for limited")
    assert report["mechanism"] == "driver", report


def test_with_a_driver_older_than_r615_the_real_hook_fails_the_start_too(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str,
        runtime_class: Any):
    """Past the cgroup check, a driver without nvmlDeviceSetMemoryLimits_v1: the hook (linked lazily,
    as the toolkit links it) dies in the dynamic loader at the call, exit 127, and the container
    does not start either; without the variables the hook never gets there."""
    pod = _create(admin, gpu_namespace, gpu_pod([
        workload_container("limited", env=LIMIT_ENV), workload_container("plain"),
    ], {"gpufence.io/memory": "2Gi"}, runtimeClassName=OLD_DRIVER_HANDLER))
    name = pod["metadata"]["name"]
    message = _failed_start(cluster, node, gpu_namespace, name, "limited")
    assert "error running hook" in message and "exit status 127" in message, message
    assert "undefined symbol: nvmlDeviceSetMemoryLimits_v1" in message, message
    kube.wait_for(lambda: "running" in (statuses(get_pod(cluster, gpu_namespace, name)).get("plain", {})
                                        .get("state") or {}), "the container without the variables running", 60, 0.5)
