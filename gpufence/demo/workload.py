"""A stand-in GPU job for the local demo.

    python -m gpufence.demo.workload DEVICE_FILE

It holds DEVICE_FILE open (a temp file standing in for /dev/nvidia0: the enforcer accepts a process
as a GPU process only if it holds an NVIDIA device file open), prints ``ready <pid>``, then a
``step N`` heartbeat every 0.2 s so the demo can show it keeps running. Its container comes from
the ``GPUFENCE_CONTAINER`` variable the webhook injected; its simulated GPU memory and SM use are
set by the demo in the simulated driver's state file. On SIGTERM it says so and exits like a
well-behaved training job that checkpoints and leaves.
"""

from __future__ import annotations

import signal
import sys
import threading


def main() -> int:
    device = open(sys.argv[1], "rb")  # noqa: SIM115 - held open for the process's whole life
    stop = threading.Event()

    def on_term(signum: int, _frame: object) -> None:
        print("got SIGTERM: checkpointing and exiting", flush=True)
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    print(f"ready {threading.get_native_id()}", flush=True)
    step = 0
    while not stop.wait(0.2):
        step += 1
        print(f"step {step}", flush=True)
    device.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        sys.exit(0)
