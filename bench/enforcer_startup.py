"""The enforcer's start-up as a host process: spawn to its ``started`` record, CPU and memory.

    python -m bench.enforcer_startup [--runs 7] [--in-cluster-env]

Host process, simulated NVML (one idle GPU), the sidecar's command line as the webhook writes it
(``--state-dir``, the default metrics port replaced by 0): wall time from ``Popen`` to the
``started`` line, the process's CPU time (utime + stime) at that moment, its own
``startup_seconds`` / ``startup_cpu_seconds`` fields, and VmRSS one second later. Medians and
ranges over ``--runs``. ``--in-cluster-env`` sets ``KUBERNETES_SERVICE_HOST`` like every pod.

This is not the sidecar in a pod: there, its container's cgroup, the CPU limit's throttling, the
image's bytecode and the kubelet's probes add to it (``tests/e2e/node/test_node_footprint.py``,
docs/PERFORMANCE.md, "The sidecar in a pod").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufence.simnvml import ENV_STATE, SimDevice, SimState, build_library, write_state

CONFIG = {"containers": {"trainer": {"memoryBytes": 8 << 30}}}


def one_run(library: Path, state_dir: Path, env: dict[str, str]) -> dict[str, float]:
    started_at = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufence.enforcer", "--nvml-library", str(library), "--metrics-port", "0",
         "--state-dir", str(state_dir), "--nvidia-device-prefix", str(state_dir / "no-device")],
        stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        record: dict = {}
        for line in proc.stdout:
            if '"event":"started"' in line:
                record = json.loads(line)
                break
        wall = time.monotonic() - started_at
        stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        time.sleep(1.0)  # resident memory once it polls
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
    finally:
        proc.terminate()
        proc.wait(10)
    return {"wall_s": wall, "cpu_s": cpu, "own_s": record.get("startup_seconds", float("nan")),
            "own_cpu_s": record.get("startup_cpu_seconds", float("nan")), "rss_mib": rss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--in-cluster-env", action="store_true")
    args = parser.parse_args()
    library = build_library()
    with tempfile.TemporaryDirectory(prefix="gpufence-startup-") as tmp:
        root = Path(tmp)
        state_file = root / "gpu.json"
        gpu = SimDevice("GPU-00000000-0000-4000-8000-000000000000", 80 << 30, ())
        write_state(state_file, SimState(devices=(gpu,)))
        env = {**os.environ, ENV_STATE: str(state_file), "GPUFENCE_CONFIG": json.dumps(CONFIG),
               "GPUFENCE_POD_NAME": "bench", "GPUFENCE_POD_NAMESPACE": "bench"}
        if args.in_cluster_env:
            env["KUBERNETES_SERVICE_HOST"] = "10.96.0.1"
        runs = []
        for i in range(args.runs):
            state_dir = root / f"state-{i}"
            state_dir.mkdir()
            runs.append(one_run(library, state_dir, env))
    print(f"enforcer start-up, host process, simulated NVML, {args.runs} runs, load {os.getloadavg()[0]:.2f}")
    for key, unit in (("wall_s", "s spawn -> started"), ("cpu_s", "s CPU to started"),
                      ("own_s", "s startup_seconds"), ("own_cpu_s", "s startup_cpu_seconds"),
                      ("rss_mib", "MiB VmRSS")):
        values = [r[key] for r in runs]
        print(f"  {statistics.median(values):7.3f} {unit} (min {min(values):.3f}, max {max(values):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
