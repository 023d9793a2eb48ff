"""Run every benchmark in turn (``make bench``); each rewrites its section of docs/PERFORMANCE.md.

    python -m bench.run_all [--quick]

``--quick`` shortens every benchmark (a smoke run, numbers not for publication). Each benchmark
runs as its own process so one's state (threads, loaded libraries) cannot skew the next.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.common import REPO_ROOT
from tests.support.server_process import child_env

FULL = [
    ["bench.mutation_core"],
    ["bench.webhook_tls"],
    ["bench.cpu_per_request"],
    ["bench.enforcer_tick"],
    ["bench.dependencies"],
    ["bench.compute_sampling"],
    ["bench.fuzz_webhook"],
    ["bench.soak"],
]
QUICK = [
    ["bench.mutation_core", "--repeats", "3", "--budget", "0.1"],
    ["bench.webhook_tls", "--duration", "2", "--warmup", "0.5", "--repeats", "1"],
    ["bench.cpu_per_request", "--repeats", "2", "--duration", "1"],
    ["bench.enforcer_tick", "--counts", "1,16,64", "--ticks", "10", "--cpu-seconds", "5", "--trials", "5"],
    ["bench.dependencies", "--counts", "1,64", "--ticks", "10", "--rounds", "1"],
    ["bench.compute_sampling", "--seconds", "30", "--seeds", "2"],
    ["bench.fuzz_webhook", "--count", "2000", "--hypothesis", "200", "--https", "100"],
    ["bench.soak", "--duration", "10"],
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    failed = []
    for cmd in QUICK if args.quick else FULL:
        print(f"\n=== python -m {' '.join(cmd)}", flush=True)
        t = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", *cmd], cwd=REPO_ROOT, env=child_env())
        print(f"=== {cmd[0]}: exit {rc} after {time.monotonic() - t:.0f} s", flush=True)
        if rc:
            failed.append(cmd[0])
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
