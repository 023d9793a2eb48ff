"""A simulated CUDA workload's allocations: what a process using the simulated GPU calls.

``allocate(uuid, nbytes)`` calls ``simnvmlAllocate`` in the simulated ``libnvidia-ml.so.1`` (found
through ``LD_LIBRARY_PATH``, as ``simulated_env`` sets it) in the calling process, which the driver
charges: past the hard limit that applies to the caller's cgroup on that device, or past the
device's memory, it raises ``SimOutOfMemoryError`` (the driver's ``NVML_ERROR_MEMORY``, 20; a CUDA
program sees ``CUDA_ERROR_OUT_OF_MEMORY``) and records nothing. Otherwise the bytes are added to the
caller's usage, which NVML's process lists, memory info and ``currentUsed`` show until the process
frees them or exits.

As a command (inside a workload container)::

    python -m gpufence.simnvml.workload --uuid GPU-... --allocate 2147483648 [--hold]

prints ``allocated <n> bytes on <uuid>`` and exits 0, or prints ``CUDA error: out of memory`` to
stderr and exits 2 (cudaErrorMemoryAllocation is 2); ``--hold`` keeps the memory until SIGTERM.
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import sys

from gpufence.simnvml.build import LIBRARY_NAME
from gpufence.simnvml.state import ERROR_CODES

OUT_OF_MEMORY = ERROR_CODES["MEMORY"]
EXIT_OUT_OF_MEMORY = 2


class SimAllocationError(RuntimeError):
    """The simulated driver refused an allocation; ``code`` is its NVML return code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class SimOutOfMemoryError(SimAllocationError, MemoryError):
    """Out of memory: the caller's cgroup would pass its hard limit, or the device its memory."""


def _library(library: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(library)
    for name in ("simnvmlAllocate", "simnvmlFree"):
        fn = getattr(lib, name)
        fn.argtypes = (ctypes.c_char_p, ctypes.c_ulonglong)
        fn.restype = ctypes.c_int
    return lib


def _call(name: str, uuid: str, nbytes: int, library: str) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes < 1 << 64:
        raise ValueError(f"nbytes must be a non-negative 64-bit integer, got {nbytes!r}")
    code = getattr(_library(library), name)(uuid.encode(), nbytes)
    if code == OUT_OF_MEMORY:
        raise SimOutOfMemoryError(code, f"out of memory: {nbytes} bytes more on {uuid} refused by the simulated driver")
    if code != 0:
        names = {v: k for k, v in ERROR_CODES.items()}
        raise SimAllocationError(code, f"{name}({uuid}, {nbytes}) failed: NVML_ERROR_{names.get(code, code)}")


def allocate(uuid: str, nbytes: int, library: str = LIBRARY_NAME) -> None:
    """Charges ``nbytes`` to the calling process on device ``uuid``; raises SimOutOfMemoryError."""
    _call("simnvmlAllocate", uuid, nbytes, library)


def free(uuid: str, nbytes: int, library: str = LIBRARY_NAME) -> None:
    """Gives back up to ``nbytes`` of what the calling process allocated on ``uuid``."""
    _call("simnvmlFree", uuid, nbytes, library)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpufence.simnvml.workload", description=__doc__.split("\n")[0])
    parser.add_argument("--uuid", required=True, help="the simulated device's UUID")
    parser.add_argument("--allocate", type=int, required=True, metavar="BYTES")
    parser.add_argument("--hold", action="store_true", help="keep the memory until SIGTERM")
    args = parser.parse_args(argv)
    try:
        allocate(args.uuid, args.allocate)
    except SimOutOfMemoryError as exc:
        print(f"CUDA error: out of memory ({exc})", file=sys.stderr, flush=True)
        return EXIT_OUT_OF_MEMORY
    print(f"allocated {args.allocate} bytes on {args.uuid}", flush=True)
    if args.hold:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
