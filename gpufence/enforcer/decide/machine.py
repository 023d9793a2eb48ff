"""The enforcer's state machine (pure), driven by ``loop.Enforcer``.

``Core.step(now, attribution, device_totals)`` takes one poll's facts and returns a frozen
:class:`Decisions`: what the pod and each container use, what to terminate (with the over-share
episodes that start and end, so each is logged once), which processes were seen unattributed for the
first time, and the throttle plan with its transitions. ``release`` (NVML lost, a failed poll) and
``reconfigure`` (a new config) end every throttle. The core owns *who is throttled*: the compute
controller inside it is the only place that decides, the loop only logs the transitions and hands
the plan to the throttle executor, which executes it.

No I/O and no clock reads: testable without processes (tests/unit/enforcer/test_machine.py). What stays at the edges
and why: the SIGKILL timers of terminated processes (``terminate.Terminator``) depend on whether
each signal was delivered and whether the process has exited, which only the edge can know; the
duty cycle's phase timing (``throttle.ThrottleExecutor``) runs on its own thread between polls.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from gpufence.contract import MIN_POLL_INTERVAL_SECONDS, EnforcerConfig
from gpufence.enforcer.decide.compute import (
    INEFFECTIVE_SECONDS,
    UNATTRIBUTED,
    ComputeTracker,
    container_sm_utilization,
    share_of,
    unattributed_sm_utilization,
)
from gpufence.enforcer.decide.memory_mechanism import (
    ContainerEnforcement,
    Discrepancy,
    apply_driver_usage,
    driver_usage,
    enforcement_by_container,
)
from gpufence.enforcer.decide.rules import (
    ContainerDeviceUsage,
    Evasion,
    PodDeviceUsage,
    TerminateOrder,
    device_orders,
    evasion_orders,
    ineffective_orders,
    memory_orders,
    pod_device_orders,
    pod_usage,
    screen_claims,
    usage_by_container,
)
from gpufence.enforcer.facts import Attribution, DriverReading, PodProcess

# Bounds the memory of "unattributed processes already logged" (a process churns PIDs for ever).
_SEEN_MAX = 10_000
# Adaptive polling: poll FAST_FACTOR times faster (not under the config's minimum interval) while a
# container or the pod uses at least HOT_RATIO of its share or budget, or grew by GROWTH_RATIO of it
# since the last poll, and for HOT_HOLD_POLLS polls after; at rest the configured interval holds,
# so the CPU cost at rest does not change.
HOT_RATIO = 0.9
GROWTH_RATIO = 0.05
FAST_FACTOR = 10
HOT_HOLD_POLLS = 20
# Without a compute share, SM utilisation is read for the gauge only, this often.
UTILISATION_REFRESH_SECONDS = 5.0


class Transition(StrEnum):
    START = "start"
    UPDATE = "update"  # the run fraction moved by at least a point
    STOP = "stop"


@dataclass(frozen=True)
class ThrottleChange:
    container: str  # a container, or ``UNATTRIBUTED`` ("") for the pod's unattributed processes
    transition: Transition
    fraction: float | None  # the run fraction now in force (None after STOP)
    share: float | None  # the container's compute share (0-1)
    demand: float | None  # mean measured SM use over the window
    sm_utilization: float  # measured now
    reason: str = ""


@dataclass(frozen=True)
class Decisions:
    usages: tuple[ContainerDeviceUsage, ...]
    pods: tuple[PodDeviceUsage, ...]
    # throttle evasions and ineffective throttles first, then unattributed (pod budget), whole
    # containers, GPU counts
    orders: tuple[TerminateOrder, ...]
    # orders whose (container, device) was not over before, and every evasion or ineffective-throttle
    # order (each is new)
    episodes_started: tuple[TerminateOrder, ...]
    episodes_ended: tuple[tuple[str | None, int], ...]  # (container or None for the pod, device)
    new_unattributed: tuple[PodProcess, ...]
    new_uninspectable: tuple[int, ...] = ()  # NVML PIDs we may not inspect, first seen this poll
    new_mig_devices: tuple[int, ...] = ()  # MIG-enabled device indexes first seen: left to MIG
    plan: Mapping[str, float] = field(default_factory=dict)  # container -> run fraction in force
    throttle_changes: tuple[ThrottleChange, ...] = ()
    # The attribution with its claims screened (``rules.screen_claims``; MIG devices' processes
    # kept: a container terminated or throttled is so on every device): what the executors act on.
    attribution: Attribution = field(default_factory=lambda: Attribution((), ()))
    # (container, device) rows where the driver's currentUsed (now the usage) differs from the
    # per-process sum, every poll (the loop reports each once)
    discrepancies: tuple[Discrepancy, ...] = ()
    # which mechanism holds each memory share the driver was asked about (the loop reports changes)
    memory_enforcement: tuple[ContainerEnforcement, ...] = ()


def without_devices(attribution: Attribution, devices: frozenset[int]) -> Attribution:
    """The attribution without the processes on ``devices`` (MIG-mode devices: left to MIG)."""
    if not devices:
        return attribution
    return Attribution(
        tuple(p for p in attribution.processes if p.device_index not in devices),
        attribution.foreign_pids,
        attribution.uninspectable,
    )


class Core:
    def __init__(
        self, config: EnforcerConfig, *, compute_window_seconds: float = 5.0, compute_period_seconds: float = 1.0,
        compute_ineffective_seconds: float = INEFFECTIVE_SECONDS,
    ) -> None:
        self.config = config
        self._window = compute_window_seconds
        self._period = compute_period_seconds
        self._ineffective_seconds = compute_ineffective_seconds
        self._tracker = self._new_tracker()
        self._plan: Mapping[str, float] = MappingProxyType({})
        self._over: frozenset[tuple[str | None, int]] = frozenset()
        self._seen: set[tuple[int, int]] = set()
        self._seen_uninspectable: set[int] = set()
        self._seen_mig: set[int] = set()
        self._last_used: dict[tuple[str | None, int], int] = {}
        self._hot_polls = 0
        self._utilisation_read_at = -math.inf

    @property
    def throttled(self) -> Mapping[str, float]:
        return self._plan

    def step(
        self,
        now: float,
        attribution: Attribution,
        device_totals: Mapping[int, int | None],
        mig_devices: frozenset[int] = frozenset(),
        evasions: Iterable[Evasion] = (),
        driver: DriverReading | None = None,
    ) -> Decisions:
        """One poll. Processes on ``mig_devices`` (MIG mode enabled) are left out of every decision:
        a MIG device's isolation is the hardware's, and NVML's per-process view of the parent GPU
        does not say which slice a process's memory is in; the loop announces it once.

        ``attribution`` is screened first (``rules.screen_claims``): a process named after no
        configured container is unattributed in every decision below. ``evasions`` are what the
        throttle executor saw since the last poll: each gives a one-shot order (never an episode
        that lasts: the terminator keeps its own timers). ``driver``: the driver's answers for the
        containers' cgroups: its currentUsed replaces the per-process sum as the container's usage
        where it is the container's alone (``memory_mechanism.driver_usage``), and they say which
        mechanism holds each share (``memory_mechanism.enforcement_by_container``)."""
        config = self.config
        screened = screen_claims(attribution, config)
        new_mig = tuple(sorted(mig_devices - self._seen_mig))
        self._seen_mig |= mig_devices
        attribution = without_devices(screened, mig_devices)
        usages, discrepancies = apply_driver_usage(
            usage_by_container(attribution, config, device_totals),
            driver_usage(driver.namespaces, driver.limits) if driver is not None else {},
        )
        pods = pod_usage(attribution, config, device_totals)
        self._heat(usages, pods)
        lasting = memory_orders(usages, pods) + device_orders(usages, config) + pod_device_orders(attribution, config)
        started = tuple(o for o in lasting if (o.container, o.device_index) not in self._over)
        ended = self._episodes_ended(lasting)
        self._tracker.observe(now, attribution, config)
        plan = self._tracker.plan(now, config)
        # One-shot orders, never an episode that lasts: a throttle evaded, and a throttle pinned at its
        # minimum that leaves the use over the share (SIGSTOP cannot reach kernels that run while the
        # process is stopped).
        once = evasion_orders(evasions, attribution) + ineffective_orders(self._tracker.take_ineffective(), attribution)
        changes = self._throttle_changes(plan, attribution)
        self._plan = MappingProxyType(dict(plan))
        return Decisions(
            usages=usages, pods=pods, orders=once + lasting, episodes_started=once + started, episodes_ended=ended,
            new_unattributed=self._first_seen_unattributed(attribution),
            new_uninspectable=self._first_seen_uninspectable(attribution), new_mig_devices=new_mig,
            plan=self._plan,
            throttle_changes=changes,
            attribution=screened,
            discrepancies=discrepancies,
            memory_enforcement=enforcement_by_container(driver, usages) if driver is not None else (),
        )

    def _episodes_ended(self, lasting: tuple[TerminateOrder, ...]) -> tuple[tuple[str | None, int], ...]:
        """The over-share episodes that ended since the last poll; ``lasting`` become the ones in force."""
        over = frozenset((o.container, o.device_index) for o in lasting)
        ended = tuple(sorted(self._over - over, key=lambda k: (k[1], k[0] or "")))
        self._over = over
        return ended

    def _first_seen_unattributed(self, attribution: Attribution) -> tuple[PodProcess, ...]:
        """The unattributed processes not seen before (each is logged once)."""
        fresh = []
        for p in attribution.processes:
            if p.container is None and (p.pid, p.start_time_ticks) not in self._seen:
                if len(self._seen) >= _SEEN_MAX:
                    self._seen.clear()
                self._seen.add((p.pid, p.start_time_ticks))
                fresh.append(p)
        return tuple(fresh)

    def _first_seen_uninspectable(self, attribution: Attribution) -> tuple[int, ...]:
        """Uninspectable NVML PIDs not in the previous poll (reported again after one went away)."""
        fresh = tuple(p for p in attribution.uninspectable if p not in self._seen_uninspectable)
        self._seen_uninspectable = set(attribution.uninspectable)
        return fresh

    def _throttle_changes(self, plan: Mapping[str, float], attribution: Attribution) -> tuple[ThrottleChange, ...]:
        """The transitions from the plan in force to ``plan``: starts, moves of a point or more, stops."""
        sm = container_sm_utilization(attribution)
        sm[UNATTRIBUTED] = unattributed_sm_utilization(attribution) or 0.0
        changes = []
        for container, fraction in plan.items():
            before = self._plan.get(container)
            if before is None:
                changes.append(self._change(container, Transition.START, fraction, sm))
            elif abs(before - fraction) >= 0.01:
                changes.append(self._change(container, Transition.UPDATE, fraction, sm))
        for container in sorted(set(self._plan) - set(plan)):
            why = "the pod is under its compute budget" if container == UNATTRIBUTED else "under share"
            changes.append(self._change(container, Transition.STOP, None, sm, why))
        return tuple(changes)

    def wants_utilisation(self, now: float) -> bool:
        """Whether this poll reads SM utilisation afresh: about once per duty-cycle period with a
        compute share, every ``UTILISATION_REFRESH_SECONDS`` (for the gauge) without one.

        The driver's reading is each process's mean since the previous read (a process absent from
        it did not run), so reading less often loses nothing, it averages over longer; the controller
        plans once per period and polls in between reuse the reading. On a real GPU the call costs
        1.4-2.6 ms, more than the rest of a quiet poll, and fast polling near a memory limit would
        otherwise repeat it 20 times a second.
        """
        limited = any(share.compute_percent is not None for share in self.config.containers.values())
        # A tenth of a period's slack: a poll that comes a little early for its timer still reads.
        every = 0.9 * self._period if limited else UTILISATION_REFRESH_SECONDS
        if now - self._utilisation_read_at < every:
            return False
        self._utilisation_read_at = now
        return True

    def poll_interval(self, base: float) -> float:
        """The interval to the next poll: ``base``, or faster while something is close to its limit."""
        if self._hot_polls <= 0:
            return base
        return min(base, max(MIN_POLL_INTERVAL_SECONDS, base / FAST_FACTOR))

    def _heat(self, usages: tuple[ContainerDeviceUsage, ...], pods: tuple[PodDeviceUsage, ...]) -> None:
        limits: list[tuple[tuple[str | None, int], int, int]] = [
            ((u.container, u.device_index), u.used_bytes, u.limit_bytes) for u in usages if u.limit_bytes
        ]
        limits += [((None, p.device_index), p.used_bytes, p.budget_bytes) for p in pods if p.budget_bytes]
        hot = False
        used_now: dict[tuple[str | None, int], int] = {}
        for key, used, limit in limits:
            used_now[key] = used
            growth = used - self._last_used.get(key, used)
            if used >= HOT_RATIO * limit or growth >= GROWTH_RATIO * limit:
                hot = True
        self._last_used = used_now
        self._hot_polls = HOT_HOLD_POLLS if hot else self._hot_polls - 1

    def release(self, reason: str) -> tuple[ThrottleChange, ...]:
        """End every throttle and start the compute controller afresh (no fresh measurements)."""
        changes = tuple(self._change(c, Transition.STOP, None, {}, reason) for c in sorted(self._plan))
        self._plan = MappingProxyType({})
        self._tracker = self._new_tracker()
        return changes

    def reconfigure(self, config: EnforcerConfig) -> tuple[ThrottleChange, ...]:
        """Switch configs: every throttle ends (under the old shares), episodes start afresh."""
        changes = self.release("config changed")
        self.config = config
        self._over = frozenset()
        return changes

    def compute_share(self, container: str) -> float | None:
        """A container's compute share (0-1), or the pod's budget for ``UNATTRIBUTED``."""
        return share_of(self.config, container)

    def _change(
        self, container: str, transition: Transition, fraction: float | None, sm: Mapping[str, float], reason: str = ""
    ) -> ThrottleChange:
        return ThrottleChange(
            container=container, transition=transition, fraction=fraction, share=self.compute_share(container),
            demand=self._tracker.demand(container), sm_utilization=sm.get(container, 0.0), reason=reason,
        )

    def _new_tracker(self) -> ComputeTracker:
        return ComputeTracker(window_seconds=self._window, period_seconds=self._period,
                              ineffective_seconds=self._ineffective_seconds)
