"""A GPU compute hog as the simulated driver sees it: holds DEVICE_FILE open and waits, as a CUDA
program blocked on its stream does while the GPU runs its kernels. Its SM use is the driver's (the
state file's, while the process is runnable: ``util_lag_ms``), not its CPU's.

    python gpu_hog.py DEVICE_FILE

Prints ``ready <pid>``; counts the SIGCONTs it is given, silently (a helper may send thousands), and
prints ``continued <n>`` on SIGUSR1. A SIGCONT's handler runs only once the process runs again, so
the count says the signals arrived, not that they were taken while it was frozen."""

from __future__ import annotations

import os
import signal
import sys


def main() -> None:
    device = open(sys.argv[1], "rb")  # noqa: SIM115 - held open for the process's life
    continued = 0

    def on_cont(signum: int, frame: object) -> None:
        nonlocal continued
        continued += 1

    def on_usr1(signum: int, frame: object) -> None:
        os.write(1, f"continued {continued}\n".encode())

    signal.signal(signal.SIGCONT, on_cont)
    signal.signal(signal.SIGUSR1, on_usr1)
    os.write(1, f"ready {os.getpid()}\n".encode())
    while device:
        signal.pause()


if __name__ == "__main__":
    main()
