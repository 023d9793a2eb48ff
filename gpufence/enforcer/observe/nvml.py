"""NVML behind one small wrapper: the enforcer's only view of the GPU driver.

Modelled on nvitop's ``libnvml.py``: the real ``pynvml`` loads the library and provides init,
handles and error types; this module decides which NVML errors are tolerable, turns them into
values plus :class:`NvmlErrorEvent` records, and keeps the per-poll path cheap.

Error policy of :meth:`NvmlClient.sample`:

* Per device or per process (``NOT_SUPPORTED``, ``NO_PERMISSION``, ``GPU_IS_LOST``, ``UNKNOWN``,
  a process that vanished between calls, ...): never raised. The value becomes ``None`` / empty and
  an :class:`NvmlErrorEvent` is reported in ``NvmlSample.errors``. ``GPU_IS_LOST`` (or a handle
  that cannot be re-acquired) marks the device ``lost`` for this round; its handle is dropped and
  re-acquired on a later round.
* ``NOT_FOUND`` from ``nvmlDeviceGetProcessUtilization`` means "no sample newer than the last one"
  (an idle GPU, or two polls within the driver's sampling period): ``sm_util_by_pid == {}``, no event.
* NVML as a whole not answering (``UNINITIALIZED``, ``DRIVER_NOT_LOADED``, ``LIBRARY_NOT_FOUND``,
  ``LIB_RM_VERSION_MISMATCH``): :class:`NvmlUnavailable`. Call ``close()`` and ``open()`` to retry.

Processes come from three lists: compute, graphics and MPS compute (MPS clients are listed only
there, so with CUDA MPS their memory would otherwise be invisible); a PID in several lists is one
process.

Cost: handles, UUIDs and total memory are cached after ``open()`` (re-queried after errors); a
sample makes four NVML calls per device (compute, graphics and MPS processes, utilisation)
into buffers reused between polls (grown on ``NVML_ERROR_INSUFFICIENT_SIZE``), decoded with
``struct.iter_unpack`` instead of pynvml's per-element ctypes objects.

The values it returns live in ``gpufence.enforcer.facts``, codes, layouts and loading in ``nvml_library``.
"""

from __future__ import annotations

import ctypes
import operator
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pynvml

from gpufence.enforcer.facts import (
    NVML_VALUE_NOT_AVAILABLE,
    DeviceSample,
    DriverLimit,
    DriverLimitState,
    GpuProcess,
    NvmlErrorEvent,
    NvmlSample,
    NvmlUnavailable,
)
from gpufence.enforcer.observe.nvml_library import (
    DEVICE_GONE,
    FATAL,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    INSUFFICIENT_SIZE,
    NOT_FOUND,
    NOT_SUPPORTED,
    PROC_V2,
    SUCCESS,
    UTIL,
    Buffer,
    Functions,
    NvmlCallError,
    base_name,
    check_same_library,
    error_name,
    fatal_message,
    init_message,
    preload,
    resolve_functions,
    shutdown_quietly,
    text,
)

__all__ = [
    "NVML_VALUE_NOT_AVAILABLE",
    "DeviceSample",
    "DriverLimit",
    "DriverLimitState",
    "GpuProcess",
    "NvmlClient",
    "NvmlErrorEvent",
    "NvmlSample",
    "NvmlUnavailable",
]


@dataclass
class _Device:
    index: int
    handle: Any = None  # pynvml c_nvmlDevice_t; None until acquired or after the device was lost
    uuid: str = ""
    total_memory_bytes: int | None = None
    total_settled: bool = False  # total known, or NOT_SUPPORTED (do not ask every round)
    mig: bool = False
    last_seen_us: int = 0  # lastSeenTimeStamp for nvmlDeviceGetProcessUtilization
    compute: Buffer = field(default_factory=lambda: Buffer(PROC_V2))
    graphics: Buffer = field(default_factory=lambda: Buffer(PROC_V2))
    mps: Buffer = field(default_factory=lambda: Buffer(PROC_V2))
    util: Buffer = field(default_factory=lambda: Buffer(UTIL))
    sm_util: Mapping[int, int] = field(default_factory=dict)  # the last fresh reading, pid -> SM%
    records: dict[int, GpuProcess] = field(default_factory=dict)  # last round's, by pid


_EMPTY: Mapping[int, int] = MappingProxyType({})
_by_timestamp = operator.itemgetter(1)


