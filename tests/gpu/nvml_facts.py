#!/usr/bin/env python3
"""What the node's driver offers gpufence, read through the real ``pynvml``: no CUDA, no enforcer.

Prints one JSON object (``facts: {...}``) with:

* the driver, NVML and CUDA driver versions;
* per device: name, UUID, total memory, MIG mode;
* whether the R615 per-cgroup memory limit calls exist (``nvmlDeviceGetMemoryLimits_v1`` /
  ``nvmlDeviceSetMemoryLimits_v1``): ``present`` when the library exports the symbol, and what a
  read for this process's own cgroup answers (the limits and ``currentUsed``, or the NVML error);
* the compute processes each device lists, with their memory, and whether each PID names a live
  process in this PID namespace (current drivers translate PIDs into the caller's namespace; a
  mismatch means host PIDs);
* the utilisation samples of the last second;
* call costs: median and p99 microseconds per call of the calls the enforcer makes every poll.

``run_gpu_validation.py`` prints these facts first (and again while its workloads run), so that a
run on a real GPU answers which enforcement points the node has. Works against the simulated
driver too (tests/integration/test_gpu_facts.py), where the limit calls are reported missing or
present as the simulation says.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

CALLS_PER_COST = 200


def own_cgroup_namespace(proc: Path = Path("/proc/self/cgroup")) -> str | None:
    """The path the limit calls take for this process's cgroup: ``/sys/fs/cgroup/<path>`` from the
    unified (``0::``) line, as the container toolkit's hook computes it; None where there is no
    unified line (cgroup v1 only)."""
    for line in proc.read_text().splitlines():
        if line.startswith("0::"):
            return ("/sys/fs/cgroup" + line[3:]).rstrip("/")
    return None


def cgroup_version(root: Path = Path("/sys/fs/cgroup")) -> str:
    """``v2`` when /sys/fs/cgroup is the unified hierarchy (what the toolkit's hook requires), else ``v1``."""
    return "v2" if (root / "cgroup.controllers").exists() else "v1"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _cost(call: Callable[[], Any], calls: int) -> dict[str, float] | str:
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        try:
            call()
        except Exception as exc:  # the fact is that the call fails, and how
            return f"error: {exc}"
        samples.append((time.perf_counter_ns() - start) / 1000)
    samples.sort()
    return {"median_us": round(statistics.median(samples), 2),
            "p99_us": round(samples[min(len(samples) - 1, int(len(samples) * 0.99))], 2)}


def memory_limits(nvml: Any, handle: Any, namespace: str | None) -> dict[str, Any]:
    """Whether the R615 limit calls exist in the loaded library and what a read for ``namespace`` gives."""
    library = nvml.nvmlLib
    present = {name: hasattr(library, name)
               for name in ("nvmlDeviceGetMemoryLimits_v1", "nvmlDeviceSetMemoryLimits_v1")}
    result: dict[str, Any] = {"symbols": present}
    if not present["nvmlDeviceGetMemoryLimits_v1"]:
        result["get"] = "function not found (driver older than R615)"
        return result
    if namespace is None:
        result["get"] = "not tried: no cgroup v2 path for this process"
        return result
    limits = nvml.c_nvmlGetMemoryLimits_v1_t()
    limits.nameSpace = ctypes.c_char_p(namespace.encode())
    try:
        nvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
    except nvml.NVMLError as exc:
        result["get"] = f"error: {exc}"
    else:
        result["get"] = {"nameSpace": namespace, "softLimit": limits.softLimit, "hardLimit": limits.hardLimit,
                         "currentUsed": limits.currentUsed}
    return result


def processes(nvml: Any, handle: Any) -> list[dict[str, Any]]:
    listed = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    return [{"pid": p.pid, "usedGpuMemory": p.usedGpuMemory,
             "pid_is_local": os.path.exists(f"/proc/{p.pid}")} for p in listed]


def utilisation(nvml: Any, handle: Any, since_us: int) -> list[dict[str, int]] | str:
    try:
        samples = nvml.nvmlDeviceGetProcessUtilization(handle, since_us)
    except nvml.NVMLError as exc:
        return f"error: {exc}"
    return [{"pid": s.pid, "smUtil": s.smUtil, "memUtil": s.memUtil, "timeStamp": s.timeStamp} for s in samples]


def collect(nvml: Any, calls: int = CALLS_PER_COST) -> dict[str, Any]:
    """The facts; ``nvml`` is the ``pynvml`` module, already initialised."""
    namespace = own_cgroup_namespace()
    facts: dict[str, Any] = {
        "driver_version": _text(nvml.nvmlSystemGetDriverVersion()),
        "nvml_version": _text(nvml.nvmlSystemGetNVMLVersion()),
        "cuda_driver_version": nvml.nvmlSystemGetCudaDriverVersion_v2(),
        "cgroup": {"version": cgroup_version(), "own_namespace": namespace},
        "devices": [],
    }
    since_us = int((time.time() - 1.0) * 1e6)
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            mig = nvml.nvmlDeviceGetMigMode(handle)[0]
        except nvml.NVMLError as exc:
            mig = f"error: {exc}"
        facts["devices"].append({
            "index": index,
            "name": _text(nvml.nvmlDeviceGetName(handle)),
            "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
            "memory_total": memory.total,
            "memory_used": memory.used,
            "mig_mode": mig,
            "memory_limits": memory_limits(nvml, handle, namespace),
            "processes": processes(nvml, handle),
            "utilisation_samples": utilisation(nvml, handle, since_us),
            "call_costs": {
                "nvmlDeviceGetComputeRunningProcesses": _cost(
                    lambda h=handle: nvml.nvmlDeviceGetComputeRunningProcesses(h), calls),
                "nvmlDeviceGetProcessUtilization": _cost(
                    lambda h=handle: _ignore_not_found(nvml, lambda: nvml.nvmlDeviceGetProcessUtilization(h, 0)),
                    calls),
                "nvmlDeviceGetMemoryInfo": _cost(lambda h=handle: nvml.nvmlDeviceGetMemoryInfo(h), calls),
            },
        })
    return facts


def _ignore_not_found(nvml: Any, call: Callable[[], Any]) -> None:
    # No sample since the last call is an answer, not a failure: it costs the same round trip.
    with contextlib.suppress(nvml.NVMLError_NotFound):
        call()


def main() -> int:
    try:
        import pynvml
    except ImportError:
        print("skipped: pynvml is not importable")
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"skipped: nvmlInit failed ({exc})")
        return 0
    try:
        print("facts: " + json.dumps(collect(pynvml), sort_keys=True))
    finally:
        pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
