"""End to end: containers are cgroups. Each simulated container is a real cgroup (v2, created here
as root), so the enforcer sees what it sees in a pod: processes it cannot attribute by their
environment, launchers without a GPU context, and a name claimed from the wrong cgroup.

Skipped, with the reason, where no writable cgroup2 hierarchy is available (not root)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

from tests.support.enforcer_harness import WORKLOAD, LineReader

GIB = 1 << 30
INTERVAL = 0.1


def launcher(tmp: pathlib.Path, *, ignore_term: bool = False) -> tuple[subprocess.Popen[str], LineReader]:
    """A container's non-GPU process (a torchrun, a shell): a workload holding no device file."""
    plain = tmp / "not-a-device"
    plain.touch()
    argv = [sys.executable, str(WORKLOAD), str(plain)] + (["--ignore-term"] if ignore_term else [])
    proc = subprocess.Popen(argv, env={**os.environ, "GPUFENCE_CONTAINER": "train"}, stdout=subprocess.PIPE, text=True)
    out = LineReader(proc.stdout, "launcher")
    out.wait_for(lambda s: s.startswith("ready"), 15)
    return proc, out


def test_the_container_over_its_share_is_terminated_as_a_whole(cgroups, gpu, make_config, tmp_path):
    """An env-less GPU process in an over-share container's cgroup and the container's non-GPU
    launcher are terminated with it (the launcher ignores SIGTERM: the SIGKILL sweep takes it);
    the neighbour container is untouched."""
    train_cg, calm_cg = cgroups.make("train"), cgroups.make("calm")
    worker = gpu.workload("train")
    envless = gpu.workload(None)  # env -i, sudo, setproctitle: no readable claim
    calm = gpu.workload("calm")
    boss, boss_out = launcher(tmp_path, ignore_term=True)
    try:
        for pid in (worker.pid, envless.pid, boss.pid):
            cgroups.move(train_cg, pid)
        cgroups.move(calm_cg, calm.pid)
        procs = (gpu.proc(worker, 1 * GIB), gpu.proc(envless, 1 * GIB), gpu.proc(calm, 1 * GIB))
        gpu.write(gpu.device_with(*procs))
        config = make_config({"train": {"memoryBytes": 2 * GIB}, "calm": {"memoryBytes": 2 * GIB}}, grace=2)
        enforcer = gpu.enforcer(config)
        enforcer.wait_ready()
        enforcer.wait_polls(2)
        # The env-less process is charged to its cgroup's container, not to the pod's unattributed.
        assert enforcer.metric("gpufence_container_gpu_memory_used_bytes", container="train") == 2 * GIB
        assert enforcer.metric("gpufence_pod_unattributed_processes", gpu="0") == 0
        assert enforcer.events("unattributed_process") == []

        gpu.write(gpu.device_with(gpu.proc(worker, 3 * GIB), gpu.proc(envless, 1 * GIB), gpu.proc(calm, 1 * GIB)))
        for w in (worker, envless):
            w.wait_line("got SIGTERM", timeout=5)
            assert w.proc.wait(5) == 0
        boss_out.wait_for(lambda s: s == "ignored SIGTERM", 5)
        assert boss.wait(10) == -signal.SIGKILL
        over = enforcer.wait_event("memory_over_share", 5, container="train")
        assert over["used_bytes"] == 4 * GIB and over["limit_bytes"] == 2 * GIB
        assert sorted(over["victims"]) == sorted([worker.pid, envless.pid])
        terms = {r["pid"] for r in enforcer.events("sigterm", outcome="sent")}
        assert terms == {worker.pid, envless.pid, boss.pid}
        kill = enforcer.wait_event("sigkill", 5, pid=boss.pid)
        assert kill["outcome"] == "sent" and kill["container"] == "train"
        assert (train_cg / "cgroup.procs").read_text().split() == []  # the container is empty: it exited
        enforcer.wait_polls(2)
        assert calm.alive() and not calm.said("got SIGTERM")
        assert enforcer.stop() == 0
    finally:
        if boss.poll() is None:
            boss.kill()
        boss.wait(5)


