"""The one door every signal of the enforcer goes through.

``SafeSignaller.send`` is the only place in the enforcer that calls ``kill``. It refuses, and logs
the refusal, unless all of these hold:

* the target is a PID of the enforcer's own namespace greater than 1, not the enforcer itself and
  not one of its ancestors (read at construction and re-read before every signal);
* the target is one of this pod's processes: its (pid, start time) is in the set the poll loop
  handed over with :meth:`authorize` (every GPU process of the latest attribution, attributed or
  not: the pod budget terminates unattributed ones), or one the terminator found in the cgroup of
  a container it terminates (:meth:`admit_members`: the container's launchers, which hold no GPU
  context); the follow-up signals SIGKILL (after our SIGTERM, or for an entry of the pending-SIGKILL
  file) and SIGCONT (after our SIGSTOP, or for an entry of the stopped-state file) are also allowed
  for processes that have since left;
* the process still exists with the same start time (field 22 of ``/proc/<pid>/stat``), read right
  before the kill. With ``pidfd_open`` (Linux >= 5.3) the pidfd is opened *first*, then the start
  time is checked, then the signal goes through the pidfd: a PID recycled after the check cannot
  receive it. Without pidfds, ``os.kill`` follows the check (a window of microseconds).

A process that vanished (``ProcessLookupError``, no ``/proc`` entry, a zombie) is a normal outcome,
not an error, also when it is no longer one this enforcer may signal: the rights of vanished
processes are forgotten each poll, and a follow-up (a retried SIGCONT) that comes after the exit
is ``gone``, not a refusal. Every decision is logged: SIGTERM/SIGKILL at info, SIGSTOP/SIGCONT
(the duty cycle sends many) at debug; refused and failed signals at warning.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpufence.enforcer.observe.procfs import read_stat
from gpufence.enforcer.report.decision_log import DecisionLog


@dataclass(frozen=True)
class SignalTarget:
    pid: int
    start_time_ticks: int
    container: str | None

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start_time_ticks)

    @classmethod
    def of(cls, process: Any) -> SignalTarget:
        """From an ``attribution.PodProcess`` (anything with pid, start_time_ticks, container)."""
        return cls(process.pid, process.start_time_ticks, process.container)


class Outcome(StrEnum):
    SENT = "sent"
    GONE = "gone"          # no such process (exited, or a zombie): nothing to do
    REUSED = "reused"      # the PID now belongs to another process: not signalled
    REFUSED = "refused"    # not a process this enforcer may signal
    FAILED = "failed"      # kill() failed otherwise (EPERM ...)
    DRY_RUN = "dry_run"


SIGNAL_NAMES: dict[int, str] = {
    signal.SIGTERM: "sigterm",
    signal.SIGKILL: "sigkill",
    signal.SIGSTOP: "sigstop",
    signal.SIGCONT: "sigcont",
}
_FOLLOW_UPS: dict[int, int] = {signal.SIGKILL: signal.SIGTERM, signal.SIGCONT: signal.SIGSTOP}
_NOT_OURS = "not in this pod's attribution"


def ancestors(pid: int, proc_root: str = "/proc") -> set[int]:
    """The PIDs of ``pid``'s parent chain (visible in this namespace)."""
    chain: set[int] = set()
    current = pid
    for _ in range(4096):
        stat = read_stat(current, proc_root)
        if stat is None:
            break
        ppid = stat.ppid
        if ppid <= 0 or ppid in chain:
            break
        chain.add(ppid)
        current = ppid
    return chain


