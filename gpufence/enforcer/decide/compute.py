"""Compute shares: a closed loop on measured SM utilisation (pure: no I/O, time passed in).

The throttle stops a container's processes for part of each period (SIGSTOP/SIGCONT); this module
decides the run fraction. It used to estimate the unthrottled demand as measured use / run
fraction, assuming use scales with the fraction at once. It does not: a stopped process's queued
kernels keep the GPU busy for a while, so right after a stop the measured use stays high, the
estimate grew, the fraction shrank, and a container at its share ended up stopped 95 % of the time.

Now the fraction is the output of a PI controller whose input is the error between the share and
the use measured over the last period, whatever the lag between stopping and the use falling:

* start: the mean use over the window exceeds the share by ``START_MARGIN`` (a sampled, integer
  percent is noisy and short bursts are no abuse) after at least one full period of data; the first
  fraction is share / mean use (what an instant plant would need), the integral starts there;
* each plan: ``f = KP * e + I``, ``I += KI * e * dt``, ``e = share - use``; the integral is kept
  within the output's range [min, 1] (anti-windup), so a long stop or a burst cannot wind it up;
* end: ``f`` reaches 1, i.e. the container runs all the time at or under its share, and stays there
  for a whole window (meanwhile it runs ``HOLD_RUN_FRACTION`` of the time); at once where it had no
  GPU process in the last period (they exited). A container at its share is
  therefore not throttled; one over it converges to it (tests/unit/enforcer/test_compute.py holds
  it within a stated tolerance with a lagged plant, and the simulated driver models the lag).
  The hold is for real drivers' readings: between time-sliced processes NVML attributes each of its
  samples to one of them, so a reading of one second is noisy and the output touches 1 now and
  then while the container is still over its share. Ending there and starting again a window
  later made a throttle stop and start again and again (a log line, an Event and a metric each:
  on an H200 it ended 5.5-9.5 s after it started and started again 2.5-3.5 s later) and let the
  container run unthrottled in between; ``bench/compute_sampling.py`` shows it.

A throttle that cannot hold the share is not kept up for ever: where the output is pinned at its
minimum (the process is held stopped ``1 - min`` of each period) and the mean use over the window is
still over the share by ``START_MARGIN`` for ``ineffective_seconds`` in a row, the work runs while
its process is stopped (long or persistent kernels, a queue deeper than the stopped phase: SM 100 %
on a 20 % share while the process was stopped 95 % of the time, issue 32 row 6). SIGSTOP cannot
reach it, so the tracker reports it (``take_ineffective``) and the core orders the container
terminated (``throttle_ineffective``), as for throttle evasion.

In audit mode nothing is stopped, so there is no loop to close: the plan says what enforcement
would start with (share / mean use).

The pod's unattributed processes (no certain container: conflicting claims in one cgroup, a name
that is no container of the pod) are one more loop, keyed ``UNATTRIBUTED``: its share is the pod's
compute budget (``pod_compute_budget``: the sum of the containers' shares) and its measured use is
the pod's whole SM use on the devices where it has unattributed processes
(``unattributed_sm_utilization``), so the pod as a whole is brought back to its budget by
duty-cycling the processes no container can be charged for; the attributed containers keep
their own loops. The strictest rule that can be justified without knowing whose the processes
are: unattributed processes get what the pod's containers leave of the pod's budget, never more.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpufence.contract import EnforcerConfig, Mode
from gpufence.enforcer.facts import Attribution

START_MARGIN = 0.10
# While the output has reached 1 for less than a window: the run fraction held (the container is
# stopped for a hundredth of each period), so that one noisy reading does not end the throttle.
HOLD_RUN_FRACTION = 0.99
# Gains, in run fraction per unit of utilisation error (KP) and per error-second (KI). With a
# container using up to a whole GPU the loop gain is at most 1·KP; KI brings a 0.1 error back in
# about a second, several times slower than a typical queued-kernel lag (0.1-0.5 s), so the loop
# does not oscillate on it (see the lag cases in tests/unit/enforcer/test_compute.py).
KP = 0.3
KI = 1.0
# The plan's key for the pod's unattributed processes: no container is named "" (names are DNS
# labels), and "" is the container label of the actions taken against unattributed processes.
UNATTRIBUTED = ""
# How long a throttle pinned at its minimum run fraction may leave the use over the share before
# it is judged ineffective and the container terminated.
INEFFECTIVE_SECONDS = 10.0


@dataclass(frozen=True)
class Ineffective:
    """A throttle that does not hold: ``key`` (a container, or ``UNATTRIBUTED``) held at the minimum
    run fraction for ``seconds`` while its mean SM use over the window stayed at ``use`` (0-1), over
    its ``share``."""

    key: str
    use: float
    share: float
    seconds: float


@dataclass(frozen=True)
class _Observation:
    time: float
    utilization: float  # container SM use in [0, 1]: per-device sum of its processes, max over devices
    present: bool = True  # it had a GPU process then


@dataclass
class _Loop:
    history: deque[_Observation] = field(default_factory=deque)
    fraction: float | None = None  # None: not throttled
    integral: float = 1.0
    last_plan: float | None = None
    full_since: float | None = None  # since when the output has been at 1 (None: it is not)
    held_over_since: float | None = None  # since when it is pinned at the minimum and still over


class ComputeTracker:
    """Per compute-limited container: the utilisation window and the controller's state.

    Call ``observe`` once per poll and then ``plan``.
    """

    def __init__(
        self,
        window_seconds: float = 5.0,
        period_seconds: float = 1.0,
        min_run_fraction: float = 0.05,
        *,
        kp: float = KP,
        ki: float = KI,
        ineffective_seconds: float = INEFFECTIVE_SECONDS,
    ) -> None:
        if not window_seconds > 0:
            raise ValueError(f"window_seconds must be positive, got {window_seconds!r}")
        if not period_seconds > 0:
            raise ValueError(f"period_seconds must be positive, got {period_seconds!r}")
        if not 0 < min_run_fraction < 1:
            raise ValueError(f"min_run_fraction must be in (0, 1), got {min_run_fraction!r}")
        self.window_seconds = window_seconds
        self.period_seconds = period_seconds
        self.min_run_fraction = min_run_fraction
        self.kp = kp
        self.ki = ki
        self.ineffective_seconds = ineffective_seconds
        self._loops: dict[str, _Loop] = {}
        self._ineffective: list[Ineffective] = []

    def observe(self, now: float, attribution: Attribution, config: EnforcerConfig) -> None:
        """Record each compute-limited container's SM use now (0 when it has no GPU process)."""
        use = container_sm_utilization(attribution)
        for container, share in config.containers.items():
            if share.compute_percent is None:
                continue
            loop = self._loops.setdefault(container, _Loop())
            loop.history.append(_Observation(now, use.get(container, 0.0), container in use))
            self._expire(loop.history, now)
        pod_use = unattributed_sm_utilization(attribution)
        pod_loop = self._loops.get(UNATTRIBUTED)
        if pod_compute_budget(config) is not None and (pod_use is not None or pod_loop is not None):
            if pod_use is None and pod_loop is not None and pod_loop.fraction is None:
                del self._loops[UNATTRIBUTED]  # no unattributed process left, none throttled: done
            else:
                loop = self._loops.setdefault(UNATTRIBUTED, _Loop())
                loop.history.append(_Observation(now, pod_use or 0.0, pod_use is not None))
                self._expire(loop.history, now)
        self._forget_unlimited(config)

    def plan(self, now: float, config: EnforcerConfig) -> Mapping[str, float]:
        """container -> run fraction in [min, 1); a container absent is not throttled."""
        self._forget_unlimited(config)
        for container, loop in self._loops.items():
            self._expire(loop.history, now)
            share = share_of(config, container)
            assert share is not None
            self._step(loop, now, share, audit=config.mode is Mode.AUDIT)
            self._judge(container, loop, now, share, audit=config.mode is Mode.AUDIT)
        return MappingProxyType({c: loop.fraction for c, loop in self._loops.items() if loop.fraction is not None})

    def take_ineffective(self) -> list[Ineffective]:
        """The throttles judged ineffective by ``plan`` since the last call."""
        found, self._ineffective = self._ineffective, []
        return found

    def _judge(self, key: str, loop: _Loop, now: float, share: float, *, audit: bool) -> None:
        """Pinned at the minimum run fraction and still over the share: for how long? Reported once
        per ``ineffective_seconds`` while it lasts (the termination it leads to ends it)."""
        mean = _mean(loop.history) if loop.history else 0.0
        pinned = loop.fraction is not None and loop.fraction <= self.min_run_fraction + 1e-9
        if audit or not pinned or mean <= share * (1 + START_MARGIN):
            loop.held_over_since = None
            return
        if loop.held_over_since is None:
            loop.held_over_since = now
        held = now - loop.held_over_since
        if held >= self.ineffective_seconds:
            assert loop.fraction is not None
            self._ineffective.append(Ineffective(key, mean, share, held))
            loop.held_over_since = now

    def demand(self, container: str) -> float | None:
        """Mean measured SM use over the window (for logs), None without data."""
        loop = self._loops.get(container)
        return _mean(loop.history) if loop is not None and loop.history else None

    def _step(self, loop: _Loop, now: float, share: float, *, audit: bool) -> None:
        history = loop.history
        if not history:
            loop.fraction = None  # no data (e.g. utilisation unavailable): never throttle blind
            return
        if loop.fraction is None or audit:
            mean = _mean(history)
            started = loop.fraction is not None
            if not started and (mean <= share * (1 + START_MARGIN) or _span(history) < self.period_seconds):
                return
            if mean <= share:
                loop.fraction = None
                return
            loop.fraction = loop.integral = max(self.min_run_fraction, share / mean)
            loop.last_plan = now
            return
        dt = min(max(now - (loop.last_plan if loop.last_plan is not None else now), 0.0), self.window_seconds)
        loop.last_plan = now
        # The use over the last period: one duty cycle, whatever phase each poll landed in.
        recent = [o for o in history if o.time > now - self.period_seconds] or [history[-1]]
        error = share - sum(o.utilization for o in recent) / len(recent)
        # Anti-windup by bounding the integral to the output's range: however long the output sat
        # at the minimum (a burst, a long lag), it recovers as soon as the error changes sign.
        loop.integral = min(max(loop.integral + self.ki * error * dt, self.min_run_fraction), 1.0)
        output = self.kp * error + loop.integral
        if output < 1:
            loop.fraction, loop.full_since = max(self.min_run_fraction, output), None
            return
        # Runs all the time within its share: done once that held for a window, or at once where it
        # has had no GPU process for a period. Not on a reading of 0 alone: on a GPU time-sliced
        # many ways a small share's process often gets none of the driver's samples in a second.
        loop.integral = 1.0
        if loop.full_since is None:
            loop.full_since = now
        if now - loop.full_since >= self.window_seconds or not any(o.present for o in recent):
            loop.fraction, loop.full_since = None, None
        else:
            # Never below the floor the tracker promises, even where an admin set it above the hold.
            loop.fraction = max(self.min_run_fraction, HOLD_RUN_FRACTION)

    def _expire(self, history: deque[_Observation], now: float) -> None:
        while history and history[0].time <= now - self.window_seconds:
            history.popleft()

    def _forget_unlimited(self, config: EnforcerConfig) -> None:
        """Drop state for containers that no longer have a compute share (config changed)."""
        for container in list(self._loops):
            if share_of(config, container) is None:
                del self._loops[container]


