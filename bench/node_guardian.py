"""The node guardian's cost: CPU and memory at rest with N GPU pods on the node, and its reaction.

    python -m bench.node_guardian [--pods 50] [--rest 30] [--trials 20] [--interval 0.5]

As root, on this machine's cgroup v2 tree (``/sys/fs/cgroup`` or ``/sys/fs/cgroup/unified``): N
pods laid out as the kubelet lays them out (``.../kubepods/burstable/pod<uid>/<container id>``,
under a unique prefix), one process each in its container's cgroup, every pod admitted with an
8 GiB / 50 % share (the pods file stands for the API server), and the simulated NVML listing all of
them on one 80 GiB GPU at 1 GiB and 10 % SM (under their shares: at rest). The real ``gpufence-node``
polls them at ``--interval``; over ``--rest`` seconds its CPU time (utime + stime) and its resident
memory (VmRSS, VmHWM) are read from ``/proc``, and its mean poll from its own histogram.

Reaction (``--trials``): a process of a pod admitted without a GPU share appears in the driver's
list with 1 GiB (the state file rewritten); the time from just before that write to the moment
its SIGTERM handler runs (the guardian SIGTERMs such a container at
once). Expected about uniform in [0, interval] plus a poll.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, table, write_section
from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.simnvml import ENV_STATE, SimDevice, SimProcess, SimState, build_library, write_state

GIB = 1 << 30
WORKLOAD = REPO_ROOT / "tests" / "support" / "workload.py"


def cgroup2() -> Path:
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.controllers").exists():
            return root
    raise SystemExit("no cgroup2 tree on this machine")


class Bed:
    def __init__(self, tmp: Path) -> None:
        self.root = cgroup2()
        self.prefix = f"gpufence-bench-{uuid.uuid4().hex[:8]}"
        self.tmp = tmp
        self.pods: list[dict[str, Any]] = []
        self.procs: list[subprocess.Popen[str]] = []
        self.device = tmp / "nvidia0"
        self.device.write_bytes(b"")

    def container(self, name: str, config: EnforcerConfig | None) -> Path:
        uid, cid = str(uuid.uuid4()), uuid.uuid4().hex + uuid.uuid4().hex
        path = self.root / self.prefix / "kubepods" / "burstable" / f"pod{uid}" / cid
        path.mkdir(parents=True)
        spec: dict[str, Any] = {"containers": [{"name": "train", "image": "cuda"}]}
        if config is not None:
            spec["initContainers"] = [{"name": "gpufence-enforcer", "image": "gpufence",
                                       "env": [{"name": "GPUFENCE_CONFIG", "value": config.to_json()}]}]
        self.pods.append({"metadata": {"uid": uid, "namespace": "team-a", "name": name}, "spec": spec,
                          "status": {"containerStatuses": [{"name": "train", "containerID": f"containerd://{cid}"}]}})
        return path

    def start(self, cgroup: Path) -> subprocess.Popen[str]:
        argv = [sys.executable, str(WORKLOAD), str(self.device)]
        shell = f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))}; exec {shlex.join(argv)}"
        proc = subprocess.Popen(["sh", "-c", shell], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().startswith("ready")
        self.procs.append(proc)
        return proc

    def publish(self) -> Path:
        path = self.tmp / "pods.json"
        path.write_text(json.dumps({"pods": self.pods, "namespaces": [
            {"metadata": {"name": "team-a", "labels": {"gpufence.io/injection": "enabled"}}}]}))
        return path

    def cleanup(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        base = self.root / self.prefix
        for d in sorted((p for p in [base, *base.rglob("*")] if p.is_dir()), key=lambda p: -len(p.parts)):
            for _ in range(500):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])  # kB
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--rest", type=float, default=30.0)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--no-write", action="store_true", help="print, do not rewrite docs/PERFORMANCE.md")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (cgroups, signals)")
    lib = build_library()
    share = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 * GIB), compute_percent=50)})
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        bed = Bed(tmp)
        guardian = None
        try:
            resident = [bed.start(bed.container(f"gpu-{i}", share)) for i in range(args.pods)]
            strays = [bed.container(f"plain-{i}", None) for i in range(args.trials)]
            listed = [SimProcess.for_pid(p.pid, GIB, sm_util=10) for p in resident]
            state = tmp / "sim-state"
            write_state(state, SimState(devices=(SimDevice("GPU-0", 80 * GIB, tuple(listed)),)))
            env = {**os.environ, ENV_STATE: str(state), "LD_LIBRARY_PATH": str(lib.parent),
                   "PYTHONPATH": str(REPO_ROOT)}
            guardian = subprocess.Popen(
                [sys.executable, "-m", "gpufence.node", "--pods-file", str(bed.publish()), "--metrics-port", "0",
                 "--bind-address", "127.0.0.1", "--state-dir", str(tmp / "state"), "--poll-interval",
                 str(args.interval), "--unaccounted-grace", "5"],
                env=env, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
            )
            assert guardian.stdout is not None
            port = None
            while port is None:
                line = guardian.stdout.readline()
                assert line, "the guardian exited"
                record = json.loads(line)
                port = record.get("metrics_port") if record.get("event") == "started" else None
            # Its log is drained on a thread, so a full pipe never holds the guardian up.
            threading.Thread(target=lambda: [None for _ in guardian.stdout], daemon=True).start()
            while metric(port, "gpufence_node_poll_duration_seconds_count") < 5:
                time.sleep(0.1)
            polls0, sum0 = (metric(port, f"gpufence_node_poll_duration_seconds_{k}") for k in ("count", "sum"))
            cpu0, t0 = cpu_seconds(guardian.pid), time.monotonic()
            time.sleep(args.rest)
            cpu = (cpu_seconds(guardian.pid) - cpu0) / (time.monotonic() - t0)
            polls1, sum1 = (metric(port, f"gpufence_node_poll_duration_seconds_{k}") for k in ("count", "sum"))
            rss, hwm = proc_status(guardian.pid, "VmRSS") / 1024, proc_status(guardian.pid, "VmHWM") / 1024
            mean_poll_ms = 1000 * (sum1 - sum0) / max(1.0, polls1 - polls0)

            reactions = []
            for cgroup in strays:
                stray = bed.start(cgroup)
                assert stray.stdout is not None
                time.sleep(random.uniform(0, args.interval))  # at any phase of the guardian's poll
                t = time.monotonic()
                extra = SimProcess.for_pid(stray.pid, GIB)
                write_state(state, SimState(devices=(SimDevice("GPU-0", 80 * GIB, (*listed, extra)),)))
                assert stray.stdout.readline().startswith("got SIGTERM")
                reactions.append(time.monotonic() - t)
                stray.wait(10)
                write_state(state, SimState(devices=(SimDevice("GPU-0", 80 * GIB, tuple(listed)),)))
        finally:
            if guardian is not None:
                guardian.terminate()
                guardian.wait(10)
            bed.cleanup()
    reactions.sort()
    p99 = reactions[min(len(reactions) - 1, int(0.99 * len(reactions)))]
    rows = [
        (f"CPU at rest, {args.pods} GPU pods, {args.interval:g} s interval ({args.rest:g} s)",
         f"{100 * cpu:.2f} % of one core", "≤ 1 %", "met" if cpu <= 0.01 else "missed"),
        ("RSS (end / max)", f"{rss:.1f} / {hwm:.1f} MiB", "≤ 64 MiB", "met" if hwm <= 64 else "missed"),
        ("mean poll", f"{mean_poll_ms:.2f} ms", "", ""),
        (f"reaction p50 ({len(reactions)} trials)", f"{1000 * statistics.median(reactions):.0f} ms", "", ""),
        ("reaction p99", f"{1000 * p99:.0f} ms", f"≤ {1000 * args.interval + 100:.0f} ms",
         "met" if p99 <= args.interval + 0.1 else "missed"),
        ("reaction min / max", f"{1000 * reactions[0]:.0f} / {1000 * reactions[-1]:.0f} ms", "", ""),
    ]
    body = table(["measure", "value", "target", "verdict"], rows) + (
        "\n\nOne simulated 80 GiB GPU listing every pod's process; each pod's container in a cgroup v2 "
        "group of its own. Reaction: from just before the state file lists an unaccounted process to "
        "its SIGTERM handler running (the guardian SIGTERMs an unaccounted container at once; an "
        "admitted container's breach is the sidecar's first, the guardian's after the grace period)."
    )
    print(body)
    if not args.no_write:
        write_section("node_guardian", "Node guardian: CPU and memory at rest with GPU pods, reaction", body)


if __name__ == "__main__":
    main()
