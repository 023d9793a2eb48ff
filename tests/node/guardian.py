"""The node guardian (``gpufence-node``) on the node test bed, as its DaemonSet.

What is applied is the real install: ``kubectl kustomize k8s/overlays/node-guardian`` less the
objects of ``k8s/base`` (those are installed already, the webhook running as a local process),
that is exactly what the component ``k8s/components/node-guardian`` adds: its namespace (Pod
Security ``privileged``), ServiceAccount, read-only RBAC, the Event policy and the DaemonSet. The
only change to it is the image name, set to the one this bed imports (``tests.node.images``; the
same name as shipped, so nothing changes in fact). The kubelet, containerd and runc run the pod:
``hostPID``, privileged, the host's ``/sys/fs/cgroup`` and ``/var/lib/gpufence-node`` by
hostPath, its in-cluster ServiceAccount token for its pod watch and its Events.

What the bed cannot provide, and what stands in for it:

* no kube-scheduler (the bed's kubelet 1.30 has no 1.30 scheduler built beside it): a thread here
  binds each pending pod of the DaemonSet to the node through ``pods/binding``, which is the
  scheduler's one write for a DaemonSet pod (the DaemonSet controller already pins it to the node
  by node affinity);
* no GPU Operator or NFD to label the node: the node gets ``nvidia.com/gpu.present=true``, the
  DaemonSet's nodeSelector, as they would set it;
* no NVIDIA container toolkit: the bed's runtime wrapper (``tests.node.simruntime``) does what the
  toolkit does for a container with ``NVIDIA_VISIBLE_DEVICES`` in its environment, which the
  DaemonSet sets to ``all``: it mounts the simulated ``libnvidia-ml.so.1`` and its state, so the
  guardian's unmodified NVML loading (no ``--simulate``) finds the simulated driver. Read-only, as
  the wrapper mounts it for a sidecar: the simulated driver keeps R615's per-cgroup limits in a
  file beside its state, so the guardian cannot set one here (a real driver takes the call through
  its device node).

The decision log is the container's stdout, read from the kubelet's log files (the bed's API
server has no kubelet client credentials, so no ``kubectl logs``); a thread keeps a copy of every
incarnation's log, since the kubelet removes a deleted pod's files.

Stopping it: the DaemonSet is deleted in the foreground (the kubelet sends SIGTERM: the guardian
thaws what it froze); then no cgroup of the node's pods may be left frozen (thawed and reported
if one is), and the state directory on the host is removed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import REPO, apply_objects
from tests.node.images import GPUFENCE_IMAGE
from tests.node.node import Node

OVERLAY = REPO / "k8s" / "overlays" / "node-guardian"
BASE = REPO / "k8s" / "base"
NAMESPACE = "gpufence-node"
ACCOUNT = "gpufence-node"
DAEMONSET = "gpufence-node"
CONTAINER = "gpufence-node"
USERNAME = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
NODE_LABEL = "nvidia.com/gpu.present"
CGROUP_ROOT = Path("/sys/fs/cgroup")
POD_LOGS = Path("/var/log/pods")
# The DaemonSet's defaults, which the tests hold the guardian to (gpufence/node/cli.py): it runs
# with the manifest's args only.
POLL_INTERVAL = 0.5
METRICS_PORT = 9402
START_TIMEOUT = 180.0
STOP_TIMEOUT = 120.0


def _key(obj: dict[str, Any]) -> tuple[str, str | None, str]:
    return obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]


def component_objects(cp: ControlPlane) -> list[dict[str, Any]]:
    """The node-guardian overlay's objects that the base does not have, the image set to the bed's."""
    def render(path: Path) -> list[dict[str, Any]]:
        return [o for o in yaml.safe_load_all(cp.kubectl("kustomize", str(path)).stdout) if o]

    base = {_key(o) for o in render(BASE)}
    objects = [o for o in render(OVERLAY) if _key(o) not in base]
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    for container in daemonset["spec"]["template"]["spec"]["containers"]:
        container["image"] = GPUFENCE_IMAGE
    return objects


def cri_records(text: str) -> list[dict[str, Any]]:
    """JSON decision-log lines out of a CRI log file (``time stream tag message``)."""
    out = []
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4:
            with contextlib.suppress(ValueError):
                record = json.loads(parts[3])
                if isinstance(record, dict):
                    out.append(record)
    return out


class GuardianDaemonSet:
    """The DaemonSet's pods on the node: binds them (the scheduler's part), keeps their logs."""

    def __init__(self, cp: ControlPlane, node: Node) -> None:
        self.cp = cp
        self.node = node
        self.core = client.CoreV1Api(kube.api_client(cp.admin_kubeconfig))
        self._logs: dict[str, str] = {}  # pod log directory name -> the log text last read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bind_errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="guardian-daemonset", daemon=True)

    # -- the background part: bind pending pods, copy the log files ---------------------------

    def _run(self) -> None:
        # Logs often (the kubelet removes a deleted pod's files soon after its container exits),
        # bindings less so (one API list each).
        rounds = 0
        while not self._stop.wait(0.1):
            if rounds % 4 == 0:
                with contextlib.suppress(Exception):  # an API hiccup: the next round retries
                    self._bind_pending()
            self._read_logs()
            rounds += 1

    def _bind_pending(self) -> None:
        pods = self.core.list_namespaced_pod(NAMESPACE, field_selector="spec.nodeName=").items
        for pod in pods:
            if pod.metadata.deletion_timestamp is not None:
                continue
            body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod.metadata.name},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": self.node.name}}
            try:
                self.core.create_namespaced_pod_binding(pod.metadata.name, NAMESPACE, body, _preload_content=False)
            except client.ApiException as exc:
                if exc.status != 409:  # already bound
                    self._bind_errors.append(f"{pod.metadata.name}: {exc.status} {exc.reason}")

    def _read_logs(self) -> None:
        for path in POD_LOGS.glob(f"{NAMESPACE}_{DAEMONSET}-*/{CONTAINER}/*.log"):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace")
                key = f"{path.parent.parent.name}/{path.name}"
                with self._lock:
                    if len(text) >= len(self._logs.get(key, "")):
                        self._logs[key] = text

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._read_logs()

    # -- what the tests read --------------------------------------------------------------------

    def pods(self) -> list[client.V1Pod]:
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"app.kubernetes.io/name={DAEMONSET}").items
        return sorted(pods, key=lambda p: p.metadata.creation_timestamp)

    def records(self) -> list[dict[str, Any]]:
        """Every incarnation's decision log, each record tagged with its pod (``_pod``), oldest
        incarnation first (pod names sort by nothing useful: ordered by their ``started`` line's time)."""
        self._read_logs()
        with self._lock:
            logs = dict(self._logs)
        by_pod: dict[str, list[dict[str, Any]]] = {}
        for key in sorted(logs, key=lambda k: (k.split("/")[0], int(k.split("/")[1].split(".")[0]))):
            pod = key.split("_")[1]
            by_pod.setdefault(pod, []).extend({**r, "_pod": pod} for r in cri_records(logs[key]))
        ordered = sorted(by_pod.values(), key=lambda rs: str(rs[0].get("time", "")) if rs else "")
        return [r for rs in ordered for r in rs]

    def tail(self, chars: int = 6000) -> str:
        with self._lock:
            text = "".join(f"--- {k}\n{v[-chars:]}" for k, v in sorted(self._logs.items()))
        return text[-chars:] + (f"\nbinding errors: {self._bind_errors[-5:]}" if self._bind_errors else "")

    def check_alive(self) -> None:
        """No guardian container may have failed or restarted (the DaemonSet would hide it)."""
        for pod in self.pods():
            for status in pod.status.container_statuses or []:
                terminated = status.state.terminated if status.state else None
                if status.restart_count or (terminated is not None and pod.metadata.deletion_timestamp is None):
                    raise AssertionError(f"gpufence-node {pod.metadata.name} failed (restarts "
                                         f"{status.restart_count}, {terminated}):\n{self.tail()}")

    def wait_record(self, predicate: Callable[[dict[str, Any]], bool], what: str,
                    timeout: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            self.check_alive()
            return next((r for r in self.records() if predicate(r)), None)
        try:
            return kube.wait_for(found, what, timeout, interval=0.3)
        except AssertionError as exc:
            raise AssertionError(f"no guardian record: {what} ({exc}); its log:\n{self.tail()}") from None

    def running_pod(self, timeout: float = START_TIMEOUT, other_than: str | None = None) -> client.V1Pod:
        """The guardian's pod once it runs and has logged ``started`` (not ``other_than``'s UID)."""
        def ready() -> client.V1Pod | None:
            for pod in self.pods():
                if pod.metadata.uid == other_than or pod.metadata.deletion_timestamp is not None:
                    continue
                if pod.status.phase == "Running":
                    name = pod.metadata.name
                    if any(r.get("event") == "started" and r["_pod"] == name for r in self.records()):
                        return pod
            return None
        try:
            return kube.wait_for(ready, "the guardian's pod running", timeout, interval=0.5)
        except AssertionError:
            raise AssertionError(f"gpufence-node did not start: {self._describe()}\n{self.tail()}"
                                 f"\nkubelet: {self.node.log('kubelet')[-3000:]}") from None

    def metric(self, name: str, pod: client.V1Pod | None = None) -> float | None:
        """One unlabelled sample of the running pod's metrics (port 9402 at its pod IP, as the
        PodMonitor scrapes it); None when absent."""
        pod = pod or self.running_pod()
        with urllib.request.urlopen(f"http://{pod.status.pod_ip}:{METRICS_PORT}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == name:
                return float(value)
        return None

    def wait_polls(self, polls: int, timeout: float) -> None:
        """Until the running guardian has completed ``polls`` more polls (its poll-duration count)."""
        name = "gpufence_node_poll_duration_seconds_count"
        pod = self.running_pod()
        first = self.metric(name, pod) or 0
        kube.wait_for(lambda: (self.metric(name, pod) or 0) >= first + polls,
                      f"{polls} polls of the guardian", timeout, interval=0.2)

    def host_pid(self, pod: client.V1Pod) -> int:
        """The host PID of the guardian's process (its container's init: the DaemonSet's command)."""
        (status,) = pod.status.container_statuses
        pid = self.node.task_pid(status.container_id)
        assert pid is not None, f"no running task for {status.container_id}"
        return pid

    def _describe(self) -> str:
        pods = self.cp.kubectl("-n", NAMESPACE, "get", "pods,daemonset", "-o", "wide", check=False).stdout
        events = self.cp.kubectl("-n", NAMESPACE, "get", "events", check=False).stdout
        return f"{pods}\n{events[-3000:]}"


def frozen_pod_cgroups() -> list[Path]:
    """Cgroups of the node's pods that a freezer holds (the guardian must leave none): v1
    ``freezer.state``, and ``cgroup.freeze`` of the v2 tree (where this hybrid host's runc places
    every container too, and which the guardian uses when it has the container there)."""
    found = []
    v1 = CGROUP_ROOT / "freezer" / "kubepods"
    if v1.is_dir():
        found += [p for p in v1.rglob("freezer.state") if p.read_text().strip() != "THAWED"]
    for v2 in (CGROUP_ROOT / "kubepods", CGROUP_ROOT / "unified" / "kubepods"):
        if (v2 / "cgroup.procs").exists():
            found += [p for p in v2.rglob("cgroup.freeze") if p.read_text().strip() != "0"]
    return found


def _state_dir(objects: list[dict[str, Any]]) -> Path:
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    return Path(volumes["state"]["hostPath"]["path"])


@contextlib.contextmanager
def running_guardian(cp: ControlPlane, node: Node) -> Iterator[GuardianDaemonSet]:
    objects = component_objects(cp)
    state_dir = _state_dir(objects)
    # The host directory is the DaemonSet's: a previous run's episodes must not be recovered here.
    shutil.rmtree(state_dir, ignore_errors=True)
    cp.kubectl("label", "node", node.name, f"{NODE_LABEL}=true", "--overwrite")
    guardian = GuardianDaemonSet(cp, node)
    guardian.start()
    try:
        apply_objects(cp, objects)
        guardian.running_pod()
        yield guardian
    finally:
        _stop(cp, guardian)
        cp.kubectl("label", "node", node.name, f"{NODE_LABEL}-", check=False)
        shutil.rmtree(state_dir, ignore_errors=True)


def _stop(cp: ControlPlane, guardian: GuardianDaemonSet) -> None:
    try:
        cp.kubectl("-n", NAMESPACE, "delete", "daemonset", DAEMONSET, "--cascade=foreground", "--wait=true",
                   f"--timeout={STOP_TIMEOUT:.0f}s", check=False)
        kube.wait_for(lambda: not guardian.pods(), "the guardian's pods gone", STOP_TIMEOUT, interval=0.5)
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        print(f"gpufence-node did not stop cleanly: {exc}")
    finally:
        guardian.stop()
    left = frozen_pod_cgroups()
    for control in left:  # never leave a pod frozen, whatever went wrong
        with contextlib.suppress(OSError):
            control.write_text("THAWED" if control.name == "freezer.state" else "0")
    assert not left, f"gpufence-node left frozen cgroups: {left}\n{guardian.tail()}"
