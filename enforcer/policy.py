"""Which containers are over their shares, and what to do about it: the enforcer's pure core.

No I/O and no clock reads: every function here is a function of its arguments (``ComputeTracker``
keeps a window of past observations, and the time is always passed in). The invariant this module
guards: a process is chosen for termination only if its container is strictly over its share on
the device concerned, or it is unattributed and the pod is strictly over its budget there.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from enforcer.attribution import Attribution, PodProcess
from enforcer.config import EnforcerConfig, Mode

# -- memory ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerDeviceUsage:
    container: str
    device_index: int
    device_uuid: str
    used_bytes: int  # sum over the container's processes on that device (None used -> 0, flagged)
    limit_bytes: int | None  # None: no memory share, or total unknown for a % share
    processes: tuple[PodProcess, ...]
    unknown_usage: bool = False  # the flag: some process's used memory was None (counted as 0)


@dataclass(frozen=True)
class PodDeviceUsage:
    """The pod on one device: every GPU process accepted as the pod's counts, attributed or not."""

    device_index: int
    device_uuid: str
    used_bytes: int  # all the pod's processes on the device (unknown usage counts 0)
    unattributed_bytes: int  # the part no container can be charged for
    budget_bytes: int | None  # the sum of the GPU containers' memory shares; None: no budget
    unattributed: tuple[PodProcess, ...]


@dataclass(frozen=True)
class TerminateOrder:
    """Terminate ``victims`` (and, for a container, everything else in it) on this device's account.

    ``container`` None: the pod is over its budget and the victims are unattributed processes,
    largest first, just enough to bring the pod back under (``used_bytes``/``limit_bytes`` are the
    pod's). Otherwise the container is strictly over its own share and is terminated as a whole:
    ``victims`` are all its processes on the device (the executor adds the rest of its cgroup).
    """

    container: str | None
    device_index: int
    device_uuid: str
    used_bytes: int
    limit_bytes: int
    victims: tuple[PodProcess, ...]


def usage_by_container(
    attribution: Attribution, config: EnforcerConfig, device_totals: Mapping[int, int | None]
) -> tuple[ContainerDeviceUsage, ...]:
    """One entry per (container, device) that has at least one attributed process there, sorted by
    device then container. Unattributed processes belong to no container and appear nowhere here
    (they count in :func:`pod_usage`). A container missing from the config gets
    ``limit_bytes=None`` (nothing to enforce)."""
    groups: dict[tuple[int, str], list[PodProcess]] = defaultdict(list)
    for p in attribution.processes:
        if p.container is not None:
            groups[(p.device_index, p.container)].append(p)
    return tuple(
        _usage(container, processes, config, device_totals.get(device_index))
        for (device_index, container), processes in sorted(groups.items(), key=lambda item: item[0])
    )


def pod_usage(
    attribution: Attribution, config: EnforcerConfig, device_totals: Mapping[int, int | None]
) -> tuple[PodDeviceUsage, ...]:
    """One entry per device where the pod has a GPU process, sorted by device."""
    groups: dict[int, list[PodProcess]] = defaultdict(list)
    for p in attribution.processes:
        groups[p.device_index].append(p)
    result = []
    for device_index in sorted(groups):
        processes = groups[device_index]
        unattributed = tuple(sorted((p for p in processes if p.container is None), key=lambda p: p.pid))
        result.append(
            PodDeviceUsage(
                device_index=device_index,
                device_uuid=processes[0].device_uuid,
                used_bytes=sum(p.used_memory_bytes or 0 for p in processes),
                unattributed_bytes=sum(p.used_memory_bytes or 0 for p in unattributed),
                budget_bytes=pod_budget_bytes(config, device_totals.get(device_index)),
                unattributed=unattributed,
            )
        )
    return tuple(result)


def pod_budget_bytes(config: EnforcerConfig, device_total: int | None) -> int | None:
    """The pod's budget on a device: the sum of its GPU containers' memory shares there.

    None (no budget) when the config names no container, or when one GPU container has no memory
    share (or a percentage of an unknown total): its use is unlimited, so the pod's is too.
    """
    if not config.containers:
        return None
    total = 0
    for container in config.containers:
        limit = _limit_bytes(config, container, device_total)
        if limit is None:
            return None
        total += limit
    return total


