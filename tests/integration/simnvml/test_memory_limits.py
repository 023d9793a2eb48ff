"""simnvml's NVML R615 memory limits, through the REAL pynvml in child processes.

Every NVML call runs in a fresh interpreter that loads the fake library (see test_simnvml.py): one
process sets limits (as the container toolkit's hook does), others read them (as the enforcer does)
or allocate (as a CUDA workload does), and they share nothing but the files beside the state file.
Processes are placed in cgroup namespaces through the state file (``SimProcess.cgroup``): this
machine mounts cgroup v1, where every process's unified-hierarchy line is ``0::/``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from gpufence.enforcer.observe.procfs import read_start_time
from gpufence.simnvml import (
    NO_LIMIT,
    SimAllocation,
    SimDevice,
    SimLimit,
    SimProcess,
    SimState,
    build_library,
    driver_state_path,
    preset_limits,
    read_allocations,
    read_limits,
    simulated_env,
    write_state,
)
from gpufence.simnvml.limits import render_driver_state
from gpufence.simnvml.state import replace_file
from tests.integration.simnvml.test_simnvml import REPO, run_child

GiB = 1 << 30
MiB = 1 << 20
UUID = "GPU-11111111-2222-3333-4444-555555555555"
POD_A = "/sys/fs/cgroup/kubepods/podA/ctr"
POD_B = "/sys/fs/cgroup/kubepods/podB/ctr"
INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND, OUT_OF_MEMORY = 2, 3, 4, 13, 20

# Helpers for the child: set/get through pynvml's own structs on device 0.
LIMITS = textwrap.dedent(
    """
    def ns_bytes(ns):
        return None if ns is None else ns.encode()

    def set_limits(ns, soft, hard):
        N.nvmlInit()
        req = N.c_nvmlSetMemoryLimits_v1_t()
        req.nameSpace, req.softLimit, req.hardLimit = ns_bytes(ns), soft, hard
        return call(N.nvmlDeviceSetMemoryLimits_v1, N.nvmlDeviceGetHandleByIndex(0), req)

    def get_limits(ns):
        N.nvmlInit()
        req = N.c_nvmlGetMemoryLimits_v1_t()
        req.nameSpace = ns_bytes(ns)
        got = call(N.nvmlDeviceGetMemoryLimits_v1, N.nvmlDeviceGetHandleByIndex(0), req)
        return got if got[0] == "err" else ["ok", [req.softLimit, req.hardLimit, req.currentUsed]]
    """
)


def child(lib: pathlib.Path, state_path: pathlib.Path, body: str) -> Any:
    return run_child(lib, state_path, LIMITS + textwrap.dedent(body))


def device(*processes: SimProcess, total: int = 80 * GiB) -> SimState:
    return SimState(devices=(SimDevice(UUID, total, processes),))


@pytest.fixture(scope="session")
def lib() -> pathlib.Path:
    return build_library()


@pytest.fixture(scope="session")
def old_lib() -> pathlib.Path:
    return build_library(memory_limits=False)


@pytest.fixture
def state_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "state"


class Workload:
    """A simulated CUDA process: allocates and frees on command (stdin lines), answers on stdout."""

    SCRIPT = textwrap.dedent(
        """
        import sys
        from gpufence.simnvml import workload
        print("ready", flush=True)
        for line in sys.stdin:
            op, arg, n = line.split()
            if op == "current":  # an observer that lives on, as the enforcer does: currentUsed of namespace arg
                import pynvml as N
                N.nvmlInit()
                req = N.c_nvmlGetMemoryLimits_v1_t()
                req.nameSpace = arg.encode()
                N.nvmlDeviceGetMemoryLimits_v1(N.nvmlDeviceGetHandleByIndex(0), req)
                print(req.currentUsed, flush=True)
                continue
            try:
                getattr(workload, op)(arg, int(n))
                print("ok", flush=True)
            except workload.SimAllocationError as exc:
                print(f"err {exc.code}", flush=True)
        """
    )

    def __init__(self, lib: pathlib.Path, state_path: pathlib.Path, *, own_pid_namespace: bool = False) -> None:
        env = {**os.environ, **simulated_env(lib, state_path), "PYTHONPATH": str(REPO)}
        prefix = ["unshare", "--pid", "--fork", "--mount-proc"] if own_pid_namespace else []
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", self.SCRIPT],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"
        self.pid = self.proc.pid  # the host pid of the interpreter
        if own_pid_namespace:  # unshare forked it
            children = pathlib.Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            self.pid = int(children[0])

    def send(self, op: str, nbytes: int, arg: str = UUID) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{op} {arg} {nbytes}\n")
        self.proc.stdin.flush()

    def receive(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def _do(self, op: str, nbytes: int, arg: str = UUID) -> str:
        self.send(op, nbytes, arg)
        return self.receive()

    def allocate(self, nbytes: int) -> str:
        return self._do("allocate", nbytes)

    def free(self, nbytes: int) -> str:
        return self._do("free", nbytes)

    def current_used(self, namespace: str) -> int:
        return int(self._do("current", 0, namespace))

    def exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def workloads(lib: pathlib.Path, state_path: pathlib.Path) -> Iterator[Any]:
    started: list[Workload] = []

    def start(own_pid_namespace: bool = False) -> Workload:
        started.append(Workload(lib, state_path, own_pid_namespace=own_pid_namespace))
        return started[-1]

    yield start
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


# -- set, get, persistence ------------------------------------------------------------------------


def test_limits_set_by_one_process_are_read_by_another(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(state_path, device())
    assert child(lib, state_path, f"result = set_limits({POD_A!r}, 1 * GiB, 2 * GiB)") == ["ok", None]
    assert read_limits(state_path) == (SimLimit(UUID, POD_A, 1 * GiB, 2 * GiB),)
    assert "limit" not in state_path.read_text()  # the test's own state file is never written

    write_state(state_path, device(SimProcess(4242, 3 * GiB)))  # a new state keeps the limits
    result = child(
        lib,
        state_path,
        f"""
        result = {{
            "own": get_limits({POD_A!r}),
            "trailing_slash": get_limits({POD_A + "/"!r}),
            "child_cgroup": get_limits({POD_A + "/sub"!r}),
            "parent": get_limits("/sys/fs/cgroup/kubepods/podA"),
            "neighbour": get_limits({POD_B!r}),
            "prefix_is_not_ancestor": get_limits({POD_A + "x"!r}),
        }}
        """,
    )
    assert result["own"] == ["ok", [1 * GiB, 2 * GiB, 0]]
    assert result["trailing_slash"] == result["own"]
    assert result["child_cgroup"] == result["own"]  # a cgroup without limits is charged to its nearest limited ancestor
    for key in ("parent", "neighbour", "prefix_is_not_ancestor"):
        assert result[key] == ["err", NOT_SUPPORTED], key  # the driver: no limit here or above


def test_current_used_follows_the_processes_of_each_namespace(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(
        state_path,
        device(
            SimProcess(100, 1 * GiB, cgroup=POD_A),
            SimProcess(101, 2 * GiB, cgroup=POD_A + "/worker"),  # a descendant: charged to POD_A
            SimProcess(102, 3 * GiB, cgroup=POD_B),
            SimProcess(103, 5 * GiB, cgroup="/sys/fs/cgroup/kubepods/podC"),  # no limit anywhere above
            SimProcess(104, None, cgroup=POD_B),  # "not available": nothing to count
        ),
    )
    preset_limits(state_path, SimLimit(UUID, POD_A, 4 * GiB, 8 * GiB), SimLimit(UUID, POD_B, 0, 8 * GiB))
    body = f"result = [get_limits({POD_A!r}), get_limits({POD_B!r}), get_limits({POD_A + '/worker'!r})]"
    a, b, worker = child(lib, state_path, body)
    assert a == ["ok", [4 * GiB, 8 * GiB, 3 * GiB]]
    assert b == ["ok", [0, 8 * GiB, 3 * GiB]]
    assert worker == a

    # The usage follows the state file; a limit on the worker's own cgroup takes its usage from POD_A.
    write_state(
        state_path,
        device(
            SimProcess(100, 6 * GiB, cgroup=POD_A),
            SimProcess(101, 2 * GiB, cgroup=POD_A + "/worker"),
            SimProcess(102, 3 * GiB, cgroup=POD_B),
        ),
    )
    preset_limits(state_path, SimLimit(UUID, POD_A + "/worker", 0, 2 * GiB))
    a, b, worker = child(lib, state_path, body)
    assert a == ["ok", [4 * GiB, 8 * GiB, 6 * GiB]]
    assert b == ["ok", [0, 8 * GiB, 3 * GiB]]
    assert worker == ["ok", [0, 2 * GiB, 2 * GiB]]


# -- allocations ------------------------------------------------------------------------------------


def test_allocation_past_the_hard_limit_fails_while_the_neighbours_succeeds(
    lib: pathlib.Path, state_path: pathlib.Path, workloads: Any
) -> None:
    a, b, observer = workloads(), workloads(), workloads()
    # The state file says what A already holds (1 GiB); allocations add to it.
    write_state(state_path, device(SimProcess(a.pid, 1 * GiB, cgroup=POD_A), SimProcess(b.pid, 0, cgroup=POD_B)))
    assert child(
        lib, state_path, f"result = [set_limits({POD_A!r}, GiB, 2 * GiB), set_limits({POD_B!r}, 0, 8 * GiB)]"
    ) == [
        ["ok", None],
        ["ok", None],
    ]

    assert a.allocate(512 * MiB) == "ok"  # 1.5 GiB of 2
    assert a.allocate(1 * GiB) == f"err {OUT_OF_MEMORY}"  # 2.5 GiB: past the hard limit, nothing recorded
    assert b.allocate(4 * GiB) == "ok"  # the neighbour's namespace has room
    assert a.allocate(512 * MiB) == "ok"  # exactly at the hard limit
    assert a.allocate(1) == f"err {OUT_OF_MEMORY}"

    observe = f"""
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        result = {{
            "procs": procs(N.nvmlDeviceGetComputeRunningProcesses(h)),
            "used": N.nvmlDeviceGetMemoryInfo(h).used,
            "a": get_limits({POD_A!r}),
            "b": get_limits({POD_B!r}),
        }}
        """
    seen = child(lib, state_path, observe)
    assert seen["procs"] == sorted([[a.pid, 2 * GiB], [b.pid, 4 * GiB]])
    assert seen["used"] == 6 * GiB
    assert seen["a"] == ["ok", [1 * GiB, 2 * GiB, 2 * GiB]]
    assert seen["b"] == ["ok", [0, 8 * GiB, 4 * GiB]]
    assert {(x.pid, x.bytes) for x in read_allocations(state_path)} == {(a.pid, 1 * GiB), (b.pid, 4 * GiB)}

    assert a.free(768 * MiB) == "ok"
    assert a.allocate(512 * MiB) == "ok"  # room again after the free
    assert observer.current_used(POD_B) == 4 * GiB
    b.exit()  # the driver frees an exited process's memory
    assert observer.current_used(POD_B) == 0  # also for a process that loaded the library before
    seen = child(lib, state_path, observe)
    assert seen["a"] == ["ok", [1 * GiB, 2 * GiB, 1 * GiB + 768 * MiB]]
    assert seen["b"] == ["ok", [0, 8 * GiB, 0]]  # still listed by the state file, with its 0 bytes
    assert seen["procs"] == sorted([[a.pid, 1 * GiB + 768 * MiB], [b.pid, 0]])


def test_unlisted_workload_is_listed_and_limited_by_the_device_memory(
    lib: pathlib.Path, state_path: pathlib.Path
) -> None:
    write_state(state_path, device(total=8 * GiB))
    env = {**os.environ, **simulated_env(lib, state_path), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "gpufence.simnvml.workload", "--uuid", UUID]
    refused = subprocess.run(
        [*command, "--allocate", str(9 * GiB)], env=env, capture_output=True, text=True, cwd=REPO, check=False
    )
    assert refused.returncode == 2, refused
    assert "CUDA error: out of memory" in refused.stderr

    holder = subprocess.Popen(
        [*command, "--allocate", str(6 * GiB), "--hold"], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == f"allocated {6 * GiB} bytes on {UUID}\n"
        seen = child(
            lib,
            state_path,
            """
            N.nvmlInit()
            h = N.nvmlDeviceGetHandleByIndex(0)
            result = [procs(N.nvmlDeviceGetComputeRunningProcesses(h)), N.nvmlDeviceGetMemoryInfo(h).free]
            """,
        )
        assert seen == [[[holder.pid, 6 * GiB]], 2 * GiB]
        again = subprocess.run(
            [*command, "--allocate", str(3 * GiB)], env=env, capture_output=True, text=True, cwd=REPO, check=False
        )
        assert again.returncode == 2, again  # 6 + 3 GiB > 8 GiB
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    assert holder.returncode == 0
    done = subprocess.run(
        [*command, "--allocate", str(7 * GiB)], env=env, capture_output=True, text=True, cwd=REPO, check=False
    )
    assert done.returncode == 0, done  # the holder's memory went with it


def test_concurrent_allocations_never_pass_the_hard_limit_together(
    lib: pathlib.Path, state_path: pathlib.Path, workloads: Any
) -> None:
    crowd = [workloads() for _ in range(4)]
    write_state(state_path, device(*(SimProcess(w.pid, 0, cgroup=POD_A) for w in crowd)))
    preset_limits(state_path, SimLimit(UUID, POD_A, 0, 10 * GiB))
    for w in crowd:  # every request is queued before any answer is read: the four race
        for _ in range(5):
            w.send("allocate", GiB)
    answers = [w.receive() for w in crowd for _ in range(5)]
    assert sorted(answers) == ["err 20"] * 10 + ["ok"] * 10
    assert sum(x.bytes for x in read_allocations(state_path)) == 10 * GiB


def test_an_allocation_belongs_to_its_process_not_to_a_later_one_with_the_same_pid(
    lib: pathlib.Path, state_path: pathlib.Path, workloads: Any
) -> None:
    """A later pod's PID namespace can get a dead pod's namespace inode and the same small pids: its
    process must not inherit the dead one's allocations (a 0 % sample under its pid, memory it never took)."""
    live = workloads()
    start = read_start_time(live.pid)
    assert start is not None
    own_ns = os.stat("/proc/self/ns/pid").st_ino
    write_state(state_path, device())
    stale = SimAllocation(UUID, 0, 5 * GiB, own_ns, live.pid, start_ticks=start - 1)  # same pid, older process
    replace_file(driver_state_path(state_path), render_driver_state((), (stale,)))
    listing = "N.nvmlInit(); result = procs(N.nvmlDeviceGetComputeRunningProcesses(N.nvmlDeviceGetHandleByIndex(0)))"
    assert child(lib, state_path, listing) == []
    assert live.allocate(GiB) == "ok"  # its own entry, not the stale one's 5 GiB plus one
    assert child(lib, state_path, listing) == [[live.pid, GiB]]
    assert [(x.ns_pid, x.bytes, x.start_ticks) for x in read_allocations(state_path)] == [(live.pid, GiB, start)]


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_workload_in_its_own_pid_namespace(lib: pathlib.Path, state_path: pathlib.Path, workloads: Any) -> None:
    nested, observer = workloads(own_pid_namespace=True), workloads()
    listed = SimProcess.for_pid(nested.pid, 0, cgroup=POD_A)
    assert listed.ns_pid == 1  # it is its namespace's init
    write_state(state_path, device(listed))
    preset_limits(state_path, SimLimit(UUID, POD_A, 0, 2 * GiB))
    assert nested.allocate(3 * GiB) == f"err {OUT_OF_MEMORY}"  # its state-file cgroup is limited
    assert nested.allocate(2 * GiB) == "ok"
    assert [(x.pid, x.ns_pid) for x in read_allocations(state_path)] == [(nested.pid, 1)]  # the host pid is known
    seen = child(
        lib,
        state_path,
        "N.nvmlInit(); result = procs(N.nvmlDeviceGetComputeRunningProcesses(N.nvmlDeviceGetHandleByIndex(0)))",
    )
    assert seen == [[nested.pid, 2 * GiB]]
    assert observer.current_used(POD_A) == 2 * GiB
    nested.exit()
    assert observer.current_used(POD_A) == 0  # seen from the host namespace through its host pid


