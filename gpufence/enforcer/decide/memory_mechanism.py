"""Which mechanism holds each container's memory share, and the driver's usage per cgroup (pure).

NVML R615 keeps a soft and a hard GPU memory limit per cgroup (``nvmlDeviceGetMemoryLimits_v1``,
the namespace being the cgroup's path under /sys/fs/cgroup, as the container toolkit's
``apply-cuda-memory-limits`` hook names it) and refuses an allocation past the hard limit. Where
such a limit at or below the container's share is set on every device where the container runs,
the driver holds the share at allocation time (``driver``); else the CUDA MPS per-client limit or
an LD_PRELOAD limiter the webhook put in the container's environment (``mps``, ``preload``); else
only the enforcer's polling does. Polling stays on in every case: it is the backstop.

Whether a driver limit was *expected*: the toolkit's hook applies ``NVIDIA_GPU_MEMORY_LIMIT``
from the container's environment, so the same variable in the container's process environment
says the webhook asked for one. A driver limit that was asked for and is absent is reported.

The driver's ``currentUsed`` counts every process of the cgroup, the ones the enforcer cannot
attribute included; it replaces the per-process sum as the container's usage where it is known
for the container's own cgroup (see :func:`driver_usage`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from gpufence.contract import (
    ENV_DRIVER_MEMORY_LIMIT,
    ENV_LD_PRELOAD,
    ENV_MPS_MEMORY_LIMIT,
    ENV_PRELOAD_MEMORY_LIMIT,
)
from gpufence.enforcer.decide.rules import ContainerDeviceUsage
from gpufence.enforcer.facts import DriverLimit, DriverLimitState, DriverReading

# A difference between the driver's currentUsed and the per-process sum below this is not reported.
DISCREPANCY_MIN_BYTES = 1 << 20


class Mechanism(StrEnum):
    DRIVER = "driver"
    MPS = "mps"
    PRELOAD = "preload"
    POLLING = "polling"


@dataclass(frozen=True)
class EnvHints:
    """What the container's environment says about limits set outside the enforcer."""

    driver_limit_expected: bool = False
    mps: bool = False
    preload: bool = False

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> EnvHints:
        return cls(
            driver_limit_expected=bool(env.get(ENV_DRIVER_MEMORY_LIMIT, "").strip()),
            mps=bool(env.get(ENV_MPS_MEMORY_LIMIT, "").strip()),
            preload=bool(env.get(ENV_LD_PRELOAD, "").strip()) and bool(env.get(ENV_PRELOAD_MEMORY_LIMIT, "").strip()),
        )


@dataclass(frozen=True)
class MemoryEnforcement:
    mechanism: Mechanism
    limit_bytes: int | None  # the driver's hard limit (the largest over the devices) when it holds
    why: str
    # A driver limit was asked for (NVIDIA_GPU_MEMORY_LIMIT) and is not in force: say so (an Event).
    driver_limit_missing: bool = False


def decide(
    namespace: str | None,
    shares: Mapping[int, int | None],
    limits: Mapping[int, DriverLimit],
    hints: EnvHints,
    hidden: bool = False,
) -> MemoryEnforcement:
    """The mechanism that holds one container's memory share.

    ``shares``: device index -> the container's share there in bytes (None: no share, or a
    percentage of an unknown total) for each device where the container runs; ``limits``: what the
    driver said for the container's cgroup on those devices. ``driver`` needs a hard limit at or
    below the share on every one of them. ``hidden``: the sidecar's cgroup namespace hides the
    container's host cgroup path; the driver cannot be asked, so a limit asked for is not reported
    missing (it may well hold)."""
    devices = sorted(shares)
    driver_why: str | None
    if hidden:
        driver_why = (
            "the driver's limit cannot be read: the sidecar's cgroup namespace hides the container's host "
            "cgroup path (a limit the toolkit set may still hold)"
        )
    else:
        driver_why = _driver_gap(namespace, devices, shares, limits)
    if driver_why is None:
        hard = max(limits[d].hard_bytes or 0 for d in devices)
        where = ", ".join(f"GPU {d}: hard {limits[d].hard_bytes} <= share {shares[d]}" for d in devices)
        return MemoryEnforcement(Mechanism.DRIVER, hard, f"the driver refuses allocations past the limit ({where})")
    missing = hints.driver_limit_expected and not hidden
    if hints.mps:
        return MemoryEnforcement(
            Mechanism.MPS, None, f"CUDA MPS per-client limit ({ENV_MPS_MEMORY_LIMIT}); no driver limit: {driver_why}",
            missing
        )
    if hints.preload:
        return MemoryEnforcement(
            Mechanism.PRELOAD, None, f"LD_PRELOAD limiter ({ENV_PRELOAD_MEMORY_LIMIT}); no driver limit: {driver_why}",
            missing
        )
    return MemoryEnforcement(Mechanism.POLLING, None, f"enforced by polling only: {driver_why}", missing)


