"""A GPU "workload" for bench.enforcer_tick: holds DEVICE_FILE open, prints ``ready``, and on SIGTERM
prints ``time.time()`` (the moment the signal was handled) and exits.

    python bench/_victim.py DEVICE_FILE
"""

import os
import signal
import sys
import time

device = open(sys.argv[1], "rb")  # noqa: SIM115 - held for the process's life


def on_term(signum, frame):
    now = time.time()
    os.write(1, f"term {now!r}\n".encode())
    os._exit(0)


signal.signal(signal.SIGTERM, on_term)
os.write(1, f"ready {os.getpid()}\n".encode())
while True:
    signal.pause()
