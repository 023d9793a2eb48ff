#!/usr/bin/env python3
"""Real-GPU validation of the enforcer: real driver, real NVML, real CUDA allocations.

Runs ``python -m enforcer --config FILE`` and two CUDA workload processes (PyTorch if importable,
else CuPy) tagged ``GPUFENCE_CONTAINER=a`` / ``b``:

* ``a`` allocates well inside its memory share and keeps the SMs busy (a matmul loop) while its
  compute share is small: the enforcer should throttle it (SIGSTOP/SIGCONT), never kill it;
* ``b`` allocates inside its share, idles, then allocates beyond it: the enforcer should SIGTERM
  it. The time from the moment the over-share allocation completed to the moment ``b``'s SIGTERM
  handler ran is the headline number.

Prints the enforcer's decisions with timings and a JSON summary. Exit status: 0 when the enforcer
did what it should (or with a ``skipped:`` line when there is no NVIDIA GPU or no torch/cupy),
1 when it did not, 2 when the run itself could not be set up. See tests/gpu/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

REPO = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20

# The workload: one CUDA process. argv: backend, initial MiB, "busy"|"idle".
# stdout protocol (one line each): "READY <t>", "GROWN <mib> <t>", "SIGTERM <t>"; stdin: "grow <MiB>".
WORKLOAD = r"""
import os, queue, signal, sys, threading, time

backend, initial_mib, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def on_sigterm(signum, frame):
    print(f"SIGTERM {time.monotonic():.6f}", flush=True)
    os._exit(143)

signal.signal(signal.SIGTERM, on_sigterm)

if backend == "torch":
    import torch
    def alloc(mib):
        return torch.ones(mib << 20, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    m = torch.randn(4096, 4096, device="cuda")
    def work():
        return m @ m
else:
    import cupy
    def alloc(mib):
        return cupy.ones(mib << 20, dtype=cupy.uint8)
    def sync():
        cupy.cuda.Device().synchronize()
    m = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)
    def work():
        return m @ m

blocks = [alloc(initial_mib)]
sync()
print(f"READY {time.monotonic():.6f}", flush=True)

commands = queue.Queue()
def read_stdin():
    for line in sys.stdin:
        commands.put(line.split())
threading.Thread(target=read_stdin, daemon=True).start()

while True:
    try:
        command = commands.get_nowait()
    except queue.Empty:
        command = None
    if command and command[0] == "grow":
        blocks.append(alloc(int(command[1])))
        sync()
        print(f"GROWN {command[1]} {time.monotonic():.6f}", flush=True)
    if mode == "busy":
        for _ in range(8):
            work()
        sync()
    else:
        time.sleep(0.01)
"""

# The framework-cap scenario's workloads (PyTorch only). argv: role ("greedy"|"steady"), MiB, seconds.
# greedy: allocates MiB-sized blocks until its own allocation fails (OOM) or it holds the whole GPU;
# steady: holds MiB, then allocates and frees one MiB block over and over for the given seconds.
# stdout: "READY <t>", then greedy "OOM <held MiB>" | "NOOM <held MiB>", steady "STEADY <ok> <failed>".
CAP_WORKLOAD = r"""
import sys, time, torch

role, mib, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
block = mib << 20
if role == "greedy":
    total = torch.cuda.get_device_properties(0).total_memory
    held = []
    print(f"READY {time.monotonic():.6f}", flush=True)
    try:
        while sum(t.numel() for t in held) + block <= total:
            held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        print(f"OOM {sum(t.numel() for t in held) >> 20}", flush=True)
    else:
        print(f"NOOM {sum(t.numel() for t in held) >> 20}", flush=True)
    time.sleep(seconds)