# -- the driver's refusals ------------------------------------------------------------------------------


def test_set_refusals(lib: pathlib.Path, state_path: pathlib.Path, workloads: Any) -> None:
    w = workloads()
    write_state(state_path, device(SimProcess(w.pid, 0, cgroup=POD_A)))
    result = child(
        lib,
        state_path,
        f"""
        result = {{
            "soft_above_hard": set_limits({POD_A!r}, 2 * GiB, 1 * GiB),
            "empty": set_limits("", 0, GiB),
            "null": set_limits(None, 0, GiB),
            "relative": set_limits("kubepods/podA", 0, GiB),
            "root": set_limits("/sys/fs/cgroup", 0, GiB),
            "root_slash": set_limits("/sys/fs/cgroup/", 0, GiB),
            "get_empty": get_limits(""),
        }}
        """,
    )
    assert result.pop("root") == result.pop("root_slash") == ["err", NOT_SUPPORTED]
    assert all(value == ["err", INVALID_ARGUMENT] for value in result.values() if isinstance(value, list)), result
    assert read_limits(state_path) == ()

    assert child(lib, state_path, f"result = set_limits({POD_A!r}, 0, 4 * GiB)") == ["ok", None]
    assert w.allocate(3 * GiB) == "ok"
    result = child(
        lib,
        state_path,
        f"""
        result = [set_limits({POD_A!r}, 0, 2 * GiB), get_limits({POD_A!r}),
                  set_limits({POD_A!r}, GiB, 3 * GiB), get_limits({POD_A!r}),
                  set_limits({POD_A!r}, 0, {NO_LIMIT}), get_limits({POD_A!r})]
        """,
    )
    assert result[0] == ["err", INVALID_ARGUMENT]  # below what the limited cgroup holds
    assert result[1] == ["ok", [0, 4 * GiB, 3 * GiB]]  # unchanged
    assert result[2:4] == [["ok", None], ["ok", [1 * GiB, 3 * GiB, 3 * GiB]]]
    assert result[4:6] == [["ok", None], ["ok", [0, NO_LIMIT, 3 * GiB]]]  # NVML's "no limit"

    write_state(state_path, SimState(devices=device().devices, failures={"nvmlDeviceSetMemoryLimits": "NO_PERMISSION"}))
    assert child(lib, state_path, f"result = [set_limits({POD_A!r}, 0, GiB), get_limits({POD_A!r})[0]]") == [
        ["err", NO_PERMISSION],
        "ok",
    ]