@dataclass(frozen=True)
class ContainerEnforcement:
    """What holds one container's memory share this poll, with the driver's answers behind it."""

    container: str
    namespace: str | None  # the container's cgroup as NVML's namespace (None: none usable)
    enforcement: MemoryEnforcement
    limits: Mapping[int, DriverLimit]  # device -> what the driver said for the cgroup there


def enforcement_by_container(
    reading: DriverReading, usages: Iterable[ContainerDeviceUsage]
) -> tuple[ContainerEnforcement, ...]:
    """The mechanism that holds each share of a container the driver was asked about, on the
    devices where it runs (``usages``); nothing when the driver did not answer this poll."""
    if reading.failed:
        return ()
    shares: dict[str, dict[int, int | None]] = {}
    for u in usages:
        if u.container in reading.cgroups:
            shares.setdefault(u.container, {})[u.device_index] = u.limit_bytes
    found = []
    for container, devices in shares.items():
        namespace = reading.cgroups[container]
        limits = {d: reading.limits[(container, d)] for d in devices if (container, d) in reading.limits}
        hints = EnvHints.from_environ(reading.environ.get(container, {}))
        mechanism = decide(namespace, devices, limits, hints, hidden=container in reading.hidden)
        found.append(ContainerEnforcement(container, namespace, mechanism, limits))
    return tuple(found)


def _driver_gap(
    namespace: str | None, devices: list[int], shares: Mapping[int, int | None], limits: Mapping[int, DriverLimit]
) -> str | None:
    """Why the driver does not hold the share, or None when it does."""
    if not devices:
        return "the container has no GPU process yet"
    if namespace is None:
        return (
            "no cgroup v2 path of the container to ask the driver about (a cgroup v1 host: the driver "
            "limits cgroups v2 only)"
        )
    for d in devices:
        limit = limits.get(d)
        share = shares[d]
        if limit is None:
            return f"GPU {d}: not asked"
        if limit.state is DriverLimitState.NO_CALL:
            return "the driver has no nvmlDeviceGetMemoryLimits_v1 (older than R615)"
        if limit.state is DriverLimitState.NOT_SET:
            return (
                f"GPU {d}: no limit on {namespace} (toolkit without apply-cuda-memory-limits, or "
                f"{ENV_DRIVER_MEMORY_LIMIT} absent from the container)"
            )
        if limit.state is DriverLimitState.UNLIMITED:
            return f"GPU {d}: {namespace} has no hard limit"
        if limit.state is DriverLimitState.ERROR:
            return f"GPU {d}: nvmlDeviceGetMemoryLimits_v1 failed ({limit.error})"
        if share is None:
            return f"GPU {d}: the container has no memory share in bytes to compare the limit {limit.hard_bytes} with"
        if limit.hard_bytes is None or limit.hard_bytes > share:
            return f"GPU {d}: the driver's hard limit {limit.hard_bytes} is above the share {share}"
    return None


@dataclass(frozen=True)
class Discrepancy:
    container: str
    device_index: int
    driver_bytes: int
    process_bytes: int


def driver_usage(
    namespaces: Mapping[tuple[str, int], str], limits: Mapping[tuple[str, int], DriverLimit]
) -> dict[tuple[str, int], int]:
    """(container, device) -> the driver's ``currentUsed`` for the container's cgroup, where it is
    known and is the container's alone. NVML answers for the nearest limited ancestor-or-self, so a
    limit set on the pod's cgroup would report the pod's total for each container: answers that are
    the same for two containers' different cgroups on a device are left out (the per-process sum is
    kept), as a pod-level limit would make them."""
    found: dict[tuple[str, int], tuple[int, int, int]] = {}
    for key, limit in limits.items():
        if key in namespaces and limit.state in (DriverLimitState.SET, DriverLimitState.UNLIMITED):
            assert limit.current_used_bytes is not None
            found[key] = (limit.soft_bytes or 0, limit.hard_bytes or 0, limit.current_used_bytes)
    by_answer: dict[tuple[int, tuple[int, int, int]], set[str]] = defaultdict(set)
    for (_container, device), answer in found.items():
        by_answer[(device, answer)].add(namespaces[(_container, device)])
    return {
        key: answer[2] for key, answer in found.items() if len(by_answer[(key[1], answer)]) == 1
    }


def apply_driver_usage(
    usages: Iterable[ContainerDeviceUsage], driver_used: Mapping[tuple[str, int], int]
) -> tuple[tuple[ContainerDeviceUsage, ...], tuple[Discrepancy, ...]]:
    """The usages with the driver's figure in place of the per-process sum where the driver gives
    one, and the rows where the two differ by at least ``DISCREPANCY_MIN_BYTES``."""
    result = []
    discrepancies = []
    for u in usages:
        driver = driver_used.get((u.container, u.device_index))
        if driver is None:
            result.append(u)
            continue
        if abs(driver - u.used_bytes) >= DISCREPANCY_MIN_BYTES:
            discrepancies.append(Discrepancy(u.container, u.device_index, driver, u.used_bytes))
        result.append(replace(u, used_bytes=driver, unknown_usage=False, process_bytes=u.used_bytes))
    return tuple(result), tuple(discrepancies)