else:
    base = torch.empty(block, dtype=torch.uint8, device="cuda")
    print(f"READY {time.monotonic():.6f}", flush=True)
    ok = failed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            extra = torch.empty(block, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            del extra
            torch.cuda.empty_cache()
            ok += 1
        except torch.cuda.OutOfMemoryError:
            failed += 1
        time.sleep(0.01)
    print(f"STEADY {ok} {failed}", flush=True)
"""

INTERESTING = {
    "started",
    "nvml_opened",
    "nvml_unavailable",
    "memory_over_share",
    "memory_under_share",
    "sigterm",
    "sigkill",
    "terminated",
    "throttle_start",
    "throttle_stop",
    "throttle_error",
    "unattributed_process",
    "device_lost",
    "poll_error",
    "config_invalid",
}


def skip(reason: str) -> int:
    print(f"skipped: {reason}")
    return 0


def gpu_present() -> str | None:
    """None if an NVIDIA GPU answers through NVML, else why not."""
    try:
        import pynvml
    except ImportError:
        return "pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return f"no NVIDIA GPU (nvmlInit: {exc})"
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return "no NVIDIA GPU (NVML reports 0 devices)"
    finally:
        pynvml.nvmlShutdown()
    return None


def cuda_backend() -> str | None:
    for name in ("torch", "cupy"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


@dataclass
class Stream:
    """Lines of a child's stdout, each stamped with time.monotonic() on arrival."""

    name: str
    lines: queue.Queue[tuple[float, str]] = field(default_factory=queue.Queue)
    history: list[tuple[float, str]] = field(default_factory=list)

    def pump(self, pipe: IO[str]) -> None:
        for line in pipe:
            self.lines.put((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, prefix: str, timeout: float) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                item = self.lines.get(timeout=left)
            except queue.Empty:
                return None
            self.history.append(item)
            if item[1].startswith(prefix):
                return item


@dataclass
class EnforcerLog:
    """The enforcer's JSON decision log, collected on a thread."""

    records: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    other: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pump(self, pipe: IO[str]) -> None:
        for line in pipe:
            now = time.monotonic()
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                with self.lock:
                    self.other.append(line.rstrip("\n"))
                continue
            with self.lock:
                self.records.append((now, record))
            if record.get("event") in INTERESTING:
                print(f"  [enforcer +{now - T0:7.3f}s] {json.dumps(record, sort_keys=True)}", flush=True)

    def find(self, event: str, container: str | None = None, after: float = 0.0) -> tuple[float, dict[str, Any]] | None:
        with self.lock:
            for at, record in self.records:
                if (
                    at >= after
                    and record.get("event") == event
                    and (container is None or record.get("container") == container)
                ):
                    return at, record
        return None

    def wait(self, event: str, container: str | None, timeout: float, after: float = 0.0) -> tuple[float, Any] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.find(event, container, after)
            if found:
                return found
            time.sleep(0.02)
        return None


T0 = time.monotonic()


def start_workload(
    container: str, backend: str, initial_mib: int, mode: str, env: dict[str, str]
) -> tuple[subprocess.Popen[str], Stream]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKLOAD, backend, str(initial_mib), mode],
        env=env | {"GPUFENCE_CONTAINER": container},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    stream = Stream(container)
    assert proc.stdout is not None
    threading.Thread(target=stream.pump, args=(proc.stdout,), daemon=True).start()
    return proc, stream


def stop(proc: subprocess.Popen[str] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)  # it may be throttled (stopped)
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def framework_cap_scenario(args: argparse.Namespace) -> int:
    """Two PyTorch processes on one GPU: ``greedy`` with the allocator cap the webhook injects for its
    share (``PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:<f>``, PyTorch >= 2.10) allocates
    until its own allocation fails; ``steady`` (no cap) keeps allocating and freeing a block. Pass:
    greedy got the OOM at about its share and steady never failed. No enforcer runs: this is the
    prevention alone."""
    import pynvml

    if importlib.util.find_spec("torch") is None:
        return skip("the framework-cap scenario needs PyTorch")
    import torch

    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 10):
        return skip(f"torch {torch.__version__} has no per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF (2.10+)")
    from gpufence.contract import MemoryShare
    from gpufence.webhook.core.frameworks import DeviceMemory, framework_env
    from gpufence.webhook.core.settings import InjectionSettings

    pynvml.nvmlInit()
    try:
        total = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
    finally:
        pynvml.nvmlShutdown()
    # The webhook's own rule, as for a pod with this byte share on a GPU of this memory.
    decided = framework_env("greedy", MemoryShare(bytes=args.share_mib * MiB), {}, DeviceMemory(total, "NVML"),
                            InjectionSettings(), pytorch=True)
    cap_env = dict(decided.set_env)
    print(f"GPU memory {total >> 20} MiB, share {args.share_mib} MiB: greedy gets {cap_env}")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "XLA_", "CUDA_MEMORY"))}
    seconds = args.timeout
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        steady = subprocess.Popen([sys.executable, "-c", CAP_WORKLOAD, "steady", str(args.initial_mib), str(seconds)],
                                  env=base, stdout=subprocess.PIPE, text=True)
        procs["steady"] = steady
        assert steady.stdout is not None
        if not steady.stdout.readline().startswith("READY"):
            print("error: steady did not get ready (CUDA init failed?)")
            return 2
        greedy = subprocess.Popen([sys.executable, "-c", CAP_WORKLOAD, "greedy", "256", "2"],
                                  env={**base, **cap_env}, stdout=subprocess.PIPE, text=True)
        procs["greedy"] = greedy
        greedy_out, _ = greedy.communicate(timeout=seconds + 60)
        steady_out, _ = steady.communicate(timeout=seconds + 60)
    finally:
        for proc in procs.values():
            stop(proc)
    last = greedy_out.strip().splitlines()[-1].split() if greedy_out.strip() else ["none", "0"]
    counts = steady_out.strip().splitlines()[-1].split() if steady_out.strip() else ["STEADY", "0", "-1"]
    summary = {
        "scenario": "framework-cap", "torch": torch.__version__, "cap": cap_env,
        "greedy_own_oom": last[0] == "OOM", "greedy_held_mib": int(last[1]), "share_mib": args.share_mib,
        "steady_allocations_ok": int(counts[1]), "steady_allocations_failed": int(counts[2]),
    }
    ok = (summary["greedy_own_oom"] and summary["greedy_held_mib"] <= args.share_mib
          and summary["steady_allocations_failed"] == 0 and summary["steady_allocations_ok"] > 0)
    summary["result"] = "pass" if ok else "fail"
    print("summary: " + json.dumps(summary, sort_keys=True))
    return 0 if ok else 1