class NvmlClient:
    """One NVML session: ``open()``, ``sample()`` per poll, ``close()``. Thread-safe.

    ``library_path`` names a specific ``libnvidia-ml.so.1`` (``--simulate`` and in-process tests use
    the simulated one). pynvml always loads the library with ``dlopen("libnvidia-ml.so.1")``, by
    soname; there is no parameter for a path. The trick: ``open()`` first loads the given file with
    ``ctypes.CDLL(path, mode=RTLD_GLOBAL)``. The file's DT_SONAME is ``libnvidia-ml.so.1``, and the
    dynamic loader answers a later ``dlopen`` of a bare name with an already-loaded object whose
    soname matches, so pynvml gets the same library without ``LD_LIBRARY_PATH``. This only works if
    nothing in the process loaded another ``libnvidia-ml.so.1`` first (pynvml keeps its library for
    the life of the process); ``open()`` checks that and raises :class:`NvmlUnavailable` otherwise.
    In one process, every client must therefore use the same library file (tests: one build per
    session, e.g. ``simnvml.build_library()`` with the default cache directory).
    """

    def __init__(self, library_path: str | os.PathLike[str] | None = None) -> None:
        self._library_path = os.fspath(library_path) if library_path is not None else None
        self._lock = threading.Lock()
        self._open = False
        self._driver_version: str | None = None
        self._devices: list[_Device] = []
        self._pending: list[NvmlErrorEvent] = []
        self._fn_compute: Callable[..., int] | None = None
        self._fn_graphics: Callable[..., int] | None = None
        self._fn_mps: Callable[..., int] | None = None
        self._fn_util: Callable[..., int] | None = None
        self._fn_limits: Callable[..., int] | None = None
        self._fn_set_limits: Callable[..., int] | None = None
        self._proc_record = PROC_V2
        self._proc_names = (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
            "nvmlDeviceGetMPSComputeRunningProcesses",
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def open(self) -> None:
        """Loads and initialises NVML and caches the devices; raises NvmlUnavailable with the reason."""
        with self._lock:
            if self._open:
                return
            preloaded = preload(self._library_path)
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                raise NvmlUnavailable(init_message(exc.value, self._library_path)) from None
            try:
                check_same_library(preloaded, self._library_path)
                self._set_functions(resolve_functions())
                try:
                    self._driver_version = text(pynvml.nvmlSystemGetDriverVersion())
                except pynvml.NVMLError:
                    self._driver_version = None
                try:
                    count = pynvml.nvmlDeviceGetCount()
                except pynvml.NVMLError as exc:
                    raise NvmlUnavailable(f"NVML answered nvmlInit but not nvmlDeviceGetCount: {exc}") from None
                self._devices = [_Device(index) for index in range(count)]
                self._pending = []
                for device in self._devices:
                    try:
                        self._acquire(device, self._pending)
                    except NvmlCallError as err:
                        if err.code in FATAL:
                            raise NvmlUnavailable(fatal_message(err)) from None
                        event = NvmlErrorEvent(base_name(err.function), error_name(err.code), device.index)
                        self._pending.append(event)
            except BaseException:
                shutdown_quietly()
                raise
            self._open = True

    def close(self) -> None:
        """Ends the NVML session (the library stays loaded: pynvml never unloads it)."""
        with self._lock:
            if not self._open:
                return
            self._open = False
            self._devices = []
            self._pending = []
            shutdown_quietly()

    def __enter__(self) -> NvmlClient:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def driver_version(self) -> str | None:
        return self._driver_version

    # -- polling ---------------------------------------------------------------------------------

    def sample(self, utilisation: bool = True) -> NvmlSample:
        """Every device's processes, memory and SM utilisation now; tolerated errors as events.

        ``utilisation=False`` reuses each device's last reading instead of asking the driver: the
        call costs about as much as the rest of a poll on a real GPU. A device that lists no
        process is never asked (no sample could be attributed)."""
        with self._lock:
            if not self._open:
                raise NvmlUnavailable("NVML is not open: call NvmlClient.open() first")
            errors = self._pending
            self._pending = []
            samples = []
            try:
                for device in self._devices:
                    samples.append(self._sample_device(device, errors, utilisation))
            except NvmlCallError as err:  # only fatal codes get here
                raise NvmlUnavailable(fatal_message(err)) from None
            return NvmlSample(devices=tuple(samples), errors=tuple(errors))

    def _sample_device(self, device: _Device, errors: list[NvmlErrorEvent], utilisation: bool) -> DeviceSample:
        index = device.index
        listed: list[tuple[int, int | None]] = []
        try:
            if device.handle is None:
                self._acquire(device, errors)
            elif not device.total_settled:
                self._query_total(device, errors)
            lists = [
                (device.compute, self._fn_compute, self._proc_names[0]),
                (device.graphics, self._fn_graphics, self._proc_names[1]),
            ]
            # MPS clients are in this list; some drivers list them in the compute list too (580 on an
            # H200 did, with the same memory: merged below), others only here, next to the server.
            # Drivers without the call have no MPS clients to report: not an error.
            if self._fn_mps is not None:
                lists.append((device.mps, self._fn_mps, self._proc_names[2]))
            for buf, fn, name in lists:
                try:
                    listed += self._processes(device, buf, fn, name)
                except NvmlCallError as err:
                    if err.code in FATAL or err.code in DEVICE_GONE:
                        raise
                    errors.append(NvmlErrorEvent(base_name(err.function), error_name(err.code), index))
        except NvmlCallError as err:
            if err.code in FATAL:
                raise
            # The device is gone (or its handle could not be acquired): skip it this round.
            errors.append(NvmlErrorEvent(base_name(err.function), error_name(err.code), index))
            device.handle = None  # re-acquire (and re-read the uuid) next round
            return DeviceSample(index, device.uuid, device.total_memory_bytes, (), _EMPTY, lost=True)

        uuid = device.uuid
        used_by_pid: dict[int, int | None] = {}
        for pid, used in listed:
            if pid in used_by_pid:
                # One process in both lists has one allocation: keep the larger known value.
                previous = used_by_pid[pid]
                if previous is not None and (used is None or used <= previous):
                    continue
            used_by_pid[pid] = used
        # Reuse last round's (immutable) records where nothing changed: most processes, most polls.
        previous_records = device.records
        records: dict[int, GpuProcess] = {}
        for pid, used in used_by_pid.items():
            record = previous_records.get(pid)
            if record is None or record.used_memory_bytes != used or record.device_uuid != uuid:
                record = GpuProcess(pid, index, uuid, used)
            records[pid] = record
        device.records = records
        processes = tuple(records.values())
        if not processes:
            device.sm_util = _EMPTY
        elif utilisation:
            device.sm_util = self._util(device, errors)
        return DeviceSample(index, uuid, device.total_memory_bytes, processes, device.sm_util, mig=device.mig)

    # -- driver memory limits (NVML R615) ---------------------------------------------------------

    @property
    def has_memory_limits(self) -> bool:
        """Whether this driver has ``nvmlDeviceGetMemoryLimits_v1`` (R615 and later); known after open()."""
        return self._fn_limits is not None

    def memory_limit(self, device_index: int, namespace: str) -> DriverLimit:
        """The driver's per-cgroup memory limit and current use for ``namespace`` (a cgroup path
        under /sys/fs/cgroup, as the container toolkit's hook names it) on one device. Never raises
        for per-call errors: an old driver is ``NO_CALL``, a cgroup without a limit ``NOT_SET``."""
        with self._lock:
            if not self._open:
                raise NvmlUnavailable("NVML is not open: call NvmlClient.open() first")
            fn = self._fn_limits
            if fn is None:
                return DriverLimit(DriverLimitState.NO_CALL, error=error_name(FUNCTION_NOT_FOUND))
            device = self._devices[device_index] if 0 <= device_index < len(self._devices) else None
            if device is None or device.handle is None:
                return DriverLimit(DriverLimitState.ERROR, error=error_name(GPU_IS_LOST))
            request = pynvml.c_nvmlGetMemoryLimits_v1_t()
            request.nameSpace = namespace.encode()
            ret = fn(device.handle, ctypes.byref(request))
            if ret == SUCCESS:
                hard = int(request.hardLimit)
                state = DriverLimitState.UNLIMITED if hard == NVML_VALUE_NOT_AVAILABLE else DriverLimitState.SET
                return DriverLimit(state, int(request.softLimit), hard, int(request.currentUsed))
            if ret == FUNCTION_NOT_FOUND:
                return DriverLimit(DriverLimitState.NO_CALL, error=error_name(ret))
            if ret == NOT_SUPPORTED:
                return DriverLimit(DriverLimitState.NOT_SET, error=error_name(ret))
            return DriverLimit(DriverLimitState.ERROR, error=error_name(ret))

    def set_memory_limit(self, device_index: int, namespace: str, soft_bytes: int, hard_bytes: int) -> str | None:
        """``nvmlDeviceSetMemoryLimits_v1`` on ``namespace`` (a cgroup path under /sys/fs/cgroup) on one
        device: None when the driver took it, else the NVML error's name (``FUNCTION_NOT_FOUND`` on a
        driver before R615). Only the node guardian sets limits; the sidecar only reads them."""
        with self._lock:
            if not self._open:
                raise NvmlUnavailable("NVML is not open: call NvmlClient.open() first")
            fn = self._fn_set_limits
            if fn is None:
                return error_name(FUNCTION_NOT_FOUND)
            device = self._devices[device_index] if 0 <= device_index < len(self._devices) else None
            if device is None or device.handle is None:
                return error_name(GPU_IS_LOST)
            request = pynvml.c_nvmlSetMemoryLimits_v1_t()
            request.nameSpace = namespace.encode()
            request.softLimit = soft_bytes
            request.hardLimit = hard_bytes
            ret = fn(device.handle, ctypes.byref(request))
            return None if ret == SUCCESS else error_name(ret)

    # -- NVML calls ------------------------------------------------------------------------------

    def _acquire(self, device: _Device, errors: list[NvmlErrorEvent]) -> None:
        """Handle, UUID and total memory of a device (at open, and after it was lost)."""
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
        except pynvml.NVMLError as exc:
            raise NvmlCallError("nvmlDeviceGetHandleByIndex", exc.value) from None
        try:
            uuid = text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError as exc:
            raise NvmlCallError("nvmlDeviceGetUUID", exc.value) from None
        if uuid != device.uuid:
            device.last_seen_us = 0
        device.handle, device.uuid = handle, uuid
        device.total_settled = False
        self._query_total(device, errors)
        try:
            device.mig = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        except pynvml.NVMLError:
            device.mig = False  # NOT_SUPPORTED / FUNCTION_NOT_FOUND: a GPU without MIG

    def _query_total(self, device: _Device, errors: list[NvmlErrorEvent]) -> None:
        try:
            device.total_memory_bytes = int(pynvml.nvmlDeviceGetMemoryInfo(device.handle).total)
            device.total_settled = True
        except pynvml.NVMLError as exc:
            if exc.value in FATAL or exc.value in DEVICE_GONE:
                raise NvmlCallError("nvmlDeviceGetMemoryInfo", exc.value) from None
            # Tolerated: total unknown. NOT_SUPPORTED will not change; other errors are retried.
            device.total_settled = exc.value == NOT_SUPPORTED
            errors.append(NvmlErrorEvent("nvmlDeviceGetMemoryInfo", error_name(exc.value), device.index))

    def _processes(
        self, device: _Device, buf: Buffer, fn: Callable[..., int] | None, name: str
    ) -> list[tuple[int, int | None]]:
        """(pid, used bytes or None) from one running-processes list; raises NvmlCallError."""
        if fn is None:
            raise NvmlCallError(name, FUNCTION_NOT_FOUND)
        if buf.record is not self._proc_record:
            buf.record = self._proc_record
            buf.capacity = 0
            buf.grow(64)
        count = ctypes.c_uint(buf.capacity)
        ret = fn(device.handle, ctypes.byref(count), buf.raw)
        for _ in range(4):  # the list may grow between the calls
            if ret != INSUFFICIENT_SIZE:
                break
            buf.grow(count.value * 2 + 8)
            count.value = buf.capacity
            ret = fn(device.handle, ctypes.byref(count), buf.raw)
        if ret != SUCCESS:
            raise NvmlCallError(name, ret)
        return [
            (record[0], None if record[1] == NVML_VALUE_NOT_AVAILABLE else record[1])
            for record in buf.records(count.value)
        ]

    def _util(self, device: _Device, errors: list[NvmlErrorEvent]) -> Mapping[int, int]:
        """SM% per pid since the previous call (on a real driver one record per process, its mean
        over the driver's samples since then; the newest where a driver gives several); {} (with
        an event unless NOT_FOUND) otherwise."""
        fn = self._fn_util
        if fn is None:
            return _EMPTY
        buf = device.util
        count = ctypes.c_uint(buf.capacity)
        last_seen = ctypes.c_ulonglong(device.last_seen_us)
        ret = fn(device.handle, buf.raw, ctypes.byref(count), last_seen)
        for _ in range(4):
            if ret != INSUFFICIENT_SIZE:
                break
            buf.grow(count.value * 2 + 8)
            count.value = buf.capacity
            ret = fn(device.handle, buf.raw, ctypes.byref(count), last_seen)
        if ret == NOT_FOUND:
            return _EMPTY
        if ret != SUCCESS:
            if ret in FATAL:
                raise NvmlCallError("nvmlDeviceGetProcessUtilization", ret)
            errors.append(NvmlErrorEvent("nvmlDeviceGetProcessUtilization", error_name(ret), device.index))
            return _EMPTY
        last = device.last_seen_us
        fresh = sorted((r for r in buf.records(count.value) if r[1] > last and r[0]), key=_by_timestamp)
        if not fresh:
            return _EMPTY
        device.last_seen_us = fresh[-1][1]
        # Oldest first, so each pid ends up with its newest sample.
        return {pid: sm_util for pid, _ts, sm_util in fresh}

    def _set_functions(self, functions: Functions) -> None:
        self._proc_record = functions.proc_record
        self._fn_compute, self._fn_graphics, self._fn_mps = functions.compute, functions.graphics, functions.mps
        self._fn_util, self._fn_limits = functions.util, functions.limits
        self._fn_set_limits = functions.set_limits
