"""A tiny fake GPU workload for the enforcer's end-to-end tests.

    python tests/support/workload.py DEVICE_FILE [--ignore-term]

It sets nothing itself (its container comes from the GPUFENCE_CONTAINER the test puts in its
environment), opens DEVICE_FILE (a temp file standing in for /dev/nvidia0: the enforcer accepts a
process only if it holds such a file open), prints ``ready <pid>`` and waits for signals. It reports
every signal it handles on stdout, one line each, flushed:

* ``got SIGTERM`` — then exits 0, or with ``--ignore-term`` prints ``ignored SIGTERM`` and goes on
  (only SIGKILL ends it then);
* ``got SIGCONT <n>`` — the n-th time it was continued after a SIGSTOP (the handler runs when the
  process resumes, so this is the workload's own evidence of a duty cycle).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("device")
    parser.add_argument("--ignore-term", action="store_true")
    args = parser.parse_args()

    device = open(args.device, "rb")  # noqa: SIM115 - held open for the process's life
    continued = 0

    def say(line: str) -> None:
        # os.write, not print: Python runs a signal handler inside another's buffered write (its
        # flush checks for signals), and print from there raises "reentrant call inside
        # BufferedWriter" and ends the process, which a flood of SIGCONTs followed by a SIGTERM
        # did (issue 38 row 6). One small write to a pipe is atomic, and has no lock to re-enter.
        os.write(1, (line + "\n").encode())

    def on_term(signum: int, frame: object) -> None:
        say("got SIGTERM")
        if args.ignore_term:
            say("ignored SIGTERM")
            return
        device.close()
        sys.exit(0)

    def on_cont(signum: int, frame: object) -> None:
        nonlocal continued
        continued += 1
        say(f"got SIGCONT {continued}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGCONT, on_cont)
    say(f"ready {os.getpid()}")
    while True:
        signal.pause()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        sys.exit(0)
