"""A CPU-bound stand-in for a GPU workload: spins for ever (the freezer test measures its CPU time).

    python spin.py DEVICE_FILE

Holds DEVICE_FILE open as the test workload does, prints ``ready <pid>`` and spins."""

from __future__ import annotations

import os
import sys


def main() -> None:
    device = open(sys.argv[1], "rb")  # noqa: SIM115 - held open for the process's life
    print(f"ready {os.getpid()}", flush=True)
    count = 0
    while device:
        count += 1


if __name__ == "__main__":
    main()
