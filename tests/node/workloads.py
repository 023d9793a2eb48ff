"""Pods, workloads and observations for the node tests (what a user submits, what the node shows)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gpufence.contract import SIDECAR_NAME
from gpufence.simnvml import SimDevice, SimProcess, SimState, write_state
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.node.driver_hook import GPU_UUID
from tests.node.images import GPUFENCE_IMAGE, SETUID_ROOT_PYTHON
from tests.node.node import NODE_NAME, Node

GPU_MEMORY = 80 << 30

# A GPU process as far as the enforcer can tell: it holds the (stand-in) device open. It says when
# it got SIGTERM, so the test can tell the enforcer's signal from the kubelet's.
WORKLOAD = """
import os, signal, sys, time
device = open("/dev/nvidia0")
def on_term(signum, frame):
    print("got SIGTERM", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
print(f"gpu process {os.getpid()} uid {os.getuid()}", flush=True)
while True:
    time.sleep(3600)
"""

# Burns CPU and reports, once a second, how much wall time passed without it running: a process
# held stopped (SIGSTOP) sees gaps.
SPINNER = """
import os, time
device = open("/dev/nvidia0")
print(f"gpu process {os.getpid()}", flush=True)
last = time.monotonic()
while True:
    now = time.monotonic()
    if now - last > 0.2:
        print(f"gap {now - last:.2f}", flush=True)
    last = now
"""


# A GPU process that re-execs itself under a name that is no container of its pod (GPUFENCE_CONTAINER
# is only a claim): the enforcer holds it as unattributed, to the pod's budget.
RENAMED = """
import os
if os.environ.get("GPUFENCE_CONTAINER") != "not-a-container":
    argv = open("/proc/self/cmdline", "rb").read().rstrip(b"\\0").split(b"\\0")
    os.execve("/proc/self/exe", argv, {**os.environ, "GPUFENCE_CONTAINER": "not-a-container"})
""" + WORKLOAD


# Run by the image's setuid-root python3 (``images.SETUID_ROOT_PYTHON``) as the pod's non-root user:
# makes itself root for good (real, effective and saved uid 0) where the setuid bit took, says
# whether it did, and holds the device over its share like any workload. With argv[1] "ignore" it
# ignores SIGTERM, as an attacker would (only a SIGKILL ends it).
SETUID_ROOT_WORKLOAD = """
import os, signal, sys, time
started = os.getresuid()
try:
    os.setresuid(0, 0, 0)
    became = "became root"
except OSError as exc:
    became = f"stayed uid {os.geteuid()} ({exc.strerror})"
device = open("/dev/nvidia0")
def on_term(signum, frame):
    print("got SIGTERM", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1:] == ["ignore"] else on_term)
print(f"gpu process {os.getpid()} started with uids {started}: {became}", flush=True)
while True:
    time.sleep(3600)
"""


def setuid_root_command(*args: str) -> list[str]:
    """The command of a container that runs ``SETUID_ROOT_WORKLOAD`` through the setuid-root binary."""
    return [SETUID_ROOT_PYTHON, "-u", "-c", SETUID_ROOT_WORKLOAD, *args]


def workload_container(name: str, script: str = WORKLOAD, *, user: int | None = 0, **extra: Any) -> dict[str, Any]:
    """A GPU container. ``user`` 0 by default: most CUDA images run as root (the image's own user,
    65532, is what ``user=None`` gives)."""
    container: dict[str, Any] = {
        "name": name, "image": GPUFENCE_IMAGE, "imagePullPolicy": "Never",
        "command": ["python3", "-u", "-c", script],
        "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "10m", "memory": "32Mi"}},
        **extra,
    }
    if user is not None:
        container.setdefault("securityContext", {})["runAsUser"] = user
    return container


def gpu_pod(containers: list[dict[str, Any]], annotations: dict[str, str] | None = None,
            **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": kube.unique("gpu"), "annotations": annotations or {}},
        # No scheduler in the test bed: bound to the node as the scheduler would.
        "spec": {"nodeName": NODE_NAME, "containers": containers, **spec},
    }


def get_pod(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(cp.kubectl("-n", namespace, "get", "pod", name, "-o", "json").stdout)


def statuses(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    status = pod.get("status") or {}
    return {s["name"]: s for s in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])}


def all_running(pod: dict[str, Any]) -> bool:
    found = statuses(pod)
    names = kube.container_names(pod)
    return all(n in found and "running" in (found[n].get("state") or {}) and found[n].get("started") for n in names)


def wait_running(cp: ControlPlane, node: Node, namespace: str, name: str, timeout: float = 90.0) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        node.check_alive()
        pod = get_pod(cp, namespace, name)
        return pod if all_running(pod) else None
    try:
        return kube.wait_for(ready, f"pod {namespace}/{name} running", timeout, interval=0.3)
    except AssertionError:
        pod = get_pod(cp, namespace, name)
        raise AssertionError(f"pod not running: {json.dumps(pod.get('status'), indent=1)[-3000:]}\n"
                             f"events: {events(cp, namespace, name)}\n"
                             f"container logs: {container_logs(namespace, name)[-4000:]}\n"
                             f"kubelet: {node.log('kubelet')[-3000:]}") from None


def container_logs(namespace: str, name: str) -> str:
    """What the containers wrote, read from the kubelet's log files (no kubelet API client here)."""
    out = []
    for log in sorted(Path("/var/log/pods").glob(f"{namespace}_{name}_*/*/*.log")):
        out.append(f"--- {log.parent.name}/{log.name}\n" + log.read_text(errors="replace")[-1500:])
    return "\n".join(out)


