"""The sidecar as it runs in a pod on the real node: resident memory in its own cgroup and its start-up.

For each kind of pod the test bed runs (a memory share with the root sidecar; memory and compute
shares, which add the throttle; a pod-level ``runAsUser``, whose non-root workload the root sidecar
reaches by SYS_PTRACE where Pod Security is unset),
the figures docs/PERFORMANCE.md quotes, printed with ``-s``:

* resident memory: the sidecar container's memory cgroup (v1 ``memory.stat`` rss + rss_huge, v2
  ``anon``), sampled over a few seconds of polling;
* start-up, on one clock (the host's wall clock; the node runs on this machine): the container's
  start is containerd's ``/tasks/start`` event (``ctr events``, nanoseconds: the exec of the
  enforcer), the enforcer's ``started`` record is its CRI log timestamp (nanoseconds), and the
  workload's own ``/tasks/start`` is when the kubelet let it start (after the sidecar's postStart
  hook returned: the start-to-ready figure); the sidecar's ``started: true`` and the workload's
  ``running`` are when a watch on the pod delivered them (an upper bound: the kubelet's status
  update and the watch are included). The kubelet's own ``startedAt`` has one-second resolution,
  so it is not used;
* the CPU the sidecar's cgroup used up to ``started: true`` and how often the CFS throttled it.

The assertions are what the defaults promise: the sidecar lives inside its memory limit and the
enforcer is up before the kubelet lets the workload start.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch

from gpufence.contract import SIDECAR_NAME
from gpufence.quantity import parse_bytes
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import NAMESPACE, POLICY_CONFIGMAP, WebhookProcess, apply_objects
from tests.e2e.test_policy_reload import policy_valid, shipped_configmap
from tests.node.node import Node, cgroup_version
from tests.node.workloads import container_log, gpu_pod, host_pid, wait_record, wait_running, workload_container

# name -> (annotations, pod securityContext, workload user)
KINDS: dict[str, tuple[dict[str, str], dict[str, Any], int | None]] = {
    "memory": ({"gpufence.io/memory": "8Gi"}, {}, 0),
    "memory-and-compute": ({"gpufence.io/memory": "8Gi", "gpufence.io/compute": "20"}, {}, 0),
    "pod-run-as-user": ({"gpufence.io/memory": "8Gi"}, {"runAsUser": 1000, "runAsGroup": 1000}, None),
}
STARTS = 3  # pods per kind: the kubelet's 1 s probe tick and PLEG relist make each start differ
# Other sidecar CPU limits to measure, through the policy ConfigMap as an admin sets them, e.g.
# GPUFENCE_FOOTPRINT_CPU_LIMITS=500m,1 (docs/PERFORMANCE.md); by default only the shipped one.
CPU_LIMITS = [v.strip() for v in os.environ.get("GPUFENCE_FOOTPRINT_CPU_LIMITS", "").split(",") if v.strip()]


def _cgroup_dir(pid: int, controller: str) -> Path | None:
    """The v1 cgroup directory of ``pid`` for ``controller``; None on cgroup v2."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return Path("/sys/fs/cgroup", controllers, path.lstrip("/"))
    return None


def _v2_dir(pid: int) -> Path:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return Path("/sys/fs/cgroup", next(line.split(":", 2)[2] for line in lines if line.startswith("0::")).lstrip("/"))


def _stat(path: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in path.read_text().splitlines())}


def container_memory(pid: int) -> int:
    """Resident bytes of the container whose process is ``pid``, as its own memory cgroup accounts it."""
    v1 = _cgroup_dir(pid, "memory")
    if v1 is not None:
        values = _stat(v1 / "memory.stat")
        return values.get("rss", 0) + values.get("rss_huge", 0)
    return _stat(_v2_dir(pid) / "memory.stat").get("anon", 0)


def container_cpu(pid: int) -> tuple[float, int, int]:
    """(CPU seconds used, CFS periods, periods throttled) of the container whose process is ``pid``."""
    acct = _cgroup_dir(pid, "cpuacct")
    if acct is not None:
        cpu = _cgroup_dir(pid, "cpu")
        stat = _stat(cpu / "cpu.stat") if cpu is not None else {}
        return int((acct / "cpuacct.usage").read_text()) / 1e9, stat.get("nr_periods", 0), stat.get("nr_throttled", 0)
    stat = _stat(_v2_dir(pid) / "cpu.stat")
    return stat["usage_usec"] / 1e6, stat.get("nr_periods", 0), stat.get("nr_throttled", 0)


