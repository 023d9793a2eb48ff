"""The NVML library as pynvml loads it: error codes and their policy, raw record buffers, loading.

The parts of :class:`gpufence.enforcer.observe.nvml.NvmlClient` that are about the library rather than the
session: which codes mean "NVML as a whole stopped answering" (``FATAL``) or "this device is gone"
(``DEVICE_GONE``), the C record layouts decoded with :mod:`struct`, which symbols this driver has,
and the soname trick that makes pynvml use a given library file.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from gpufence.enforcer.facts import NvmlUnavailable

SONAME = "libnvidia-ml.so.1"

# -- NVML error codes -----------------------------------------------------------------------------

SUCCESS = pynvml.NVML_SUCCESS
INSUFFICIENT_SIZE = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
FUNCTION_NOT_FOUND = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
# The whole library stopped answering: no device can be sampled until a fresh init.
FATAL = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)
# The device is gone for this round (drop the handle, re-acquire later).
DEVICE_GONE = frozenset({GPU_IS_LOST, getattr(pynvml, "NVML_ERROR_GPU_NOT_FOUND", 28)})

ERROR_NAMES: dict[int, str] = {
    value: name.removeprefix("NVML_ERROR_")
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}


def error_name(code: int) -> str:
    """``"NOT_SUPPORTED"`` for ``NVML_ERROR_NOT_SUPPORTED``; ``"ERROR_<n>"`` for codes pynvml does not know."""
    return ERROR_NAMES.get(code, f"ERROR_{code}")


def base_name(function: str) -> str:
    """Metric-stable function names: ``nvmlDeviceGetComputeRunningProcesses_v3`` -> without ``_v3``."""
    return re.sub(r"_v\d+$", "", function)


class NvmlCallError(Exception):
    def __init__(self, function: str, code: int) -> None:
        super().__init__(function, code)
        self.function = function
        self.code = code


# -- raw buffers ----------------------------------------------------------------------------------

# Native layouts (ctypes/C alignment): nvmlProcessInfo_v2_t/_v3_t, nvmlProcessInfo_v1_t,
# nvmlProcessUtilizationSample_t.
# Only the fields the enforcer uses are decoded (pid, usedGpuMemory / pid, timeStamp, smUtil).
PROC_V2 = struct.Struct("@IQ8x")
PROC_V1 = struct.Struct("@IQ")
UTIL = struct.Struct("@IQI12x")
assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == PROC_V2.size
assert ctypes.sizeof(pynvml.c_nvmlProcessUtilizationSample_t) == UTIL.size


class Buffer:
    """A reusable C array of fixed-size records, grown on demand."""

    __slots__ = ("capacity", "raw", "record")

    def __init__(self, record: struct.Struct, capacity: int = 64) -> None:
        self.record = record
        self.capacity = 0
        self.raw: ctypes.Array[ctypes.c_char] = ctypes.create_string_buffer(0)
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        if capacity > self.capacity:
            self.capacity = capacity
            self.raw = ctypes.create_string_buffer(capacity * self.record.size)

    def records(self, count: int) -> Any:
        return self.record.iter_unpack(self.raw.raw[: count * self.record.size])


@dataclass(frozen=True)
class Functions:
    """The driver's symbols the per-poll path calls directly (None: this driver lacks it)."""

    proc_record: struct.Struct
    compute: Callable[..., int] | None
    graphics: Callable[..., int] | None
    mps: Callable[..., int] | None
    util: Callable[..., int] | None
    limits: Callable[..., int] | None
    set_limits: Callable[..., int] | None = None  # nvmlDeviceSetMemoryLimits_v1: the node guardian's


def resolve_functions() -> Functions:
    """The newest process-list symbols this driver has (v3, else v2 with the same layout, else v1)."""

    def first(*names: str) -> tuple[Callable[..., int] | None, str]:
        for name in names:
            try:
                return pynvml._nvmlGetFunctionPointer(name), name
            except pynvml.NVMLError:
                continue
        return None, names[0]

    compute, compute_name = first(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    )
    graphics, graphics_name = first(
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses",
    )
    # Both lists must use one record layout; v1 (no suffix) is nvmlProcessInfo_v1_t.
    v1 = not compute_name.endswith(("_v2", "_v3")) or not graphics_name.endswith(("_v2", "_v3"))
    if v1:
        compute, _ = first("nvmlDeviceGetComputeRunningProcesses")
        graphics, _ = first("nvmlDeviceGetGraphicsRunningProcesses")
    mps, mps_name = first(
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses",
    )
    if v1 != (not mps_name.endswith(("_v2", "_v3"))):
        # One record layout for all lists: take the MPS symbol of the same layout, if any.
        mps, _ = first("nvmlDeviceGetMPSComputeRunningProcesses") if v1 else (None, "")
    util, _ = first("nvmlDeviceGetProcessUtilization")
    # Drivers before R615 lack the per-cgroup memory limits: memory_limit() answers NO_CALL.
    limits, _ = first("nvmlDeviceGetMemoryLimits_v1")
    set_limits, _ = first("nvmlDeviceSetMemoryLimits_v1")
    return Functions(PROC_V1 if v1 else PROC_V2, compute, graphics, mps, util, limits, set_limits)


def preload(path: str | None) -> ctypes.CDLL | None:
    """Load ``path`` first: a later dlopen of the soname (pynvml's) then gets this file."""
    if path is None:
        return None
    if not os.path.exists(path):
        raise NvmlUnavailable(f"NVML library {path} does not exist")
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise NvmlUnavailable(f"cannot load the NVML library {path}: {exc}") from None


def check_same_library(preloaded: ctypes.CDLL | None, path: str | None) -> None:
    if preloaded is None:
        return
    loaded = pynvml.nvmlLib
    mine = ctypes.cast(preloaded.nvmlShutdown, ctypes.c_void_p).value
    theirs = ctypes.cast(loaded.nvmlShutdown, ctypes.c_void_p).value if loaded is not None else None
    if mine != theirs:
        raise NvmlUnavailable(
            f"pynvml already uses another {SONAME} in this process, so {path} cannot take "
            "effect: pynvml loads NVML once per process; use one library file per process"
        )


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def shutdown_quietly() -> None:
    with contextlib.suppress(pynvml.NVMLError):
        pynvml.nvmlShutdown()


def init_message(code: int, library_path: str | None) -> str:
    where = library_path or SONAME
    if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return (
            f"NVML library {SONAME} not found: no NVIDIA driver on this host, or it is not mounted into "
            "this container (the NVIDIA container toolkit mounts it when NVIDIA_DRIVER_CAPABILITIES "
            "includes 'utility'); for a simulated GPU use --simulate"
        )
    if code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return f"NVIDIA driver not loaded (nvmlInit via {where} returned NVML_ERROR_DRIVER_NOT_LOADED)"
    if code == pynvml.NVML_ERROR_NO_PERMISSION:
        return f"no permission to use NVML (nvmlInit via {where} returned NVML_ERROR_NO_PERMISSION)"
    if code == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return f"NVML library {where} does not match the loaded kernel driver (driver upgraded? reboot or reload it)"
    return f"nvmlInit via {where} failed: NVML_ERROR_{error_name(code)}"


def fatal_message(err: NvmlCallError) -> str:
    return f"NVML stopped answering: {err.function} returned NVML_ERROR_{error_name(err.code)}"
