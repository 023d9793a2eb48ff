"""simnvml's memory-limit files and cgroup mapping, without the library (tests/integration/simnvml
loads it through the real pynvml)."""

from __future__ import annotations

import os
import pathlib

import pytest

from gpufence.simnvml import (
    NO_LIMIT,
    SimAllocation,
    SimDevice,
    SimLimit,
    SimProcess,
    SimState,
    cgroup_namespace,
    driver_state_path,
    preset_limits,
    process_cgroup_namespace,
    read_allocations,
    read_limits,
    render_state,
    reset_driver_state,
    write_state,
)
from gpufence.simnvml.limits import parse_driver_state, render_driver_state

GiB = 1 << 30
UUID = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def state_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "state"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope\n",
            "/sys/fs/cgroup/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope",
        ),
        ("0::/\n", "/sys/fs/cgroup"),
        ("0::/a/b/\n", "/sys/fs/cgroup/a/b"),
        # cgroup v1 host (this machine): the v1 hierarchies are ignored, the unified line is used.
        ("4:memory:/process_api/x\n1:cpu:/\n0::/\n", "/sys/fs/cgroup"),
        ("12:memory:/docker/abc\n1:name=systemd:/docker/abc\n", None),  # v1 only, no unified line
        ("", None),
    ],
)
def test_cgroup_namespace(text: str, expected: str | None) -> None:
    assert cgroup_namespace(text) == expected


def test_process_cgroup_namespace_reads_proc() -> None:
    with open("/proc/self/cgroup", encoding="utf-8") as handle:
        assert process_cgroup_namespace(os.getpid()) == cgroup_namespace(handle.read())


def test_limit_and_process_cgroup_are_validated() -> None:
    assert SimLimit(UUID, "/sys/fs/cgroup/a/", 0, GiB).namespace == "/sys/fs/cgroup/a"
    with pytest.raises(ValueError, match="soft_limit_bytes"):
        SimLimit(UUID, "/sys/fs/cgroup/a", 2 * GiB, GiB)
    with pytest.raises(ValueError, match="absolute cgroup path"):
        SimLimit(UUID, "sys/fs/cgroup/a", 0, GiB)
    with pytest.raises(ValueError, match="absolute cgroup path"):
        SimLimit(UUID, "", 0, GiB)
    with pytest.raises(ValueError, match="hard_limit_bytes"):
        SimLimit(UUID, "/sys/fs/cgroup/a", 0, NO_LIMIT + 1)
    with pytest.raises(ValueError, match="uuid"):
        SimLimit("GPU 1", "/sys/fs/cgroup/a", 0, GiB)
    with pytest.raises(ValueError, match="cgroup"):
        SimProcess(1, 0, cgroup="relative/path")
    with pytest.raises(ValueError, match="cgroup"):
        SimProcess(1, 0, cgroup="/sys/fs/cgroup/with space")


def test_state_file_carries_the_process_cgroup_only_when_given() -> None:
    state = SimState(
        devices=(SimDevice(UUID, GiB, (SimProcess(7, 1, cgroup="/sys/fs/cgroup/pod/c"), SimProcess(8, 2))),),
        host_pidns_inode=1,
    )
    procs = [line for line in render_state(state).splitlines() if line.startswith("proc ")]
    assert procs == ["proc compute 7 1 0 - - /sys/fs/cgroup/pod/c", "proc compute 8 2 0 - -"]


def test_driver_state_round_trip_and_errors() -> None:
    limits = (
        SimLimit(UUID, "/sys/fs/cgroup/pod a/c", GiB, 2 * GiB),
        SimLimit("GPU-b", "/sys/fs/cgroup/x", 0, NO_LIMIT),
    )
    allocations = (SimAllocation(UUID, 42, GiB, 4026531836, 42),)
    text = render_driver_state(limits, allocations)
    assert (
        text.splitlines()[1] == f"limit {UUID} {GiB} {2 * GiB} /sys/fs/cgroup/pod a/c"
    )  # namespace last: spaces allowed
    assert parse_driver_state(text) == (limits, allocations)
    assert parse_driver_state("") == ((), ())
    # The start time came later: a ledger without it reads as "unknown" (0); one field more is an error.
    assert parse_driver_state(f"gpufence-simnvml-driver 1\nalloc {UUID} 42 {GiB} 4026531836 42\n")[1] == (
        SimAllocation(UUID, 42, GiB, 4026531836, 42, 0),
    )
    assert render_driver_state((), (SimAllocation(UUID, 42, GiB, 7, 42, 9001),)).splitlines()[1].endswith(" 42 9001")
    with pytest.raises(ValueError, match="too many"):
        parse_driver_state(f"gpufence-simnvml-driver 1\nalloc {UUID} 42 {GiB} 7 42 9001 1\n")
    with pytest.raises(ValueError, match="not a simnvml driver-state file"):
        parse_driver_state("gpufence-simnvml 1\n")
    with pytest.raises(ValueError, match="line 2"):
        parse_driver_state("gpufence-simnvml-driver 1\nlimit GPU-a 1\n")


def test_preset_and_reset_leave_the_state_file_alone(state_path: pathlib.Path) -> None:
    write_state(state_path, SimState(devices=(SimDevice(UUID, 80 * GiB),)))
    before = state_path.read_bytes()
    assert read_limits(state_path) == () and read_allocations(state_path) == ()
    a = SimLimit(UUID, "/sys/fs/cgroup/a", 0, GiB)
    preset_limits(state_path, a, SimLimit(UUID, "/sys/fs/cgroup/b", 0, GiB))
    preset_limits(state_path, SimLimit(UUID, "/sys/fs/cgroup/b/", GiB, 3 * GiB))  # same namespace: replaced
    assert read_limits(state_path) == (a, SimLimit(UUID, "/sys/fs/cgroup/b", GiB, 3 * GiB))
    assert driver_state_path(state_path) == state_path.with_name("state.driver")
    assert state_path.read_bytes() == before
    reset_driver_state(state_path)
    assert read_limits(state_path) == ()
    reset_driver_state(state_path)  # nothing to reset is fine
    assert sorted(p.name for p in state_path.parent.iterdir()) == ["state", "state.driver.lock"]
