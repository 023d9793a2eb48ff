"""The sidecar's CPU at rest in a pod on the node test bed: the enforcer, its heartbeat thread and
the liveness probes the kubelet execs into it, as the container's own cgroup accounts them, over a
40 s window with one GPU process under its share and the default 0.5 s poll. Target: under 0.5 % of a
core (docs/PERFORMANCE.md).

A measurement, not a test of behaviour, so it lives here rather than in `make test`: the window is
the measurement, and its result depends on the machine's load. It runs on the node test bed's
fixtures (a real kube-apiserver, kubelet, containerd and runc; root), loaded as pytest plugins:

    make bench-node      # or: .venv/bin/python -m pytest -s -p tests.e2e.conftest \\
                         #       -p tests.e2e.node.conftest bench/node_sidecar_cpu.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.node.node import Node
from tests.node.workloads import (
    get_pod,
    gpu_pod,
    host_pid,
    statuses,
    wait_record,
    wait_running,
    workload_container,
    write_gpu_state,
)

GIB = 1 << 30
WINDOW_SECONDS = 40.0
TARGET_PERCENT_OF_A_CORE = 0.5  # docs/PERFORMANCE.md
# The node bed's start and the window: tests/e2e's own items get this from their conftest.
pytestmark = pytest.mark.timeout(600)


def _container_cpu_seconds(pid: int) -> float:
    """CPU time used so far by the container whose process is ``pid``, as its cgroup accounts it
    (every process of it: the enforcer, and each probe the kubelet execs into it)."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            base = Path("/sys/fs/cgroup", controllers)
            return int((base / path.lstrip("/") / "cpuacct.usage").read_text()) / 1e9
    v2 = next(line.split(":", 2)[2] for line in lines if line.startswith("0::"))
    stat = dict(line.split() for line in Path("/sys/fs/cgroup", v2.lstrip("/"), "cpu.stat").read_text().splitlines())
    return int(stat["usage_usec"]) / 1e6


def _process_cpu_seconds(pid: int) -> float:
    """CPU time of the process ``pid`` itself, all its threads (utime + stime from /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time of each thread of ``pid`` by its kernel name (the enforcer names its threads: poll,
    heartbeat, nvml, http, throttle, events; the main thread keeps the program's)."""
    found: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


def _cpu_jiffies() -> tuple[int, int]:
    """(steal, total) jiffies of the machine so far (/proc/stat): steal is time the hypervisor gave
    this VM's CPUs to others, which the load average does not show."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return fields[7], sum(fields[:8])


def _reference_cpu_ms(rounds: int = 3) -> float:
    """CPU ms of a fixed pure-Python loop (the best of ``rounds``): how fast this machine runs Python
    now. Two runs of the bench compare only where this figure is about the same."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        total = 0
        for i in range(1_000_000):
            total += i % 7
        best = min(best, time.process_time() - start)
    return best * 1000


def test_the_sidecars_cpu_at_rest_with_its_probes(admin: client.ApiClient, cluster: ControlPlane, node: Node,
                                                  sim: Node, gpu_namespace: str) -> None:
    """Printed (-s) for docs/PERFORMANCE.md; checked against the target."""
    created = kube.create_pod(admin, gpu_namespace, gpu_pod([workload_container("trainer")],
                                                            {"gpufence.io/memory": "8Gi"}))
    assert created.admitted, created.message
    running = wait_running(cluster, node, gpu_namespace, created.obj["metadata"]["name"])
    write_gpu_state(node, [(host_pid(node, running, "trainer"), 1 * GIB, 5)])
    wait_record(running, lambda r: r.get("event") == "nvml_opened", "NVML opened (simulator loaded)")
    pid = host_pid(node, running, SIDECAR_NAME)
    window = WINDOW_SECONDS
    reference = _reference_cpu_ms()
    threads_before, jiffies_before = _thread_cpu_seconds(pid), _cpu_jiffies()
    before, own_before, started = _container_cpu_seconds(pid), _process_cpu_seconds(pid), time.monotonic()
    time.sleep(window)  # the measurement is the window itself: nothing to wait for
    used, elapsed = _container_cpu_seconds(pid) - before, time.monotonic() - started
    own = _process_cpu_seconds(pid) - own_before
    threads = {name: seconds - threads_before.get(name, 0.0) for name, seconds in _thread_cpu_seconds(pid).items()}
    steal, total = (after - before for after, before in zip(_cpu_jiffies(), jiffies_before, strict=True))
    share = used / elapsed * 100
    print(f"\nsidecar at rest, real node: {used * 1000:.0f} ms CPU in {elapsed:.1f} s = {share:.2f} % of a core "
          f"(enforcer, heartbeat and {int(elapsed // 10)} liveness probes); of which the enforcer process "
          f"{own * 1000:.0f} ms, the probes {(used - own) * 1000:.0f} ms")
    print("the enforcer's threads: " + ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds
                                                  in sorted(threads.items(), key=lambda item: -item[1]))
          + " (utime + stime, counted in clock ticks)")
    print(f"the machine: a reference Python loop took {reference:.0f} ms of CPU; steal {100 * steal / total:.1f} % "
          f"of its CPU time during the window; load average {os.getloadavg()[0]:.2f}")
    assert statuses(get_pod(cluster, gpu_namespace, running["metadata"]["name"]))[SIDECAR_NAME]["restartCount"] == 0
    assert share < TARGET_PERCENT_OF_A_CORE, share
