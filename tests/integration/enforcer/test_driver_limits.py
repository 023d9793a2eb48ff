"""End to end: the driver's per-cgroup memory limits (NVML R615) and the enforcer.

Real cgroup v2 groups stand for the containers (the ``cgroups`` fixture), real workload processes
in them allocate through the simulated driver (``alloc_workload.py``), which charges each
allocation to the caller's cgroup and refuses it past that cgroup's hard limit, as the real driver
does. ``preset_limits`` stands for the container toolkit's ``apply-cuda-memory-limits`` hook having
run at container creation. The enforcer is the real one, its pynvml loading the simulated library.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from gpufence.simnvml import SimLimit, SimProcess, build_library, preset_limits
from tests.support.enforcer_harness import GpuSandbox, LineReader

GIB = 1 << 30
UUID = "GPU-0"
ALLOC = pathlib.Path(__file__).resolve().parent / "alloc_workload.py"


class Allocator:
    """A container's GPU process: allocates on command, in the cgroup it was moved to."""

    def __init__(self, sandbox: GpuSandbox, container: str, env: dict[str, str] | None = None) -> None:
        full_env = {**sandbox.env(), "GPUFENCE_CONTAINER": container, **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, str(ALLOC), str(sandbox.device), UUID],
            env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.out = LineReader(self.proc.stdout, f"alloc[{container}]")
        _, line = self.out.wait_for(lambda s: s.startswith("ready "), 15)
        self.pid = int(line.split()[1])

    def alloc(self, nbytes: int) -> str:
        start = len(self.out.snapshot())
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"alloc {nbytes}\n")
        self.proc.stdin.flush()
        _, line = self.out.wait_for(lambda s: s.startswith(("allocated", "CUDA error")), 15, start)
        return line

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


@pytest.fixture
def allocators() -> Any:
    made: list[Allocator] = []

    def start(sandbox: GpuSandbox, container: str, env: dict[str, str] | None = None) -> Allocator:
        made.append(Allocator(sandbox, container, env))
        return made[-1]

    yield start
    for a in made:
        a.close()


@pytest.fixture
def old_gpu(tmp_path: pathlib.Path) -> Any:
    """A sandbox whose simulated driver predates R615: no limit calls at all."""
    (tmp_path / "old").mkdir()
    sandbox = GpuSandbox(tmp_path / "old", build_library(memory_limits=False))
    yield sandbox
    sandbox.cleanup()


def namespace(cgroups: Any, cgroup: pathlib.Path) -> str:
    """The cgroup's NVML namespace, as the toolkit's hook names it from /proc/<pid>/cgroup."""
    return "/sys/fs/cgroup/" + str(cgroup.relative_to(cgroups.parent.parent))


EXPECTS_LIMIT = {"NVIDIA_GPU_MEMORY_LIMIT": "2048", "NVIDIA_GPU_MEMORY_REQUEST": "2048"}


def _hog_and_calm_holding_1gib(cgroups, gpu, allocators, hog_cg, calm_cg):
    """Two allocating workloads, ``hog`` (which expects a driver limit) and ``calm``, each in its
    cgroup and holding 1 GiB on the simulated GPU."""
    gpu.write(gpu.device_with())
    hog = allocators(gpu, "hog", EXPECTS_LIMIT)
    calm = allocators(gpu, "calm")
    cgroups.move(hog_cg, hog.pid)
    cgroups.move(calm_cg, calm.pid)
    assert hog.alloc(1 * GIB) == f"allocated {GIB}"
    assert calm.alloc(1 * GIB) == f"allocated {GIB}"
    return hog, calm


def test_driver_limit_refuses_the_allocation_and_the_enforcer_reports_driver(cgroups, gpu, make_config, allocators):
    hog_cg, calm_cg = cgroups.make("hog"), cgroups.make("calm")
    preset_limits(
        gpu.state_path,
        SimLimit(UUID, namespace(cgroups, hog_cg), 2 * GIB, 2 * GIB),
        SimLimit(UUID, namespace(cgroups, calm_cg), 4 * GIB, 4 * GIB),
    )
    hog, calm = _hog_and_calm_holding_1gib(cgroups, gpu, allocators, hog_cg, calm_cg)
    config = make_config({"hog": {"memoryBytes": 2 * GIB}, "calm": {"memoryBytes": 4 * GIB}}, grace=30)
    enforcer = gpu.enforcer(config)
    report = enforcer.wait_event("memory_enforcement", 10, container="hog")
    assert report["mechanism"] == "driver", report
    assert report["limit_bytes"] == 2 * GIB
    assert report["cgroup"] == namespace(cgroups, hog_cg)
    assert report["driver"]["0"]["current_used_bytes"] == GIB
    assert enforcer.wait_event("memory_enforcement", 10, container="calm")["mechanism"] == "driver"
    assert enforcer.metric("gpufence_container_memory_enforcement", container="hog", mechanism="driver") == 1
    assert enforcer.metric("gpufence_container_memory_enforcement", container="hog", mechanism="polling") is None
    status, body = enforcer.http("/healthz")  # the liveness line, then each container's mechanism
    assert status == 200 and body.splitlines() == ["ok", "memory calm: driver", "memory hog: driver"], body

    # Past the share: the driver refuses at allocation; the neighbour still gets its memory.
    assert hog.alloc(2 * GIB) == "CUDA error: out of memory"
    assert calm.alloc(2 * GIB) == f"allocated {2 * GIB}"
    enforcer.wait_polls(3)
    assert enforcer.metric("gpufence_container_gpu_memory_used_bytes", container="hog") == GIB
    assert enforcer.metric("gpufence_container_gpu_memory_used_bytes", container="calm") == 3 * GIB
    assert enforcer.events("sigterm") == [] and enforcer.events("memory_over_share") == []
    assert enforcer.events("driver_memory_limit_missing") == []
    assert hog.proc.poll() is None and calm.proc.poll() is None
    assert enforcer.stop() == 0


