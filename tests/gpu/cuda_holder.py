#!/usr/bin/env python3
"""A CUDA process that holds GPU memory: ``cuda_holder.py BACKEND MIB`` (BACKEND ``torch`` or ``cupy``).

Allocates MIB MiB on the first GPU, prints ``READY <its pid as it sees it>`` and holds the memory
until its stdin closes. The GPU scripts beside it start it where they need a GPU process: in this
PID namespace, in a new one, or in a cgroup of its own.
"""

import os
import sys

backend, mib = sys.argv[1], int(sys.argv[2])
if backend == "torch":
    import torch

    block = torch.ones(mib << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
else:
    import cupy

    block = cupy.ones(mib << 20, dtype=cupy.uint8)
    cupy.cuda.Device().synchronize()
print(f"READY {os.getpid()}", flush=True)
sys.stdin.read()