def _usage(
    container: str, processes: list[PodProcess], config: EnforcerConfig, device_total: int | None
) -> ContainerDeviceUsage:
    processes.sort(key=lambda p: p.pid)
    return ContainerDeviceUsage(
        container=container,
        device_index=processes[0].device_index,
        device_uuid=processes[0].device_uuid,
        used_bytes=sum(p.used_memory_bytes or 0 for p in processes),
        limit_bytes=_limit_bytes(config, container, device_total),
        processes=tuple(processes),
        unknown_usage=any(p.used_memory_bytes is None for p in processes),
    )


def _limit_bytes(config: EnforcerConfig, container: str, device_total: int | None) -> int | None:
    share = config.containers.get(container)
    if share is None or share.memory is None:
        return None
    if share.memory.bytes is not None:
        return share.memory.bytes
    # A percentage of an unknown (or nonsensical) total is no limit: never kill on a guess.
    if device_total is None or device_total <= 0:
        return None
    return share.memory.limit_bytes(device_total)


def memory_orders(
    usages: Iterable[ContainerDeviceUsage], pods: Iterable[PodDeviceUsage] = ()
) -> tuple[TerminateOrder, ...]:
    """What to terminate, in the order to do it: first, on each device where the pod is strictly
    over its budget, unattributed processes (largest first, just enough); then every container
    strictly over its own share on some device, as a whole.

    The pod budget is the isolation between pods and does not depend on attribution; attribution
    only decides which container pays. A process whose usage is unknown (None) is never chosen for
    the pod budget (killing it frees an unknown amount); ties go to the newest process (the one
    that most likely just pushed the pod over).
    """
    orders = [order for pod in pods if (order := _pod_order(pod)) is not None]
    for usage in usages:
        if usage.limit_bytes is None or usage.used_bytes <= usage.limit_bytes:
            continue
        # Re-check each process although usage_by_container built the list: a hand-built
        # ContainerDeviceUsage must not make another container's or device's process a victim.
        victims = tuple(
            sorted(
                (p for p in usage.processes if p.container == usage.container and p.device_index == usage.device_index),
                key=_largest_newest,
            )
        )
        if victims:
            orders.append(
                TerminateOrder(
                    container=usage.container,
                    device_index=usage.device_index,
                    device_uuid=usage.device_uuid,
                    used_bytes=usage.used_bytes,
                    limit_bytes=usage.limit_bytes,
                    victims=victims,
                )
            )
    return tuple(orders)


def _pod_order(pod: PodDeviceUsage) -> TerminateOrder | None:
    if pod.budget_bytes is None or pod.used_bytes <= pod.budget_bytes:
        return None
    candidates = sorted(
        (
            p
            for p in pod.unattributed
            if p.container is None
            and p.device_index == pod.device_index
            and p.used_memory_bytes is not None
            and p.used_memory_bytes > 0
        ),
        key=_largest_newest,
    )
    remaining = pod.used_bytes
    victims = []
    for p in candidates:
        if remaining <= pod.budget_bytes:
            break
        victims.append(p)
        remaining -= p.used_memory_bytes or 0
    if not victims:
        return None  # nothing unattributed to take: the containers over their shares pay
    return TerminateOrder(
        container=None,
        device_index=pod.device_index,
        device_uuid=pod.device_uuid,
        used_bytes=pod.used_bytes,
        limit_bytes=pod.budget_bytes,
        victims=tuple(victims),
    )


def _largest_newest(p: PodProcess) -> tuple[int, int, int]:
    return (-(p.used_memory_bytes or 0), -p.start_time_ticks, -p.pid)


# -- compute ---------------------------------------------------------------------------------------

# Hysteresis. A container starts being throttled only when its demand exceeds its share by this
# fraction of the share (an integer-percent, sampled metric is noisy, and short bursts are not
# abuse); once throttled, it stays throttled until its estimated demand is at or under the share
# itself, where the planned run fraction would reach 1. Between the two thresholds the state does
# not change, so noise around the share cannot make it flap.
START_MARGIN = 0.10


