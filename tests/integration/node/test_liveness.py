"""The guardian's view of which listed PIDs are live processes (``node.liveness``), on real processes:
a start time read once and held through a pidfd, an exit or a zombie seen at the next look without
reading ``/proc`` again, and no descriptor kept for a PID no longer listed."""

from __future__ import annotations

import os
import signal
import subprocess

from gpufence.enforcer.observe.procfs import read_stat
from gpufence.node.liveness import LiveProcesses
from tests.support.enforcer_harness import wait_state


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_live_processes_are_known_by_start_time_and_an_exit_or_a_zombie_is_seen() -> None:
    live = LiveProcesses()
    sleeper = subprocess.Popen(["sleep", "300"])
    doomed = subprocess.Popen(["sleep", "300"])
    try:
        fds = open_fds()
        stat = read_stat(sleeper.pid)
        assert stat is not None
        found = live.start_times([sleeper.pid, doomed.pid, 0x3FFFFFF0])  # the last: no such process
        assert found[sleeper.pid] == stat.start_time_ticks and set(found) == {sleeper.pid, doomed.pid}
        assert open_fds() == fds + 2  # one pidfd per live process, none for the missing one
        doomed.send_signal(signal.SIGKILL)
        wait_state(doomed.pid, lambda s: s == "Z", 10)  # a zombie: not reaped yet
        assert set(live.start_times([sleeper.pid, doomed.pid])) == {sleeper.pid}
        doomed.wait()
        assert set(live.start_times([sleeper.pid, doomed.pid])) == {sleeper.pid}
        assert open_fds() == fds + 1
        live.start_times([])  # nothing listed: nothing held
        assert open_fds() == fds
    finally:
        for p in (sleeper, doomed):
            p.kill()
            p.wait()
        live.close()