def _mean(history: deque[_Observation]) -> float:
    return sum(o.utilization for o in history) / len(history)


def _span(history: deque[_Observation]) -> float:
    """Seconds between the first and the last observation in the window."""
    return history[-1].time - history[0].time


def pod_compute_budget(config: EnforcerConfig) -> float | None:
    """The pod's compute budget (0-1 of a GPU): the sum of its containers' compute shares, at most
    a whole GPU. None (no budget) when the config names no container or one of them has no compute
    share: its use is unlimited, so the pod's is too (as ``rules.pod_budget_bytes`` for memory)."""
    if not config.containers:
        return None
    total = 0.0
    for share in config.containers.values():
        if share.compute_percent is None:
            return None
        total += share.compute_percent / 100
    return min(total, 1.0)


def share_of(config: EnforcerConfig, key: str) -> float | None:
    """The compute share (0-1) a plan key is held to: a container's, or the pod's budget for
    ``UNATTRIBUTED``; None: not limited."""
    if key == UNATTRIBUTED:
        return pod_compute_budget(config)
    share = config.containers.get(key)
    return None if share is None or share.compute_percent is None else share.compute_percent / 100


def unattributed_sm_utilization(attribution: Attribution) -> float | None:
    """The pod's SM use in [0, 1] where it has unattributed processes: on each such device the sum
    over all the pod's processes there (attributed ones included: the budget is the pod's), capped
    at the device's 100 %, and the maximum over those devices. None: no unattributed process."""
    devices = {p.device_index for p in attribution.processes if p.container is None}
    if not devices:
        return None
    per_device: dict[int, int] = defaultdict(int)
    for p in attribution.processes:
        if p.device_index in devices:
            per_device[p.device_index] += max(p.sm_util or 0, 0)
    return max(min(percent, 100) / 100 for percent in per_device.values())


def container_sm_utilization(attribution: Attribution) -> dict[str, float]:
    """container -> SM use in [0, 1]: the sum over its processes on each device, capped at the
    device's 100 %, and the maximum over devices (a share is a share of each GPU it uses).

    A process NVML gave no utilisation for counts as 0: NVML reports only processes that ran since
    its last sample, and a stopped process does not run. Unattributed processes are not counted.
    """
    per_device: dict[tuple[str, int], int] = defaultdict(int)
    for p in attribution.processes:
        if p.container is not None:
            per_device[(p.container, p.device_index)] += max(p.sm_util or 0, 0)
    result: dict[str, float] = {}
    for (container, _), percent in per_device.items():
        result[container] = max(result.get(container, 0.0), min(percent, 100) / 100)
    return result
