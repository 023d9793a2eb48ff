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
import stat as stat_module
from dataclasses import dataclass, field

from gpufence.contract import ENV_CONTAINER

NVIDIA_DEVICE_PREFIX_DEFAULT = "/dev/nvidia"
# Tests and the local demo have no GPU: the workloads open a temp file named like
# <tmp>/dev/nvidia0 and the enforcer is told that prefix through this variable.
ENV_NVIDIA_DEVICE_PREFIX = "GPUFENCE_NVIDIA_DEVICE_PREFIX"
# More character devices to count as NVIDIA's, besides the node's (``/proc/devices``): a comma
# separated list of ``MAJOR`` or ``MAJOR:MINOR`` (tests give a device of their own making).
ENV_NVIDIA_DEVICES = "GPUFENCE_NVIDIA_DEVICES"
PROC_DEVICES = "/proc/devices"


@dataclass(frozen=True)
class DeviceIdentity:
    """What makes an open file or a mapping an NVIDIA device: the device itself, not its name.

    A root workload may hold the GPU through any name: a renamed or symlinked node, a bind mount, an
    ``mknod`` alias with NVIDIA's major and minor (CAP_MKNOD is in the runtime's default set). Every
    one of them is the same character device, so a file is NVIDIA's when it is a character device
    whose major is one the node's driver registered (``/proc/devices``: ``nvidia``, ``nvidia-uvm``,
    ``nvidia-caps``, ``nvidia-frontend``, ``nvidia-nvlink``, ...), or whose ``(major, minor)`` is
    configured, or (the simulated driver's test bed, where the "devices" are plain files) the very
    file ``(st_dev, st_ino)`` of one that was under the prefix at start, whatever name it has now.
    A path under ``prefix`` still counts as well (the node's own ``/dev/nvidia*``).
    """

    prefix: str
    majors: frozenset[int] = frozenset()
    devices: frozenset[tuple[int, int]] = frozenset()  # (major, minor)
    files: frozenset[tuple[int, int]] = field(default=frozenset())  # (st_dev, st_ino) of plain files

    @classmethod
    def of(cls, prefix: str, extra: str | None = None, proc_devices: str = PROC_DEVICES) -> DeviceIdentity:
        """NVIDIA's majors from ``proc_devices``, the ``MAJOR[:MINOR]`` list ``extra``, and what is under
        ``prefix`` now (a character device by its numbers, any other file by its identity).
        ValueError for a malformed ``extra``."""
        majors = set(nvidia_majors(proc_devices))
        devices: set[tuple[int, int]] = set()
        for item in (extra or "").split(","):
            item = item.strip()
            if not item:
                continue
            major, sep, minor = item.partition(":")
            try:
                if sep:
                    devices.add((int(major), int(minor)))
                else:
                    majors.add(int(major))
            except ValueError:
                raise ValueError(f"not a device number MAJOR or MAJOR:MINOR: {item!r}") from None
        directory, _, stem = prefix.rpartition("/")
        found, files = _under_prefix(directory or "/", stem)
        return cls(prefix, frozenset(majors), frozenset(devices | found), frozenset(files))

    def in_root_of(self, pid: int, proc_root: str) -> DeviceIdentity:
        """This identity plus what is under the prefix as process ``pid`` sees it: its container's own
        ``/dev/nvidia*``, through ``/proc/<pid>/root`` (its mount namespace). The sidecar's ``/dev``
        need not hold them (a runtime may give it no device nodes, and the simulated driver's plain
        files have no major to recognise them by), yet a root workload that bind-mounts its
        ``/dev/nvidia0`` at ``/dev/xgpu0`` and holds it only there holds the same file (issue 38 row
        5). For matching that process's descriptors only: a file the container put there makes none
        of another process's files a GPU."""
        directory, _, stem = self.prefix.rpartition("/")
        devices, files = _under_prefix(f"{proc_root}/{pid}/root{directory or '/'}", stem, follow=False)
        if devices <= self.devices and files <= self.files:
            return self
        return DeviceIdentity(self.prefix, self.majors, self.devices | devices, self.files | files)

    def matches(self, st: os.stat_result) -> bool:
        """Whether the file ``st`` describes is one of NVIDIA's devices (or the simulator's files)."""
        if stat_module.S_ISCHR(st.st_mode):
            major = os.major(st.st_rdev)
            return major in self.majors or (major, os.minor(st.st_rdev)) in self.devices
        return (st.st_dev, st.st_ino) in self.files

    def summary(self) -> dict[str, object]:
        """For the ``started`` log line."""
        return {"prefix": self.prefix, "majors": sorted(self.majors),
                "devices": [f"{a}:{b}" for a, b in sorted(self.devices)], "files": len(self.files)}


