"""The simulated driver's per-cgroup memory limits (NVML R615) and the allocations they limit.

Processes change them through the library (``nvmlDeviceSetMemoryLimits_v1``, ``simnvmlAllocate``,
``simnvmlFree``: see ``fake_nvml_limits.c``), so that what one process sets (the container
toolkit's hook) the others see (the enforcer, the workloads). They live beside the state file, in
``<state file>.driver``, which ``write_state`` never touches::

    gpufence-simnvml-driver 1
    limit <uuid> <soft bytes> <hard bytes> <namespace>
    alloc <uuid> <host pid, 0 if unknown> <bytes> <allocator's pid ns inode> <its pid there> <its start time>

Writers (the library, ``preset_limits``, ``reset_driver_state``) hold ``flock`` on
``<state file>.driver.lock`` and replace the file atomically; readers need no lock.

A namespace is a cgroup directory as NVML names it, ``/sys/fs/cgroup/<path>`` on cgroup v2. A
process's namespace is its state-file ``cgroup`` if given, else ``cgroup_namespace`` of its
``/proc/<pid>/cgroup``. Limits apply to the namespace and its descendants that have no limits of
their own, as in the driver.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

from gpufence.simnvml.state import replace_file

LEDGER_MAGIC = "gpufence-simnvml-driver 1"
CGROUP_ROOT = "/sys/fs/cgroup"
# NVML_DEVICE_MEMORY_LIMIT_MAX: soft 0 with this hard limit is "no limit".
NO_LIMIT = 0xFFFFFFFFFFFFFFFF
_NAMESPACE_MAX = 1024  # fake_nvml.c's CGROUP_PATH_MAX


def _check_uuid(uuid: str) -> None:
    if not uuid or len(uuid) >= 96 or not uuid.isascii() or any(c.isspace() for c in uuid):
        raise ValueError(f"uuid must be 1-95 ASCII characters without whitespace, got {uuid!r}")


def _check_u64(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= NO_LIMIT:
        raise ValueError(f"{name} must be an integer in [0, 2**64-1], got {value!r}")


def normalise_namespace(namespace: str) -> str:
    """The namespace as the driver keys it: absolute, without a trailing '/'."""
    if (
        not isinstance(namespace, str)
        or not namespace.startswith("/")
        or "\n" in namespace
        or len(namespace.encode()) >= _NAMESPACE_MAX
    ):
        raise ValueError(
            "a namespace is an absolute cgroup path (one line, shorter than 1024 bytes) such as"
            f" '/sys/fs/cgroup/kubepods/pod1'; got {namespace!r}"
        )
    return namespace.rstrip("/") or "/"


@dataclass(frozen=True)
class SimLimit:
    uuid: str
    namespace: str  # e.g. "/sys/fs/cgroup/kubepods/pod1/c1"
    soft_limit_bytes: int
    hard_limit_bytes: int

    def __post_init__(self) -> None:
        _check_uuid(self.uuid)
        object.__setattr__(self, "namespace", normalise_namespace(self.namespace))
        _check_u64("soft_limit_bytes", self.soft_limit_bytes)
        _check_u64("hard_limit_bytes", self.hard_limit_bytes)
        if self.soft_limit_bytes > self.hard_limit_bytes:
            raise ValueError(
                f"soft_limit_bytes ({self.soft_limit_bytes}) must not exceed hard_limit_bytes ({self.hard_limit_bytes})"
            )


@dataclass(frozen=True)
class SimAllocation:
    uuid: str
    pid: int  # host pid: the state file lists the allocator or it runs in the host pid namespace; else 0
    bytes: int
    ns_inode: int  # the allocator's pid namespace and its pid there
    ns_pid: int
    # Its start time (clock ticks after boot; 0: unknown): a reused namespace inode and pid are
    # another process, whose allocations these are not.
    start_ticks: int = 0


def driver_state_path(state_path: str | os.PathLike[str]) -> pathlib.Path:
    """Where the limits and allocations for this state file live."""
    return pathlib.Path(f"{os.fspath(state_path)}.driver")


def cgroup_namespace(proc_cgroup_text: str) -> str | None:
    """The NVML namespace for a process, from the text of its ``/proc/<pid>/cgroup``.

    The unified hierarchy's line ``0::/<path>`` gives ``/sys/fs/cgroup/<path>`` (``0::/`` gives
    ``/sys/fs/cgroup``), as the container toolkit's hook builds it; None without such a line. On a
    cgroup v1 host the ``0::`` line names the (unused) unified hierarchy, so processes there all
    map to ``/sys/fs/cgroup``: tests place processes with ``SimProcess.cgroup`` instead. The
    library applies the same rule (``namespace_from_cgroup_file`` in fake_nvml_limits.c).
    """
    for line in proc_cgroup_text.splitlines():
        if line.startswith("0::/"):
            path = line[3:].rstrip("/")
            return CGROUP_ROOT + path
    return None


def process_cgroup_namespace(pid: int | str = "self") -> str | None:
    """``cgroup_namespace`` of ``/proc/<pid>/cgroup``."""
    with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as handle:
        return cgroup_namespace(handle.read())


def parse_driver_state(text: str) -> tuple[tuple[SimLimit, ...], tuple[SimAllocation, ...]]:
    """Parses ``<state>.driver``; an empty text is no limits and no allocations."""
    if not text:
        return (), ()
    lines = text.splitlines()
    if lines[0] != LEDGER_MAGIC:
        raise ValueError(f"not a simnvml driver-state file (first line {lines[0]!r})")
    limits: list[SimLimit] = []
    allocations: list[SimAllocation] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        kind, _, rest = line.partition(" ")
        try:
            if kind == "limit":
                uuid, soft, hard, namespace = rest.split(" ", 3)
                limits.append(SimLimit(uuid, namespace, int(soft), int(hard)))
            elif kind == "alloc":
                uuid, pid, nbytes, ns_inode, ns_pid, *start = rest.split(" ")
                if len(start) > 1:
                    raise ValueError(f"{len(start) - 1} field(s) too many")
                allocations.append(SimAllocation(uuid, int(pid), int(nbytes), int(ns_inode), int(ns_pid),
                                                 int(start[0]) if start else 0))
            else:
                raise ValueError(f"unknown record {kind!r}")
        except ValueError as exc:
            raise ValueError(f"malformed driver-state line {number}: {line!r} ({exc})") from None
    return tuple(limits), tuple(allocations)


def render_driver_state(limits: tuple[SimLimit, ...], allocations: tuple[SimAllocation, ...] = ()) -> str:
    lines = [LEDGER_MAGIC]
    lines.extend(f"limit {x.uuid} {x.soft_limit_bytes} {x.hard_limit_bytes} {x.namespace}" for x in limits)
    lines.extend(f"alloc {a.uuid} {a.pid} {a.bytes} {a.ns_inode} {a.ns_pid} {a.start_ticks}" for a in allocations)
    return "\n".join(lines) + "\n"


def _read(state_path: str | os.PathLike[str]) -> tuple[tuple[SimLimit, ...], tuple[SimAllocation, ...]]:
    try:
        text = driver_state_path(state_path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return (), ()
    return parse_driver_state(text)


def read_limits(state_path: str | os.PathLike[str]) -> tuple[SimLimit, ...]:
    """The limits processes have set through NVML (or ``preset_limits``) for this state file."""
    return _read(state_path)[0]


def read_allocations(state_path: str | os.PathLike[str]) -> tuple[SimAllocation, ...]:
    """The simulated allocations recorded for this state file (entries of exited processes may remain
    until the next allocation; the driver no longer counts them)."""
    return _read(state_path)[1]


@contextlib.contextmanager
def _locked(state_path: str | os.PathLike[str]) -> Iterator[pathlib.Path]:
    path = driver_state_path(state_path)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        os.close(fd)


def preset_limits(state_path: str | os.PathLike[str], *limits: SimLimit) -> None:
    """Sets limits as if a process (the toolkit's hook) had set them through NVML before the test.

    Replaces any limit of the same device and namespace; keeps the others and the allocations. It
    does not apply the driver's checks against current use: use pynvml for those.
    """
    with _locked(state_path) as path:
        current, allocations = _read(state_path)
        keys = {(x.uuid, x.namespace) for x in limits}
        kept = tuple(x for x in current if (x.uuid, x.namespace) not in keys)
        replace_file(path, render_driver_state(kept + tuple(limits), allocations))


def reset_driver_state(state_path: str | os.PathLike[str]) -> None:
    """Forgets every limit and allocation (a driver reload)."""
    with _locked(state_path) as path, contextlib.suppress(FileNotFoundError):
        path.unlink()
