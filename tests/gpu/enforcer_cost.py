#!/usr/bin/env python3
"""What the enforcer costs on a machine with a real GPU and driver: memory, start-up and CPU at rest.

The real node test bed measures the sidecar in its own cgroup against the simulated
``libnvidia-ml.so.1``; the real library is far larger and its calls far slower, so this run
measures the same things against the real one. The enforcer (``python -m gpufence.enforcer``, the
sidecar's command) runs in a cgroup v2 group of its own with the sidecar's default CPU limit
(``cpu.max`` 500m) where the machine lets us create one (root, cgroup v2), else as a plain process
(then the output says so). Three runs of ``--seconds`` each, at the default poll interval:

* ``no_gpu_process``: nothing on the GPU, a memory share configured;
* ``memory_share``: a CUDA process of container ``a`` holds ``--mib`` MiB, a memory share only
  (utilisation is then read for the gauge only, every few seconds);
* ``compute_share``: the same process, ``a`` also has a compute share (utilisation once per duty-cycle period, 1 s).

Per run: ``started``'s own start-up figures, the time from exec to ``started`` seen from outside,
the CPU used at rest after ``started`` (the cgroup's ``cpu.stat``, else ``/proc``), the mean poll
duration from the enforcer's own histogram, and memory: the group's ``memory.current``/``peak``
and its ``anon``/``file`` split, and the process's ``smaps_rollup`` (Rss, Pss, Anonymous).

Also: a breakdown of opening NVML (import, ``nvmlInit``, first calls: wall and CPU time, anonymous
memory) in a fresh interpreter, and exec to ``started`` under CPU limits of 250m, 500m and 1000m.

Prints ``enforcer_cost: {...}``; ``skipped:`` (exit 0) without NVML or without torch/cupy for
the holder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
CPU_MAX = "50000 100000"  # the sidecar's default limit, 500m
MiB = 1 << 20
HOLDER = pathlib.Path(__file__).with_name("cuda_holder.py")


# argv: none. Prints one JSON line: per step of opening NVML as the enforcer does, the wall and CPU
# milliseconds and the growth of anonymous resident memory (KiB), in a fresh interpreter.
INIT_BREAKDOWN = r"""
import json, resource, time
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
steps = []
def step(name, fn):
    w, c, a = time.perf_counter(), time.process_time(), anon()
    value = fn()
    steps.append({"step": name, "wall_ms": round(1000 * (time.perf_counter() - w), 2),
                  "cpu_ms": round(1000 * (time.process_time() - c), 2), "anon_kib": anon() - a})
    return value
steps.append({"step": "interpreter", "cpu_ms": round(1000 * time.process_time(), 2), "anon_kib": anon()})
nvml = step("import pynvml", lambda: __import__("pynvml"))
step("nvmlInit", nvml.nvmlInit)
count = step("nvmlDeviceGetCount", nvml.nvmlDeviceGetCount)
handles = step("handles, UUIDs, memory", lambda: [
    (h, nvml.nvmlDeviceGetUUID(h), nvml.nvmlDeviceGetMemoryInfo(h))
    for h in (nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count))])
step("first process lists", lambda: [nvml.nvmlDeviceGetComputeRunningProcesses(h) for h, _, _ in handles])
def util():
    for h, _, _ in handles:
        try:
            nvml.nvmlDeviceGetProcessUtilization(h, 0)
        except nvml.NVMLError:
            pass
