"""What NVML tells the enforcer, as plain values: no driver, no pynvml needed to use them.

:mod:`gpufence.enforcer.observe.nvml` produces these (and re-exports them, so callers keep importing from
there); the policy, attribution and reporting code only reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

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
