"""Which of the PIDs NVML lists are live processes, and since when, without reading every one's
``/proc/<pid>/stat`` at every poll.

The guardian needs each listed process's start time (a process is known by PID and start time, so a
recycled PID is never taken for the process that had it) and whether it is still alive (a zombie
holds no GPU and has nothing to signal). Both are read once, when a PID is first listed, and a
pidfd is opened on it before the read: a pidfd names one process for good and turns readable when
that process exits, so one ``poll(2)`` over all of them says which have exited since. A PID whose
pidfd is readable is read afresh (a new process may have its number). Where a pidfd cannot be
opened (a kernel before 5.3, the descriptor limit) that PID is read from ``/proc`` at every poll, as
before.
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Iterable

from gpufence.enforcer.observe.procfs import read_stat

# Descriptors held at most: past it, the PIDs not yet held are read from /proc at every poll.
MAX_PIDFDS = 4096


class LiveProcesses:
    """PID -> start time for the live processes among those asked about (one instance per loop)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc_root = proc_root
        self._held: dict[int, tuple[int, int]] = {}  # pid -> (pidfd, start time in ticks)
        self._by_fd: dict[int, int] = {}
        self._poller = select.poll()

    def start_times(self, pids: Iterable[int]) -> dict[int, int]:
        """Each live (not exited, not a zombie) process among ``pids``: its start time in ticks."""
        wanted = set(pids)
        for pid in [p for p in self._held if p not in wanted]:
            self._release(pid)  # no longer listed: its descriptor is not kept
        exited = {self._by_fd[fd] for fd, _ in self._poller.poll(0) if fd in self._by_fd}
        for pid in exited:
            self._release(pid)
        found = {}
        for pid in wanted:
            held = self._held.get(pid)
            start = held[1] if held is not None else self._first_look(pid)
            if start is not None:
                found[pid] = start
        return found

    def close(self) -> None:
        for pid in list(self._held):
            self._release(pid)

    def _first_look(self, pid: int) -> int | None:
        fd = None
        if len(self._held) < MAX_PIDFDS:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return None
            except OSError:
                fd = None  # no pidfd for it: read from /proc at every poll
        # Read after the pidfd is open: if this PID's process exits meanwhile, the pidfd says so.
        stat = read_stat(pid, self._proc_root)
        if stat is None or stat.is_dead:
            if fd is not None:
                os.close(fd)
            return None
        if fd is not None:
            self._held[pid] = (fd, stat.start_time_ticks)
            self._by_fd[fd] = pid
            self._poller.register(fd, select.POLLIN)
        return stat.start_time_ticks

    def _release(self, pid: int) -> None:
        fd, _ = self._held.pop(pid)
        del self._by_fd[fd]
        with contextlib.suppress(KeyError, ValueError):
            self._poller.unregister(fd)
        os.close(fd)