def host_pid(node: Node, pod: dict[str, Any], container: str) -> int:
    cid = statuses(pod)[container]["containerID"]
    pid = node.task_pid(cid)
    assert pid is not None, f"container {container} ({cid}) has no running task"
    return pid


def write_gpu_state(node: Node, processes: Iterable[tuple[int, int, int]]) -> None:
    """The simulated GPU's processes: (host pid, bytes used, SM %); the simulator maps the host pid
    to the one the sidecar sees in the pod's PID namespace, as the driver does."""
    write_state(node.state_file, SimState(devices=(SimDevice(
        GPU_UUID, GPU_MEMORY, tuple(SimProcess.for_pid(pid, used, sm_util=sm) for pid, used, sm in processes)),)))


def clear_namespace(cp: ControlPlane, node: Node, namespace: str) -> None:
    """After a node test: no GPU process left in the simulated driver, the namespace's pods gone
    before the next test starts (GPUs, CPU of 2-core machines), the namespace on its way out."""
    write_gpu_state(node, ())
    cp.kubectl("-n", namespace, "delete", "pods", "--all", "--wait=true", "--timeout=90s", check=False)
    cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def wait_terminated(cp: ControlPlane, namespace: str, name: str, container: str,
                    timeout: float = 60.0) -> dict[str, Any]:
    """The pod once ``container`` is terminated (a pod with ``restartPolicy: Never``)."""
    def terminated() -> dict[str, Any] | None:
        current = get_pod(cp, namespace, name)
        return current if "terminated" in (statuses(current)[container].get("state") or {}) else None
    return kube.wait_for(terminated, f"{container} of {namespace}/{name} terminated", timeout, 0.3)


def wait_sidecar_restarted(cp: ControlPlane, namespace: str, name: str, what: str, timeout: float) -> dict[str, Any]:
    """The pod once its sidecar has been restarted and has started again."""
    def restarted() -> dict[str, Any] | None:
        current = get_pod(cp, namespace, name)
        status = statuses(current)[SIDECAR_NAME]
        return current if status["restartCount"] >= 1 and status.get("started") else None
    return kube.wait_for(restarted, what, timeout, 0.3)


def proc_status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as the kernel reports it (``Uid``: real, effective, saved, filesystem;
    ``NoNewPrivs``: 1 where setuid bits and file capabilities no longer raise privileges)."""
    fields = (line.partition(":") for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: value.strip() for key, _, value in fields}


def events(cp: ControlPlane, namespace: str, pod: str) -> list[dict[str, Any]]:
    items = json.loads(cp.kubectl("-n", namespace, "get", "events", "-o", "json").stdout)["items"]
    return [e for e in items if e["involvedObject"].get("name") == pod]


def container_log(pod: dict[str, Any], container: str, restart: int | None = None) -> str:
    """The container's log file on this node (the API server has no kubelet client credentials
    here, so ``kubectl logs`` is not available; the files are the same the kubelet serves)."""
    meta = pod["metadata"]
    directory = Path("/var/log/pods") / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container
    if restart is None:
        files = sorted(directory.glob("*.log"), key=lambda p: int(p.name.split(".")[0]))
    else:
        files = [directory / f"{restart}.log"]
    return "".join(p.read_text(errors="replace") for p in files if p.exists())


def enforcer_records(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The enforcer's JSON decision log (CRI log lines: time stream tag message)."""
    records = []
    for line in container_log(pod, SIDECAR_NAME).splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4:
            try:
                records.append(json.loads(parts[3]))
            except ValueError:
                continue
    return records


