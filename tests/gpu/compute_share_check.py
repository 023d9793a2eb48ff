#!/usr/bin/env python3
"""Whether the enforcer's compute share gives a neighbour its GPU time back: real driver, real CUDA.

Without MPS or MIG, processes on one GPU time-slice it; the enforcer holds a container to its
compute share by stopping and continuing its processes (SIGSTOP/SIGCONT duty cycle) on measured SM
utilisation. This run measures what that is worth, in matrix products per second (PyTorch, bf16
``--size`` cubed, each process counting its own):

1. ``a`` alone, then ``c`` alone: each one's solo rate;
2. both together, no enforcer: how they share the GPU;
3. the enforcer (``python -m gpufence.enforcer``, poll ``--poll-interval``) with ``a`` at
   ``--share`` percent and ``c`` without a compute share: after ``throttle_start`` for ``a``,
   ``--seconds`` of both rates.

Prints ``compute_share: {...}``: the rates, each as a fraction of its solo rate, and the
enforcer's throttle records. Pass: ``a`` keeps running, ``a``'s fraction while throttled is at
most its share plus ``--tolerance``, and ``c`` gets more than it did beside an unthrottled ``a``.
``--neighbours N`` runs N busy neighbours (``c``, ``d``, ...), as on a GPU time-sliced N+1 ways;
each must then gain.
``skipped:`` (exit 0) without NVML or PyTorch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

REPO = pathlib.Path(__file__).resolve().parents[2]

# argv: matrix size, busy fraction (1: as fast as it can; below 1 it sleeps after each batch so that
# its GPU work takes about that fraction of the time). Prints "COUNT <monotonic time> <products so
# far>" about every 0.1 s: cumulative, so a window's throughput counts the time the process was
# stopped (a median of per-interval rates would not: it measures the rate while running).
WORKLOAD = r"""
import sys, time, torch
n, busy = int(sys.argv[1]), float(sys.argv[2])
m = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
count, printed = 0, 0.0
while True:
    t = time.monotonic()
    for _ in range(4):
        m @ m
    torch.cuda.synchronize()
    count += 4
    now = time.monotonic()
    if busy < 1:
        time.sleep((now - t) * (1 - busy) / busy)
        now = time.monotonic()
    if now - printed >= 0.1:
        print(f"COUNT {now:.6f} {count}", flush=True)
        printed = now
"""


class Rates:
    """A workload's COUNT lines, collected on a thread."""

    def __init__(self, name: str, process: subprocess.Popen[str]) -> None:
        self.name, self.process = name, process
        self.samples: list[tuple[float, float]] = []
        self._first = threading.Event()
        assert process.stdout is not None
        threading.Thread(target=self._pump, args=(process.stdout,), daemon=True).start()

    def _pump(self, pipe: IO[str]) -> None:
        for line in pipe:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "COUNT":
                self.samples.append((float(parts[1]), float(parts[2])))
                self._first.set()

    def ready(self, timeout: float) -> bool:
        return self._first.wait(timeout)

    def throughput(self, start: float, end: float) -> float | None:
        """Products per second between the first and the last count inside [start, end]."""
        window = [(t, count) for t, count in self.samples if start <= t <= end]
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return None
        return round((window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]), 2)


def start(name: str, size: int, env: dict[str, str], busy: float = 1.0) -> Rates:
    process = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(size), str(busy)], stdout=subprocess.PIPE,
                               text=True, env={**env, "GPUFENCE_CONTAINER": name})
    return Rates(name, process)


def stop(rates: Rates | None) -> None:
    if rates is None or rates.process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        rates.process.send_signal(signal.SIGCONT)  # never leave a stopped process behind
        rates.process.kill()
    rates.process.wait(timeout=30)


def measure(seconds: float, *workloads: Rates) -> dict[str, float | None]:
    begin = time.monotonic()
    time.sleep(seconds)  # rates accumulate on their own threads; nothing to await
    end = time.monotonic()
    return {w.name: w.throughput(begin, end) for w in workloads}


def solo(name: str, size: int, env: dict[str, str], seconds: float) -> float | None:
    rates = start(name, size, env)
    try:
        if not rates.ready(120):
            return None
        return measure(seconds, rates)[name]
    finally:
        stop(rates)


