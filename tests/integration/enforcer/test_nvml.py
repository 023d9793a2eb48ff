"""gpufence.enforcer.observe.nvml.NvmlClient against the simulated driver, in-process.

pynvml loads libnvidia-ml.so.1 once per process, so every in-process test uses the same library
file: ``simnvml.build_library()`` with the default cache directory (the file other in-process tests
of this suite load too). Each test points ``GPUFENCE_SIM_STATE`` at its own state file; the
simulated library reads that variable at every call. Tests that need a pristine process (missing
library, a second library) run in a child interpreter.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pynvml
import pytest

from gpufence.enforcer.observe.nvml import (
    DeviceSample,
    GpuProcess,
    NvmlClient,
    NvmlErrorEvent,
    NvmlSample,
    NvmlUnavailable,
)
from gpufence.simnvml import ENV_STATE, SimDevice, SimProcess, SimState, build_library, write_state
from tests.support.prerequisites import skip_by_design

REPO = pathlib.Path(__file__).resolve().parents[3]
GiB = 1 << 30
UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"

Writer = Callable[[SimState], None]


@pytest.fixture(scope="session")
def lib() -> pathlib.Path:
    return build_library()


@pytest.fixture
def sim(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Writer:
    path = tmp_path / "sim-state"
    monkeypatch.setenv(ENV_STATE, str(path))
    return lambda state: write_state(path, state)


@pytest.fixture
def client(lib: pathlib.Path, sim: Writer) -> Iterator[NvmlClient]:
    nvml = NvmlClient(lib)
    yield nvml
    nvml.close()


def two_devices(
    a: tuple[SimProcess, ...] = (),
    b: tuple[SimProcess, ...] = (),
    *,
    a_kwargs: dict[str, Any] | None = None,
    b_kwargs: dict[str, Any] | None = None,
    **state_kwargs: Any,
) -> SimState:
    dev_a = SimDevice(UUID_A, 80 * GiB, a, **(a_kwargs or {}))
    dev_b = SimDevice(UUID_B, 40 * GiB, b, **(b_kwargs or {}))
    return SimState(devices=(dev_a, dev_b), **state_kwargs)


def wait_for_next_window() -> None:
    """The simulated driver samples utilisation every 10 ms."""
    time.sleep(0.012)


# -- the happy path --------------------------------------------------------------------------------


def test_sample_reports_devices_processes_memory_and_utilization(client: NvmlClient, sim: Writer) -> None:
    sim(
        two_devices(
            a=(
                SimProcess(100, 2 * GiB, sm_util=60),
                SimProcess(101, None, sm_util=5),  # memory not available
                SimProcess(102, GiB, kind="graphics"),
                SimProcess(100, 3 * GiB, kind="graphics"),  # in both lists: once, larger value
                SimProcess(103, None, kind="graphics"),
                SimProcess(103, 7, kind="compute"),  # known value wins over not-available
            ),
            b=(SimProcess(200, 4 * GiB, sm_util=90),),
        )
    )
    client.open()
    assert client.driver_version == "560.35.03"
    sample = client.sample()
    assert isinstance(sample, NvmlSample)
    assert sample.errors == ()
    a, b = sample.devices
    assert isinstance(a, DeviceSample)
    assert (a.index, a.uuid, a.total_memory_bytes, a.lost) == (0, UUID_A, 80 * GiB, False)
    assert sorted(a.processes, key=lambda p: p.pid) == [
        GpuProcess(100, 0, UUID_A, 3 * GiB),
        GpuProcess(101, 0, UUID_A, None),
        GpuProcess(102, 0, UUID_A, GiB),
        GpuProcess(103, 0, UUID_A, 7),
    ]
    assert dict(a.sm_util_by_pid) == {100: 60, 101: 5, 102: 0, 103: 0}
    assert (b.index, b.uuid, b.total_memory_bytes) == (1, UUID_B, 40 * GiB)
    assert b.processes == (GpuProcess(200, 1, UUID_B, 4 * GiB),)
    assert dict(b.sm_util_by_pid) == {200: 90}


def test_utilization_is_newest_since_previous_sample(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(a=(SimProcess(100, GiB, sm_util=10),)))
    client.open()
    assert dict(client.sample().devices[0].sm_util_by_pid) == {100: 10}
    # Same sampling window: nothing newer than what we saw (NOT_FOUND), which is not an error.
    sim(two_devices(a=(SimProcess(100, GiB, sm_util=20),)))
    for _ in range(3):
        quick = client.sample()
        if not quick.devices[0].sm_util_by_pid:
            break
    assert dict(quick.devices[0].sm_util_by_pid) in ({}, {100: 20})
    assert quick.errors == ()
    wait_for_next_window()
    assert dict(client.sample().devices[0].sm_util_by_pid) == {100: 20}


def test_utilisation_is_reused_when_not_asked_for_and_never_read_for_a_device_without_processes(
    client: NvmlClient, sim: Writer
) -> None:
    # Device a lists a process, device b none; the utilisation call fails on both devices, so
    # every call made shows up as an error event.
    failing = {"nvmlDeviceGetProcessUtilization": "NOT_SUPPORTED"}
    sim(two_devices(a=(SimProcess(100, GiB, sm_util=40),), failures=failing))
    client.open()
    not_supported = NvmlErrorEvent("nvmlDeviceGetProcessUtilization", "NOT_SUPPORTED", 0)
    assert client.sample(utilisation=True).errors == (not_supported,)
    assert client.sample(utilisation=False).errors == ()
    # Without failures: a fresh reading, then the same reading again while the driver's moved on.
    sim(two_devices(a=(SimProcess(100, GiB, sm_util=40),)))
    wait_for_next_window()
    assert dict(client.sample(utilisation=True).devices[0].sm_util_by_pid) == {100: 40}
    sim(two_devices(a=(SimProcess(100, GiB, sm_util=90),)))
    wait_for_next_window()
    assert dict(client.sample(utilisation=False).devices[0].sm_util_by_pid) == {100: 40}
    assert dict(client.sample(utilisation=True).devices[0].sm_util_by_pid) == {100: 90}
    # The process is gone: its old reading goes with it.
    sim(two_devices())
    assert dict(client.sample(utilisation=False).devices[0].sm_util_by_pid) == {}


def test_processes_appear_and_vanish_between_samples(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(a=(SimProcess(100, GiB), SimProcess(101, GiB))))
    client.open()
    assert {p.pid for p in client.sample().devices[0].processes} == {100, 101}
    sim(two_devices(a=(SimProcess(101, 2 * GiB),), b=(SimProcess(300, GiB),)))
    sample = client.sample()
    assert sample.devices[0].processes == (GpuProcess(101, 0, UUID_A, 2 * GiB),)
    assert sample.devices[1].processes == (GpuProcess(300, 1, UUID_B, GiB),)
    assert sample.errors == ()


def test_mps_clients_are_counted(client: NvmlClient, sim: Writer) -> None:
    """With CUDA MPS a client is listed by nvmlDeviceGetMPSComputeRunningProcesses, on some drivers
    only there, on others in the compute list too (580 on an H200, docs/gpu-validation.md): its
    memory must be seen either way, once per process (pid 100 here is in both lists)."""
    sim(two_devices(a=(SimProcess(100, GiB), SimProcess(200, 3 * GiB, kind="mps"), SimProcess(100, GiB, kind="mps"))))
    client.open()
    device = client.sample().devices[0]
    assert {p.pid: p.used_memory_bytes for p in device.processes} == {100: GiB, 200: 3 * GiB}
    assert sorted(p.pid for p in device.processes) == [100, 200]


def test_256_processes_and_buffer_growth(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(a=tuple(SimProcess(1000 + i, i * 4096, sm_util=i % 101) for i in range(10))))
    client.open()
    assert len(client.sample().devices[0].processes) == 10
    many = tuple(SimProcess(1000 + i, i * 4096, sm_util=i % 101) for i in range(256))
    graphics = tuple(SimProcess(5000 + i, GiB, kind="graphics") for i in range(100))
    sim(two_devices(a=many + graphics))
    wait_for_next_window()
    device = client.sample().devices[0]
    assert len(device.processes) == 356
    assert {p.pid: p.used_memory_bytes for p in device.processes if p.pid < 5000} == {
        1000 + i: i * 4096 for i in range(256)
    }
    assert len(device.sm_util_by_pid) == 356
    assert device.sm_util_by_pid[1000 + 255] == 255 % 101


# -- tolerated errors --------------------------------------------------------------------------------


def test_utilization_not_supported_is_an_event(client: NvmlClient, sim: Writer) -> None:
    failures = {"nvmlDeviceGetProcessUtilization": "NOT_SUPPORTED"}
    sim(two_devices(a=(SimProcess(100, GiB, sm_util=50),), b=(SimProcess(200, GiB, sm_util=5),), failures=failures))
    client.open()
    sample = client.sample()
    assert all(dict(d.sm_util_by_pid) == {} for d in sample.devices)
    assert sample.devices[0].processes == (GpuProcess(100, 0, UUID_A, GiB),)
    assert sample.errors == (
        NvmlErrorEvent("nvmlDeviceGetProcessUtilization", "NOT_SUPPORTED", 0),
        NvmlErrorEvent("nvmlDeviceGetProcessUtilization", "NOT_SUPPORTED", 1),
    )


def test_utilization_not_found_is_no_sample_and_no_event(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(a=(SimProcess(100, GiB, sm_util=50),), failures={"nvmlDeviceGetProcessUtilization": "NOT_FOUND"}))
    client.open()
    sample = client.sample()
    assert dict(sample.devices[0].sm_util_by_pid) == {}
    assert sample.errors == ()


def test_memory_info_not_supported_gives_unknown_total_once(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(a=(SimProcess(100, GiB),), b_kwargs={"memory_info_not_supported": True}))
    client.open()
    first = client.sample()
    assert first.devices[1].total_memory_bytes is None
    assert first.devices[0].total_memory_bytes == 80 * GiB
    assert first.errors == (NvmlErrorEvent("nvmlDeviceGetMemoryInfo", "NOT_SUPPORTED", 1),)
    assert client.sample().errors == ()  # NOT_SUPPORTED does not change: not asked again


def test_memory_info_transient_error_is_retried(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(failures={"nvmlDeviceGetMemoryInfo@0": "UNKNOWN"}))
    client.open()
    first = client.sample()
    assert first.devices[0].total_memory_bytes is None
    # Once at open, once more when this round retried it.
    assert first.errors == (NvmlErrorEvent("nvmlDeviceGetMemoryInfo", "UNKNOWN", 0),) * 2
    sim(two_devices())
    second = client.sample()
    assert second.devices[0].total_memory_bytes == 80 * GiB
    assert second.errors == ()


def test_process_list_error_on_one_device(client: NvmlClient, sim: Writer) -> None:
    sim(
        two_devices(
            b=(SimProcess(200, GiB), SimProcess(201, GiB, kind="graphics")),
            failures={"nvmlDeviceGetComputeRunningProcesses@1": "NO_PERMISSION"},
        )
    )
    client.open()
    sample = client.sample()
    assert sample.devices[1].processes == (GpuProcess(201, 1, UUID_B, GiB),)  # graphics still listed
    assert not sample.devices[1].lost
    assert sample.errors == (NvmlErrorEvent("nvmlDeviceGetComputeRunningProcesses", "NO_PERMISSION", 1),)


def test_device_lost_after_open_and_back(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(a=(SimProcess(100, GiB),), b=(SimProcess(200, GiB),)))
    client.open()
    assert not any(d.lost for d in client.sample().devices)
    sim(two_devices(a=(SimProcess(100, GiB),), b=(SimProcess(200, GiB),), b_kwargs={"lost": True}))
    sample = client.sample()
    a, b = sample.devices
    assert a.processes == (GpuProcess(100, 0, UUID_A, GiB),)
    assert b.lost and b.processes == () and dict(b.sm_util_by_pid) == {}
    assert (b.index, b.uuid, b.total_memory_bytes) == (1, UUID_B, 40 * GiB)  # last known identity
    assert sample.errors == (NvmlErrorEvent("nvmlDeviceGetComputeRunningProcesses", "GPU_IS_LOST", 1),)
    # While lost, the handle is re-acquired each round (and fails).
    again = client.sample()
    assert again.devices[1].lost
    assert again.errors == (NvmlErrorEvent("nvmlDeviceGetHandleByIndex", "GPU_IS_LOST", 1),)
    sim(two_devices(a=(SimProcess(100, GiB),), b=(SimProcess(200, GiB),)))
    back = client.sample()
    assert not back.devices[1].lost
    assert back.devices[1].processes == (GpuProcess(200, 1, UUID_B, GiB),)
    assert back.errors == ()


def test_device_lost_at_open(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(a=(SimProcess(100, GiB),), a_kwargs={"lost": True}, b=(SimProcess(200, GiB),)))
    client.open()
    sample = client.sample()
    a, b = sample.devices
    assert a.lost and (a.index, a.uuid, a.total_memory_bytes) == (0, "", None)  # never seen
    assert b.processes == (GpuProcess(200, 1, UUID_B, GiB),)
    # The event from open() and the one from this round's retry.
    assert sample.errors == (
        NvmlErrorEvent("nvmlDeviceGetHandleByIndex", "GPU_IS_LOST", 0),
        NvmlErrorEvent("nvmlDeviceGetHandleByIndex", "GPU_IS_LOST", 0),
    )
    sim(two_devices(a=(SimProcess(100, GiB),), b=(SimProcess(200, GiB),)))
    a = client.sample().devices[0]
    assert not a.lost and (a.uuid, a.total_memory_bytes) == (UUID_A, 80 * GiB)
    assert a.processes == (GpuProcess(100, 0, UUID_A, GiB),)


def test_process_list_v1_fallback(client: NvmlClient, sim: Writer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An old driver without the _v2/_v3 symbols: the v1 record layout (no instance ids)."""
    real = pynvml._nvmlGetFunctionPointer

    def old_driver(name: str) -> object:
        if name.endswith(("RunningProcesses_v3", "RunningProcesses_v2")):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return real(name)

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", old_driver)
    sim(two_devices(a=(SimProcess(100, GiB), SimProcess(101, None), SimProcess(102, 5, kind="graphics"))))
    client.open()
    assert sorted(client.sample().devices[0].processes, key=lambda p: p.pid) == [
        GpuProcess(100, 0, UUID_A, GiB),
        GpuProcess(101, 0, UUID_A, None),
        GpuProcess(102, 0, UUID_A, 5),
    ]


