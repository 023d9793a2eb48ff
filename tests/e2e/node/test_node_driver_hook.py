"""NVIDIA's real ``apply-cuda-memory-limits`` hook on the real node (kubelet, containerd, runc).

The hook is the toolkit's own ``nvidia-cdi-hook`` (v1.20.2, built from its pinned Go module by
``tests.e2e.binaries``), run by runc as a ``createRuntime`` hook from the OCI spec containerd wrote
for the pod (``tests.node.driver_hook``: containerd 1.6 has no CDI, so a runtime handler's base spec
carries the hook, chosen by a RuntimeClass). Its driver library is the simulated
``libnvidia-ml.so.1``; the workloads allocate through the same library and its state.

The pods go through gpufence's webhook as a user's would: a GPU pod with a memory share
(``gpufence.io/memory: 2Gi``) pinned by its nodeSelector to nodes labelled
``gpufence.io/driver-memory-limits=true`` (the node is labelled for this module) gets
``NVIDIA_GPU_MEMORY_LIMIT`` = ``NVIDIA_GPU_MEMORY_REQUEST`` = 2048 (MiB) from the webhook under the
default ``driver-memory-limits: auto``; the same pod unpinned gets neither. No pod here sets the
variables itself except to show that the webhook replaces the author's value: the webhook removes
or replaces an author's entry, so a hand-written value could not reach the node anyway.

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

from gpufence.contract import (
    DRIVER_LIMITS_NODE_LABEL,
    ENV_DRIVER_MEMORY_LIMIT,
    ENV_DRIVER_MEMORY_REQUEST,
    SIDECAR_NAME,
)
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
from tests.node.node import NODE_NAME, Node, cgroup_version
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
SHARE = {"gpufence.io/memory": "2Gi"}
# What a user adds to say "only on nodes that can apply the driver's limit" (docs/driver-limits.md).
PINNED = {DRIVER_LIMITS_NODE_LABEL: "true"}
# What the webhook writes for the 2Gi share: whole MiB, request = limit.
DRIVER_ENV = {ENV_DRIVER_MEMORY_LIMIT: "2048", ENV_DRIVER_MEMORY_REQUEST: "2048"}
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


@pytest.fixture(scope="module")
def driver_limit_node(admin: client.ApiClient, cluster: ControlPlane, node: Node) -> Any:
    """The node labelled as an admin labels one that can apply the driver's limit (the kubelet
    admits a pinned pod only there); unlabelled afterwards, as the other node tests expect it, and
    only once the webhook's Node cache shows it unlabelled (else the next module's pods, bound to
    the node by name, would still get the variables, which this cgroup v1 node's hook refuses)."""
    probe_namespace = kube.create_namespace(admin, "driverlabel", kube.OPT_IN)
    set_node_label(admin, cluster, probe_namespace, labelled=True)
    yield probe_namespace
    set_node_label(admin, cluster, probe_namespace, labelled=False)
    cluster.kubectl("delete", "namespace", probe_namespace, "--wait=false", check=False)


def set_node_label(admin: client.ApiClient, cluster: ControlPlane, probe_namespace: str, *, labelled: bool) -> None:
    """Label or unlabel the node, then wait until the webhook says so: under ``auto`` a GPU pod bound
    to the node by ``nodeName`` gets the driver variables exactly when the node is labelled (the
    webhook's Node cache, issue 32 row 8), which a dry run shows without creating anything."""
    label = f"{DRIVER_LIMITS_NODE_LABEL}=true" if labelled else f"{DRIVER_LIMITS_NODE_LABEL}-"
    cluster.kubectl("label", "node", NODE_NAME, label, "--overwrite")

    def webhook_agrees() -> bool | None:
        created = kube.create_pod(admin, probe_namespace, gpu_pod([workload_container("probe")], dict(SHARE)),
                                  dry_run=True)
        assert created.admitted, created.message
        return ((_stored_env(created.obj, "probe") == DRIVER_ENV) == labelled) or None

    kube.wait_for(webhook_agrees, f"the webhook seeing {NODE_NAME} {'labelled' if labelled else 'unlabelled'}",
                  30, 0.2)


def _pod(containers: list[dict[str, Any]], handler: str, *, pinned: bool = True) -> dict[str, Any]:
    """A GPU pod with the 2Gi share on ``handler``'s runtime, pinned to driver-limit nodes or not."""
    extra: dict[str, Any] = {"nodeSelector": dict(PINNED)} if pinned else {}
    return gpu_pod(containers, dict(SHARE), runtimeClassName=handler, **extra)


def _create(admin: client.ApiClient, namespace: str, pod: dict) -> dict:
    """The pod as the API server stored it, after gpufence's webhook."""
    created = kube.create_pod(admin, namespace, pod)
    assert created.admitted, created.message
    return created.obj


