#!/usr/bin/env python3
"""What NVML's per-process utilisation says about time-sliced CUDA processes: raw data for the
compute controller, real driver, real CUDA.

Two PyTorch workloads (``compute_share_check.WORKLOAD``: bf16 matrix products, each counting its
own) run in phases; in each, their true throughput (products per second over the phase, stopped
time included) is measured beside what ``nvmlDeviceGetProcessUtilization`` returned on every read:
the read's time, and each record's process, timestamp and SM%. Phases:

1. ``solo``: ``a`` alone, as fast as it can;
2. ``partial``: ``a`` alone, busy about 30 % of the time;
3. ``together``: ``a`` and ``c`` as fast as they can, reads every 0.25 s and then every 2 s (does
   one read return several samples of a process?), then one read from timestamp 0 (what the
   driver keeps);
4. ``duty``: as 3, with this script stopping ``a`` 70 % of each second (SIGSTOP/SIGCONT): what a
   run fraction of 0.3 does to each one's throughput, and what NVML shows of it.

Prints ``compute_trace: {...}`` (one JSON line). ``skipped:`` (exit 0) without NVML or PyTorch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from compute_share_check import REPO, Rates, start, stop

SIZE = 8192


class Reader:
    """Reads NVML's per-process utilisation on a thread on a schedule of (interval, seconds)."""

    def __init__(self, handle: Any, names: dict[int, str]) -> None:
        self.handle, self.names = handle, names
        self.reads: list[dict[str, Any]] = []
        self.last = 0

    def run(self, schedule: list[tuple[float, float]], t0: float) -> None:
        import pynvml

        for interval, seconds in schedule:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(interval)
                begin = time.perf_counter()
                try:
                    samples = pynvml.nvmlDeviceGetProcessUtilization(self.handle, self.last)
                except pynvml.NVMLError as exc:
                    samples, error = [], str(exc)
                else:
                    error = None
                cost_us = round((time.perf_counter() - begin) * 1e6)
                try:
                    device: int | None = pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu
                except pynvml.NVMLError:  # the simulated driver of a dry run has no device rates
                    device = None
                records = [[self.names.get(s.pid, s.pid), s.timeStamp, s.smUtil] for s in samples]
                fresh = [r for r in records if r[1] > self.last]
                if fresh:
                    self.last = max(r[1] for r in fresh)
                self.reads.append({"t": round(time.monotonic() - t0, 3), "interval": interval, "us": cost_us,
                                   "device_gpu": device, "records": records, "fresh": len(fresh),
                                   **({"error": error} if error else {})})


def duty_cycle(process: Any, run: float, period: float, stop_event: threading.Event) -> None:
    """Stops ``process`` for (1 - run) of each period until ``stop_event``; leaves it running."""
    try:
        while not stop_event.is_set():
            process.send_signal(signal.SIGCONT)
            if stop_event.wait(run * period):
                break
            process.send_signal(signal.SIGSTOP)
            stop_event.wait((1 - run) * period)
    except ProcessLookupError:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)  # never leave it stopped


def phase(handle: Any, workloads: list[Rates], schedule: list[tuple[float, float]],
          duty: float | None = None) -> dict[str, Any]:
    names = {w.process.pid: w.name for w in workloads}
    reader = Reader(handle, names)
    stop_event = threading.Event()
    cycler = None
    if duty is not None:
        cycler = threading.Thread(target=duty_cycle, args=(workloads[0].process, duty, 1.0, stop_event))
        cycler.start()
    t0 = time.monotonic()
    # A first read so that the phase's reads start from the driver's newest sample.
    reader.run([(0.0, 0.001)], t0)
    reader.reads.clear()
    begin = time.monotonic()
    reader.run(schedule, t0)
    end = time.monotonic()
    stop_event.set()
    if cycler is not None:
        cycler.join()
    return {"seconds": round(end - begin, 2),
            "throughput": {w.name: w.throughput(begin, end) for w in workloads},
            "reads": reader.reads}


def main() -> int:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("pynvml") is None:
        print("skipped: needs PyTorch and pynvml")
        return 0
    import pynvml

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("GPUFENCE_CONTAINER", None)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    result: dict[str, Any] = {"driver": pynvml.nvmlSystemGetDriverVersion(), "size": SIZE}
    a = c = None
    try:
        for name, busy in (("solo", 1.0), ("partial", 0.3)):
            a = start("a", SIZE, env, busy)
            if not a.ready(120):
                print("error: the workload did not start (CUDA?)")
                return 2
            result[name] = phase(handle, [a], [(0.5, 6)])
            stop(a)
        a, c = start("a", SIZE, env), start("c", SIZE, env)
        if not (a.ready(120) and c.ready(120)):
            print("error: the workloads did not start (CUDA?)")
            return 2
        result["together"] = phase(handle, [a, c], [(0.25, 4), (2.0, 6)])
        names = {a.process.pid: "a", c.process.pid: "c"}
        kept = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
        result["kept_from_zero"] = [[names.get(s.pid, s.pid), s.timeStamp, s.smUtil] for s in kept]
        result["duty"] = phase(handle, [a, c], [(0.5, 8)], duty=0.3)
    finally:
        stop(a)
        stop(c)
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    print("compute_trace: " + json.dumps(result, sort_keys=True, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