def raw_samples(seconds: float, names: dict[int, str]) -> list[list[Any]] | str:
    """NVML's per-process utilisation samples as the driver gives them, read every 0.5 s for
    ``seconds``: [pid's name, timestamp (us), smUtil] for the given PIDs. Shows the sampling period
    and what a throttled process's samples look like while it is stopped."""
    import pynvml

    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        out: list[list[Any]] = []
        last = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.5)  # the enforcer's default interval: what one of its reads would get
            with contextlib.suppress(pynvml.NVMLError_NotFound):
                for sample in pynvml.nvmlDeviceGetProcessUtilization(handle, last):
                    if sample.pid in names and sample.timeStamp > last:
                        out.append([names[sample.pid], sample.timeStamp, sample.smUtil])
            if out:
                last = max(last, max(row[1] for row in out))
        return sorted(out, key=lambda row: row[1])
    except pynvml.NVMLError as exc:
        return f"error: {exc}"
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def fraction(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=8192, help="matrix size (default 8192)")
    parser.add_argument("--share", type=float, default=30, help="a's compute share, percent (default 30)")
    parser.add_argument("--seconds", type=float, default=8, help="each measuring window (default 8)")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="enforcer poll (default 0.5)")
    parser.add_argument("--tolerance", type=float, default=0.15, help="slack over the share (default 0.15)")
    parser.add_argument("--throttle-timeout", type=float, default=60, help="wait for throttle_start (default 60)")
    parser.add_argument("--neighbours", type=int, default=1, choices=range(1, 8), metavar="1-7",
                        help="busy neighbours without a compute share, named c, d, ... (default 1)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("pynvml") is None:
        print("skipped: needs PyTorch and pynvml")
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("GPUFENCE_CONTAINER", None)
    result: dict[str, Any] = {"size": args.size, "share_percent": args.share, "poll_interval": args.poll_interval}
    names = ["a"] + [chr(ord("c") + i) for i in range(args.neighbours)]
    result["neighbours"] = args.neighbours
    # The workloads are identical: a's and c's solo rates are measured, and c's stands for the rest.
    result["solo"] = {name: solo(name, args.size, env, args.seconds / 2) for name in names[:2]}
    result["solo"].update({name: result["solo"]["c"] for name in names[2:]})
    a = enforcer = None
    others: list[Rates] = []
    records: list[dict[str, Any]] = []
    throttled = threading.Event()
    try:
        a = start("a", args.size, env)
        others = [start(name, args.size, env) for name in names[1:]]
        if not all(w.ready(120) for w in [a, *others]):
            print("error: the workloads did not start (CUDA?)")
            return 2
        pids = {w.process.pid: w.name for w in [a, *others]}
        result["together"] = measure(args.seconds, a, *others)
        result["raw_samples_together"] = raw_samples(2, pids)
        with tempfile.TemporaryDirectory(prefix="gpufence-compute-") as tmp:
            config = pathlib.Path(tmp, "config.json")
            config.write_text(json.dumps({"version": 1, "mode": "enforce", "pollIntervalSeconds": args.poll_interval,
                                          "containers": {"a": {"computePercent": args.share},
                                                         **{n: {"memoryBytes": 64 << 30} for n in names[1:]}}}))
            pathlib.Path(tmp, "state").mkdir()
            enforcer = subprocess.Popen(
                [sys.executable, "-m", "gpufence.enforcer", "--config", str(config), "--metrics-port", "0",
                 "--state-dir", f"{tmp}/state"],
                stdout=subprocess.PIPE, text=True, cwd=REPO,
                env={**env, "GPUFENCE_POD_NAME": "compute-share", "GPUFENCE_POD_NAMESPACE": "local"})

            def pump(pipe: IO[str]) -> None:
                for line in pipe:
                    with contextlib.suppress(ValueError):
                        record = json.loads(line)
                        if record.get("event", "").startswith("throttle"):
                            records.append(record)
                            if record["event"] == "throttle_start" and record.get("container") == "a":
                                throttled.set()

            assert enforcer.stdout is not None
            threading.Thread(target=pump, args=(enforcer.stdout,), daemon=True).start()
            t0 = time.monotonic()
            if not throttled.wait(args.throttle_timeout):
                result["error"] = f"no throttle_start for a within {args.throttle_timeout:g} s"
            else:
                result["throttle_start_after_s"] = round(time.monotonic() - t0, 3)
                time.sleep(2 * args.poll_interval + 1)  # let the controller settle on its first duty cycle
                result["throttled"] = measure(args.seconds, a, *others)
                result["raw_samples_throttled"] = raw_samples(3, pids)
            result["a_alive"] = a.process.poll() is None
    finally:
        if enforcer is not None:
            enforcer.terminate()
            try:
                enforcer.wait(timeout=15)
            except subprocess.TimeoutExpired:
                enforcer.kill()
        for workload in [a, *others]:
            stop(workload)
    solo_rates = result["solo"]
    for phase in ("together", "throttled"):
        if phase in result:
            result[f"{phase}_fraction_of_solo"] = {k: fraction(v, solo_rates[k]) for k, v in result[phase].items()}
    result["throttle_records"] = records[:6]
    frac = result.get("throttled_fraction_of_solo", {})
    before = result.get("together_fraction_of_solo", {})
    ok = (result.get("a_alive") and frac.get("a") is not None and frac["a"] <= args.share / 100 + args.tolerance
          and all(frac.get(n) is not None and before.get(n) is not None and frac[n] > before[n] for n in names[1:]))
    result["result"] = "pass" if ok else "fail"
    print("compute_share: " + json.dumps(result, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
