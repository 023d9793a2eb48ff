"""Facts about a process, read from a proc root.

Every reader here tolerates the process vanishing mid-read (it can exit, or its PID can be reused,
at any instant): the answer is then None, never an exception. Reads use ``os.open``/``os.read``
rather than ``open()`` because they sit on the enforcer's per-tick path and the buffered-file
machinery costs more than the read itself.

Identity of a process is ``(pid, start_time_ticks)``: field 22 of ``/proc/<pid>/stat`` is the
start time in clock ticks since boot, which a reused PID cannot repeat (the kernel would have to
start two processes in the same tick with the same PID). ``read_facts`` reads the start time
before and after the other files, so a ``ProcFacts`` never mixes two processes' files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpufence.contract import ENV_CONTAINER

NVIDIA_DEVICE_PREFIX_DEFAULT = "/dev/nvidia"
# Tests and the local demo have no GPU: the workloads open a temp file named like
# <tmp>/dev/nvidia0 and the enforcer is told that prefix through this variable.
ENV_NVIDIA_DEVICE_PREFIX = "GPUFENCE_NVIDIA_DEVICE_PREFIX"

_CONTAINER_KEY = ENV_CONTAINER.encode() + b"="
# /proc/<pid>/stat and status fit in one page; environ and cgroup are read to EOF.
_SMALL_READ = 4096


@dataclass(frozen=True)
class ProcFacts:
    pid: int
    start_time_ticks: int  # field 22 of /proc/<pid>/stat: identity of the process for PID-reuse checks
    container: str | None  # GPUFENCE_CONTAINER from /proc/<pid>/environ; None if absent/unreadable
    cgroup: str | None  # /proc/<pid>/cgroup content (cross-check)
    holds_nvidia_device: bool  # some /proc/<pid>/fd/* links to a path starting with the device prefix
    # False: /proc/<pid>/fd could not be listed (EACCES: no ptrace access, e.g. the sidecar has fewer
    # capabilities than the workload): whether it holds the device is unknown, not "no".
    inspectable: bool = True


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat the enforcer needs, from one read."""

    state: str  # field 3: R, S, D, T (stopped), t, Z (zombie), X (dead), ...
    ppid: int
    start_time_ticks: int

    @property
    def is_dead(self) -> bool:
        """A zombie or dead process: nothing to signal, nothing to attribute."""
        return self.state in ("Z", "X")


def default_device_prefix() -> str:
    """The device prefix: ``GPUFENCE_NVIDIA_DEVICE_PREFIX`` if set and non-empty, else ``/dev/nvidia``."""
    return os.environ.get(ENV_NVIDIA_DEVICE_PREFIX) or NVIDIA_DEVICE_PREFIX_DEFAULT


