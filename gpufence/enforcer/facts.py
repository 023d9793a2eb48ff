"""What one poll observed, as plain values: no driver, no /proc, no pynvml needed to use them.

``observe/`` produces these (NVML's answers in :mod:`gpufence.enforcer.observe.nvml`, which
re-exports them; the pod's GPU processes in ``observe/attribution.py``; the driver's per-cgroup
limits in ``observe/driver_limits.py``); the pure ``decide/`` reads them and imports nothing of
``observe/`` (an import contract in pyproject.toml), and ``act/`` and ``report/`` read them too.
Standard library and ``gpufence.contract`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from gpufence.contract import (
    ENV_DRIVER_MEMORY_LIMIT,
    ENV_LD_PRELOAD,
    ENV_MPS_MEMORY_LIMIT,
    ENV_PRELOAD_MEMORY_LIMIT,
)

NVML_VALUE_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF


class NvmlUnavailable(Exception):
    """NVML cannot be used: library missing, driver not loaded, init failed, or NVML stopped answering."""


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    device_index: int
    device_uuid: str
    used_memory_bytes: int | None  # None: NVML_VALUE_NOT_AVAILABLE or not supported


@dataclass(frozen=True, slots=True)
class NvmlErrorEvent:
    function: str  # e.g. "nvmlDeviceGetProcessUtilization" (without the _vN suffix)
    error: str  # e.g. "NOT_SUPPORTED", "GPU_IS_LOST"
    device_index: int | None


@dataclass(frozen=True)
class DeviceSample:
    index: int
    uuid: str
    total_memory_bytes: int | None
    processes: tuple[GpuProcess, ...]  # compute + graphics, merged by pid (a pid in both lists once)
    # SM% per pid since the previous read (a real driver gives each process's mean over its samples
    # since then, one record each); {} if unsupported or nothing ran
    sm_util_by_pid: Mapping[int, int]
    lost: bool = False  # device fell off the bus this round: skip it, keep going
    mig: bool = False  # MIG mode enabled: isolation is MIG's (hardware); the enforcer leaves it alone


@dataclass(frozen=True)
class NvmlSample:
    devices: tuple[DeviceSample, ...]
    errors: tuple[NvmlErrorEvent, ...] = field(default=())  # tolerated errors this round


class DriverLimitState(StrEnum):
    """What ``nvmlDeviceGetMemoryLimits_v1`` (NVML R615) says about one cgroup on one device."""

    SET = "set"  # a hard limit below NVML_DEVICE_MEMORY_LIMIT_MAX applies to the cgroup
    UNLIMITED = "unlimited"  # the cgroup (or an ancestor) is registered, with the "no limit" maximum
    NOT_SET = "not_set"  # NOT_SUPPORTED: no limit on the cgroup or above (toolkit hook absent, cgroup v1)
    NO_CALL = "no_call"  # FUNCTION_NOT_FOUND: a driver older than R615
    ERROR = "error"  # any other answer (the call failed this time)


@dataclass(frozen=True, slots=True)
class DriverLimit:
    state: DriverLimitState
    soft_bytes: int | None = None
    hard_bytes: int | None = None
    current_used_bytes: int | None = None  # what the cgroup holds on the device, per the driver
    error: str | None = None  # the NVML error name for NOT_SET / NO_CALL / ERROR


# -- the pod's GPU processes (observe/attribution.py) ---------------------------------------------


@dataclass(frozen=True)
class PodProcess:
    pid: int  # PID in the enforcer's own namespace: the ONLY number ever signalled
    nvml_pid: int
    start_time_ticks: int
    container: str | None  # None: no certain container -> counted for the pod budget, logged
    device_index: int
    device_uuid: str
    used_memory_bytes: int | None
    sm_util: int | None
    # The process's cgroup when it tells containers apart (not the enforcer's own, readable): the
    # container's identity, used to terminate the container as a whole. None: unknown.
    cgroup: str | None = None
    # The process's own GPUFENCE_CONTAINER claim (for the log only: a claim is never a key).
    claim: str | None = None


@dataclass(frozen=True)
class Attribution:
    processes: tuple[PodProcess, ...]  # this pod's GPU processes (one entry per pid and device)
    foreign_pids: tuple[int, ...]  # NVML PIDs judged not in this pod: ignored
    # NVML PIDs of local processes whose descriptors we may not read (no ptrace access; a sidecar
    # with fewer capabilities than the workload): in ``processes`` too, reported besides.
    uninspectable: tuple[int, ...] = ()


# -- the driver's per-cgroup limits (observe/driver_limits.py) ------------------------------------

# The variables of a container's environment that say which limits were asked for outside the
# enforcer (read once per container cgroup; ``decide/memory_mechanism.EnvHints`` interprets them).
HINT_VARIABLES = frozenset({ENV_DRIVER_MEMORY_LIMIT, ENV_MPS_MEMORY_LIMIT, ENV_PRELOAD_MEMORY_LIMIT, ENV_LD_PRELOAD})


@dataclass(frozen=True)
class DriverReading:
    """One poll's answers of the driver about the configured containers' cgroups."""

    # (container, device) -> the container's cgroup as NVML's namespace, where it has one of its own
    namespaces: Mapping[tuple[str, int], str] = field(default_factory=dict)
    # (container, device) -> what the driver said for that namespace
    limits: Mapping[tuple[str, int], DriverLimit] = field(default_factory=dict)
    # container -> its namespace (None: no usable one, or several cgroups under one name)
    cgroups: Mapping[str, str | None] = field(default_factory=dict)
    # container -> the ``HINT_VARIABLES`` of its environment (one of its processes')
    environ: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    failed: bool = False  # NVML did not answer (hung, closed): nothing to decide or report this poll
    # containers whose host cgroup path our cgroup namespace hides
    hidden: frozenset[str] = frozenset()
