"""simnvml: the fake libnvidia-ml.so.1, driven through the REAL pynvml in child processes.

pynvml dlopens "libnvidia-ml.so.1" once per process, so every check that loads the library runs in
a fresh interpreter with LD_LIBRARY_PATH pointing at the built library. The state file and the
build's configuration errors, which need no library, are tested in tests/unit/simnvml.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from gpufence.simnvml import (
    ENV_STATE,
    SimDevice,
    SimProcess,
    SimState,
    build_library,
    pid_namespace_inode,
    simulated_env,
    write_state,
)

REPO = pathlib.Path(__file__).resolve().parents[3]
GiB = 1 << 30
NOT_AVAILABLE_ULL = 0xFFFFFFFFFFFFFFFF

# Runs in the child before each test body. `call` returns ["ok", value] or ["err", NVML code].
PRELUDE = textwrap.dedent(
    """
    import ctypes, json, os, sys
    import pynvml as N
    from gpufence.simnvml import *

    GiB = 1 << 30

    def call(fn, *args):
        try:
            return ["ok", fn(*args)]
        except N.NVMLError as exc:
            return ["err", exc.value]

    def raw(name):
        return N._nvmlGetFunctionPointer(name)

    def procs(items):
        return sorted([p.pid, p.usedGpuMemory] for p in items)
    """
)


@pytest.fixture(scope="session")
def lib() -> pathlib.Path:
    return build_library()  # the default cache: usually built already


@pytest.fixture
def state_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "state"


def run_child(
    lib: pathlib.Path,
    state_path: pathlib.Path | None,
    body: str,
    *,
    extra_env: dict[str, str] | None = None,
    expect_rc: int = 0,
) -> Any:
    """Runs PRELUDE + body in a fresh interpreter; body assigns `result`, which comes back as JSON."""
    env = dict(os.environ)
    env.update(simulated_env(lib, state_path if state_path is not None else ""))
    if state_path is None:
        env.pop(ENV_STATE)
    env["PYTHONPATH"] = str(REPO)
    env.update(extra_env or {})
    code = PRELUDE + textwrap.dedent(body) + "\nprint('RESULT=' + json.dumps(result))\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    assert proc.returncode == expect_rc, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT=")]
    assert lines, f"no result:\n{proc.stdout}\n{proc.stderr}"
    result = json.loads(lines[-1].removeprefix("RESULT="))
    if isinstance(result, dict):
        result["_stderr"] = proc.stderr
    return result


def one_device(*processes: SimProcess, **kwargs: Any) -> SimState:
    return SimState(devices=(SimDevice("GPU-11111111-2222-3333-4444-555555555555", 80 * GiB, processes),), **kwargs)


# -- build ----------------------------------------------------------------------------------------


def test_build_is_cached_and_has_the_nvml_soname(tmp_path: pathlib.Path) -> None:
    first = build_library(tmp_path)
    assert first.name == "libnvidia-ml.so.1"
    assert first.parent.parent == tmp_path
    stamp = first.stat().st_mtime_ns
    assert build_library(tmp_path) == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt
    assert list(first.parent.iterdir()) == [first]  # no temp files left behind
    readelf = shutil.which("readelf")
    if readelf:
        dynamic = subprocess.run([readelf, "-d", str(first)], capture_output=True, text=True, check=True).stdout
        assert "[libnvidia-ml.so.1]" in dynamic


def test_build_concurrent_callers_agree(tmp_path: pathlib.Path) -> None:
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(build_library(tmp_path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(results)) == 1
    assert [p.name for p in results[0].parent.iterdir()] == ["libnvidia-ml.so.1"]


# -- the library through pynvml -------------------------------------------------------------------


def test_devices_memory_and_versions(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(
        state_path,
        SimState(
            devices=(
                SimDevice("GPU-a", 80 * GiB, (SimProcess(100, 3 * GiB), SimProcess(101, None))),
                SimDevice("GPU-b", 40 * GiB, name="NVIDIA A100 (simulated)"),
            )
        ),
    )
    result = run_child(
        lib,
        state_path,
        """
        N.nvmlInit()
        handles = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
        v2 = N.nvmlDeviceGetMemoryInfo(handles[0], version=N.nvmlMemory_v2)
        by_uuid = N.nvmlDeviceGetHandleByUUID(b"GPU-b")
        result = {
            "driver": N.nvmlSystemGetDriverVersion(),
            "nvml": N.nvmlSystemGetNVMLVersion(),
            "cuda": N.nvmlSystemGetCudaDriverVersion_v2(),
            "uuids": [N.nvmlDeviceGetUUID(h) for h in handles],
            "names": [N.nvmlDeviceGetName(h) for h in handles],
            "indexes": [N.nvmlDeviceGetIndex(h) for h in handles],
            "memory": [[m.total, m.used, m.free] for m in map(N.nvmlDeviceGetMemoryInfo, handles)],
            "memory_v2": [v2.total, v2.reserved, v2.used, v2.free],
            "by_uuid": N.nvmlDeviceGetIndex(by_uuid),
            "bad_index": call(N.nvmlDeviceGetHandleByIndex, 2),
            "unknown_uuid": call(N.nvmlDeviceGetHandleByUUID, b"GPU-zzz"),
            "small_buffer": raw("nvmlDeviceGetUUID")(handles[0], ctypes.create_string_buffer(4), 4),
            "error_string": N.nvmlErrorString(N.NVML_ERROR_GPU_IS_LOST),
        }
        N.nvmlShutdown()
        result["after_shutdown"] = call(N.nvmlDeviceGetCount)
        result["double_shutdown"] = call(N.nvmlShutdown)
        """,
    )
    assert result["driver"] == "560.35.03"
    assert result["nvml"] == "12.560.35.03"
    assert result["cuda"] == 12060
    assert result["uuids"] == ["GPU-a", "GPU-b"]
    assert result["names"] == ["NVIDIA H200 (simulated)", "NVIDIA A100 (simulated)"]
    assert result["indexes"] == [0, 1]
    # used = sum of the processes' known usage; free = total - used
    assert result["memory"] == [[80 * GiB, 3 * GiB, 77 * GiB], [40 * GiB, 0, 40 * GiB]]
    assert result["memory_v2"] == [80 * GiB, 0, 3 * GiB, 77 * GiB]
    assert result["by_uuid"] == 1
    assert result["bad_index"] == ["err", 2]  # INVALID_ARGUMENT
    assert result["unknown_uuid"] == ["err", 6]  # NOT_FOUND
    assert result["small_buffer"] == 7  # INSUFFICIENT_SIZE
    assert result["error_string"] == "GPU is lost"
    assert result["after_shutdown"] == ["err", 1]  # UNINITIALIZED
    assert result["double_shutdown"] == ["err", 1]


def test_process_lists_and_memory_not_available(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(
        state_path,
        one_device(
            SimProcess(200, 2 * GiB),
            SimProcess(201, None),
            SimProcess(202, 5 * GiB, kind="graphics"),
            SimProcess(200, GiB, kind="graphics"),  # one process in both lists
        ),
    )
    result = run_child(
        lib,
        state_path,
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        compute = N.nvmlDeviceGetComputeRunningProcesses(h)
        array = (N.c_nvmlProcessInfo_v3_t * 4)()
        count = ctypes.c_uint(4)
        ret = raw("nvmlDeviceGetComputeRunningProcesses_v3")(h, ctypes.byref(count), array)
        result = {
            "compute": procs(compute),
            "graphics": procs(N.nvmlDeviceGetGraphicsRunningProcesses(h)),
            "compute_v2": procs(N.nvmlDeviceGetComputeRunningProcesses_v2(h)),
            "instance_ids": [compute[0].gpuInstanceId, compute[0].computeInstanceId],
            "raw": [ret, count.value, [[a.pid, a.usedGpuMemory] for a in array[: count.value]]],
        }
        """,
    )
    assert result["compute"] == [[200, 2 * GiB], [201, None]]
    assert result["graphics"] == [[200, GiB], [202, 5 * GiB]]
    assert result["compute_v2"] == result["compute"]
    assert result["instance_ids"] == [0xFFFFFFFF, 0xFFFFFFFF]  # not a MIG device
    # The raw value in the struct is NVML_VALUE_NOT_AVAILABLE (pynvml maps it to None).
    assert result["raw"] == [0, 2, [[200, 2 * GiB], [201, NOT_AVAILABLE_ULL]]]