@dataclass(frozen=True)
class _Observation:
    time: float
    utilization: float  # container SM use in [0, 1]: per-device sum of its processes, max over devices
    run_fraction: float  # the fraction of each period it was allowed to run when this was measured


class ComputeTracker:
    """Rolling SM-utilisation window per container and duty-cycle planning.

    While a container runs a fraction f of each period its measured SM use u includes the stopped
    time (which shows 0), so its demand is about u/f; over the window we estimate it as
    mean(u) / mean(f), robust to individual samples landing in a run or a stop phase. The next run
    fraction is share/demand, clamped to ``[min_run_fraction, 1)``; reaching 1 ends the throttle.

    Call ``observe`` once per poll and then ``plan``; ``plan`` remembers what it returned, as the
    fraction in force for the next observations. In audit mode nothing is actually stopped, so the
    fraction in force is recorded as 1 and the plan says what enforcement *would* do.
    """

    def __init__(
        self, window_seconds: float = 5.0, period_seconds: float = 1.0, min_run_fraction: float = 0.05
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
        self._history: dict[str, deque[_Observation]] = {}
        self._fraction: dict[str, float] = {}  # containers currently throttled -> fraction in force

    def observe(self, now: float, attribution: Attribution, config: EnforcerConfig) -> None:
        """Record each compute-limited container's SM use now (0 when it has no GPU process)."""
        use = container_sm_utilization(attribution)
        for container, share in config.containers.items():
            if share.compute_percent is None:
                continue
            in_force = self._fraction.get(container, 1.0) if config.mode is Mode.ENFORCE else 1.0
            history = self._history.setdefault(container, deque())
            history.append(_Observation(now, use.get(container, 0.0), in_force))
            self._expire(history, now)
        self._forget_unlimited(config)

    def plan(self, now: float, config: EnforcerConfig) -> Mapping[str, float]:
        """container -> run fraction in (0, 1); a container absent is not throttled."""
        self._forget_unlimited(config)
        for container, history in self._history.items():
            self._expire(history, now)
            share = config.containers[container].compute_percent
            assert share is not None
            fraction = self._next_fraction(history, share / 100, throttled=container in self._fraction)
            if fraction is None:
                self._fraction.pop(container, None)
            else:
                self._fraction[container] = fraction
        return MappingProxyType(dict(self._fraction))

    def demand(self, container: str) -> float | None:
        """The current estimate of a container's unthrottled SM use (for logs), None without data."""
        history = self._history.get(container)
        return _demand(history) if history else None

    def _next_fraction(self, history: deque[_Observation], share: float, *, throttled: bool) -> float | None:
        if not history:
            return None  # no data (e.g. utilisation unavailable): never throttle blind
        demand = _demand(history)
        if throttled:
            if demand <= share:
                return None
        else:
            # Start only on a sustained excess: at least one full period observed in the window.
            if demand <= share * (1 + START_MARGIN) or _span(history) < self.period_seconds:
                return None
        fraction = max(self.min_run_fraction, share / demand)
        # share/demand < 1 here; the guard keeps float rounding from yielding exactly 1.
        return fraction if fraction < 1 else None

    def _expire(self, history: deque[_Observation], now: float) -> None:
        while history and history[0].time <= now - self.window_seconds:
            history.popleft()

    def _forget_unlimited(self, config: EnforcerConfig) -> None:
        """Drop state for containers that no longer have a compute share (config changed)."""
        for container in list(self._history):
            share = config.containers.get(container)
            if share is None or share.compute_percent is None:
                del self._history[container]
                self._fraction.pop(container, None)


def _demand(history: Iterable[_Observation]) -> float:
    observations = list(history)
    mean_use = sum(o.utilization for o in observations) / len(observations)
    mean_fraction = sum(o.run_fraction for o in observations) / len(observations)
    return mean_use / mean_fraction


def _span(history: deque[_Observation]) -> float:
    """Seconds between the first and the last observation in the window."""
    return history[-1].time - history[0].time


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