class SafeSignaller:
    def __init__(
        self,
        log: DecisionLog,
        *,
        proc_root: str = "/proc",
        own_pid: int | None = None,
        dry_run: bool = False,
    ) -> None:
        self._log = log
        self._proc_root = proc_root
        self._own_pid = own_pid if own_pid is not None else os.getpid()
        self._protected = {self._own_pid} | ancestors(self._own_pid, proc_root)
        self._dry_run = dry_run
        self._lock = threading.Lock()
        self._authorized: dict[tuple[int, int], str | None] = {}
        # Processes of a container being terminated that are no GPU processes (key -> container).
        self._members: dict[tuple[int, int], str | None] = {}
        # key -> the signal we sent that allows a follow-up (SIGTERM -> SIGKILL, SIGSTOP -> SIGCONT)
        self._follow_up: dict[tuple[int, int], set[int]] = {}
        self._use_pidfd = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")

    # -- authority -----------------------------------------------------------------------------

    def authorize(self, targets: Iterable[SignalTarget]) -> None:
        """Replace the set of this pod's GPU processes (call once per poll)."""
        authorized = {t.key: t.container for t in targets if t.pid > 1}
        with self._lock:
            self._authorized = authorized
            # Forget the rights of processes that no longer exist.
            for rights in (self._follow_up, self._members):
                for key in list(rights):
                    stat = read_stat(key[0], self._proc_root)
                    if stat is None or stat.start_time_ticks != key[1] or stat.is_dead:
                        del rights[key]

    def admit_members(self, targets: Iterable[SignalTarget]) -> None:
        """Allow signals to processes of a container being terminated (found in its cgroup, in our
        PID namespace) for as long as they live."""
        with self._lock:
            for t in targets:
                if t.pid > 1:
                    self._members[t.key] = t.container

    def adopt_stopped(self, target: SignalTarget) -> None:
        """Allow SIGCONT for a process a previous enforcer recorded as stopped."""
        with self._lock:
            self._follow_up.setdefault(target.key, set()).add(signal.SIGSTOP)

    def adopt_terminated(self, target: SignalTarget) -> None:
        """Allow SIGKILL for a process a previous enforcer SIGTERMed (its recorded grace period)."""
        with self._lock:
            self._follow_up.setdefault(target.key, set()).add(signal.SIGTERM)

    # -- the door ------------------------------------------------------------------------------

    def send(self, target: SignalTarget, sig: int, *, reason: str, **fields: Any) -> Outcome:
        name = SIGNAL_NAMES.get(sig, f"signal_{int(sig)}")
        why = self._refusal(target, sig)
        vanished = self._vanished(target) if why == _NOT_OURS else None
        if why is not None and vanished is None:
            self._log.warning(
                name, outcome=Outcome.REFUSED, why=why, reason=reason,
                pid=target.pid, container=target.container, **fields,
            )
            return Outcome.REFUSED
        outcome, detail = vanished if vanished is not None else self._deliver(target, sig)
        with self._lock:
            if outcome is Outcome.SENT and sig in (signal.SIGTERM, signal.SIGSTOP):
                self._follow_up.setdefault(target.key, set()).add(sig)
            elif outcome in (Outcome.GONE, Outcome.REUSED) or sig == signal.SIGKILL:
                self._follow_up.pop(target.key, None)
            elif outcome is Outcome.SENT and sig == signal.SIGCONT:
                rights = self._follow_up.get(target.key)
                if rights is not None:
                    rights.discard(signal.SIGSTOP)
                    if not rights:
                        del self._follow_up[target.key]
        if outcome is Outcome.FAILED:
            level = "warning"
        elif sig in (signal.SIGSTOP, signal.SIGCONT):
            level = "debug"  # the duty cycle sends several a second
        else:
            level = "info"
        self._log.emit(
            name, level=level, outcome=outcome, reason=reason, detail=detail,
            pid=target.pid, container=target.container, **fields,
        )
        return outcome

    def _refusal(self, target: SignalTarget, sig: int) -> str | None:
        if target.pid <= 1:
            return "pid <= 1"
        if target.pid in self._protected or target.pid in ancestors(self._own_pid, self._proc_root):
            return "the enforcer itself or one of its ancestors"
        with self._lock:
            for known in (self._authorized, self._members):
                if target.key in known:
                    container = known[target.key]
                    if container != target.container:
                        return f"attributed to container {container!r}, not {target.container!r}"
                    return None
            needed = _FOLLOW_UPS.get(sig)
            if needed is not None and needed in self._follow_up.get(target.key, ()):
                return None
        return _NOT_OURS

    def _vanished(self, target: SignalTarget) -> tuple[Outcome, str] | None:
        """Why ``target`` names no live process any more (GONE, REUSED), None while it lives."""
        stat = read_stat(target.pid, self._proc_root)
        if stat is None:
            return Outcome.GONE, "no such process"
        if stat.start_time_ticks != target.start_time_ticks:
            return Outcome.REUSED, f"start time {stat.start_time_ticks} != {target.start_time_ticks}"
        if stat.is_dead:
            return Outcome.GONE, "zombie"
        return None

    def _deliver(self, target: SignalTarget, sig: int) -> tuple[Outcome, str | None]:
        pidfd: int | None = None
        try:
            if self._use_pidfd:
                try:
                    pidfd = os.pidfd_open(target.pid)
                except ProcessLookupError:
                    return Outcome.GONE, "no such process"
                except OSError:  # ENOSYS (old kernel, seccomp) -> fall back to kill()
                    pidfd = None
            vanished = self._vanished(target)
            if vanished is not None:
                return vanished
            if self._dry_run:
                return Outcome.DRY_RUN, None
            try:
                if pidfd is not None:
                    signal.pidfd_send_signal(pidfd, sig)
                else:
                    os.kill(target.pid, sig)
            except ProcessLookupError:
                return Outcome.GONE, "exited before the signal"
            except OSError as exc:
                return Outcome.FAILED, f"{type(exc).__name__}: {exc}"
            return Outcome.SENT, None
        finally:
            if pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(pidfd)

    def state(self, target: SignalTarget) -> str | None:
        """The state letter of ``target`` (``/proc/<pid>/stat`` field 3), None if it is gone or the
        PID is another process's now. One small read: the throttle calls it while holding processes
        stopped, to see whether something else continued them."""
        stat = read_stat(target.pid, self._proc_root)
        if stat is None or stat.start_time_ticks != target.start_time_ticks:
            return None
        return stat.state

    def stop_pending(self, target: SignalTarget) -> bool:
        """Whether a SIGSTOP sent to ``target`` waits to be acted on (``ShdPnd``/``SigPnd`` of
        ``/proc/<pid>/status``): a process seen running with one pending was not continued by anyone
        (a SIGCONT discards pending stop signals), it has not run its signal handling yet."""
        data = _read_status(target.pid, self._proc_root)
        if data is None:
            return False
        for line in data.splitlines():
            if line.startswith((b"ShdPnd:", b"SigPnd:")):
                try:
                    if int(line.split()[1], 16) >> (signal.SIGSTOP - 1) & 1:
                        return True
                except (IndexError, ValueError):
                    continue
        return False

    def alive(self, target: SignalTarget) -> bool:
        """The process still exists with the same identity (and is not a zombie)."""
        stat = read_stat(target.pid, self._proc_root)
        return stat is not None and stat.start_time_ticks == target.start_time_ticks and not stat.is_dead


def _read_status(pid: int, proc_root: str) -> bytes | None:
    """/proc/<pid>/status, or None when it is gone."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            return f.read(16384)
    except OSError:
        return None