step("first utilisation", util)
step("enforcer modules", lambda: __import__("gpufence.enforcer.cli"))
print(json.dumps(steps))
"""


def controllers_enabled() -> str | None:
    """Enable the memory and cpu controllers for the root's children; None, or why not."""
    if not (CGROUP_ROOT / "cgroup.controllers").exists():
        return "no cgroup v2 at /sys/fs/cgroup"
    try:
        wanted = {"memory", "cpu"} - set((CGROUP_ROOT / "cgroup.subtree_control").read_text().split())
        if wanted:
            (CGROUP_ROOT / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
    except OSError as exc:
        return f"cannot enable the memory and cpu controllers: {exc}"
    return None


def new_group(name: str, cpu_max: str) -> pathlib.Path | None:
    """A fresh group per run, so that its peak and its file pages are that run's alone. The page
    cache is dropped first: otherwise the driver library's pages stay charged to an earlier group."""
    with contextlib.suppress(OSError):
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("1")
    group = CGROUP_ROOT / f"gpufence-enforcer-cost-{os.getpid()}-{name}"
    try:
        group.mkdir()
        (group / "cpu.max").write_text(cpu_max)
    except OSError:
        return None
    return group


def read_keyed(path: pathlib.Path) -> dict[str, int]:
    with contextlib.suppress(OSError):
        return {k: int(v) for k, v in (line.split()[:2] for line in path.read_text().splitlines())}
    return {}


def proc_cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(group: pathlib.Path | None, pid: int) -> float:
    if group is not None:
        return read_keyed(group / "cpu.stat").get("usage_usec", 0) / 1e6
    return proc_cpu_seconds(pid)


def memory(group: pathlib.Path | None, pid: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        rollup = pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
        kb = {line.split(":")[0]: int(line.split()[1]) for line in rollup if line.endswith("kB")}
        out["process_mib"] = {k: round(kb.get(k, 0) / 1024, 1) for k in ("Rss", "Pss", "Anonymous")}
    if group is not None:
        stat = read_keyed(group / "memory.stat")
        out["group_mib"] = {
            "current": round(int((group / "memory.current").read_text()) / MiB, 1),
            "peak": round(int((group / "memory.peak").read_text()) / MiB, 1) if (group / "memory.peak").exists()
            else None,
            **{k: round(stat.get(k, 0) / MiB, 1) for k in ("anon", "file", "kernel", "shmem")},
        }
    return out


def poll_mean_ms(port: int) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        for key in ("gpufence_poll_duration_seconds_sum", "gpufence_poll_duration_seconds_count"):
            if line.startswith(key + " "):
                values[key] = float(line.split()[1])
    count = values.get("gpufence_poll_duration_seconds_count")
    return round(1000 * values["gpufence_poll_duration_seconds_sum"] / count, 3) if count else None


def run(name: str, containers: dict[str, Any], seconds: float, cpu_max: str | None) -> dict[str, Any]:
    """One enforcer, in a group of its own with ``cpu_max`` as its CPU limit (None: no group)."""
    group = new_group(name, cpu_max) if cpu_max is not None else None
    try:
        return measure(name, containers, seconds, group)
    finally:
        if group is not None:
            with contextlib.suppress(OSError):
                group.rmdir()


def measure(name: str, containers: dict[str, Any], seconds: float, group: pathlib.Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpufence-cost-") as tmp:
        config = pathlib.Path(tmp) / "config.json"
        config.write_text(json.dumps({"version": 1, "mode": "enforce", "containers": containers}))
        (pathlib.Path(tmp) / "state").mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               "GPUFENCE_POD_NAME": "enforcer-cost", "GPUFENCE_POD_NAMESPACE": "local"}
        env.pop("GPUFENCE_CONTAINER", None)
        procs = str(group / "cgroup.procs") if group is not None else None

        def enter_group() -> None:
            if procs is not None:
                pathlib.Path(procs).write_text(str(os.getpid()))

        t0 = time.monotonic()
        enforcer = subprocess.Popen(
            [sys.executable, "-m", "gpufence.enforcer", "--config", str(config), "--metrics-port", "0",
             "--state-dir", f"{tmp}/state"],
            env=env, stdout=subprocess.PIPE, text=True, preexec_fn=enter_group, cwd=REPO,
        )
        assert enforcer.stdout is not None
        started: dict[str, Any] | None = None
        try:
            for line in enforcer.stdout:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("event") == "started":
                        started = record
                        break
            if started is None:
                return {"error": f"no 'started' line (exit {enforcer.wait(timeout=10)})"}
            seen_started = time.monotonic() - t0
            cpu0, t1 = cpu_seconds(group, enforcer.pid), time.monotonic()
            time.sleep(seconds)  # at rest: nothing happens that could be awaited instead
            cpu1, t2 = cpu_seconds(group, enforcer.pid), time.monotonic()
            return {
                "run": name,
                "own_group": group is not None,
                "started_seconds_from_exec": round(seen_started, 3),
                "startup_seconds": started.get("startup_seconds"),
                "startup_cpu_seconds": started.get("startup_cpu_seconds"),
                "cpu_at_rest_percent_of_a_core": round(100 * (cpu1 - cpu0) / (t2 - t1), 3),
                "poll_mean_ms": poll_mean_ms(int(started["metrics_port"])),
                "memory": memory(group, enforcer.pid),
            }
        finally:
            enforcer.terminate()
            try:
                enforcer.wait(timeout=15)
            except subprocess.TimeoutExpired:
                enforcer.kill()


def init_breakdown() -> list[dict[str, Any]] | str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", INIT_BREAKDOWN], capture_output=True, text=True, timeout=60,
                          check=False, env=env)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"failed: {done.stderr.strip()[-500:]}"


def startup_at_limits(limits: list[str], repeats: int) -> dict[str, list[float]] | str:
    """Exec to ``started`` under each CPU limit (millicores), ``repeats`` times, no GPU process."""
    out = {}
    for limit in limits:
        cpu_max = f"{int(limit.removesuffix('m')) * 100} 100000"
        times = []
        for i in range(repeats):
            measured = run(f"start-{limit}-{i}", {"a": {"memoryBytes": 4 << 30}}, 0.0, cpu_max)
            if "error" in measured:
                return str(measured["error"])
            times.append(measured["started_seconds_from_exec"])
        out[limit] = times
    return out


def main(argv: list[str]) -> int:
    seconds = float(argv[0]) if argv else 20.0
    mib = 1024
    # In a child: this process must not map the driver library (its pages would be charged here).
    ask = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlSystemGetDriverVersion())"
    probe = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, timeout=60, check=False)
    if probe.returncode != 0:
        print(f"skipped: NVML did not answer ({probe.stderr.strip()[-300:]})")
        return 0
    driver = probe.stdout.strip()
    backend = next((b for b in ("torch", "cupy") if importlib.util.find_spec(b) is not None), None)
    if backend is None:
        print("skipped: neither torch nor cupy is importable")
        return 0
    why_not = controllers_enabled()
    groups = why_not is None
    cpu_max = CPU_MAX if groups else None
    where = f"own cgroup v2 group per run, cpu.max {CPU_MAX}" if groups else f"plain process ({why_not})"
    result: dict[str, Any] = {"driver_version": driver, "where": where, "seconds_at_rest": seconds, "runs": []}
    share = {"memoryBytes": 4 << 30}
    result["nvml_init_breakdown"] = init_breakdown()
    if groups:
        result["started_seconds_by_cpu_limit"] = startup_at_limits(["250m", "500m", "1000m"], 3)
    result["runs"].append(run("no_gpu_process", {"a": share}, seconds, cpu_max))
    holder = subprocess.Popen([sys.executable, str(HOLDER), backend, str(mib)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "GPUFENCE_CONTAINER": "a"})
    assert holder.stdout is not None and holder.stdin is not None
    if holder.stdout.readline().split()[:1] != ["READY"]:
        print(f"error: the CUDA holder did not get ready (exit {holder.wait()})")
        return 2
    try:
        result["runs"].append(run("memory_share", {"a": share}, seconds, cpu_max))
        result["runs"].append(run("compute_share", {"a": {**share, "computePercent": 30}}, seconds, cpu_max))
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    print("enforcer_cost: " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
