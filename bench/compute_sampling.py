"""The compute controller against the way a real driver samples per-process utilisation (simulated).

    python -m bench.compute_sampling [--seconds S] [--seeds N] [--no-write]

Not a speed figure: what share a container held to a compute share actually gets on a GPU
time-sliced among busy processes, when the controller sees only what NVML reports. The model
follows what an H200 (driver 580) showed (docs/gpu-validation.md, "Compute shares on a time-sliced
GPU"): the driver takes a sample on a fixed clock (every 0.2 s); each sample goes to one of the
processes running at that instant; a read of ``nvmlDeviceGetProcessUtilization`` gives each
process its share of the samples since the previous read. The enforcer's parts are the real ones:
``ComputeTracker`` plans from those readings (taken when ``Core.wants_utilisation`` says, about
once per duty-cycle period; polls every 0.5 s), and
the duty cycle takes each cycle's length from the throttle executor's own ``cycle_length`` (its
period with ``PERIOD_JITTER``), run for the plan's fraction of it. The container and its
neighbours are always busy; while the container runs, the GPU is split evenly among the running
processes.

Each row: the container's true GPU time over ``--seconds``, mean and range over ``--seeds`` seeds,
and how many times its throttle started or stopped; with the executor's jitter and with a cycle kept
to the period (jitter 0), the case the jitter exists for.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from bench.common import table, write_section
from gpufence.contract import ContainerShare, EnforcerConfig
from gpufence.enforcer.act.throttle import PERIOD_JITTER, cycle_length
from gpufence.enforcer.decide.compute import ComputeTracker
from gpufence.enforcer.decide.machine import Core
from gpufence.enforcer.facts import Attribution, PodProcess

SAMPLE_SECONDS = 0.2  # the driver's sampling clock on the H200
POLL_SECONDS = 0.5  # the enforcer's default poll interval
PERIOD_SECONDS = 1.0  # the default duty-cycle period
STEP = 0.005  # simulation step, seconds
CASES = ((30, 1), (15, 3), (6, 7))  # (compute share %, busy neighbours): the device runs' cases


@dataclass(frozen=True)
class Outcome:
    gpu_share: float  # the container's true share of the GPU's time
    changes: int  # throttle starts and stops


def simulate(share_percent: int, neighbours: int, *, seconds: float, seed: int, jitter: float) -> Outcome:
    rng = random.Random(seed)
    cycle_rng = random.Random(seed + 1)
    config = EnforcerConfig(containers={"a": ContainerShare(compute_percent=share_percent)})
    tracker = ComputeTracker(period_seconds=PERIOD_SECONDS)
    core = Core(config, compute_period_seconds=PERIOD_SECONDS)  # only for its utilisation cadence
    plan: dict[str, float] = {}
    hits = samples = 0  # the container's samples and all samples since the last read
    reading = 0
    cycle_start = cycle_end = 0.0
    gpu_time = 0.0
    changes = 0
    throttled = False
    next_sample = next_poll = 0.0
    steps = int(seconds / STEP)
    for i in range(steps):
        now = i * STEP
        if now >= cycle_end:
            cycle_start = cycle_end
            cycle_end = cycle_start + cycle_length(PERIOD_SECONDS, jitter, cycle_rng)
        running = now - cycle_start < plan.get("a", 1.0) * (cycle_end - cycle_start)
        sharing = neighbours + running
        if running:
            gpu_time += STEP / sharing
        if now >= next_sample:
            next_sample += SAMPLE_SECONDS
            samples += 1
            hits += running and rng.random() < 1 / sharing
        if now >= next_poll:
            next_poll += POLL_SECONDS
            if core.wants_utilisation(now):
                reading = round(99 * hits / samples) if samples else 0
                hits = samples = 0
            process = PodProcess(1, 1, 1, "a", 0, "GPU-0", 0, reading or None)
            tracker.observe(now, Attribution((process,), ()), config)
            plan = dict(tracker.plan(now, config))
            if ("a" in plan) != throttled:
                throttled = not throttled
                changes += 1
    return Outcome(gpu_time / seconds, changes)


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