_Ids = set[tuple[int, int]]


def _under_prefix(directory: str, stem: str, *, follow: bool = True) -> tuple[_Ids, _Ids]:
    """The files of ``directory`` whose name starts with ``stem``: character devices by their
    ``(major, minor)``, regular files by their ``(st_dev, st_ino)``; nothing where it is unreadable.
    ``follow`` False: a symlink is no device (in another process's root an absolute link would
    resolve in ours)."""
    devices: _Ids = set()
    files: _Ids = set()
    try:
        names = os.listdir(directory)
    except OSError:
        return devices, files
    for name in names:
        if not name.startswith(stem):
            continue
        try:
            st = os.stat(f"{directory.rstrip('/')}/{name}", follow_symlinks=follow)
        except OSError:
            continue
        if stat_module.S_ISCHR(st.st_mode):
            devices.add((os.major(st.st_rdev), os.minor(st.st_rdev)))
        elif stat_module.S_ISREG(st.st_mode):
            files.add((st.st_dev, st.st_ino))
    return devices, files


def nvidia_majors(proc_devices: str = PROC_DEVICES) -> list[int]:
    """The character-device majors whose driver name starts with ``nvidia`` in ``proc_devices``
    (the node's: /proc/devices is not namespaced); [] when unreadable or without NVIDIA's driver."""
    try:
        with open(proc_devices) as f:
            text = f.read()
    except OSError:
        return []
    found, char = [], False
    for line in text.splitlines():
        if line.strip().endswith("devices:"):
            char = line.strip() == "Character devices:"
            continue
        parts = line.split()
        if char and len(parts) == 2 and parts[1].startswith("nvidia") and parts[0].isdigit():
            found.append(int(parts[0]))
    return found


def _identity(device: DeviceIdentity | str) -> DeviceIdentity:
    return device if isinstance(device, DeviceIdentity) else DeviceIdentity.of(device)

_CONTAINER_KEY = ENV_CONTAINER.encode() + b"="
# /proc/<pid>/stat and status fit in one page; environ and cgroup are read to EOF.
_SMALL_READ = 4096


@dataclass(frozen=True)
class ProcFacts:
    pid: int
    start_time_ticks: int  # field 22 of /proc/<pid>/stat: identity of the process for PID-reuse checks
    container: str | None  # GPUFENCE_CONTAINER from /proc/<pid>/environ; None if absent/unreadable
    cgroup: str | None  # /proc/<pid>/cgroup content (cross-check)
    holds_nvidia_device: bool  # some descriptor or mapping is an NVIDIA device (``DeviceIdentity``)
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


def holds_device(pid: int, proc_root: str, device: DeviceIdentity | str) -> bool:
    """Whether some open descriptor or mapping of the process is an NVIDIA device (``device``: the
    identity, or a prefix to build one from).

    Unreadable (gone, or no ptrace permission) reads as False: a process we cannot inspect is
    not accepted as ours.
    """
    return fd_scan(pid, proc_root, device)[0]


# Descriptor targets that are no file with a name to stat (sockets, pipes, eventfds...).
_NO_FILE = ("socket:", "pipe:", "anon_inode:")


