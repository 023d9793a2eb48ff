"""enforcer.observe.attribution against real processes: NVML samples (enforcer.observe.nvml's own dataclasses)
naming real child PIDs, our own PID, PIDs of exited processes and of another PID namespace."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gpufence.enforcer.observe.attribution import (
    Attribution,
    Attributor,
    PidMode,
    PodProcess,
    bind_names,
    cgroup_names,
    choose_mode,
    resolve_containers,
)
from gpufence.enforcer.observe.nvml import DeviceSample, GpuProcess, NvmlSample
from gpufence.enforcer.observe.procfs import ProcFacts, read_start_time
from tests.integration.enforcer.test_procfs import _CHILD, GpuDir, Spawn, gpu_dir, spawn
from tests.support.prerequisites import needs

__all__ = ["gpu_dir", "spawn"]  # fixtures shared with test_procfs

REPO_ROOT = Path(__file__).resolve().parents[3]
NOBODY = 1  # an own_pid that is no test process's parent, so the test's children count as workloads


def device(index: int, used: dict[int, int | None], sm: dict[int, int] | None = None, **kw: object) -> DeviceSample:
    uuid = f"GPU-{index}"
    return DeviceSample(
        index=index,
        uuid=uuid,
        total_memory_bytes=16 << 30,
        processes=tuple(GpuProcess(pid, index, uuid, n) for pid, n in used.items()),
        sm_util_by_pid=sm or {},
        **kw,  # type: ignore[arg-type]
    )


def sample(*devices: DeviceSample) -> NvmlSample:
    return NvmlSample(devices=devices, errors=())


def local(gpu: GpuDir, own_pid: int = NOBODY) -> Attributor:
    return Attributor(PidMode.LOCAL, device_prefix=gpu.prefix, own_pid=own_pid)


def by_pid(attribution: Attribution) -> dict[int, str | None]:
    return {p.pid: p.container for p in attribution.processes}


def gone_pid(spawn: Spawn) -> int:
    child = spawn("train")
    child.stop()
    return child.pid


# -- LOCAL --------------------------------------------------------------------------------------------


def test_local_mode_attributes_pod_processes_and_rejects_the_rest(spawn: Spawn, gpu_dir: GpuDir) -> None:
    train, eval_, unattributed = spawn("train"), spawn("eval"), spawn(None)
    no_device = spawn("train", device=False)  # e.g. a legacy driver's host PID colliding with a local one
    missing = gone_pid(spawn)
    nvml_pids = [train.pid, eval_.pid, unattributed.pid, no_device.pid, missing, os.getpid()]
    result = local(gpu_dir).attribute(sample(device(0, {pid: 1 << 20 for pid in nvml_pids})))
    assert by_pid(result) == {train.pid: "train", eval_.pid: "eval", unattributed.pid: None}
    # The test process holds no device file here: it is rejected like any other stranger.
    assert result.foreign_pids == tuple(sorted([no_device.pid, missing, os.getpid()]))


def test_pod_process_fields(spawn: Spawn, gpu_dir: GpuDir) -> None:
    train = spawn("train")
    result = local(gpu_dir).attribute(
        sample(
            device(0, {train.pid: 3 << 30}, sm={train.pid: 42}),
            device(1, {train.pid: None}),  # memory unknown, no utilisation sample on device 1
        )
    )
    start = read_start_time(train.pid)
    assert result.processes == (
        PodProcess(train.pid, train.pid, start, "train", 0, "GPU-0", 3 << 30, 42, claim="train"),
        PodProcess(train.pid, train.pid, start, "train", 1, "GPU-1", None, None, claim="train"),
    )
    assert result.foreign_pids == ()


def test_the_enforcer_itself_is_never_a_workload(spawn: Spawn, gpu_dir: GpuDir) -> None:
    # The enforcer holds device files (NVML opens them), so the device check alone would accept it.
    with open(gpu_dir.device, "rb"):
        train, helper = spawn("train"), spawn(None)
        nvml = sample(device(0, {os.getpid(): 1, train.pid: 1, helper.pid: 1}))
        result = Attributor(PidMode.LOCAL, device_prefix=gpu_dir.prefix).attribute(nvml)  # own_pid: this process
    # Our own PID and our unattributed child (a helper of ours) are dropped; an attributed child is a
    # workload launched on purpose (tests, the demo), and nothing is reported as foreign.
    assert by_pid(result) == {train.pid: "train"}
    assert result.foreign_pids == ()
    # own_pid is honoured when given.
    assert by_pid(local(gpu_dir, own_pid=train.pid).attribute(nvml)) == {helper.pid: None}


def test_a_process_that_exits_is_dropped_at_the_next_tick(spawn: Spawn, gpu_dir: GpuDir) -> None:
    train, eval_ = spawn("train"), spawn("eval")
    attributor = local(gpu_dir)
    nvml = sample(device(0, {train.pid: 1, eval_.pid: 1}))
    assert by_pid(attributor.attribute(nvml)) == {train.pid: "train", eval_.pid: "eval"}
    eval_.stop()
    # NVML can still list it for a moment; the cached facts must not keep it alive.
    result = attributor.attribute(nvml)
    assert (by_pid(result), result.foreign_pids) == ({train.pid: "train"}, (eval_.pid,))


def test_a_zombie_is_not_a_gpu_process(spawn: Spawn, gpu_dir: GpuDir) -> None:
    train = spawn("train")
    nvml = sample(device(0, {train.pid: 1}))
    train.exit_unreaped()  # exited, not yet reaped: its PID and start time still read
    assert read_start_time(train.pid) is not None
    result = local(gpu_dir).attribute(nvml)
    # Its descriptors are closed: it holds no device, so it is not (any more) a GPU process of ours.
    assert (result.processes, result.foreign_pids) == ((), (train.pid,))


def test_a_process_that_opens_the_device_later_is_accepted_later(spawn: Spawn, gpu_dir: GpuDir) -> None:
    child = spawn("train", device=False)
    attributor = local(gpu_dir)
    nvml = sample(device(0, {child.pid: 1}))
    assert attributor.attribute(nvml).foreign_pids == (child.pid,)
    child.open_device()
    assert by_pid(attributor.attribute(nvml)) == {child.pid: "train"}


def test_lost_devices_and_nonsense_pids_are_ignored(spawn: Spawn, gpu_dir: GpuDir) -> None:
    train = spawn("train")
    result = local(gpu_dir).attribute(sample(device(0, {0: 1, -1: 1, 2**31: 1}), device(1, {train.pid: 1}, lost=True)))
    assert result.processes == ()
    assert result.foreign_pids == (-1, 0, 2**31)


def test_device_prefix_comes_from_the_environment_by_default(
    spawn: Spawn, gpu_dir: GpuDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    train = spawn("train")
    nvml = sample(device(0, {train.pid: 1}))
    monkeypatch.delenv("GPUFENCE_NVIDIA_DEVICE_PREFIX", raising=False)
    assert Attributor(PidMode.LOCAL, own_pid=NOBODY).attribute(nvml).foreign_pids == (train.pid,)
    monkeypatch.setenv("GPUFENCE_NVIDIA_DEVICE_PREFIX", gpu_dir.prefix)
    assert by_pid(Attributor(PidMode.LOCAL, own_pid=NOBODY).attribute(nvml)) == {train.pid: "train"}


# -- HOST_PROC ------------------------------------------------------------------------------------------


def test_host_proc_mode_in_the_same_namespace(spawn: Spawn, gpu_dir: GpuDir) -> None:
    # host_proc_root is our own /proc: NSpid has a single entry and the namespace is ours.
    train, unattributed, no_device = spawn("train"), spawn(None), spawn("eval", device=False)
    missing = gone_pid(spawn)
    attributor = Attributor(PidMode.HOST_PROC, host_proc_root="/proc", device_prefix=gpu_dir.prefix, own_pid=NOBODY)
    nvml = sample(device(0, {p: 1 for p in (train.pid, unattributed.pid, no_device.pid, missing)}))
    for _ in range(2):  # the second tick is served from the cache
        result = attributor.attribute(nvml)
        # In our namespace by the host's /proc and listed by NVML: the pod's GPU process whatever it
        # holds (issue 32 row 2: a device held through a name or path no check covers).
        assert by_pid(result) == {train.pid: "train", unattributed.pid: None, no_device.pid: "eval"}
        assert all(p.nvml_pid == p.pid for p in result.processes)
        assert result.foreign_pids == (missing,)


def test_host_proc_mode_needs_a_host_proc() -> None:
    with pytest.raises(ValueError):
        Attributor(PidMode.HOST_PROC)


def test_choose_mode(tmp_path: Path) -> None:
    assert choose_mode(None) is PidMode.LOCAL
    assert choose_mode("") is PidMode.LOCAL
    assert choose_mode(str(tmp_path / "absent")) is PidMode.LOCAL
    assert choose_mode(str(tmp_path)) is PidMode.LOCAL  # mounted but empty: not a proc
    assert choose_mode("/proc") is PidMode.HOST_PROC


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount", "true"], capture_output=True, check=False)
    return probe.returncode == 0


needs_unshare = needs(_can_unshare(), reason="needs root and unshare(1) for PID namespaces")


@pytest.mark.root
@needs_unshare
def test_host_proc_mode_rejects_another_pid_namespace(gpu_dir: GpuDir) -> None:
    # A GPU process in a child PID namespace (think: another pod) reported by its host PID.
    env = {"PATH": os.environ.get("PATH", ""), "GPUFENCE_CONTAINER": "train"}
    unshare = subprocess.Popen(
        ["unshare", "--pid", "--fork", sys.executable, "-c", _CHILD, str(gpu_dir.device), "1", ""],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert unshare.stdout is not None
        assert unshare.stdout.readline() == "ready\n"
        (inner,) = psutil.Process(unshare.pid).children()
        nvml = sample(device(0, {inner.pid: 1}))
        host = Attributor(PidMode.HOST_PROC, host_proc_root="/proc", device_prefix=gpu_dir.prefix, own_pid=NOBODY)
        result = host.attribute(nvml)
        assert (result.processes, result.foreign_pids) == ((), (inner.pid,))
        # LOCAL mode cannot tell (it is visible and holds the device): why HOST_PROC exists.
        assert by_pid(local(gpu_dir).attribute(nvml)) == {inner.pid: "train"}
    finally:
        assert unshare.stdin is not None
        unshare.stdin.close()
        unshare.wait(timeout=10)


_ENFORCER_IN_A_POD = """
import json, os, subprocess, sys
from gpufence.enforcer.observe.attribution import Attributor, PidMode
from gpufence.enforcer.observe.nvml import DeviceSample, GpuProcess, NvmlSample
host_proc, device_file, child, outer_runner = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
nvml_fd = open(device_file, "rb")  # as NVML would: the enforcer itself holds a device file
env = {"GPUFENCE_CONTAINER": "train", "PATH": os.environ["PATH"]}
work = subprocess.Popen([sys.executable, "-c", child, device_file, "1", ""], env=env,
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert work.stdout.readline() == "ready\\n"
# Host PIDs, found without NSpid: <host_proc>/self is us; our child is whoever has us as parent.
self_host = int(os.readlink(f"{host_proc}/self"))
def parent(p):
    try:
        return open(f"{host_proc}/{p}/stat").read().rpartition(")")[2].split()[1]
    except OSError:  # a host process that exited while we looked
        return None
work_host = next(int(p) for p in os.listdir(host_proc) if p.isdigit() and parent(p) == str(self_host))
# A legacy driver reports host PIDs: our workload's, ours, and the outer test runner's.
procs = tuple(GpuProcess(pid, 0, "GPU-0", 5) for pid in (work_host, self_host, outer_runner))
sample = NvmlSample((DeviceSample(0, "GPU-0", 1 << 34, procs, {}),), ())
attributor = Attributor(PidMode.HOST_PROC, host_proc_root=host_proc,
                        device_prefix=device_file[:-1], own_pid=os.getpid())
result = attributor.attribute(sample)
print(json.dumps({"work_local": work.pid, "work_host": work_host, "self_host": self_host,
                  "processes": [[p.pid, p.nvml_pid, p.container] for p in result.processes],
                  "foreign": list(result.foreign_pids)}), flush=True)
work.stdin.close(); work.wait()
"""


@pytest.mark.root
@needs_unshare
def test_host_proc_mode_translates_host_pids_from_inside_a_pod(gpu_dir: GpuDir, tmp_path: Path) -> None:
    # The enforcer in its own PID namespace (a pod), the host's /proc mounted at host_proc as the
    # webhook does for legacy drivers: host PIDs map to our innermost PIDs; others are foreign.
    host_proc = tmp_path / "hostproc"
    host_proc.mkdir()
    script = (
        f"mount --bind /proc {host_proc} && mount -t proc proc /proc && "
        f'exec "$0" -c "$1" {host_proc} {gpu_dir.device} "$2" {os.getpid()}'
    )
    run = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount", "sh", "-c", script, sys.executable, _ENFORCER_IN_A_POD, _CHILD],
        cwd=REPO_ROOT,
        env={"PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["work_local"] != out["work_host"]  # really two PID numbers for one process
    assert out["processes"] == [[out["work_local"], out["work_host"], "train"]]
    # Our own host PID is dropped (the enforcer); the outer test runner is another namespace's process.
    assert out["foreign"] == [os.getpid()]


# -- cgroup cross-check -----------------------------------------------------------------------------


def facts(pid: int, container: str | None, cgroup: str | None) -> ProcFacts:
    return ProcFacts(pid=pid, start_time_ticks=pid, container=container, cgroup=cgroup, holds_nvidia_device=True)


OWN = "0::/../sidecar"


@pytest.mark.parametrize(
    ("processes", "expected"),
    [
        pytest.param(
            [facts(1, "train", "0::/../a"), facts(2, "train", "0::/../a"), facts(3, "eval", "0::/../b")],
            {1: "train", 2: "train", 3: "eval"},
            id="consistent",
        ),
        pytest.param(
            [facts(1, "train", "0::/../a"), facts(2, "eval", "0::/../a"), facts(3, "eval", "0::/../b")],
            {1: None, 2: None, 3: "eval"},
            id="one cgroup claims two names: that cgroup only is unattributed",
        ),
        pytest.param(
            [facts(1, "train", "0::/../a"), facts(2, "train", "0::/../b"), facts(3, "eval", "0::/../c")],
            {1: None, 2: None, 3: "eval"},
            id="a name claimed from two cgroups, no binding: both unattributed",
        ),
        pytest.param(
            [facts(1, "train", "0::/../a"), facts(2, None, "0::/../a")],
            {1: "train", 2: "train"},
            id="no readable claim: the cgroup names it",
        ),
        pytest.param(
            [facts(1, None, "0::/../a")],
            {1: None},
            id="nobody in the cgroup claims, no binding",
        ),
        pytest.param(
            [facts(1, "train", OWN), facts(2, "eval", OWN), facts(3, "train", None)],
            {1: "train", 2: "eval", 3: "train"},
            id="our own or an unreadable cgroup says nothing",
        ),
        pytest.param([], {}, id="empty"),
    ],
)
def test_resolve_containers(processes: list[ProcFacts], expected: dict[int, str | None]) -> None:
    assert resolve_containers(processes, OWN) == expected


def test_a_bound_name_survives_an_impostor_and_names_claimless_processes() -> None:
    bound = {"train": "0::/../a"}
    impostor = [facts(1, "train", "0::/../a"), facts(2, "train", "0::/../evil"), facts(3, None, "0::/../a")]
    assert resolve_containers(impostor, OWN, bound) == {1: "train", 2: None, 3: "train"}
    # With no claimant left in its cgroup (env -i everywhere), the binding still names it.
    assert resolve_containers([facts(4, None, "0::/../a")], OWN, bound) == {4: "train"}


def test_bindings_follow_a_restarted_container_and_ignore_ambiguity() -> None:
    bound = {"train": "0::/../a"}
    # The container restarted: a new cgroup is the only holder of its name.
    assert bind_names({"0::/../a2": "train"}, bound) == {"train": "0::/../a2"}
    # Two holders (cannot happen after cgroup_names, but bind_names must not pick one).
    assert bind_names({"0::/../x": "train", "0::/../y": "train"}, bound) == bound
    # An idle container keeps its binding.
    assert bind_names({"0::/../b": "eval"}, bound) == {"train": "0::/../a", "eval": "0::/../b"}
    assert cgroup_names({"0::/../a": {"train", "eval"}}, bound) == {"0::/../a": None}