# -- NVML unavailable ----------------------------------------------------------------------------------


def test_nvml_stops_answering_raises_and_reopen_recovers(client: NvmlClient, sim: Writer) -> None:
    sim(two_devices(a=(SimProcess(100, GiB),)))
    client.open()
    client.sample()
    sim(two_devices(a=(SimProcess(100, GiB),), failures={"*": "UNINITIALIZED"}))
    with pytest.raises(NvmlUnavailable, match=r"NVML stopped answering: \w+ returned NVML_ERROR_UNINITIALIZED"):
        client.sample()
    client.close()
    sim(two_devices(a=(SimProcess(100, GiB),)))
    client.open()
    assert client.sample().devices[0].processes == (GpuProcess(100, 0, UUID_A, GiB),)


def test_init_errors_are_clear(client: NvmlClient, sim: Writer) -> None:
    sim(SimState(devices=(), init_error="DRIVER_NOT_LOADED"))
    with pytest.raises(NvmlUnavailable, match="NVIDIA driver not loaded"):
        client.open()
    sim(SimState(devices=(), init_error="NO_PERMISSION"))
    with pytest.raises(NvmlUnavailable, match="no permission"):
        client.open()
    sim(SimState(devices=(), failures={"nvmlDeviceGetCount": "UNKNOWN"}))
    with pytest.raises(NvmlUnavailable, match="nvmlDeviceGetCount"):
        client.open()
    with pytest.raises(NvmlUnavailable, match="not open"):
        client.sample()
    sim(SimState(devices=()))
    client.open()
    assert client.sample() == NvmlSample(devices=(), errors=())
    client.close()
    client.close()  # idempotent


