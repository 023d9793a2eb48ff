"""A GPU workload that allocates on the simulated driver, for the driver-limit scenarios.

    python alloc_workload.py DEVICE_FILE UUID

Opens DEVICE_FILE (the enforcer accepts a process only if it holds such a file), prints
``ready <pid>``, then for each line ``alloc <bytes>`` on stdin allocates through the simulated
driver (``gpufence.simnvml.workload.allocate``, in this process, charged to this process's cgroup)
and prints ``allocated <bytes>`` or ``CUDA error: out of memory``. On SIGTERM it prints
``got SIGTERM`` and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys

from gpufence.simnvml import workload


def main() -> int:
    device_file, uuid = sys.argv[1], sys.argv[2]
    device = open(device_file, "rb")  # noqa: SIM115 - held open for the process's life

    def on_term(signum: int, frame: object) -> None:
        print("got SIGTERM", flush=True)
        device.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    print(f"ready {os.getpid()}", flush=True)
    for line in sys.stdin:
        op, _, arg = line.strip().partition(" ")
        if op != "alloc":
            continue
        try:
            workload.allocate(uuid, int(arg))
        except workload.SimOutOfMemoryError:
            print("CUDA error: out of memory", flush=True)
        else:
            print(f"allocated {arg}", flush=True)
    signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