def test_old_driver_reports_polling_and_still_terminates(cgroups, old_gpu, make_config, allocators):
    gpu = old_gpu
    hog_cg, calm_cg = cgroups.make("hog"), cgroups.make("calm")
    hog, calm = _hog_and_calm_holding_1gib(cgroups, gpu, allocators, hog_cg, calm_cg)
    config = make_config({"hog": {"memoryBytes": 2 * GIB}, "calm": {"memoryBytes": 4 * GIB}}, grace=30)
    enforcer = gpu.enforcer(config)
    report = enforcer.wait_event("memory_enforcement", 10, container="hog")
    assert report["mechanism"] == "polling", report
    assert "older than R615" in report["why"]
    assert report["driver"]["0"]["state"] == "no_call"
    missing = enforcer.wait_event("driver_memory_limit_missing", 10, container="hog")
    assert "older than R615" in missing["why"]
    assert enforcer.wait_event("memory_enforcement", 10, container="calm")["mechanism"] == "polling"
    assert enforcer.events("driver_memory_limit_missing", container="calm") == []  # it asked for none
    assert enforcer.metric("gpufence_container_memory_enforcement", container="hog", mechanism="polling") == 1
    status, body = enforcer.http("/healthz")
    assert status == 200 and body.splitlines() == ["ok", "memory calm: polling", "memory hog: polling"], body

    # Nothing refuses the allocation: polling terminates the container over its share.
    assert hog.alloc(2 * GIB) == f"allocated {2 * GIB}"
    hog.out.wait_for(lambda s: s == "got SIGTERM", 10)
    assert hog.proc.wait(5) == 0
    over = enforcer.wait_event("memory_over_share", 5, container="hog")
    assert over["used_bytes"] == 3 * GIB and over["limit_bytes"] == 2 * GIB
    enforcer.wait_polls(2)
    assert calm.proc.poll() is None
    assert enforcer.stop() == 0


def test_current_used_is_the_usage_and_a_discrepancy_is_logged_once(cgroups, gpu, make_config, allocators):
    """The driver counts what the cgroup holds, also through a process the enforcer cannot see (here
    one it finds no trace of in its /proc): its currentUsed is the usage, polling acts on it as the
    backstop although the driver holds a limit, and the gap to the per-process sum is logged once."""
    train_cg = cgroups.make("train")
    ns = namespace(cgroups, train_cg)
    preset_limits(gpu.state_path, SimLimit(UUID, ns, 2 * GIB, 2 * GIB))
    gpu.write(gpu.device_with())
    worker = allocators(gpu, "train")
    cgroups.move(train_cg, worker.pid)
    assert worker.alloc(GIB + GIB // 2) == f"allocated {GIB + GIB // 2}"
    config = make_config({"train": {"memoryBytes": 2 * GIB}}, grace=30)
    enforcer = gpu.enforcer(config)
    assert enforcer.wait_event("memory_enforcement", 10, container="train")["mechanism"] == "driver"
    enforcer.wait_polls(2)
    assert enforcer.metric("gpufence_container_gpu_memory_used_bytes", container="train") == GIB + GIB // 2
    assert enforcer.events("driver_usage_discrepancy") == []

    # A process of the cgroup the enforcer cannot attribute (no such pid in its namespace).
    ghost = SimProcess(_free_pid(), 1 * GIB, cgroup=ns)
    gpu.write(gpu.device_with(ghost))
    gap = enforcer.wait_event("driver_usage_discrepancy", 10, container="train")
    assert gap["driver_used_bytes"] == 2 * GIB + GIB // 2 and gap["process_sum_bytes"] == GIB + GIB // 2
    worker.out.wait_for(lambda s: s == "got SIGTERM", 10)
    over = enforcer.wait_event("memory_over_share", 5, container="train")
    assert over["used_bytes"] == 2 * GIB + GIB // 2 and over["limit_bytes"] == 2 * GIB
    enforcer.wait_polls(3)
    assert len(enforcer.events("driver_usage_discrepancy")) == 1
    assert enforcer.stop() == 0


def _free_pid() -> int:
    """A pid no process has now: one a reaped child had."""
    child = subprocess.Popen(["true"])
    child.wait()
    assert not os.path.exists(f"/proc/{child.pid}")
    return child.pid
