"""The compute controller against the way a real driver samples per-process utilisation (simulated).

    python -m bench.compute_sampling [--seconds S] [--seeds N] [--no-write]

Not a speed figure: what share a container held to a compute share actually gets on a GPU
time-sliced among busy processes, when the controller sees only what NVML reports: the model of
the driver's sampling and the enforcer's real controller in tests/support/compute_sampling.py.

Each row: the container's true GPU time over ``--seconds``, mean and range over ``--seeds`` seeds,
and how many times its throttle started or stopped; with the executor's jitter and with a cycle kept
to the period (jitter 0), the case the jitter exists for.
"""

from __future__ import annotations

import argparse
import statistics

from bench.common import table, write_section
from gpufence.enforcer.act.throttle import PERIOD_JITTER
from tests.support.compute_sampling import CASES, PERIOD_SECONDS, POLL_SECONDS, SAMPLE_SECONDS, simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="simulated seconds per run (default 120)")
    parser.add_argument("--seeds", type=int, default=10, help="runs per row (default 10)")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/PERFORMANCE.md")
    args = parser.parse_args(argv)
    rows = []
    for share, neighbours in CASES:
        for jitter in (PERIOD_JITTER, 0.0):
            runs = [simulate(share, neighbours, seconds=args.seconds, seed=seed, jitter=jitter)
                    for seed in range(args.seeds)]
            got = [r.gpu_share for r in runs]
            rows.append([f"{share} %, time-sliced {neighbours + 1} ways", f"{jitter:g}",
                         f"{statistics.mean(got):.3f} ({min(got):.3f}-{max(got):.3f})",
                         f"{statistics.mean(got) / (share / 100):.2f}",
                         f"{statistics.mean(r.changes for r in runs):.1f}"])
    text = table(["share, GPU", "period jitter", "true GPU share, mean (range)", "x share",
                  f"throttle starts + stops in {args.seconds:g} s"], rows)
    text += (f"\n\nSimulated: {args.seeds} seeds per row, {args.seconds:g} s each; the driver samples every "
             f"{SAMPLE_SECONDS:g} s, the enforcer polls every {POLL_SECONDS:g} s and reads utilisation once per "
             f"{PERIOD_SECONDS:g} s duty-cycle period; the real ComputeTracker and the executor's cycle lengths.")
    print(text)
    if not args.no_write:
        write_section("compute_sampling", "Compute shares against the driver's sampling (simulated)", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
