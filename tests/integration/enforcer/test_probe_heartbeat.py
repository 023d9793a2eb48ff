"""The heartbeat check of the sidecar's exec probe (gpufence/enforcer/probe.py) against a running
process that is not the enforcer: a child of the test (same root, running, not the probe), so the
check never depends on who started the test run (its parent may be PID 1 in a container). The
checks that need no running process are in tests/unit/enforcer/test_probe.py."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufence.enforcer import probe
from tests.support.heartbeats import start_time, write_heartbeat


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A running process standing in for the enforcer: it waits on its stdin until the test ends."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        yield child
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_fresh_heartbeat_of_a_running_process_passes(tmp_path: Path, sleeper) -> None:
    write_heartbeat(tmp_path, sleeper.pid, detail="ok; not ready: NVML is not available")
    assert probe.check(str(tmp_path)) == (True, "ok; not ready: NVML is not available")


def test_a_stale_heartbeat_fails_after_its_bound(tmp_path: Path, sleeper) -> None:
    write_heartbeat(tmp_path, sleeper.pid, age=0.0, bound=5.0)
    now = probe.clock()
    assert probe.check(str(tmp_path), now=now + 4.5)[0]
    ok, why = probe.check(str(tmp_path), now=now + 5.5)
    assert not ok and "old (bound 5.0s)" in why


def test_a_heartbeat_that_says_not_live_fails_with_its_reason(tmp_path: Path, sleeper) -> None:
    write_heartbeat(tmp_path, sleeper.pid, live=False, detail="an NVML call is hung (3.0s past its deadline)")
    ok, why = probe.check(str(tmp_path))
    assert not ok and "NVML call is hung" in why


def test_a_heartbeat_naming_another_process_than_its_writer_fails(tmp_path: Path, sleeper) -> None:
    write_heartbeat(tmp_path, sleeper.pid, started=start_time(sleeper.pid) - 1)
    ok, why = probe.check(str(tmp_path))
    assert not ok and "not the process that wrote" in why


def test_a_heartbeat_from_the_future_fails(tmp_path: Path, sleeper) -> None:
    write_heartbeat(tmp_path, sleeper.pid, age=-30)
    ok, why = probe.check(str(tmp_path))
    assert not ok and "future" in why


def test_no_heartbeat_fails_and_a_link_is_not_followed(tmp_path: Path, sleeper) -> None:
    ok, why = probe.check(str(tmp_path))
    assert not ok and "has not started" in why
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_heartbeat(elsewhere, sleeper.pid)
    (tmp_path / probe.HEARTBEAT_FILE).symlink_to(elsewhere / probe.HEARTBEAT_FILE)
    assert not probe.check(str(tmp_path))[0]


def test_the_detail_stays_on_one_line(tmp_path: Path, sleeper) -> None:
    write_heartbeat(tmp_path, sleeper.pid, detail="ok;\nsecond line\tand tab")
    assert probe.check(str(tmp_path)) == (True, "ok; second line and tab")


def test_the_hook_passes_at_once_on_a_passing_heartbeat(tmp_path: Path, sleeper, capsys) -> None:
    write_heartbeat(tmp_path, sleeper.pid)
    assert probe.wait_until_up(str(tmp_path), timeout=5, alive=lambda: pytest.fail("no need to look")) == 0


def test_another_process_of_this_container_is_seen(sleeper) -> None:
    """The child shares the test's root directory, as the enforcer shares the hook's (the hook's own
    parent is not counted: a shell running the hook is no enforcer)."""
    assert probe.container_has_another_process()