def test_an_impostor_cgroup_neither_takes_the_name_nor_disturbs_the_container(cgroups, gpu, make_config):
    """A process in another cgroup claiming ``train`` after the enforcer bound the name: it is
    unattributed (pod budget), and ``train`` keeps its own share and its own accounting."""
    train_cg, evil_cg = cgroups.make("train"), cgroups.make("evil")
    worker = gpu.workload("train")
    cgroups.move(train_cg, worker.pid)
    gpu.write(gpu.device_with(gpu.proc(worker, 1 * GIB)))
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 2 * GIB}}, grace=5))
    enforcer.wait_ready()
    enforcer.wait_polls(2)

    impostor = gpu.workload("train")
    cgroups.move(evil_cg, impostor.pid)
    gpu.write(gpu.device_with(gpu.proc(worker, 1 * GIB), gpu.proc(impostor, GIB // 2)))
    seen = enforcer.wait_event("unattributed_process", 5, pid=impostor.pid)
    assert seen["cgroup"].endswith("/evil")
    enforcer.wait_polls(2)
    assert enforcer.metric("gpufence_container_gpu_memory_used_bytes", container="train") == GIB
    assert enforcer.metric("gpufence_pod_gpu_memory_unattributed_bytes", gpu="0") == GIB // 2
    # Pushing the pod over its budget (2 GiB) takes the impostor, not the container it imitates.
    gpu.write(gpu.device_with(gpu.proc(worker, 1 * GIB), gpu.proc(impostor, 3 * GIB)))
    impostor.wait_line("got SIGTERM", timeout=5)
    enforcer.wait_polls(2)
    assert worker.alive() and not worker.said("got SIGTERM")
    assert enforcer.stop() == 0


def test_env_less_gpu_workers_take_the_name_their_launcher_claims(cgroups, gpu, make_config, tmp_path):
    """Every GPU process of the container lost its claim (env -i, setproctitle); the launcher that
    started them, which holds no GPU context, still names the cgroup."""
    train_cg = cgroups.make("train")
    worker = gpu.workload(None)
    boss, _ = launcher(tmp_path)  # claims "train", holds no device
    try:
        for pid in (worker.pid, boss.pid):
            cgroups.move(train_cg, pid)
        gpu.write(gpu.device_with(gpu.proc(worker, GIB)))
        enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 2 * GIB}}, grace=5))
        enforcer.wait_ready()
        enforcer.wait_polls(2)
        assert enforcer.metric("gpufence_container_gpu_memory_used_bytes", container="train") == GIB
        assert enforcer.events("unattributed_process") == []
        gpu.write(gpu.device_with(gpu.proc(worker, 3 * GIB)))
        worker.wait_line("got SIGTERM", timeout=5)
        assert boss.wait(5) == 0  # the launcher goes with its container
        assert enforcer.stop() == 0
    finally:
        if boss.poll() is None:
            boss.kill()
        boss.wait(5)


def test_a_restarted_enforcer_sweeps_the_cgroup_when_the_recorded_grace_period_ends(
    cgroups, gpu, make_config, tmp_path
):
    """The sweep of a terminated container's cgroup is on record with its deadline too: a worker
    its launcher started after the SIGTERM (no GPU context yet, never SIGTERMed) is killed by the
    next enforcer when the first grace period ends, although NVML no longer lists anything."""
    train_cg = cgroups.make("train")
    worker = gpu.workload("train", ignore_term=True)
    cgroups.move(train_cg, worker.pid)
    gpu.write(gpu.device_with(gpu.proc(worker, 3 * GIB)))
    config = make_config({"train": {"memoryBytes": 2 * GIB}}, grace=2)
    first = gpu.enforcer(config)
    worker.wait_line("ignored SIGTERM", 5)
    first.proc.kill()
    assert first.proc.wait(5) == -signal.SIGKILL

    gpu.write(gpu.device_with())
    late, late_out = launcher(tmp_path, ignore_term=True)
    try:
        cgroups.move(train_cg, late.pid)
        second = gpu.enforcer(config)
        assert worker.proc.wait(5) == -signal.SIGKILL
        assert late.wait(5) == -signal.SIGKILL
        assert not any(line == "got SIGTERM" for line in late_out.snapshot())  # killed by the sweep
        assert second.wait_event("sigkill", 5, pid=late.pid)["container"] == "train"
        assert second.events("kill_deadlines_recovered")[0]["cgroups"] == 1
        assert second.stop() == 0
    finally:
        if late.poll() is None:
            late.kill()
        late.wait(5)