def process_cost(pid: int) -> dict[str, float] | str:
    """The enforcer's own cost on this host after the run, from /proc (a host process with the real
    NVML, not a pod's cgroup): resident and proportional memory, CPU seconds, threads."""
    try:
        rollup = pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:] if line.endswith("kB")}
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError) as exc:
        return f"unreadable: {exc}"
    ticks = os.sysconf("SC_CLK_TCK")
    return {"rss_mib": round(fields.get("Rss", 0) / 1024, 1), "pss_mib": round(fields.get("Pss", 0) / 1024, 1),
            "cpu_seconds": round((int(stat[11]) + int(stat[12])) / ticks, 2), "threads": int(stat[17])}


def print_nvml_facts(when: str) -> None:
    """What the driver offers (versions, R615 limit calls, PIDs, per-process memory, utilisation,
    call costs): tests/gpu/nvml_facts.py, in its own process so that its NVML session is its own."""
    facts = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("nvml_facts.py"))],
                           capture_output=True, text=True, timeout=120, check=False)
    print(f"nvml facts ({when}):")
    print(facts.stdout.rstrip() or f"error: nvml_facts.py printed nothing: {facts.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("enforcer", "framework-cap"), default="enforcer",
                        help="enforcer: the enforcer against two CUDA workloads (default); framework-cap: two "
                             "PyTorch processes, one with the webhook's allocator cap, no enforcer")
    parser.add_argument("--share-mib", type=int, default=4096, help="memory share of each container (default 4096)")
    parser.add_argument("--initial-mib", type=int, default=1024, help="allocation inside the share (default 1024)")
    parser.add_argument("--over-mib", type=int, default=4096, help="b's extra allocation beyond it (default 4096)")
    parser.add_argument("--compute-percent", type=float, default=30, help="a's compute share (default 30)")
    parser.add_argument("--poll-interval", type=float, default=0.2, help="enforcer poll interval (default 0.2)")
    parser.add_argument("--grace", type=float, default=3.0, help="SIGTERM -> SIGKILL grace period (default 3)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each decision (default 60)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds inside the shares first (default 3)")
    parser.add_argument("--no-compute", action="store_true", help="a idles instead of saturating the SMs")
    args = parser.parse_args(argv)

    why = gpu_present()
    if why:
        return skip(why)
    print_nvml_facts("before the workloads")
    if args.scenario == "framework-cap":
        return framework_cap_scenario(args)
    backend = cuda_backend()
    if backend is None:
        return skip("neither torch nor cupy is importable")
    if importlib.util.find_spec("gpufence.enforcer") is None:
        print(f"error: the enforcer package is not importable (run from {REPO} or install gpufence)")
        return 2

    config = {
        "version": 1,
        "mode": "enforce",
        "gracePeriodSeconds": args.grace,
        "pollIntervalSeconds": args.poll_interval,
        "containers": {
            "a": {"memoryBytes": args.share_mib * MiB, "computePercent": args.compute_percent},
            "b": {"memoryBytes": args.share_mib * MiB},
        },
    }
    print(f"backend: {backend}; config: {json.dumps(config)}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("GPUFENCE_POD_NAME", "gpu-validation")
    env.setdefault("GPUFENCE_POD_NAMESPACE", "local")
    env.pop("GPUFENCE_CONTAINER", None)

    enforcer: subprocess.Popen[str] | None = None
    a = b = None
    ok = True
    summary: dict[str, Any] = {"backend": backend, "config": config}
    with tempfile.TemporaryDirectory(prefix="gpufence-gpu-") as tmp:
        config_path = pathlib.Path(tmp) / "config.json"
        config_path.write_text(json.dumps(config))
        state_dir = pathlib.Path(tmp) / "state"
        state_dir.mkdir()
        try:
            log = EnforcerLog()
            enforcer = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpufence.enforcer",
                    "--config",
                    str(config_path),
                    "--metrics-port",
                    "0",
                    "--state-dir",
                    str(state_dir),
                ],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
                cwd=REPO,
            )
            assert enforcer.stdout is not None
            threading.Thread(target=log.pump, args=(enforcer.stdout,), daemon=True).start()
            if not log.wait("started", None, timeout=30):
                print("error: the enforcer did not log 'started' within 30 s")
                return 2

            print(f"starting workloads: a (busy={not args.no_compute}) and b, {args.initial_mib} MiB each")
            a, a_out = start_workload("a", backend, args.initial_mib, "idle" if args.no_compute else "busy", env)
            b, b_out = start_workload("b", backend, args.initial_mib, "idle", env)
            for name, stream in (("a", a_out), ("b", b_out)):
                if not stream.wait_for("READY", timeout=120):
                    print(f"error: workload {name} did not get ready (CUDA init failed?)")
                    return 2
            print(f"workload PIDs: a={a.pid} b={b.pid}")
            print_nvml_facts("with the workloads running")

            # Phase 1: inside the memory shares. Nobody may be SIGTERMed.
            phase1 = time.monotonic()
            time.sleep(args.settle)
            early = [log.find("sigterm", c, phase1) for c in ("a", "b")]
            if any(early):
                print("FAIL: a workload inside its memory share was SIGTERMed")
                ok = False

            # Compute: a saturates the SMs with a small compute share -> throttle_start.
            if not args.no_compute:
                found = log.wait("throttle_start", "a", timeout=args.timeout, after=phase1)
                if found:
                    summary["a_throttle_start_after_s"] = round(found[0] - phase1, 3)
                    print(f"a throttled {found[0] - phase1:.3f} s after the workloads were ready")
                else:
                    print(f"FAIL: a (busy, compute share {args.compute_percent}%) was never throttled")
                    ok = False

            # Phase 2: b allocates beyond its share.
            assert b.stdin is not None
            b.stdin.write(f"grow {args.over_mib}\n")
            b.stdin.flush()
            grown = b_out.wait_for("GROWN", timeout=60)
            if not grown:
                print("error: b did not report its over-share allocation (out of GPU memory?)")
                return 2
            t_grown = float(grown[1].split()[2])
            term = b_out.wait_for("SIGTERM", timeout=args.timeout)
            decision = log.find("sigterm", "b", after=phase1)
            over = log.find("memory_over_share", "b", after=phase1)
            if term:
                t_term = float(term[1].split()[1])
                summary["b_over_share_to_sigterm_s"] = round(t_term - t_grown, 3)
                print(f"b: over-share allocation done -> SIGTERM received: {t_term - t_grown:.3f} s")
            else:
                print(f"FAIL: b was not SIGTERMed within {args.timeout} s of exceeding its share")
                ok = False
            if over:
                summary["b_over_share_to_decision_s"] = round(over[0] - t_grown, 3)
                print(f"b: over-share allocation done -> enforcer's memory_over_share line: {over[0] - t_grown:.3f} s")
            if decision:
                summary["b_sigterm_logged"] = decision[1]
            with contextlib.suppress(subprocess.TimeoutExpired):
                b.wait(timeout=args.grace + 5)
            summary["b_exit_status"] = b.poll()

            # a must have survived everything (throttled at most).
            time.sleep(max(args.poll_interval * 3, 0.5))
            summary["a_alive"] = a.poll() is None
            if not summary["a_alive"] or log.find("sigterm", "a") or log.find("sigkill", "a"):
                print("FAIL: a (inside its memory share) was signalled or died")
                ok = False
            summary["a_throttle_events"] = sum(
                1 for _, r in log.records if r.get("container") == "a" and r.get("event") == "throttle_start"
            )
            summary["enforcer_errors"] = [
                r for _, r in log.records if r.get("event") in ("poll_error", "nvml_unavailable", "throttle_error")
            ]
            summary["enforcer_process"] = process_cost(enforcer.pid)
        finally:
            stop(a)
            stop(b)
            if enforcer is not None and enforcer.poll() is None:
                enforcer.send_signal(signal.SIGTERM)
                try:
                    enforcer.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    enforcer.kill()
    summary["result"] = "pass" if ok else "fail"
    print("summary: " + json.dumps(summary, sort_keys=True, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