def test_context_manager_and_threads(lib: pathlib.Path, sim: Writer) -> None:
    sim(two_devices(a=tuple(SimProcess(100 + i, GiB) for i in range(64))))
    failures: list[BaseException] = []
    with NvmlClient(lib) as nvml:

        def poll() -> None:
            try:
                for _ in range(50):
                    assert len(nvml.sample().devices[0].processes) == 64
            except BaseException as exc:  # pragma: no cover - reported below
                failures.append(exc)

        threads = [threading.Thread(target=poll) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []


def run_child(code: str, env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", ENV_STATE)}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_missing_library_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    result = run_child(
        f"""
        import json
        from gpufence.enforcer.observe.nvml import NvmlClient, NvmlUnavailable
        out = {{}}
        for key, path in (("path", {str(tmp_path / "nope" / "libnvidia-ml.so.1")!r}), ("system", None)):
            try:
                NvmlClient(path).open()
                out[key] = "opened"
            except NvmlUnavailable as exc:
                out[key] = str(exc)
        print(json.dumps(out))
        """,
        clean_env(),
    )
    assert result["path"] == f"NVML library {tmp_path / 'nope' / 'libnvidia-ml.so.1'} does not exist"
    if ctypes.util.find_library("nvidia-ml"):
        skip_by_design("system-nvml", "this host has a system NVML library")
    assert isinstance(result["system"], str)
    assert result["system"].startswith("NVML library libnvidia-ml.so.1 not found: no NVIDIA driver")


def test_second_library_in_one_process_is_refused(lib: pathlib.Path, tmp_path: pathlib.Path) -> None:
    other = tmp_path / "other" / lib.name  # the same code in another file: a second copy once loaded
    other.parent.mkdir()
    shutil.copy2(lib, other)
    state = tmp_path / "state"
    write_state(state, two_devices(a=(SimProcess(100, GiB),)))
    env = clean_env() | {ENV_STATE: str(state)}
    result = run_child(
        f"""
        import json
        from gpufence.enforcer.observe.nvml import NvmlClient, NvmlUnavailable
        first = NvmlClient({str(lib)!r})
        first.open()
        out = {{"first": [p.pid for p in first.sample().devices[0].processes]}}
        first.close()
        try:
            NvmlClient({str(other)!r}).open()
            out["second"] = "opened"
        except NvmlUnavailable as exc:
            out["second"] = str(exc)
        again = NvmlClient({str(lib)!r})
        again.open()
        out["again"] = len(again.sample().devices)
        print(json.dumps(out))
        """,
        env,
    )
    assert result["first"] == [100]
    assert "pynvml already uses another libnvidia-ml.so.1" in str(result["second"])
    assert result["again"] == 2


def test_memory_limit_per_cgroup(client: NvmlClient, sim: Writer, tmp_path: pathlib.Path) -> None:
    """The driver's per-cgroup limit and currentUsed (NVML R615), each answer mapped to a state."""
    from gpufence.enforcer.observe.nvml import DriverLimit, DriverLimitState
    from gpufence.simnvml import NO_LIMIT, SimLimit, preset_limits

    pod_a, pod_b = "/sys/fs/cgroup/kubepods/podA/c", "/sys/fs/cgroup/kubepods/podB/c"
    sim(two_devices((SimProcess(100, 3 * GiB, cgroup=pod_a), SimProcess(101, 1 * GiB, cgroup=pod_b))))
    preset_limits(tmp_path / "sim-state", SimLimit(UUID_A, pod_a, GiB, 4 * GiB), SimLimit(UUID_A, pod_b, 0, NO_LIMIT))
    client.open()
    assert client.memory_limit(0, pod_a) == DriverLimit(DriverLimitState.SET, GiB, 4 * GiB, 3 * GiB)
    assert client.memory_limit(0, pod_a + "/worker") == client.memory_limit(0, pod_a)  # nearest limited ancestor
    assert client.memory_limit(0, pod_b) == DriverLimit(DriverLimitState.UNLIMITED, 0, NO_LIMIT, GiB)
    assert client.memory_limit(1, pod_a) == DriverLimit(DriverLimitState.NOT_SET, error="NOT_SUPPORTED")
    assert client.memory_limit(0, "/sys/fs/cgroup/kubepods/podC") == DriverLimit(
        DriverLimitState.NOT_SET, error="NOT_SUPPORTED"
    )
    assert client.memory_limit(5, pod_a).state is DriverLimitState.ERROR  # no such device
    sim(SimState(devices=two_devices().devices, failures={"nvmlDeviceGetMemoryLimits": "UNKNOWN"}))
    assert client.memory_limit(0, pod_a) == DriverLimit(DriverLimitState.ERROR, error="UNKNOWN")
