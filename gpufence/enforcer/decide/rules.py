"""Which containers are over their shares, and what to do about it: the enforcer's pure rules.

No I/O and no clock reads: every function here is a function of its arguments (the compute
controller, ``compute.py``, keeps a window and its state, and the time is passed in). The
invariant this module guards: a process is chosen for termination only if its container is strictly over its share on
the device concerned, or it is unattributed and the pod is strictly over its budget there, or its
container (or, for an unattributed process, the pod) runs on more GPUs than it requested, or it
(or its container) was seen running while the throttle held it stopped.

A claim is never a key (:func:`screen_claims`): a process the attribution names after something that
is no configured container of the pod is unattributed, and unattributed processes count against
the pod's budgets: memory (:func:`pod_usage`), compute (``compute.pod_compute_budget``) and the
GPU count (:func:`pod_device_orders`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from gpufence.contract import EnforcerConfig, LimitUnit
from gpufence.enforcer.facts import Attribution, PodProcess

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
    # Which part of the share is the limit here (a share in two units: the smaller on this device).
    limit_unit: LimitUnit | None = None
    # The per-process sum, when ``used_bytes`` is the driver's currentUsed for the container's cgroup.
    process_bytes: int | None = None


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
    # Set when the container runs on more GPUs than it requested (``device_orders``): how many it
    # requested and the devices it runs on; ``device_index`` is then the first one beyond the count.
    gpus_requested: int | None = None
    devices_used: tuple[int, ...] = ()
    # Set when the order is for throttle evasion (``evasion_orders``): the PIDs seen running while
    # the throttle held them stopped.
    evaded_pids: tuple[int, ...] = ()
    evaded_phases: int = 0
    # Set when the order is for an ineffective throttle (``ineffective_orders``): the mean SM use
    # (0-1) that stayed over the compute share while the throttle held the processes stopped.
    ineffective_use: float | None = None
    compute_share: float | None = None
    held_seconds: float = 0.0


@dataclass(frozen=True)
class Evasion:
    """A process the throttle executor saw running during its stopped phase, in ``phases`` stopped
    phases within its window (something else sends it SIGCONT)."""

    container: str | None  # None: an unattributed process (throttled against the pod's budget)
    pid: int
    start_time_ticks: int
    state: str  # its /proc state letter when last seen running
    phases: int


def screen_claims(attribution: Attribution, config: EnforcerConfig) -> Attribution:
    """The attribution with every process named after no configured container made unattributed.

    A name is a claim any process can make (it re-execs itself with GPUFENCE_CONTAINER set to
    anything): a name that is no container of the pod's config has no share, so accepting it
    would exempt the process from every limit. Unattributed, it counts against the pod's budgets.
    """
    names = config.containers
    if all(p.container is None or p.container in names for p in attribution.processes):
        return attribution
    processes = tuple(
        p if p.container is None or p.container in names else replace(p, container=None) for p in attribution.processes
    )
    return Attribution(processes, attribution.foreign_pids, attribution.uninspectable)


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
    limit = _limit(config, container, device_total)
    return ContainerDeviceUsage(
        container=container,
        device_index=processes[0].device_index,
        device_uuid=processes[0].device_uuid,
        used_bytes=sum(p.used_memory_bytes or 0 for p in processes),
        limit_bytes=None if limit is None else limit[0],
        processes=tuple(processes),
        unknown_usage=any(p.used_memory_bytes is None for p in processes),
        limit_unit=None if limit is None else limit[1],
    )


def _limit(config: EnforcerConfig, container: str, device_total: int | None) -> tuple[int, LimitUnit] | None:
    """The container's limit on a device and its unit. A percentage of an unknown (or nonsensical)
    total is no limit: never kill on a guess (a share in two units keeps its bytes)."""
    share = config.containers.get(container)
    if share is None or share.memory is None:
        return None
    return share.memory.limit_on(device_total)


def _limit_bytes(config: EnforcerConfig, container: str, device_total: int | None) -> int | None:
    found = _limit(config, container, device_total)
    return None if found is None else found[0]


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


def device_orders(usages: Iterable[ContainerDeviceUsage], config: EnforcerConfig) -> tuple[TerminateOrder, ...]:
    """Containers whose processes run on more GPUs than they requested, to terminate as a whole.

    A GPU container that takes NVIDIA_VISIBLE_DEVICES=all from a ConfigMap (envFrom: admission
    sees the reference, not the value) gets every GPU of the node from the container toolkit,
    outside the scheduler's count. NVML's view of where its processes are cannot be forged from
    inside the pod. Which of its GPUs the device plugin assigned is not visible here, so the order
    names the devices beyond the first ``gpus`` by index. A container that uses one GPU it was not
    assigned is not caught: that needs the assignment (see docs/limitations.md).
    """
    rows_of: dict[str, list[ContainerDeviceUsage]] = defaultdict(list)
    for usage in usages:
        rows_of[usage.container].append(usage)
    orders = []
    for container in sorted(rows_of):
        share = config.containers.get(container)
        rows = sorted(rows_of[container], key=lambda u: u.device_index)
        if share is None or share.gpus is None or len(rows) <= share.gpus:
            continue
        extra = rows[share.gpus :]
        victims = tuple(sorted((p for u in rows for p in u.processes if p.container == container), key=_largest_newest))
        orders.append(TerminateOrder(
            container=container, device_index=extra[0].device_index, device_uuid=extra[0].device_uuid,
            used_bytes=sum(u.used_bytes for u in extra), limit_bytes=0, victims=victims,
            gpus_requested=share.gpus, devices_used=tuple(u.device_index for u in rows),
        ))
    return tuple(orders)


def pod_gpus_requested(config: EnforcerConfig) -> int | None:
    """The GPUs the pod requested: the sum of its containers' ``gpus``. None (no rule) when the
    config names no container or one has no count (a config written before counts existed)."""
    if not config.containers:
        return None
    total = 0
    for share in config.containers.values():
        if share.gpus is None:
            return None
        total += share.gpus
    return total


def pod_device_orders(attribution: Attribution, config: EnforcerConfig) -> tuple[TerminateOrder, ...]:
    """The unattributed processes, to terminate when the pod runs on more GPUs than it requested.

    The containers' own counts are :func:`device_orders`; this is the pod's: every device where
    one of its processes runs counts, attributed or not. When the pod is over its count and some of
    its processes are unattributed, those are the ones no container can be charged for, so all of
    them go (a group spread over devices is one escape, as a container over its count is one
    container); the attributed containers stay, each within its own count.
    """
    requested = pod_gpus_requested(config)
    unattributed = {(p.pid, p.start_time_ticks): p for p in attribution.processes if p.container is None}
    if requested is None or not unattributed:
        return ()
    devices = sorted({p.device_index for p in attribution.processes})
    if len(devices) <= requested:
        return ()
    extra = devices[requested:]
    uuid = next(p.device_uuid for p in attribution.processes if p.device_index == extra[0])
    used = sum(p.used_memory_bytes or 0 for p in attribution.processes if p.device_index in extra)
    victims = tuple(sorted(unattributed.values(), key=_largest_newest))
    return (TerminateOrder(
        container=None, device_index=extra[0], device_uuid=uuid, used_bytes=used, limit_bytes=0,
        victims=victims, gpus_requested=requested, devices_used=tuple(devices),
    ),)


def evasion_orders(evasions: Iterable[Evasion], attribution: Attribution) -> tuple[TerminateOrder, ...]:
    """What to terminate for throttle evasion: the evader's whole container, or an unattributed
    evader on its own (its cgroup names no container that could be terminated).

    Only processes of the current attribution are ever victims: an evader that left the pod's
    processes (exited) gives no order.
    """
    by_container: dict[str | None, list[Evasion]] = defaultdict(list)
    for e in evasions:
        by_container[e.container].append(e)
    orders = []
    for container in sorted(by_container, key=lambda c: (c is None, c or "")):
        found = by_container[container]
        keys = {(e.pid, e.start_time_ticks) for e in found}
        if container is None:
            chosen = [p for p in attribution.processes if p.container is None and (p.pid, p.start_time_ticks) in keys]
        else:
            chosen = [p for p in attribution.processes if p.container == container]
        victims = tuple(sorted({(p.pid, p.start_time_ticks): p for p in chosen}.values(), key=_largest_newest))
        evaders = [p for p in chosen if (p.pid, p.start_time_ticks) in keys]
        if not victims or not evaders:
            continue
        first = min(evaders, key=lambda p: p.device_index)
        orders.append(TerminateOrder(
            container=container, device_index=first.device_index, device_uuid=first.device_uuid,
            used_bytes=sum(p.used_memory_bytes or 0 for p in chosen if p.device_index == first.device_index),
            limit_bytes=0, victims=victims, evaded_pids=tuple(sorted({p.pid for p in evaders})),
            evaded_phases=max(e.phases for e in found),
        ))
    return tuple(orders)


def ineffective_orders(found: Iterable[Ineffective], attribution: Attribution) -> tuple[TerminateOrder, ...]:
    """What to terminate for a throttle that does not hold (``compute.Ineffective``): the container
    as a whole, or for the pod's unattributed loop its unattributed processes (no container can be
    terminated for them). Only processes of the current attribution are victims."""
    orders = []
    for f in found:
        container = None if f.key == UNATTRIBUTED else f.key
        chosen = [p for p in attribution.processes if p.container == container]
        if not chosen:
            continue
        victims = tuple(sorted({(p.pid, p.start_time_ticks): p for p in chosen}.values(), key=_largest_newest))
        first = min(chosen, key=lambda p: p.device_index)
        orders.append(TerminateOrder(
            container=container, device_index=first.device_index, device_uuid=first.device_uuid,
            used_bytes=sum(p.used_memory_bytes or 0 for p in chosen if p.device_index == first.device_index),
            limit_bytes=0, victims=victims, ineffective_use=f.use, compute_share=f.share, held_seconds=f.seconds,
        ))
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
# The compute decisions live in gpufence/enforcer/decide/compute.py (a controller with state of its own); they are
# re-exported here so "the pure core" stays one import for its callers.
from gpufence.enforcer.decide.compute import (  # noqa: E402
    START_MARGIN,
    UNATTRIBUTED,
    ComputeTracker,
    Ineffective,
    container_sm_utilization,
    pod_compute_budget,
)

__all__ = [
    "START_MARGIN",
    "UNATTRIBUTED",
    "ComputeTracker",
    "ContainerDeviceUsage",
    "Evasion",
    "Ineffective",
    "PodDeviceUsage",
    "TerminateOrder",
    "container_sm_utilization",
    "device_orders",
    "evasion_orders",
    "ineffective_orders",
    "memory_orders",
    "pod_budget_bytes",
    "pod_compute_budget",
    "pod_device_orders",
    "pod_gpus_requested",
    "pod_usage",
    "screen_claims",
    "usage_by_container",
]