def read_stat(pid: int | str, proc_root: str = "/proc") -> ProcStat | None:
    """State, parent PID and start time, or None if the process is gone or the file is malformed."""
    data = _read_small(f"{proc_root}/{pid}/stat")
    if data is None:
        return None
    # Field 2 (comm) is parenthesised and may itself contain spaces and ')': split after the
    # LAST ')'. What follows starts at field 3, so field N is at index N - 3.
    fields = data.rpartition(b")")[2].split()
    try:
        return ProcStat(state=fields[0].decode("ascii"), ppid=int(fields[1]), start_time_ticks=int(fields[19]))
    except (IndexError, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def read_start_time(pid: int, proc_root: str = "/proc") -> int | None:
    stat = read_stat(pid, proc_root) if pid > 0 else None
    return stat.start_time_ticks if stat is not None else None


def read_nspid(pid: int, proc_root: str) -> tuple[int, ...] | None:
    """The NSpid line of /proc/<pid>/status, outermost namespace first (None before Linux 4.1)."""
    data = _read_small(f"{proc_root}/{pid}/status", size=16384)
    if data is None:
        return None
    for line in data.splitlines():
        if line.startswith(b"NSpid:"):
            try:
                pids = tuple(int(part) for part in line[len(b"NSpid:") :].split())
            except ValueError:
                return None
            return pids or None
    return None


def pidns_inode(pid: int | str, proc_root: str) -> int | None:
    """Inode of the PID namespace of a process (``"self"`` allowed); None if gone or not permitted."""
    try:
        return os.stat(f"{proc_root}/{pid}/ns/pid").st_ino
    except OSError:
        return None


def holds_device(pid: int, proc_root: str, device_prefix: str) -> bool:
    """Whether some open descriptor of the process links to a path starting with ``device_prefix``.

    Unreadable (gone, or no ptrace permission) reads as False: a process we cannot inspect is
    not accepted as ours.
    """
    return fd_scan(pid, proc_root, device_prefix)[0]


def fd_scan(pid: int, proc_root: str, device_prefix: str) -> tuple[bool, bool]:
    """(holds the device, descriptors readable): (False, False) when /proc/<pid>/fd is denied (the
    directory itself, or, as for another process of the same uid with more capabilities, its links)."""
    fd_dir = f"{proc_root}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except PermissionError:
        return False, False
    except OSError:
        return False, True  # gone: nothing to inspect, and nothing denied
    denied = False
    for name in names:
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except PermissionError:
            # The directory of a same-uid process lists, but each link needs ptrace access.
            denied = True
            continue
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith(device_prefix):
            return True, True
    return False, not denied


def read_facts(pid: int, proc_root: str = "/proc", device_prefix: str | None = None) -> ProcFacts | None:
    """All facts about one process, or None if it vanished (or its PID was reused) during the read.

    ``device_prefix`` None means ``default_device_prefix()`` (the environment, read now).
    """
    if pid <= 0:
        return None
    prefix = device_prefix if device_prefix is not None else default_device_prefix()
    start = read_start_time(pid, proc_root)
    if start is None:
        return None
    base = f"{proc_root}/{pid}"
    container = _container_from_environ(_read_all(f"{base}/environ"))
    cgroup_bytes = _read_all(f"{base}/cgroup")
    holds, inspectable = fd_scan(pid, proc_root, prefix)
    # Re-read the identity: if the process exited (or the PID now names another process) while
    # we read, the files above may describe a different process or none.
    if read_start_time(pid, proc_root) != start:
        return None
    return ProcFacts(
        pid=pid,
        start_time_ticks=start,
        container=container,
        cgroup=cgroup_bytes.decode("utf-8", "replace").strip() if cgroup_bytes is not None else None,
        holds_nvidia_device=holds,
        inspectable=inspectable,
    )


def read_claim(pid: int, proc_root: str = "/proc") -> str | None:
    """GPUFENCE_CONTAINER from /proc/<pid>/environ; None if absent or unreadable."""
    return _container_from_environ(_read_all(f"{proc_root}/{pid}/environ"))


def read_environ(pid: int, names: frozenset[str], proc_root: str = "/proc") -> dict[str, str]:
    """The first value of each of ``names`` in /proc/<pid>/environ (as getenv() would see it);
    absent, unreadable or non-UTF-8 values are left out. Needs the same ptrace access as the claim."""
    environ = _read_all(f"{proc_root}/{pid}/environ")
    found: dict[str, str] = {}
    for entry in (environ or b"").split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if not sep:
            continue
        try:
            name = key.decode("utf-8")
            if name in names and name not in found:
                found[name] = value.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return found


def _container_from_environ(environ: bytes | None) -> str | None:
    """GPUFENCE_CONTAINER's value, the first occurrence as getenv() would see it.

    An empty, non-UTF-8 or missing value is None: such a process cannot be attributed.
    """
    if not environ:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(_CONTAINER_KEY):
            try:
                value = entry[len(_CONTAINER_KEY) :].decode("utf-8")
            except UnicodeDecodeError:
                return None
            return value or None
    return None


def _read_small(path: str, size: int = _SMALL_READ) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, size)
    except OSError:  # ESRCH: exited between open and read
        return None
    finally:
        os.close(fd)


def _read_all(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:  # ESRCH/EACCES mid-read: treat as unreadable
        return None
    finally:
        os.close(fd)


def read_cgroup(pid: int, proc_root: str = "/proc") -> str | None:
    """The content of /proc/<pid>/cgroup (world-readable: no ptrace right needed), stripped."""
    data = _read_all(f"{proc_root}/{pid}/cgroup")
    return data.decode("utf-8", "replace").strip() if data is not None else None


def processes_in_cgroup(cgroup: str, proc_root: str = "/proc") -> list[tuple[int, int]]:
    """(pid, start time) of every live process of this PID namespace whose cgroup is ``cgroup``.

    A container cannot leave its cgroup, so this is the whole container (its launchers and helpers
    that hold no GPU context included). Each start time is read before and after the cgroup, so an
    entry never mixes two processes.
    """
    found = []
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        stat = read_stat(pid, proc_root)
        if stat is None or stat.is_dead:
            continue
        if read_cgroup(pid, proc_root) == cgroup and read_start_time(pid, proc_root) == stat.start_time_ticks:
            found.append((pid, stat.start_time_ticks))
    return found


# Capability bits (linux/capability.h) the enforcer reports at start.
_CAPS = {"dac_read_search": 2, "kill": 5, "setuid": 7, "sys_ptrace": 19}


def own_privileges(proc_root: str = "/proc") -> dict[str, object]:
    """This process's uid and the capabilities that decide what it can inspect and signal (from
    /proc/self/status; psutil does not expose capabilities)."""
    data = _read_small(f"{proc_root}/self/status", size=16384) or b""
    effective = 0
    for line in data.splitlines():
        if line.startswith(b"CapEff:"):
            effective = int(line.split()[1], 16)
    result: dict[str, object] = {"uid": os.geteuid(), "cap_effective": f"{effective:016x}"}
    result.update({f"cap_{name}": bool(effective >> bit & 1) for name, bit in _CAPS.items()})
    return result


def privilege_limits(privileges: dict[str, object]) -> list[str]:
    """What these privileges cannot do, in words (empty: nothing the kernel would refuse)."""
    limits = []
    if not privileges.get("cap_kill"):
        limits.append(f"no CAP_KILL: can signal only processes of uid {privileges.get('uid')}")
    if not privileges.get("cap_sys_ptrace"):
        limits.append(
            "no CAP_SYS_PTRACE: can inspect (/proc/<pid>/fd, environ) only processes of its own uid whose "
            "capabilities it holds too; others are reported as process_uninspectable"
        )
    return limits
