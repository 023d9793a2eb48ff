"""A tenant's helper that continues a throttled process in every other stopped phase only (issue 32,
row 5): a streak of stopped phases in a row never forms, and the process's running time doubles.

    python alternate_sigcont.py PID [BURST_SECONDS]

It watches the target's state in /proc (what any process of the pod may read): when a stopped phase
begins (state ``T``) it sends SIGCONT every millisecond for ``BURST_SECONDS`` (0.15 by default), then
lets the throttle stop it again, and leaves the next stopped phase alone. It prints ``acted N`` and
``skipped N`` per phase, and ``target gone`` when the target exits."""

from __future__ import annotations

import os
import signal
import sys
import time


def state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait(pid: int, stopped: bool) -> None:
    """Until the target is stopped (or runs); SystemExit when it is gone."""
    while True:
        s = state(pid)
        if s is None or s in "ZX":
            print("target gone", flush=True)
            raise SystemExit(0)
        if (s == "T") == stopped:
            return
        time.sleep(0.0005)


def main() -> None:
    pid = int(sys.argv[1])
    burst = float(sys.argv[2]) if len(sys.argv) > 2 else 0.15
    print("attacking", flush=True)
    act, phase = True, 0
    wait(pid, stopped=False)  # start from a run phase
    while True:
        wait(pid, stopped=True)  # a stopped phase begins
        phase += 1
        if act:
            end = time.monotonic() + burst
            while time.monotonic() < end:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    print("target gone", flush=True)
                    return
                time.sleep(0.001)
            print(f"acted {phase}", flush=True)
            wait(pid, stopped=True)  # the throttle stops it again within this phase
        else:
            print(f"skipped {phase}", flush=True)
        wait(pid, stopped=False)  # the throttle's own SIGCONT: the run phase
        act = not act


if __name__ == "__main__":
    main()
