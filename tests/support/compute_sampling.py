"""A model of how a real driver samples per-process SM utilisation, driving the enforcer's real
compute controller (simulated; shared by bench/compute_sampling.py, which prints the figures, and
tests/unit/enforcer/test_compute.py, which holds them).

The model follows what an H200 (driver 580) showed (docs/gpu-validation.md, "Compute shares on a
time-sliced GPU"): the driver takes a sample on a fixed clock (every 0.2 s); each sample goes to one
of the processes running at that instant; a read of ``nvmlDeviceGetProcessUtilization`` gives each
process its share of the samples since the previous read. The enforcer's parts are the real ones:
``ComputeTracker`` plans from those readings (taken when ``Core.wants_utilisation`` says, about
once per duty-cycle period; polls every 0.5 s), and the duty cycle takes each cycle's length from
the throttle executor's own ``cycle_length`` (its period with ``PERIOD_JITTER``), run for the plan's
fraction of it. The container and its neighbours are always busy; while the container runs, the GPU
is split evenly among the running processes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpufence.contract import ContainerShare, EnforcerConfig
from gpufence.enforcer.act.throttle import cycle_length
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
