"""simnvml's utilisation follows a process's run state at the driver's boundary (``util_lag_ms``):
a process stopped by a signal or held by the cgroup freezer (v1 ``freezer.state``, v2
``cgroup.freeze``) submits no GPU work, so the driver reports no SM use for it, and a SIGCONT to a
frozen process changes nothing. Real processes in real cgroups, read through the real pynvml."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from gpufence.simnvml import SimProcess, build_library, write_state
from tests.integration.simnvml.test_simnvml import GiB, one_device, run_child
from tests.support.prerequisites import missing

CGROUP = pathlib.Path("/sys/fs/cgroup")


def cgroup2_mount() -> pathlib.Path | None:
    for root in (CGROUP, CGROUP / "unified"):
        if (root / "cgroup.controllers").exists():
            return root
    return None


@pytest.fixture(scope="module")
def lib() -> pathlib.Path:
    return build_library()


@pytest.fixture(params=["v1", "v2"])
def frozen_dir(request: pytest.FixtureRequest) -> Iterator[tuple[str, pathlib.Path]]:
    """A fresh cgroup of the freezer: v1's ``freezer`` hierarchy or the cgroup2 tree."""
    if os.geteuid() != 0:
        missing("needs root to create cgroups")
    if request.param == "v1":
        top = CGROUP / "freezer"
        if not (top / "freezer.state").exists() and not (top / "cgroup.procs").exists():
            missing("no cgroup v1 freezer hierarchy on this machine")
    else:
        mount = cgroup2_mount()
        if mount is None:
            missing("no cgroup2 mount on this machine")
        top = mount
    path = top / f"gpufence-simnvml-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    try:
        yield request.param, path
    finally:
        (path / ("cgroup.freeze" if request.param == "v2" else "freezer.state")).write_text(
            "0" if request.param == "v2" else "THAWED")
        for pid in (path / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                path.rmdir()
                break
            except OSError:  # a killed process leaves the cgroup once reaped
                assert time.monotonic() < deadline, f"cannot remove {path}"
                time.sleep(0.01)


def test_a_frozen_process_uses_no_sm_whatever_sigcont_it_gets(
    lib: pathlib.Path, tmp_path: pathlib.Path, frozen_dir: tuple[str, pathlib.Path]
) -> None:
    version, cgroup = frozen_dir
    state_path = tmp_path / "state"
    proc = subprocess.Popen(["sh", "-c", f"echo $$ > {cgroup / 'cgroup.procs'}; exec sleep 300"])
    try:
        deadline = time.monotonic() + 10
        while str(proc.pid) not in (cgroup / "cgroup.procs").read_text().split():
            assert time.monotonic() < deadline, "the process never entered its cgroup"
            time.sleep(0.005)
        write_state(state_path, one_device(SimProcess(proc.pid, GiB, sm_util=80), util_lag_ms=1))
        freeze, thaw = (("cgroup.freeze", "1"), ("cgroup.freeze", "0")) if version == "v2" else (
            ("freezer.state", "FROZEN"), ("freezer.state", "THAWED"))
        result = run_child(lib, state_path, f"""
            import os, signal, time, pathlib
            cgroup = pathlib.Path({str(cgroup)!r})
            pid = {proc.pid}
            N.nvmlInit()
            h = N.nvmlDeviceGetHandleByIndex(0)

            def read():
                # One read per sampling period of the driver (10 ms) or more: each is the mean since the last.
                time.sleep(0.02)
                got = call(N.nvmlDeviceGetProcessUtilization, h, 0)
                return [s.smUtil for s in got[1] if s.pid == pid][0] if got[0] == "ok" else read()

            def held(want, between=lambda: None):
                # The lag's tail first (a read straddling the change is a mean of both), then five in a row.
                for _ in range(200):
                    between()
                    if read() == want:
                        break
                reads = []
                for _ in range(5):
                    between()
                    reads.append(read())
                return reads

            def frozen():
                if {version!r} == "v2":
                    return "frozen 1" in (cgroup / "cgroup.events").read_text().splitlines()
                return (cgroup / "freezer.state").read_text().strip() == "FROZEN"

            running = held(80)
            (cgroup / {freeze[0]!r}).write_text({freeze[1]!r})
            while not frozen():
                time.sleep(0.005)
            state = open(f"/proc/{{pid}}/stat").read().rpartition(")")[2].split()[0]
            while_frozen = held(0, lambda: os.kill(pid, signal.SIGCONT))
            (cgroup / {thaw[0]!r}).write_text({thaw[1]!r})
            thawed = held(80)
            os.kill(pid, signal.SIGSTOP)
            stopped = held(0)
            os.kill(pid, signal.SIGCONT)
            result = {{"running": running, "frozen": while_frozen, "thawed": thawed, "stopped": stopped,
                      "state": state}}
            """)
    finally:
        proc.kill()
        proc.wait()
    assert result["running"] == [80] * 5
    # Frozen, the kernel shows it D (v1) or S (v2), never T: the driver reads the freezer itself.
    assert result["state"] in ("D", "S")
    assert result["frozen"] == [0] * 5  # a SIGCONT before each read: still frozen, still no SM
    assert result["thawed"] == [80] * 5
    assert result["stopped"] == [0] * 5