def _stored_env(pod: dict[str, Any], container: str) -> dict[str, str | None]:
    """The driver limit variables in ``container``'s stored spec (what the webhook left there)."""
    found = next(c for c in pod["spec"]["containers"] if c["name"] == container)
    return {e["name"]: e.get("value") for e in found.get("env") or () if e["name"] in DRIVER_ENV}


def _spec_env(spec: dict[str, Any]) -> dict[str, str]:
    """The driver limit variables in an OCI spec's process env (what the hook reads)."""
    pairs = (entry.split("=", 1) for entry in spec["process"]["env"])
    return {name: value for name, value in pairs if name in DRIVER_ENV}


def _process_env(pid: int) -> dict[str, str]:
    """The driver limit variables in a running process's environment, as the host sees it."""
    pairs = (entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry)
    return {name: value for name, value in pairs if name in DRIVER_ENV}


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


def _wait_container_running(cluster: ControlPlane, namespace: str, name: str, container: str) -> None:
    kube.wait_for(lambda: "running" in (statuses(get_pod(cluster, namespace, name)).get(container, {})
                                        .get("state") or {}), f"the {container} container running", 60, 0.5)


def test_a_pinned_pod_does_not_start_where_the_hook_cannot_apply_the_limit_and_unpinned_it_runs(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str,
        runtime_class: Any, driver_limit_node: Any):
    """The safety decision and the proof of the default. A pod pinned to driver-limit nodes gets the
    variables from the webhook; on a node whose hook cannot apply them (here: cgroup v1) its GPU
    container does not start at all (an OCI createRuntime hook that fails fails runc's create).
    The same pod on the same node once the admin has taken the label off gets no variables under
    ``auto`` and runs with the same handler."""
    if cgroup_version() == "v2":
        skip_by_design("cgroup-v2-node", "on a cgroup v2 node the hook applies the limit: nothing fails here")
    pod = _create(admin, gpu_namespace, _pod([workload_container("limited")], HOOK_HANDLER))
    assert _stored_env(pod, "limited") == DRIVER_ENV, pod["spec"]["containers"]
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

    # The same pod on the same node once the admin has taken the label off: bound by nodeName to a
    # node the webhook knows as unlabelled, it gets no variables under `auto` and runs.
    set_node_label(admin, cluster, driver_limit_node, labelled=False)
    try:
        unpinned = _create(admin, gpu_namespace, _pod([workload_container("limited")], HOOK_HANDLER,
                                                      pinned=False))
        assert _stored_env(unpinned, "limited") == {}, unpinned["spec"]["containers"]
        running = wait_running(cluster, node, gpu_namespace, unpinned["metadata"]["name"])
    finally:
        set_node_label(admin, cluster, driver_limit_node, labelled=True)
    spec = _bundle_spec(node, statuses(running)["limited"]["containerID"])
    assert _spec_env(spec) == {}, spec["process"]["env"]
    hooks = spec["hooks"]["createRuntime"]
    assert [h["args"][:2] for h in hooks] == [["nvidia-cdi-hook", "apply-cuda-memory-limits"]], hooks
    assert hooks[0]["args"][-2:] == ["--gpu-id", GPU_UUID]