def test_old_driver_has_no_limit_calls_and_no_limits(
    old_lib: pathlib.Path, lib: pathlib.Path, state_path: pathlib.Path
) -> None:
    assert old_lib.parent != lib.parent
    assert build_library(memory_limits=False) == old_lib  # cached
    write_state(state_path, device())
    preset_limits(state_path, SimLimit(UUID, POD_A, 0, 1 * GiB))
    result = child(
        old_lib,
        state_path,
        f"""
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        errors = []
        for fn, struct in ((N.nvmlDeviceSetMemoryLimits_v1, N.c_nvmlSetMemoryLimits_v1_t),
                           (N.nvmlDeviceGetMemoryLimits_v1, N.c_nvmlGetMemoryLimits_v1_t)):
            req = struct()
            req.nameSpace = {POD_A!r}.encode()
            try:
                fn(h, req)
                errors.append("no error")
            except N.NVMLError_FunctionNotFound as exc:
                errors.append(exc.value)
        # An allocation is not limited by a driver that has no limits.
        write_state(os.environ["GPUFENCE_SIM_STATE"], SimState(devices=(SimDevice({UUID!r}, 80 * GiB,
                    (SimProcess(os.getpid(), 0, cgroup={POD_A!r}),)),)))
        from gpufence.simnvml import workload
        workload.allocate({UUID!r}, 2 * GiB)
        result = errors
        """,
    )
    assert result == [FUNCTION_NOT_FOUND, FUNCTION_NOT_FOUND]