def wait_record(pod: dict[str, Any], predicate: Callable[[dict[str, Any]], bool], what: str,
                timeout: float = 30.0) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((r for r in enforcer_records(pod) if predicate(r)), None)
    try:
        return kube.wait_for(found, what, timeout, interval=0.2)
    except AssertionError:
        raise AssertionError(f"no enforcer record: {what}; log:\n{container_log(pod, SIDECAR_NAME)[-4000:]}"
                             f"\nwhat the sidecar measures now:\n{_measured(pod)}") from None


def _measured(pod: dict[str, Any]) -> str:
    """The sidecar's per-container and per-pod figures, for a failure message: what it saw, not what it did."""
    try:
        found = metrics(pod)
    except OSError as exc:
        return f"(no metrics: {exc})"
    return "\n".join(f"{k} {v}" for k, v in found.items()
                     if k.startswith(("gpufence_container_", "gpufence_pod_", "gpufence_enforcement_actions",
                                      "gpufence_uninspectable", "gpufence_nvml_errors", "gpufence_poll_errors")))


def process_state(pid: int) -> str:
    """The kernel's state letter for ``pid`` (``T`` = stopped), "" when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def sample_states(pid: int, seconds: float) -> set[str]:
    """The states ``pid`` was seen in over ``seconds`` (polled every 10 ms: a duty cycle has no event)."""
    seen = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.add(process_state(pid))
        time.sleep(0.01)
    return seen


# Run as root in a GPU container: finds the enforcer in the shared PID namespace and sends it
# the signal named by argv[1]; then holds the device like any workload.
SABOTEUR = """
import os, signal, sys, time
device = open("/dev/nvidia0")
sig = getattr(signal, sys.argv[1])
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():  # this script's own text names the enforcer
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if any(arg.rsplit(b"/", 1)[-1] == b"gpufence-enforcer" for arg in argv):
            os.kill(int(pid), sig)
            print(f"sent {sys.argv[1]} to enforcer pid {pid}", flush=True)
while True:
    time.sleep(3600)
"""


def metrics(pod: dict[str, Any], port: int = 9401) -> dict[str, float]:
    """The sidecar's Prometheus metrics (no labels kept: name{labels} -> value), from the pod IP."""
    import urllib.request

    with urllib.request.urlopen(f"http://{pod['status']['podIP']}:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def sidecar_terminates_over_memory(cp: ControlPlane, running: dict[str, Any], container: str,
                                   used: int, limit: int, what: str) -> None:
    """The sidecar's whole answer to ``container`` holding ``used`` bytes on a ``limit`` share: its
    ``memory_over_share`` record, a SIGTERM it sent, and the kubelet restarting the container, whose
    workload saw the signal (the stand-in workloads print "got SIGTERM")."""
    namespace, name = running["metadata"]["namespace"], running["metadata"]["name"]
    over = wait_record(running, lambda r: r.get("event") == "memory_over_share" and r.get("container") == container,
                       f"memory_over_share for {container}, {what}", timeout=40)
    assert over["used_bytes"] == used and over["limit_bytes"] == limit, over
    term = wait_record(running, lambda r: r.get("event") == "sigterm" and r.get("container") == container,
                       f"the sidecar's SIGTERM to {container}, {what}")
    assert term["outcome"] == "sent" and term["reason"] == "memory_over_share", term
    kube.wait_for(lambda: statuses(get_pod(cp, namespace, name))[container]["restartCount"] >= 1,
                  f"{container} terminated and restarted by the kubelet", 60, 0.3)
    assert "got SIGTERM" in container_log(get_pod(cp, namespace, name), container, restart=0)