def _wall(timestamp: str) -> float:
    """RFC 3339 with up to nine fractional digits (CRI logs, ``ctr events``) as a float timestamp."""
    seconds, _, rest = timestamp.rstrip("Z").partition(".")
    fraction = "".join(ch for ch in rest if ch.isdigit())
    return datetime.fromisoformat(seconds + "+00:00").timestamp() + float(f"0.{fraction or 0}")


class TaskStarts:
    """containerd's ``/tasks/start`` events while it runs: container id -> wall time (ns precision)."""

    def __init__(self, node: Node) -> None:
        self.starts: dict[str, float] = {}
        self._proc = subprocess.Popen([*node.ctr, "-n", "k8s.io", "events"], stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            # "2026-12-04 03:40:00.123456789 +0000 UTC k8s.io /tasks/start {"container_id":"...","pid":1}"
            parts = line.split(" ", 6)
            if len(parts) == 7 and parts[5] == "/tasks/start" and '"container_id":"' in parts[6]:
                cid = parts[6].split('"container_id":"', 1)[1].split('"', 1)[0]
                self.starts.setdefault(cid, _wall(f"{parts[0]}T{parts[1]}"))

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(5)


@dataclass
class PodWatch:
    """When a watch on the pod first delivered the sidecar ``started: true`` and a workload running."""

    sidecar_started: float | None = None
    workload_running: float | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _watch(admin: client.ApiClient, namespace: str, name: str, seen: PodWatch) -> None:
    stream = watch.Watch().stream(client.CoreV1Api(admin).list_namespaced_pod, namespace,
                                  field_selector=f"metadata.name={name}", timeout_seconds=120)
    for event in stream:
        now = time.time()
        status = event["raw_object"].get("status") or {}
        for c in status.get("initContainerStatuses") or []:
            if c["name"] == SIDECAR_NAME and c.get("started") and seen.sidecar_started is None:
                seen.sidecar_started = now
        for c in status.get("containerStatuses") or []:
            if "running" in (c.get("state") or {}) and seen.workload_running is None:
                seen.workload_running = now
        if seen.sidecar_started is not None and seen.workload_running is not None:
            break
    seen.done.set()


@pytest.fixture(params=[None, *CPU_LIMITS], ids=lambda v: f"cpu-limit-{v or 'shipped'}")
def cpu_limit(request: pytest.FixtureRequest, cluster: ControlPlane, admin: client.ApiClient,
              gpufence: WebhookProcess, gpu_namespace: str) -> Iterator[str | None]:
    value = request.param
    if value is None:
        yield None
        return
    client.CoreV1Api(admin).patch_namespaced_config_map(POLICY_CONFIGMAP, NAMESPACE,
                                                        {"data": {"sidecar-cpu-limit": value}})

    def injected_with_it() -> bool:  # the webhook and the guard both read the new value
        created = kube.create_pod(admin, gpu_namespace, gpu_pod([workload_container("probe")],
                                                                {"gpufence.io/memory": "1Gi"}), dry_run=True)
        sidecar = created.admitted and next(c for c in created.obj["spec"]["initContainers"]
                                            if c["name"] == SIDECAR_NAME)
        return bool(sidecar) and sidecar["resources"]["limits"].get("cpu") == value

    kube.wait_for(injected_with_it, f"pods injected with a sidecar CPU limit of {value}", 30, 0.5)
    yield value
    apply_objects(cluster, [shipped_configmap(cluster, gpufence)], "--force-conflicts")
    kube.wait_for(lambda: policy_valid(gpufence), "the webhook to read the shipped policy again", 30)


@pytest.fixture
def task_starts(node: Node) -> Iterator[TaskStarts]:
    starts = TaskStarts(node)
    time.sleep(0.2)  # `ctr events` subscribes before the first pod is created (no readiness signal to await)
    yield starts
    starts.close()


def _one_start(admin: client.ApiClient, cluster: ControlPlane, node: Node, namespace: str, kind: str,
               starts: TaskStarts) -> dict[str, Any]:
    annotations, pod_context, user = KINDS[kind]
    pod = gpu_pod([workload_container("trainer", user=user)], dict(annotations),
                  **({"securityContext": pod_context} if pod_context else {}))
    seen = PodWatch()
    watcher = threading.Thread(target=_watch, args=(admin, namespace, pod["metadata"]["name"], seen), daemon=True)
    watcher.start()
    time.sleep(0.2)  # the watch's request is on its way before the pod exists
    created = kube.create_pod(admin, namespace, pod)
    assert created.admitted, created.message
    running = wait_running(cluster, node, namespace, pod["metadata"]["name"])
    assert seen.done.wait(30), "the watch did not see the sidecar started and the workload running"
    pid = host_pid(node, running, SIDECAR_NAME)
    cpu, periods, throttled = container_cpu(pid)
    cid = next(c for c in running["status"]["initContainerStatuses"] if c["name"] == SIDECAR_NAME)["containerID"]
    task_start = kube.wait_for(lambda: starts.starts.get(cid.split("://", 1)[-1]), "containerd's /tasks/start", 10)
    started_line = next(line for line in container_log(running, SIDECAR_NAME).splitlines()
                        if '"event":"started"' in line)
    started = _wall(started_line.split(" ", 1)[0])
    # The workload's own task start (containerd's clock, like the sidecar's): when the kubelet let
    # it start, which the sidecar's postStart hook holds back until the enforcer is up.
    workload_cid = next(c for c in running["status"]["containerStatuses"] if c["name"] == "trainer")["containerID"]
    workload_start = kube.wait_for(lambda: starts.starts.get(workload_cid.split("://", 1)[-1]),
                                   "containerd's /tasks/start of the workload", 10)
    record = json.loads(started_line.split(" ", 3)[3])
    return {"enforcer_cpu": record.get("startup_cpu_seconds", float("nan")),
            "running": running, "pid": pid, "to_started": started - task_start,
            "to_ready": seen.sidecar_started - task_start, "to_workload": seen.workload_running - task_start,
            "to_workload_start": workload_start - task_start,
            "cpu": cpu, "periods": periods, "throttled": throttled}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_sidecars_footprint_and_start_up(admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node,
                                              gpu_namespace: str, task_starts: TaskStarts, kind: str,
                                              cpu_limit: str | None) -> None:
    runs = []
    for _ in range(STARTS):
        runs.append(_one_start(admin, cluster, node, gpu_namespace, kind, task_starts))
    running, pid = runs[-1]["running"], runs[-1]["pid"]
    sidecar = next(c for c in running["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    limit = parse_bytes(sidecar["resources"]["limits"]["memory"])
    cpu_limit = sidecar["resources"].get("limits", {}).get("cpu", "none")
    wait_record(running, lambda r: r.get("event") == "nvml_opened", "NVML opened (simulator loaded)")
    samples = []
    for _ in range(5):  # a few seconds of polling at the default interval: steady state
        samples.append(container_memory(pid))
        time.sleep(1)
    peak = max(samples)

    def column(key: str, scale: float = 1.0, digits: int = 2) -> str:
        return " / ".join(f"{r[key] * scale:.{digits}f}" for r in runs)

    throttling = " / ".join(f"{r['throttled']}/{r['periods']}" for r in runs)
    print(f"\nsidecar [{kind}] (real node, cgroup {cgroup_version()}, CPU limit {cpu_limit}, simulated NVML, "
          f"{STARTS} pods, load {os.getloadavg()[0]:.2f}): resident {peak / (1 << 20):.1f} MiB "
          f"(samples {[round(s / (1 << 20), 1) for s in samples]}), limit {limit / (1 << 20):.0f} MiB; "
          f"container start -> `started` {column('to_started')} s, -> the workload's container start "
          f"{column('to_workload_start')} s, -> watch sees started: true {column('to_ready')} s, "
          f"-> watch sees the workload running {column('to_workload')} s; CPU to ready {column('cpu', 1000, 0)} ms "
          f"(the enforcer's own to `started`: {column('enforcer_cpu', 1000, 0)} ms), "
          f"throttled {throttling} CFS periods")
    assert 0 < peak < limit, (peak, limit)
    for r in runs:
        # The kubelet starts the workload only once the sidecar's postStart hook returned, and the
        # hook returns only on a heartbeat the enforcer writes after its `started` record.
        assert 0 < r["to_started"] < r["to_workload_start"], r
        assert r["to_started"] < r["to_ready"] <= r["to_workload"], r