def test_insufficient_size_protocol_with_300_processes(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(state_path, one_device(*(SimProcess(1000 + i, i * 1024, sm_util=i % 101) for i in range(300))))
    result = run_child(
        lib,
        state_path,
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        fn = raw("nvmlDeviceGetComputeRunningProcesses_v3")
        count = ctypes.c_uint(0)
        sizing = fn(h, ctypes.byref(count), None)
        sizing_count = count.value
        small = (N.c_nvmlProcessInfo_v3_t * 10)()
        count.value = 10
        too_small = fn(h, ctypes.byref(count), small)
        too_small_count = count.value
        util = raw("nvmlDeviceGetProcessUtilization")
        ucount = ctypes.c_uint(0)
        usizing = util(h, None, ctypes.byref(ucount), ctypes.c_ulonglong(0))
        usizing_count = ucount.value
        usmall = (N.c_nvmlProcessUtilizationSample_t * 5)()
        ucount.value = 5
        utoo_small = util(h, usmall, ctypes.byref(ucount), ctypes.c_ulonglong(0))
        compute = N.nvmlDeviceGetComputeRunningProcesses(h)
        samples = N.nvmlDeviceGetProcessUtilization(h, 0)
        result = {
            "sizing": [sizing, sizing_count],
            "too_small": [too_small, too_small_count],
            "util_sizing": [usizing, usizing_count],
            "util_too_small": [utoo_small, ucount.value],
            "pids": [p.pid for p in compute],
            "used": [p.usedGpuMemory for p in compute],
            "sm": {s.pid: s.smUtil for s in samples},
        }
        """,
    )
    assert result["sizing"] == [7, 300]  # NVML_ERROR_INSUFFICIENT_SIZE, count set
    assert result["too_small"] == [7, 300]
    assert result["util_sizing"] == [7, 300]
    assert result["util_too_small"] == [7, 300]
    assert result["pids"] == [1000 + i for i in range(300)]
    assert result["used"] == [i * 1024 for i in range(300)]
    assert result["sm"] == {str(1000 + i): i % 101 for i in range(300)}


def test_utilization_samples_and_timestamps(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(
        state_path,
        SimState(
            devices=(
                SimDevice("GPU-a", 80 * GiB, (SimProcess(300, GiB, sm_util=70), SimProcess(301, GiB, sm_util=0))),
                SimDevice("GPU-idle", 80 * GiB),
            )
        ),
    )
    result = run_child(
        lib,
        state_path,
        """
        import time
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        PERIOD_US = 10_000  # the simulated driver's sampling period (SAMPLE_PERIOD_US)
        before = int(time.time() * 1e6)
        samples = N.nvmlDeviceGetProcessUtilization(h, 0)
        newest = max(s.timeStamp for s in samples)
        # Asking again with lastSeenTimeStamp = newest must find nothing while the driver has not
        # taken a newer sample. On a loaded machine two calls can straddle a sampling period, so
        # retry until one pair is bracketed by the same period of the (shared) realtime clock; an
        # unbracketed pair may only answer NOT_FOUND or strictly newer samples.
        same_window = None
        straddled_ok = True
        for _ in range(1000):
            t0 = time.time_ns() // 1000
            first = N.nvmlDeviceGetProcessUtilization(h, 0)
            ts = max(s.timeStamp for s in first)
            again = call(N.nvmlDeviceGetProcessUtilization, h, ts)
            t1 = time.time_ns() // 1000
            if t0 // PERIOD_US == t1 // PERIOD_US:
                same_window = again
                break
            if again[0] == "ok":
                straddled_ok = straddled_ok and all(s.timeStamp > ts for s in again[1])
            else:
                straddled_ok = straddled_ok and again == ["err", 6]
        if same_window is not None and same_window[0] == "ok":
            same_window = ["ok", [[s.pid, s.timeStamp] for s in same_window[1]]]
        time.sleep(0.03)
        later = N.nvmlDeviceGetProcessUtilization(h, newest)
        result = {
            "samples": sorted([s.pid, s.smUtil] for s in samples),
            "ts_ok": abs(newest - before) < 5_000_000,
            "same_window": same_window,
            "straddled_ok": straddled_ok,
            "later_newer": all(s.timeStamp > newest for s in later),
            "future": call(N.nvmlDeviceGetProcessUtilization, h, 2**63),
            "idle_device": call(N.nvmlDeviceGetProcessUtilization, N.nvmlDeviceGetHandleByIndex(1), 0),
        }
        """,
    )
    assert result["samples"] == [[300, 70], [301, 0]]
    assert result["ts_ok"]  # microseconds since the epoch
    assert result["same_window"] == ["err", 6]  # NOT_FOUND: nothing newer than lastSeenTimeStamp
    assert result["straddled_ok"]
    assert result["later_newer"]
    assert result["future"] == ["err", 6]
    assert result["idle_device"] == ["err", 6]


def test_error_injection(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(
        state_path,
        SimState(
            devices=(
                SimDevice("GPU-a", 80 * GiB, (SimProcess(400, GiB, sm_util=10),)),
                SimDevice("GPU-b", 80 * GiB, (SimProcess(401, GiB),), memory_info_not_supported=True),
                SimDevice("GPU-lost", 80 * GiB, lost=True),
            ),
            failures={
                "nvmlDeviceGetProcessUtilization": "NOT_SUPPORTED",
                "nvmlDeviceGetComputeRunningProcesses@1": "NO_PERMISSION",
            },
        ),
    )
    result = run_child(
        lib,
        state_path,
        """
        N.nvmlInit()
        a, b = N.nvmlDeviceGetHandleByIndex(0), N.nvmlDeviceGetHandleByIndex(1)
        result = {
            "count": N.nvmlDeviceGetCount(),
            "util": call(N.nvmlDeviceGetProcessUtilization, a, 0),
            "compute_a": procs(N.nvmlDeviceGetComputeRunningProcesses(a)),
            "compute_b": call(N.nvmlDeviceGetComputeRunningProcesses_v3, b),
            "memory_b": call(N.nvmlDeviceGetMemoryInfo, b),
            "memory_b_v2": call(N.nvmlDeviceGetMemoryInfo, b, N.nvmlMemory_v2),
            "lost_handle": call(N.nvmlDeviceGetHandleByIndex, 2),
        }
        # The device falls off the bus after its handle was taken.
        write_state(os.environ["GPUFENCE_SIM_STATE"], SimState(devices=(SimDevice("GPU-a", 80 * GiB, lost=True),)))
        result["lost_uuid"] = call(N.nvmlDeviceGetUUID, a)
        result["lost_procs"] = call(N.nvmlDeviceGetComputeRunningProcesses, a)
        result["removed"] = call(N.nvmlDeviceGetUUID, b)
        write_state(os.environ["GPUFENCE_SIM_STATE"], SimState(devices=(), failures={"*": "UNKNOWN"}))
        result["everything"] = [call(N.nvmlDeviceGetCount), call(N.nvmlSystemGetDriverVersion)]
        """,
    )
    assert result["count"] == 3  # a lost device is still counted
    assert result["util"] == ["err", 3]  # NOT_SUPPORTED
    assert result["compute_a"] == [[400, GiB]]
    assert result["compute_b"] == ["err", 4]  # NO_PERMISSION on device 1 only, via the unversioned key
    assert result["memory_b"] == ["err", 3]
    assert result["memory_b_v2"] == ["err", 3]
    assert result["lost_handle"] == ["err", 15]  # GPU_IS_LOST
    assert result["lost_uuid"] == ["err", 15]
    assert result["lost_procs"] == ["err", 15]
    assert result["removed"] == ["err", 15]
    assert result["everything"] == [["err", 999], ["err", 999]]


def test_init_failures_and_late_environment(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(state_path, SimState(devices=(), init_error="DRIVER_NOT_LOADED"))
    result = run_child(
        lib,
        state_path,
        """
        result = {"init": call(N.nvmlInit)}
        try:
            N.nvmlInit()
        except N.NVMLError_DriverNotLoaded as exc:
            result["message"] = str(exc)
        result["before_init"] = call(N.nvmlDeviceGetCount)
        """,
    )
    assert result["init"] == ["err", 9]
    assert result["message"] == "Driver Not Loaded"
    assert result["before_init"] == ["err", 1]  # UNINITIALIZED

    # No GPUFENCE_SIM_STATE at start: init fails and says why; the enforcer may set it later.
    write_state(state_path, one_device(SimProcess(500, GiB)))
    result = run_child(
        lib,
        None,
        f"""
        result = {{"without": call(N.nvmlInit)}}
        os.environ["GPUFENCE_SIM_STATE"] = {str(state_path)!r}
        result["with"] = call(N.nvmlInit)
        result["count"] = N.nvmlDeviceGetCount()
        """,
    )
    assert result["without"] == ["err", 9]
    assert "GPUFENCE_SIM_STATE is not set" in result["_stderr"]
    assert result["with"] == ["ok", None]
    assert result["count"] == 1


def test_state_changes_are_picked_up_between_calls(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(state_path, one_device(SimProcess(600, GiB, sm_util=10)))
    result = run_child(
        lib,
        state_path,
        """
        path = os.environ["GPUFENCE_SIM_STATE"]
        uuid = "GPU-11111111-2222-3333-4444-555555555555"
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        seen = [procs(N.nvmlDeviceGetComputeRunningProcesses(h))]
        # Same size, same second, only one digit differs: still a change.
        write_state(path, SimState(devices=(SimDevice(uuid, 80 << 30, (SimProcess(600, 2 << 30, sm_util=10),)),)))
        seen.append(procs(N.nvmlDeviceGetComputeRunningProcesses(h)))
        write_state(path, SimState(devices=(SimDevice(uuid, 80 << 30, (
            SimProcess(600, 2 << 30), SimProcess(601, 3 << 30))),)))
        seen.append(procs(N.nvmlDeviceGetComputeRunningProcesses(h)))
        seen.append(N.nvmlDeviceGetMemoryInfo(h).used)
        # A malformed or missing file keeps the last good state.
        with open(path, "w") as f:
            f.write("gpufence-simnvml 1\\ndevice broken\\n")
        seen.append(procs(N.nvmlDeviceGetComputeRunningProcesses(h)))
        os.unlink(path)
        seen.append(procs(N.nvmlDeviceGetComputeRunningProcesses(h)))
        write_state(path, SimState(devices=(SimDevice(uuid, 80 << 30),)))
        seen.append(procs(N.nvmlDeviceGetComputeRunningProcesses(h)))
        result = {"seen": seen}
        """,
    )
    assert result["seen"] == [
        [[600, GiB]],
        [[600, 2 * GiB]],
        [[600, 2 * GiB], [601, 3 * GiB]],
        5 * GiB,
        [[600, 2 * GiB], [601, 3 * GiB]],
        [[600, 2 * GiB], [601, 3 * GiB]],
        [],
    ]
    assert "malformed line 2" in result["_stderr"]


def test_namespace_aware_and_legacy_driver(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    """Same-namespace cases; the caller plays 'container' by declaring another host namespace."""
    me = pid_namespace_inode()
    processes = (
        SimProcess(700, GiB, sm_util=20),  # host namespace, no ns info
        SimProcess(701, GiB, sm_util=30, ns_inode=me, ns_pid=7),  # in the caller's namespace
        SimProcess(702, GiB, sm_util=40, ns_inode=me + 1, ns_pid=8),  # in some other container
    )
    body = """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        result = {
            "compute": [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)],
            "util": sorted([s.pid, s.smUtil] for s in N.nvmlDeviceGetProcessUtilization(h, 0)),
        }
        """
    # The caller is in the host namespace: host PIDs for everyone, in both modes.
    for driver in ("namespace_aware", "legacy"):
        write_state(state_path, one_device(*processes, driver=driver))
        result = run_child(lib, state_path, body)
        assert result["compute"] == [700, 701, 702], driver
        assert result["util"] == [[700, 20], [701, 30], [702, 40]], driver
    # The caller is not in the host namespace: a current driver shows only its own namespace's
    # processes, with their inner PIDs; a legacy driver still shows every host PID.
    write_state(state_path, one_device(*processes, host_pidns_inode=me + 100))
    result = run_child(lib, state_path, body)
    assert result["compute"] == [7]
    assert result["util"] == [[7, 30]]
    write_state(state_path, one_device(*processes, host_pidns_inode=me + 100, driver="legacy"))
    result = run_child(lib, state_path, body)
    assert result["compute"] == [700, 701, 702]


def test_concurrent_calls_during_state_rewrites(lib: pathlib.Path, state_path: pathlib.Path) -> None:
    write_state(state_path, one_device(*(SimProcess(800 + i, GiB) for i in range(50))))
    result = run_child(
        lib,
        state_path,
        """
        import threading
        path = os.environ["GPUFENCE_SIM_STATE"]
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        bad = []
        stop = threading.Event()

        def reader():
            while not stop.is_set():
                n = len(N.nvmlDeviceGetComputeRunningProcesses(h))
                if n not in (50, 100):
                    bad.append(n)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for i in range(40):
            n = 50 if i % 2 else 100
            write_state(path, SimState(devices=(SimDevice("GPU-x", 80 << 30,
                tuple(SimProcess(800 + j, 1 << 30) for j in range(n))),)))
        stop.set()
        for t in threads:
            t.join()
        result = {"bad": bad}
        """,
    )
    assert result["bad"] == []