def fd_scan(pid: int, proc_root: str, device: DeviceIdentity | str) -> tuple[bool, bool]:
    """(holds the device, descriptors readable): (False, False) when /proc/<pid>/fd is denied (the
    directory itself, or, as for another process of the same uid with more capabilities, its links).

    A descriptor is the device when its path is under the prefix, or when the file it is (``stat``
    through the descriptor: whatever its name, a link, a bind mount or a deleted alias) is one of
    NVIDIA's (``DeviceIdentity.matches``), or the same file as one under the prefix in the process's
    own root (``DeviceIdentity.in_root_of``). Without such a descriptor the process's mappings are
    looked at (``maps_hold_device``): a device mapped and its descriptor closed."""
    identity = _identity(device)
    fd_dir = f"{proc_root}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except PermissionError:
        return False, False
    except OSError:
        return False, True  # gone: nothing to inspect, and nothing denied
    denied = False
    local: DeviceIdentity | None = None  # with the process's own /dev/nvidia*, read once if needed
    for name in names:
        path = f"{fd_dir}/{name}"
        try:
            target = os.readlink(path)
        except PermissionError:
            # The directory of a same-uid process lists, but each link needs ptrace access.
            denied = True
            continue
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith(identity.prefix):
            return True, True
        if target.startswith(_NO_FILE):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if identity.matches(st):
            return True, True
        if local is None:
            local = identity.in_root_of(pid, proc_root)
        if local is not identity and local.matches(st):
            return True, True
    if not denied:
        if local is None:
            local = identity.in_root_of(pid, proc_root)
        if maps_hold_device(pid, proc_root, local):
            return True, True
    return False, not denied


def maps_hold_device(pid: int, proc_root: str, device: DeviceIdentity | str) -> bool:
    """Whether some mapping of the process (``/proc/<pid>/maps``) is an NVIDIA device: named under
    the prefix, the simulator's file by its ``(device, inode)``, or a character device that is
    NVIDIA's (stat through ``map_files``, which needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE, else
    through the path in the process's root when it still names the mapped file)."""
    identity = _identity(device)
    data = _read_all(f"{proc_root}/{pid}/maps")
    if not data:
        return False
    seen: set[tuple[int, int]] = set()
    for line in data.decode("utf-8", "replace").splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue  # anonymous, [heap], [stack], [vdso]...
        span, dev, inode, path = fields[0], fields[3], fields[4], fields[5]
        if path.startswith(identity.prefix):
            return True
        try:
            major, _, minor = dev.partition(":")
            key = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
        except ValueError:
            continue
        if key[1] == 0 or key in seen:
            continue
        seen.add(key)
        if key in identity.files:
            return True
        st = _mapped_file(pid, proc_root, span, path, key)
        if st is not None and stat_module.S_ISCHR(st.st_mode) and identity.matches(st):
            return True
    return False


def _mapped_file(pid: int, proc_root: str, span: str, path: str, key: tuple[int, int]) -> os.stat_result | None:
    """The mapped file's stat: through ``map_files`` (privileged), else through its path in the
    process's root when that path still names the mapped file (same device and inode)."""
    try:
        return os.stat(f"{proc_root}/{pid}/map_files/{span}")
    except OSError:
        pass
    if path.endswith(" (deleted)"):
        return None
    try:
        st = os.stat(f"{proc_root}/{pid}/root{path}")
    except OSError:
        return None
    return st if (st.st_dev, st.st_ino) == key else None


def read_facts(
    pid: int, proc_root: str = "/proc", device_prefix: DeviceIdentity | str | None = None
) -> ProcFacts | None:
    """All facts about one process, or None if it vanished (or its PID was reused) during the read.

    ``device_prefix`` (a ``DeviceIdentity``, or a prefix to build one from) None means
    ``default_device_prefix()`` (the environment, read now).
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
