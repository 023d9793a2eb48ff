"""The host's cgroup filesystem, as the guardian acts on it: a container's processes, its freezer, and
signals to every process in it.

cgroup v1 (``<root>/<controller>/<path>``): the ``freezer`` hierarchy's ``freezer.state``
(``FROZEN``/``THAWED``) and ``cgroup.procs``. cgroup v2 (``<root>/<path>``, or ``<root>/unified``
on a hybrid host): ``cgroup.freeze`` (``1``/``0``), ``cgroup.procs`` and ``cgroup.kill``. Where the
process's v2 path is below the root the v2 files are used, else the v1 freezer's. A frozen process
runs no instruction until its cgroup is thawed, whatever signal it gets (SIGCONT included), so no
process of the container can undo the freezer's duty cycle; only a writer of the cgroup's files can,
and those are the host's.

Every signal goes through a pidfd opened after the PID was read from ``cgroup.procs`` and checked to
be in the cgroup still, so a PID reused by another process in between is never hit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpufence.node.census import Placement, placement

DEFAULT_ROOT = "/sys/fs/cgroup"
V1_FREEZER = "freezer"
# How many freeze-kill-thaw rounds a SIGKILL sweep makes at most (a fork between the read of
# cgroup.procs and the signals is caught by the next round; the freeze stops forks in between).
KILL_ROUNDS = 5


class CgroupError(OSError):
    """A cgroup file could not be read or written (the message names it)."""


@dataclass(frozen=True)
class Signalled:
    sent: tuple[int, ...]  # PIDs the signal was delivered to
    gone: tuple[int, ...]  # PIDs that exited before the signal
    failed: tuple[tuple[int, str], ...]  # PID, error


class CgroupFs:
    def __init__(self, root: str = DEFAULT_ROOT, proc_root: str = "/proc") -> None:
        self.root = Path(root)
        self.proc_root = proc_root
        if (self.root / "cgroup.controllers").exists():
            self.unified: Path | None = self.root  # a pure v2 host
        elif (self.root / "unified" / "cgroup.controllers").exists():
            self.unified = self.root / "unified"  # a hybrid host: v1 controllers, a v2 tree besides
        else:
            self.unified = None

    # -- where --------------------------------------------------------------------------------

    def v2_dir(self, where: Placement) -> Path | None:
        if self.unified is None or where.unified in (None, "/"):
            return None
        assert where.unified is not None
        return self.unified / where.unified.lstrip("/")

    def freezer_dir(self, where: Placement) -> Path | None:
        if where.freezer in (None, "/"):
            return None
        assert where.freezer is not None
        return self.root / V1_FREEZER / where.freezer.lstrip("/")

    def dirs(self, where: Placement) -> list[Path]:
        return [d for d in (self.v2_dir(where), self.freezer_dir(where)) if d is not None and d.is_dir()]

    # -- processes ----------------------------------------------------------------------------

    def pids(self, where: Placement) -> set[int]:
        """Every process in the container's cgroup and below it (a cgroup the container made)."""
        found: set[int] = set()
        for top in self.dirs(where):
            for directory in _walk(top):
                with contextlib.suppress(OSError):
                    found.update(int(line) for line in (directory / "cgroup.procs").read_text().split())
        return found

    def in_cgroup(self, pid: int, where: Placement) -> bool:
        """Whether the process ``pid`` is (still) in the container's cgroup or below it."""
        try:
            text = Path(f"{self.proc_root}/{pid}/cgroup").read_text()
        except OSError:
            return False
        now = placement(text)
        return _under(now.unified, where.unified) or _under(now.freezer, where.freezer)

    def signal(self, where: Placement, sig: int) -> Signalled:
        """``sig`` to every process of the container, whatever its user, through a pidfd each."""
        sent, gone, failed = [], [], []
        for pid in sorted(self.pids(where)):
            outcome = self._send(pid, sig, where)
            if outcome is None:
                sent.append(pid)
            elif outcome == "gone":
                gone.append(pid)
            else:
                failed.append((pid, outcome))
        return Signalled(tuple(sent), tuple(gone), tuple(failed))

    def kill(self, where: Placement) -> Signalled:
        """SIGKILL every process of the container: frozen first so that nothing forks between the
        read and the signals, thawed after (a frozen process dies only once it runs). Rounds until
        nothing is left or ``KILL_ROUNDS`` are done; ``cgroup.kill`` (v2) first where there is one."""
        sent: list[int] = []
        gone: list[int] = []
        failed: list[tuple[int, str]] = []
        v2 = self.v2_dir(where)
        if v2 is not None and (v2 / "cgroup.kill").exists():
            before = self.pids(where)
            try:
                (v2 / "cgroup.kill").write_text("1")  # the kernel's own sweep, forks included
                sent += sorted(before)
            except OSError:
                pass  # the rounds below do it
        for _ in range(KILL_ROUNDS):
            if not self.pids(where):
                break
            with contextlib.suppress(CgroupError):
                self.freeze(where)
            try:
                result = self.signal(where, signal.SIGKILL)
            finally:
                self.thaw(where)
            sent += result.sent
            gone += result.gone
            failed = list(result.failed)
        return Signalled(tuple(sorted(set(sent))), tuple(sorted(set(gone) - set(sent))), tuple(failed))

    # -- the freezer --------------------------------------------------------------------------

    def freeze(self, where: Placement) -> None:
        self._set_frozen(where, True)

    def thaw(self, where: Placement) -> None:
        self._set_frozen(where, False)

    def frozen(self, where: Placement) -> bool | None:
        """Whether the container's freezer holds it (None: no freezer). v1 says FREEZING while tasks
        are on their way; that counts as frozen (they run no more user code)."""
        v2 = self.v2_dir(where)
        try:
            if v2 is not None:
                return (v2 / "cgroup.freeze").read_text().strip() == "1"
            v1 = self.freezer_dir(where)
            if v1 is not None:
                return (v1 / "freezer.state").read_text().strip() != "THAWED"
        except OSError as exc:
            raise CgroupError(exc.errno, f"cannot read the freezer of {where.path}: {exc.strerror}") from None
        return None

    def _set_frozen(self, where: Placement, frozen: bool) -> None:
        v2 = self.v2_dir(where)
        if v2 is not None:
            target, value = v2 / "cgroup.freeze", "1" if frozen else "0"
        else:
            v1 = self.freezer_dir(where)
            if v1 is None:
                raise CgroupError(errno.ENOENT, f"no freezer for the cgroup {where.path}")
            target, value = v1 / "freezer.state", "FROZEN" if frozen else "THAWED"
        try:
            target.write_text(value)
        except OSError as exc:
            if not frozen and exc.errno == errno.ENOENT:
                return  # the cgroup is gone: nothing is held
            raise CgroupError(exc.errno, f"cannot write {value} to {target}: {exc.strerror}") from None

    # -- signals ------------------------------------------------------------------------------

    def _send(self, pid: int, sig: int, where: Placement) -> str | None:
        """None when delivered, ``gone``, or the error's name."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))
        try:
            # The pidfd pins the process; checked after it is open, the cgroup is this process's.
            if not self.in_cgroup(pid, where):
                return "gone"
            signal.pidfd_send_signal(fd, sig)
            return None
        except ProcessLookupError:
            return "gone"
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))
        finally:
            os.close(fd)


def _walk(top: Path) -> Iterator[Path]:
    yield top
    with contextlib.suppress(OSError):
        for child in sorted(top.iterdir()):
            if child.is_dir():
                yield from _walk(child)


def _under(path: str | None, top: str | None) -> bool:
    if path is None or top in (None, "/"):
        return False
    assert top is not None
    return path == top or path.startswith(top.rstrip("/") + "/")
