"""The enforcer's poll-and-decide tick, its CPU and memory at rest, and its reaction time.

    python -m bench.enforcer_tick [--counts 1,16,64,256] [--ticks 30] [--cpu-seconds 30]
                                  [--trials 50] [--no-write]

Real processes (``sleep`` children holding a fake device file open, each with its own
``GPUFENCE_CONTAINER``) stand behind the simulated NVML's process list, so attribution reads real
``/proc``. Three measurements:

1. **Tick** (in process): ``Enforcer.tick()`` with the real adapters (pynvml on the simulated
   ``libnvidia-ml.so.1``, attribution, policy, metrics; nothing is over its share) for 1..256 GPU
   processes; median and p99 over ``--ticks`` warm ticks, the first (cold) tick after the process
   list appeared, and the split sample / attribute / policy.
2. **At rest**: ``python -m enforcer --simulate`` (default 0.5 s interval) watching 64 processes:
   CPU share of one core and RSS over ``--cpu-seconds`` (psutil on the enforcer process).
3. **Reaction**: a workload goes over its share (the moment before the state file is written) to
   the moment its SIGTERM handler runs (it prints ``time.time()``), ``--trials`` times with a random
   phase against the poll interval.

Targets: tick < 5 ms at 64 processes, < 1 % of one core, RSS < 60 MB, p99 reaction < interval + 100 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, table, write_section
from tests.support.server_process import child_env
from tests.support.stats import median, percentile

MiB, GiB = 1 << 20, 1 << 30
CONTAINERS = ("c0", "c1", "c2", "c3")
INTERVAL = 0.5
VICTIM = Path(__file__).resolve().parent / "_victim.py"


# The reaction-time workload's own container: a container over its share is terminated as a whole,
# so it must not share one with the background processes.
VICTIM_CONTAINER = "victim"
SHARE = 8 * GiB


def config_doc(interval: float = INTERVAL) -> dict[str, Any]:
    containers = {c: {"memoryBytes": SHARE, "computePercent": 50} for c in (*CONTAINERS, VICTIM_CONTAINER)}
    return {"version": 1, "mode": "enforce", "gracePeriodSeconds": 10, "pollIntervalSeconds": interval,
            "containers": containers}


@contextlib.contextmanager
def gpu_processes(n: int, device: Path) -> Iterator[list[int]]:
    """``n`` sleep processes holding ``device`` open, spread over the containers."""
    procs: list[subprocess.Popen[bytes]] = []
    fd = os.open(device, os.O_RDONLY)
    try:
        for i in range(n):
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GPUFENCE_CONTAINER": CONTAINERS[i % 4]}
            procs.append(subprocess.Popen(["sleep", "3600"], pass_fds=(fd,), env=env))
        yield [p.pid for p in procs]
    finally:
        os.close(fd)
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def sim_state(pids: list[int], extra: tuple[Any, ...] = ()) -> Any:
    from gpufence.simnvml import SimDevice, SimProcess, SimState

    procs = tuple(SimProcess.for_pid(pid, 10 * MiB, sm_util=1) for pid in pids) + extra
    return SimState(devices=(SimDevice("GPU-bench-0", 80 * GiB, procs),))


# --- 1. tick in process ---------------------------------------------------------------------------
def measure_ticks(root: Path, counts: list[int], ticks: int) -> list[dict[str, Any]]:
    from gpufence import simnvml
    from gpufence.contract import EnforcerConfig
    from gpufence.enforcer.act.signals import SafeSignaller
    from gpufence.enforcer.act.stopped_state import StoppedState
    from gpufence.enforcer.act.throttle import ThrottleExecutor
    from gpufence.enforcer.decide.rules import ComputeTracker, memory_orders, usage_by_container
    from gpufence.enforcer.loop import Enforcer
    from gpufence.enforcer.observe.attribution import Attributor, PidMode
    from gpufence.enforcer.observe.nvml import NvmlClient
    from gpufence.enforcer.report.decision_log import DecisionLog
    from gpufence.enforcer.report.events import EventRecorder, PodRef
    from gpufence.enforcer.report.health import Health
    from gpufence.enforcer.report.metrics import EnforcerMetrics

    lib = simnvml.build_library()
    device, state = root / "dev" / "nvidia0", root / "sim-state"
    os.environ[simnvml.ENV_STATE] = str(state)
    simnvml.write_state(state, sim_state([]))
    config = EnforcerConfig.from_dict(config_doc())
    log = DecisionLog(namespace="bench", pod="bench", stream=io.StringIO())
    signaller = SafeSignaller(log)
    stopped = StoppedState(None, log)
    throttle = ThrottleExecutor(signaller, stopped, log)
    attributor = Attributor(PidMode.LOCAL, device_prefix=str(root / "dev" / "nvidia"))
    enforcer = Enforcer(
        config, pid_mode=PidMode.LOCAL, attributor=attributor,
        client_factory=lambda: NvmlClient(library_path=lib), signaller=signaller, throttle=throttle,
        stopped=stopped, log=log, metrics=EnforcerMetrics("bench", "bench"), health=Health(INTERVAL),
        events=EventRecorder(log, PodRef("bench", "bench", None)),
    )
    assert enforcer.open_nvml(), "cannot open the simulated NVML"
    split_client = NvmlClient(library_path=lib)
    split_client.open()
    rows = []
    try:
        for n in counts:
            with gpu_processes(n, device) as pids:
                simnvml.write_state(state, sim_state(pids))
                t = time.perf_counter()
                enforcer.tick()
                cold = time.perf_counter() - t
                for _ in range(3):
                    enforcer.tick()
                times = []
                for _ in range(ticks):
                    t = time.perf_counter()
                    enforcer.tick()
                    times.append(time.perf_counter() - t)
                    time.sleep(0.002)
                # The split, with a separate attributor so the enforcer's caches are not disturbed.
                split_attr = Attributor(PidMode.LOCAL, device_prefix=str(root / "dev" / "nvidia"))
                tracker = ComputeTracker()
                split_attr.attribute(split_client.sample())
                s_t, a_t, p_t = [], [], []
                attributed = 0
                for _ in range(ticks):
                    t0 = time.perf_counter()
                    sample = split_client.sample()
                    t1 = time.perf_counter()
                    attribution = split_attr.attribute(sample)
                    t2 = time.perf_counter()
                    totals = {d.index: d.total_memory_bytes for d in sample.devices}
                    memory_orders(usage_by_container(attribution, config, totals))
                    tracker.observe(time.monotonic(), attribution, config)
                    tracker.plan(time.monotonic(), config)
                    t3 = time.perf_counter()
                    s_t.append(t1 - t0)
                    a_t.append(t2 - t1)
                    p_t.append(t3 - t2)
                    attributed = sum(1 for p in attribution.processes if p.container is not None)
                rows.append({"n": n, "attributed": attributed, "tick_ms": median(times) * 1e3,
                             "tick_p99_ms": percentile(times, 99) * 1e3, "cold_ms": cold * 1e3,
                             "sample_ms": median(s_t) * 1e3, "attribute_ms": median(a_t) * 1e3,
                             "policy_ms": median(p_t) * 1e3})
                print(f"tick n={n}: {rows[-1]}", flush=True)
    finally:
        split_client.close()
        enforcer.close()
    return rows


# --- 2 and 3: the enforcer as a subprocess --------------------------------------------------------
class EnforcerProcess:
    def __init__(self, root: Path) -> None:
        from gpufence import simnvml


        self.state = root / "sim-state"
        cfg = root / "config.json"
        cfg.write_text(json.dumps(config_doc()))
        (root / "state-dir").mkdir(exist_ok=True)
        env = child_env()
        env.update(simnvml.simulated_env(simnvml.build_library(), self.state))
        argv = [sys.executable, "-m", "gpufence.enforcer", "--simulate", str(self.state), "--config", str(cfg),
                "--nvidia-device-prefix", str(root / "dev" / "nvidia"), "--metrics-port", "0",
                "--bind-address", "127.0.0.1", "--state-dir", str(root / "state-dir")]
        self.stderr = open(root / "enforcer.stderr", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True)
        self.lines: list[dict[str, Any]] = []
        self._started = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._started.wait(30):
            raise RuntimeError(f"enforcer did not start: {(root / 'enforcer.stderr').read_text()[-2000:]}")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                self.lines.append(record)
                if record.get("event") == "started":
                    self._started.set()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def measure_rest(enf: EnforcerProcess, seconds: float) -> dict[str, Any]:
    import psutil

    p = psutil.Process(enf.proc.pid)
    time.sleep(2.0)  # a few ticks past start-up
    before, t0 = p.cpu_times(), time.monotonic()
    rss_max = 0
    while time.monotonic() - t0 < seconds:
        rss_max = max(rss_max, p.memory_info().rss)
        time.sleep(1.0)
    after, t1 = p.cpu_times(), time.monotonic()
    cpu = (after.user + after.system - before.user - before.system) / (t1 - t0)
    return {"cpu_percent": cpu * 100, "rss_mb": p.memory_info().rss / 1e6, "rss_max_mb": rss_max / 1e6,
            "seconds": t1 - t0, "threads": p.num_threads()}


def measure_reaction(
    enf: EnforcerProcess, pids: list[int], device: Path, trials: int, *, approach: bool = False
) -> dict[str, Any]:
    """``approach``: the workload first grows to 95 % of its share (the enforcer then polls faster),
    then crosses it; otherwise it jumps from 1 MiB straight over (reaction up to one interval)."""
    from gpufence.simnvml import SimProcess, write_state

    rng = random.Random(1)
    reactions, failures = [], 0
    for _ in range(trials):
        victim = subprocess.Popen([sys.executable, str(VICTIM), str(device)], stdout=subprocess.PIPE,
                                  env={**child_env(), "GPUFENCE_CONTAINER": VICTIM_CONTAINER})
        assert victim.stdout is not None
        if not victim.stdout.readline().startswith(b"ready"):
            raise RuntimeError("victim did not start")
        write_state(enf.state, sim_state(pids, (SimProcess.for_pid(victim.pid, 1 * MiB),)))
        time.sleep(rng.uniform(2 * INTERVAL, 3 * INTERVAL))  # seen under share; random phase
        if approach:
            write_state(enf.state, sim_state(pids, (SimProcess.for_pid(victim.pid, SHARE * 95 // 100),)))
            time.sleep(rng.uniform(2 * INTERVAL, 3 * INTERVAL))
        over = sim_state(pids, (SimProcess.for_pid(victim.pid, 9 * GiB),))
        t_write = time.time()
        write_state(enf.state, over)
        line = _readline(victim, 10 * INTERVAL + 5)
        if line.startswith(b"term "):
            reactions.append(float(line.split()[1]) - t_write)
        else:
            failures += 1
        victim.kill()
        victim.wait()
    write_state(enf.state, sim_state(pids))
    ms = [r * 1000 for r in reactions]
    return {"trials": trials, "failures": failures, "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
            "min_ms": min(ms, default=float("nan")), "max_ms": max(ms, default=float("nan"))}


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    return out[0] if out else b""


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from gpufence import simnvml


    with tempfile.TemporaryDirectory(prefix="gpufence-bench-") as tmp:
        root = Path(tmp)
        (root / "dev").mkdir()
        device = root / "dev" / "nvidia0"
        device.write_bytes(b"")
        ticks = measure_ticks(root, args.counts, args.ticks)
        with gpu_processes(64, device) as pids:
            simnvml.write_state(root / "sim-state", sim_state(pids))
            enf = EnforcerProcess(root)
            try:
                rest = measure_rest(enf, args.cpu_seconds)
                print(f"rest: {rest}", flush=True)
                reaction = measure_reaction(enf, pids, device, args.trials)
                print(f"reaction: {reaction}", flush=True)
                approach = measure_reaction(enf, pids, device, args.trials, approach=True)
                print(f"reaction (approach): {approach}", flush=True)
                errors = [r for r in enf.lines if r.get("event") in ("poll_error", "nvml_unavailable")]
            finally:
                enf.close()
    return {"ticks": ticks, "rest": rest, "reaction": reaction, "approach": approach, "errors": len(errors)}


def render(m: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [[r["n"], r["attributed"], f"{r['tick_ms']:.2f}", f"{r['tick_p99_ms']:.2f}", f"{r['cold_ms']:.2f}",
             f"{r['sample_ms']:.2f}", f"{r['attribute_ms']:.2f}", f"{r['policy_ms']:.2f}"] for r in m["ticks"]]
    t64 = next((r["tick_ms"] for r in m["ticks"] if r["n"] == 64), float("nan"))
    rest, reac, appr = m["rest"], m["reaction"], m["approach"]
    limit = INTERVAL * 1000 + 100

    def v(ok: bool) -> str:
        return "met" if ok else "MISSED"

    return (
        table(["GPU processes", "attributed", "tick median ms", "tick p99 ms", "cold tick ms", "sample ms",
               "attribute ms", "policy ms"], rows)
        + f"\n\nWarm ticks: {args.ticks} per row (the attributor caches per (pid, start time)); the cold tick is the "
        "first after the processes appeared. sample/attribute/policy: medians of the same steps timed apart.\n\n"
        + table(["measure", "value", "target", "verdict"], [
            ["tick at 64 processes (median)", f"{t64:.2f} ms", "< 5 ms", v(t64 < 5)],
            [f"CPU at rest, 64 processes, {INTERVAL} s interval ({rest['seconds']:.0f} s)",
             f"{rest['cpu_percent']:.2f} % of one core", "< 1 %", v(rest["cpu_percent"] < 1)],
            ["RSS (end / max sampled)", f"{rest['rss_mb']:.1f} / {rest['rss_max_mb']:.1f} MB", "< 60 MB",
             v(rest["rss_max_mb"] < 60)],
            [f"reaction p50 ({reac['trials']} trials, {reac['failures']} without SIGTERM)", f"{reac['p50_ms']:.0f} ms",
             "", ""],
            ["reaction p99", f"{reac['p99_ms']:.0f} ms", f"< {limit:.0f} ms", v(reac["p99_ms"] < limit)],
            ["reaction min / max", f"{reac['min_ms']:.0f} / {reac['max_ms']:.0f} ms", "", ""],
            [f"reaction after approaching the share, p50 ({appr['trials']} trials, {appr['failures']} without "
             "SIGTERM)", f"{appr['p50_ms']:.0f} ms", "", ""],
            ["reaction after approaching the share, p99", f"{appr['p99_ms']:.0f} ms", "< 100 ms",
             v(appr["p99_ms"] < 100)],
            ["reaction after approaching, min / max", f"{appr['min_ms']:.0f} / {appr['max_ms']:.0f} ms", "", ""],
        ])
        + f"\n\nReaction: from just before the state file naming the process over its share is written to the "
        f"moment the workload's SIGTERM handler runs; from far under its share (a jump) expected about uniform "
        f"in [0, interval] plus the tick; after growing to 95 % of it the enforcer polls 10x faster "
        f"(adaptive interval, {INTERVAL / 10 * 1000:.0f} ms), so the crossing is seen within that. "
        f"Enforcer poll errors during the run: {m['errors']}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--cpu-seconds", type=float, default=30.0)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    text = render(measure(args), args)
    print(text)
    if not args.no_write:
        write_section("enforcer_tick", "Enforcer: tick, CPU and memory at rest, reaction time", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