def test_the_webhooks_limit_is_set_by_the_real_hook_on_each_containers_cgroup_in_a_v2_view(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str,
        runtime_class: Any, driver_limit_node: Any):
    """The same binary, given the v2 node's view (see the module's docstring), reads the variables
    the webhook wrote from the real OCI spec, calls nvmlDeviceSetMemoryLimits_v1 on each GPU
    container's own cgroup (soft = hard = the 2Gi share), and the simulated driver refuses the
    allocation past it; the neighbour, in its own cgroup under its own limit, allocates what the
    first was refused, and the enforcer reports the driver as the mechanism."""
    pod = _create(admin, gpu_namespace, _pod([
        workload_container("limited", ALLOCATOR, args=[str(GIB), str(3 * GIB // 2)]),
        workload_container("neighbour", ALLOCATOR, args=[str(3 * GIB // 2)]),
    ], V2_VIEW_HANDLER))
    assert _stored_env(pod, "limited") == _stored_env(pod, "neighbour") == DRIVER_ENV, pod["spec"]["containers"]
    running = wait_running(cluster, node, gpu_namespace, pod["metadata"]["name"])
    found = statuses(running)

    # The OCI spec the runtime got from containerd carries the webhook's variables and the hook.
    spec = _bundle_spec(node, found["limited"]["containerID"])
    assert _spec_env(spec) == DRIVER_ENV, spec["process"]["env"]
    assert spec["hooks"]["createRuntime"][0]["args"][2] == "apply-cuda-memory-limits"

    # The hook set request/limit (MiB -> bytes) on each container's own cgroup, named as it names it.
    # runc put each container into the unified hierarchy too, at the path of its v1 cgroups: the
    # hook's /proc/<pid>/cgroup rule finds the container's own cgroup, as on a v2 node.
    limited_groups = _cgroups(host_pid(node, running, "limited"))
    limited_cg, neighbour_cg = limited_groups[""], _cgroups(host_pid(node, running, "neighbour"))[""]
    assert limited_cg.endswith(found["limited"]["containerID"].split("://", 1)[-1]), limited_cg
    if cgroup_version() == "hybrid":
        assert limited_groups["memory"] == limited_cg, limited_groups
    limits = read_limits(node.state_file)
    for cgroup in (limited_cg, neighbour_cg):
        assert SimLimit(GPU_UUID, "/sys/fs/cgroup" + cgroup, 2 * GIB, 2 * GIB) in limits, limits

    # In the container: 1 GiB fits, 1.5 GiB more would pass 2 GiB and is refused; the neighbour
    # gets its 1.5 GiB although the pod then holds 2.5 GiB: each limit is the container's own.
    kube.wait_for(lambda: "out of memory" in container_log(running, "limited"), "the refused allocation", 30, 0.3)
    log = container_log(running, "limited")
    assert f"allocated {GIB}" in log and f"out of memory {3 * GIB // 2} (nvml 20)" in log, log
    kube.wait_for(lambda: f"allocated {3 * GIB // 2}" in container_log(running, "neighbour"),
                  "the neighbour's allocation", 30, 0.3)

    for container in ("limited", "neighbour"):
        report = wait_record(running, lambda r, c=container: r.get("event") == "memory_enforcement"
                             and r.get("container") == c, f"the enforcer's mechanism for {container}")
        assert report["mechanism"] == "driver", report


def test_an_author_set_limit_above_the_share_is_replaced_by_the_shares_value_on_the_node(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str,
        runtime_class: Any, driver_limit_node: Any):
    """The variables are gpufence's: an author who asks the driver for the whole GPU
    (``NVIDIA_GPU_MEMORY_LIMIT=81920``) gets the share's 2048 in the running container's
    environment, and the hook sets that, so an allocation the author's value would let through
    is refused."""
    pod = _create(admin, gpu_namespace, _pod([workload_container(
        "main", ALLOCATOR, args=[str(3 * GIB)], env=[{"name": ENV_DRIVER_MEMORY_LIMIT, "value": "81920"}],
    )], V2_VIEW_HANDLER))
    assert _stored_env(pod, "main") == DRIVER_ENV, pod["spec"]["containers"]
    running = wait_running(cluster, node, gpu_namespace, pod["metadata"]["name"])
    pid = host_pid(node, running, "main")
    assert _process_env(pid) == DRIVER_ENV
    cgroup = "/sys/fs/cgroup" + _cgroups(pid)[""]
    assert [x for x in read_limits(node.state_file) if x.namespace == cgroup] == [
        SimLimit(GPU_UUID, cgroup, 2 * GIB, 2 * GIB)]
    kube.wait_for(lambda: "out of memory" in container_log(running, "main"), "the refused allocation", 30, 0.3)
    assert f"out of memory {3 * GIB} (nvml 20)" in container_log(running, "main")


def test_with_a_driver_older_than_r615_the_real_hook_fails_the_start_too(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str,
        runtime_class: Any, driver_limit_node: Any):
    """Past the cgroup check, a driver without nvmlDeviceSetMemoryLimits_v1: the hook (linked lazily,
    as the toolkit links it) dies in the dynamic loader at the call, exit 127, and the pinned pod's
    GPU container does not start either (a node labelled wrongly). The pod needs no hand-written
    variables: the webhook writes them for the pin, and the sidecar, which the webhook gives none,
    goes through the same hook and runs: without the variables the hook never gets there."""
    pod = _create(admin, gpu_namespace, _pod([workload_container("limited")], OLD_DRIVER_HANDLER))
    assert _stored_env(pod, "limited") == DRIVER_ENV, pod["spec"]["containers"]
    sidecar = next(c for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
                   if c["name"] == SIDECAR_NAME)
    assert not [e for e in sidecar.get("env") or () if e["name"] in DRIVER_ENV], sidecar
    name = pod["metadata"]["name"]
    message = _failed_start(cluster, node, gpu_namespace, name, "limited")
    assert "error running hook" in message and "exit status 127" in message, message
    assert "undefined symbol: nvmlDeviceSetMemoryLimits_v1" in message, message
    _wait_container_running(cluster, gpu_namespace, name, SIDECAR_NAME)
