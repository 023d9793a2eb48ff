"""The simulated driver's state: what devices exist and which processes use them.

``write_state`` is the only writer of the state file the fake ``libnvidia-ml.so.1`` reads (named
by ``$GPUFENCE_SIM_STATE``). The file format is private to this module and ``fake_nvml.c``::

    gpufence-simnvml 1
    driver namespace_aware|legacy
    host_pidns <inode>
    util_lag_ms <ms>                                    (optional: utilisation follows the run state with a lag)
    init_error <code>                                   (optional)
    fail <function>[@<device index>] <code>             (zero or more)
    hang <function>[@<device index>]                    (zero or more: the call blocks until dropped)
    device <total> <lost 0|1> <meminfo_not_supported 0|1> <uuid> <name...>
    mig                                                 (optional: MIG mode on the device above)
    proc <compute|graphics|mps> <host pid> <used|-> <sm%> <ns inode|-> <ns pid|-> [<cgroup>]   (for the device above)
    end

``<cgroup>``: the process's cgroup namespace for NVML's memory limits (``/sys/fs/cgroup/<path>``);
without it the driver reads ``/proc/<pid>/cgroup`` (see ``gpufence.simnvml.limits``).

Failure keys: a function name (``nvmlDeviceGetProcessUtilization``; a name without the ``_vN``
suffix also matches the versioned symbols), optionally ``@<index>`` to fail one device only, or
``*`` to fail every call after init (NVML as a whole stops answering).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

ENV_STATE = "GPUFENCE_SIM_STATE"

# NVML return codes by name (nvml.h; the same values as pynvml's NVML_ERROR_* constants).
ERROR_CODES: Mapping[str, int] = MappingProxyType(
    {
        "UNINITIALIZED": 1,
        "INVALID_ARGUMENT": 2,
        "NOT_SUPPORTED": 3,
        "NO_PERMISSION": 4,
        "ALREADY_INITIALIZED": 5,
        "NOT_FOUND": 6,
        "INSUFFICIENT_SIZE": 7,
        "INSUFFICIENT_POWER": 8,
        "DRIVER_NOT_LOADED": 9,
        "TIMEOUT": 10,
        "IRQ_ISSUE": 11,
        "LIBRARY_NOT_FOUND": 12,
        "FUNCTION_NOT_FOUND": 13,
        "CORRUPTED_INFOROM": 14,
        "GPU_IS_LOST": 15,
        "RESET_REQUIRED": 16,
        "OPERATING_SYSTEM": 17,
        "LIB_RM_VERSION_MISMATCH": 18,
        "IN_USE": 19,
        "MEMORY": 20,
        "NO_DATA": 21,
        "VGPU_ECC_NOT_SUPPORTED": 22,
        "INSUFFICIENT_RESOURCES": 23,
        "FREQ_NOT_SUPPORTED": 24,
        "ARGUMENT_VERSION_MISMATCH": 25,
        "DEPRECATED": 26,
        "NOT_READY": 27,
        "GPU_NOT_FOUND": 28,
        "INVALID_STATE": 29,
        "RESET_TYPE_NOT_SUPPORTED": 30,
        "UNKNOWN": 999,
    }
)

DRIVER_MODES = ("namespace_aware", "legacy")
PROCESS_KINDS = ("compute", "graphics", "mps")  # mps: an MPS client, listed by the MPS call only
_MAGIC = "gpufence-simnvml 1"
_FAILURE_KEY = re.compile(r"^(\*|nvml[A-Za-z0-9_]+)(@\d+)?$")
_MAX_DEVICES = 256
_UINT32_MAX = 0xFFFFFFFF
_UINT64_MAX = 0xFFFFFFFFFFFFFFFF
_CGROUP_PATH_MAX = 1024  # fake_nvml.c's CGROUP_PATH_MAX


def error_code(name: str) -> int:
    """The NVML return code for an error name (``"NOT_SUPPORTED"`` or ``"NVML_ERROR_NOT_SUPPORTED"``)."""
    key = name.upper().removeprefix("NVML_ERROR_")
    try:
        return ERROR_CODES[key]
    except KeyError:
        raise ValueError(f"unknown NVML error name {name!r}; expected one of {', '.join(ERROR_CODES)}") from None


def pid_namespace_inode(pid: int | str = "self") -> int:
    """The inode of the (innermost) PID namespace of a process, from ``/proc/<pid>/ns/pid``."""
    link = os.readlink(f"/proc/{pid}/ns/pid")  # "pid:[4026531836]"
    match = re.fullmatch(r"pid:\[(\d+)\]", link)
    if not match:
        raise ValueError(f"unexpected /proc/{pid}/ns/pid link {link!r}")
    return int(match.group(1))


def _innermost_pid(pid: int) -> int:
    """The PID of a process inside its innermost PID namespace (last field of NSpid)."""
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
        for line in status:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid  # kernels before 4.1 have no NSpid: no nested namespaces to speak of


@dataclass(frozen=True)
class SimProcess:
    pid: int  # host PID (as seen by the writer)
    used_memory_bytes: int | None  # None -> NVML_VALUE_NOT_AVAILABLE
    sm_util: int = 0  # percent, reported by nvmlDeviceGetProcessUtilization
    kind: str = "compute"  # or "graphics", or "mps" (an MPS client: nvmlDeviceGetMPSComputeRunningProcesses)
    ns_inode: int | None = None  # innermost pid namespace inode (None: host namespace)
    ns_pid: int | None = None  # pid inside that namespace
    # Its cgroup as NVML's memory limits name it ("/sys/fs/cgroup/<path>"); None: the driver reads
    # /proc/<pid>/cgroup (limits.cgroup_namespace). Lets a test place processes in cgroups without
    # cgroup v2.
    cgroup: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.pid, bool) or not isinstance(self.pid, int) or not (0 < self.pid <= _UINT32_MAX):
            raise ValueError(f"pid must be a positive 32-bit integer, got {self.pid!r}")
        used = self.used_memory_bytes
        if used is not None and (isinstance(used, bool) or not isinstance(used, int) or not (0 <= used < _UINT64_MAX)):
            raise ValueError(f"used_memory_bytes must be None or an integer in [0, 2**64-1), got {used!r}")
        if isinstance(self.sm_util, bool) or not isinstance(self.sm_util, int) or not (0 <= self.sm_util <= 100):
            raise ValueError(f"sm_util must be an integer percentage in [0, 100], got {self.sm_util!r}")
        if self.kind not in PROCESS_KINDS:
            raise ValueError(f"kind must be one of {PROCESS_KINDS}, got {self.kind!r}")
        if (self.ns_inode is None) != (self.ns_pid is None):
            raise ValueError("ns_inode and ns_pid must be given together")
        if self.ns_pid is not None and not (0 < self.ns_pid <= _UINT32_MAX):
            raise ValueError(f"ns_pid must be a positive 32-bit integer, got {self.ns_pid!r}")
        if self.ns_inode is not None and not (0 < self.ns_inode < _UINT64_MAX):
            raise ValueError(f"ns_inode must be a positive integer, got {self.ns_inode!r}")
        cg = self.cgroup
        if cg is not None and (
            not isinstance(cg, str)
            or not cg.startswith("/")
            or not cg.isascii()
            or any(c.isspace() for c in cg)
            or len(cg) >= _CGROUP_PATH_MAX
        ):
            raise ValueError(
                f"cgroup must be None or an absolute ASCII path without whitespace shorter than {_CGROUP_PATH_MAX}"
                f" bytes, e.g. '/sys/fs/cgroup/kubepods/pod1/c1'; got {cg!r}"
            )

    @classmethod
    def for_pid(
        cls, pid: int, used_memory_bytes: int | None, sm_util: int = 0, kind: str = "compute", cgroup: str | None = None
    ) -> SimProcess:
        """Fills ns_inode/ns_pid from /proc/<pid>/ns/pid and the last field of NSpid in /proc/<pid>/status."""
        try:
            ns_inode = pid_namespace_inode(pid)
            ns_pid = _innermost_pid(pid)
        except FileNotFoundError:
            raise ProcessLookupError(f"no process with pid {pid} (no /proc/{pid})") from None
        return cls(pid, used_memory_bytes, sm_util=sm_util, kind=kind, ns_inode=ns_inode, ns_pid=ns_pid, cgroup=cgroup)


@dataclass(frozen=True)
class SimDevice:
    uuid: str
    total_memory_bytes: int
    processes: tuple[SimProcess, ...] = ()
    name: str = "NVIDIA H200 (simulated)"
    lost: bool = False
    memory_info_not_supported: bool = False
    mig: bool = False  # MIG mode enabled (nvmlDeviceGetMigMode)

    def __post_init__(self) -> None:
        object.__setattr__(self, "processes", tuple(self.processes))
        if not self.uuid or len(self.uuid) >= 96 or any(c.isspace() for c in self.uuid) or not self.uuid.isascii():
            raise ValueError(f"uuid must be 1-95 ASCII characters without whitespace, got {self.uuid!r}")
        if len(self.name.encode()) >= 96 or "\n" in self.name or "\r" in self.name:
            raise ValueError(f"name must be one line shorter than 96 bytes, got {self.name!r}")
        total = self.total_memory_bytes
        if isinstance(total, bool) or not isinstance(total, int) or not (0 <= total < _UINT64_MAX):
            raise ValueError(f"total_memory_bytes must be a non-negative integer, got {total!r}")
        for proc in self.processes:
            if not isinstance(proc, SimProcess):
                raise TypeError(f"processes must be SimProcess instances, got {proc!r}")


@dataclass(frozen=True)
class SimState:
    devices: tuple[SimDevice, ...]
    driver: str = "namespace_aware"  # or "legacy"
    init_error: str | None = None  # NVML error name, e.g. "DRIVER_NOT_LOADED"
    failures: Mapping[str, str] = field(default_factory=dict)  # function name -> NVML error name
    host_pidns_inode: int | None = None  # None -> the writer's own /proc/self/ns/pid inode
    # Failure keys (as in ``failures``) whose calls block, as on a GPU that fell off the bus, until
    # a state without them is written.
    hangs: tuple[str, ...] = ()
    # When set, a process's reported SM use is its sm_util times an exponential average (this time
    # constant, ms) of whether it is running (neither stopped by a signal nor held by the cgroup
    # freezer), sampled by the driver every 10 ms: a stopped process's queued kernels keep the GPU
    # busy for a while, and a continued one takes a while to fill it again. None: sm_util as written.
    util_lag_ms: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "failures", MappingProxyType(dict(self.failures)))
        object.__setattr__(self, "hangs", tuple(self.hangs))
        lag = self.util_lag_ms
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or not 0 < lag < 3_600_000):
            raise ValueError(f"util_lag_ms must be None or a positive number of milliseconds, got {lag!r}")
        for key in self.hangs:
            if not isinstance(key, str) or not _FAILURE_KEY.match(key) or len(key.split("@")[0]) >= 128:
                raise ValueError(f"hang key must be an NVML function name, optionally '@<device index>'; got {key!r}")
        if len(self.devices) > _MAX_DEVICES:
            raise ValueError(f"at most {_MAX_DEVICES} simulated devices, got {len(self.devices)}")
        for dev in self.devices:
            if not isinstance(dev, SimDevice):
                raise TypeError(f"devices must be SimDevice instances, got {dev!r}")
        if self.driver not in DRIVER_MODES:
            raise ValueError(f"driver must be one of {DRIVER_MODES}, got {self.driver!r}")
        if self.init_error is not None:
            error_code(self.init_error)
        for key, name in self.failures.items():
            if not isinstance(key, str) or not _FAILURE_KEY.match(key) or len(key.split("@")[0]) >= 128:
                raise ValueError(
                    f"failure key must be an NVML function name, optionally '@<device index>', or '*'; got {key!r}"
                )
            error_code(name)


_write_lock = threading.Lock()
_last_mtime_ns = 0


def _next_mtime_ns() -> int:
    """Strictly increasing modification times, so the reader sees every write as a change.

    File timestamps are only as fine as the kernel's coarse clock and a freed inode can be reused by
    the next temp file; with an explicit, always-increasing mtime two quick writes of the same size
    are still told apart.
    """
    global _last_mtime_ns
    with _write_lock:
        _last_mtime_ns = max(time.time_ns(), _last_mtime_ns + 1_000)
        return _last_mtime_ns


def render_state(state: SimState) -> str:
    """The state file's text (private format; see the module docstring)."""
    host = state.host_pidns_inode
    if host is None:
        try:
            host = pid_namespace_inode("self")
        except OSError:
            host = 0
    lines = [_MAGIC, f"driver {state.driver}", f"host_pidns {host}"]
    if state.init_error is not None:
        lines.append(f"init_error {error_code(state.init_error)}")
    lines.extend(f"fail {key} {error_code(name)}" for key, name in state.failures.items())
    lines.extend(f"hang {key}" for key in state.hangs)
    if state.util_lag_ms is not None:
        lines.append(f"util_lag_ms {state.util_lag_ms}")
    for dev in state.devices:
        flags = f"{int(dev.lost)} {int(dev.memory_info_not_supported)}"
        lines.append(f"device {dev.total_memory_bytes} {flags} {dev.uuid} {dev.name}")
        if dev.mig:
            lines.append("mig")
        for proc in dev.processes:
            used = "-" if proc.used_memory_bytes is None else str(proc.used_memory_bytes)
            ns_inode = "-" if proc.ns_inode is None else str(proc.ns_inode)
            ns_pid = "-" if proc.ns_pid is None else str(proc.ns_pid)
            cgroup = "" if proc.cgroup is None else f" {proc.cgroup}"
            lines.append(f"proc {proc.kind} {proc.pid} {used} {proc.sm_util} {ns_inode} {ns_pid}{cgroup}")
    lines.append("end")
    return "\n".join(lines) + "\n"


def write_state(path: str | os.PathLike[str], state: SimState) -> None:
    """Atomically replaces the state file at ``path`` (temp file in the same directory + os.replace),
    with an mtime the library has not seen before (it re-reads the file when its stamp changes)."""
    replace_file(path, render_state(state), fresh_mtime=True)


def replace_file(path: str | os.PathLike[str], text: str, *, fresh_mtime: bool = False) -> None:
    """Writes ``text`` to ``path`` atomically: a temp file in the same directory, then os.replace, so
    a reader sees the old file or the new one, never half of one. The simulated driver's files."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        if fresh_mtime:
            mtime = _next_mtime_ns()
            os.utime(tmp, ns=(mtime, mtime))
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
