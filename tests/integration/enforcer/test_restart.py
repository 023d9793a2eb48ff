"""End to end: what survives a restart of the enforcer sidecar within its pod. The real enforcer runs
as a subprocess and is killed and started again over the same state directory (the pod's
``gpufence-state`` volume), against real child processes receiving real signals."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpufence.enforcer.act.signals import SignalTarget
from gpufence.enforcer.act.stopped_state import StoppedState
from gpufence.enforcer.observe.procfs import read_stat
from gpufence.enforcer.report.decision_log import DecisionLog
from tests.support.enforcer_harness import proc_state, wait_state
from tests.support.prerequisites import needs

# Root without any capability: it may signal only processes of its own uid (no CAP_KILL).
NO_CAPS = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--")

needs_credentials = needs(
    os.geteuid() == 0 and shutil.which("setpriv") is not None,
    "needs root and setpriv (util-linux) to run processes with chosen credentials",
)


def _stopped_file(gpu: Any) -> list[tuple[int, int]]:
    doc = json.loads((gpu.state_dir / "stopped.json").read_text())
    return [(e["pid"], e["start_time_ticks"]) for e in doc["stopped"]]


class Stranger:
    """A stopped process an enforcer without CAP_KILL may not continue: another uid (65534), in a
    session of its own (the kernel lets SIGCONT through within one session, whoever sends it), as a
    container of another runAsUser is. The test (root with CAP_KILL) stopped it, as a previous
    enforcer would have, and left it recorded in the state file."""

    def __init__(self, gpu: Any) -> None:
        self.proc = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--bounding-set=-all",
             "--inh-caps=-all", "--", "sleep", "300"],
            start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
        self.pid = self.proc.pid
        # setpriv drops to uid 65534, then execs sleep in place (same PID, same start time): wait for
        # the exec, so that what is stopped is no longer a process of uid 0.
        wait_state(self.pid, lambda s: s is not None and _comm(self.pid) == "sleep", 5)
        stat = read_stat(self.pid)
        assert stat is not None
        self.key = (self.pid, stat.start_time_ticks)
        os.kill(self.pid, signal.SIGSTOP)
        wait_state(self.pid, lambda s: s == "T", 5)
        StoppedState(gpu.state_dir, DecisionLog(stream=io.StringIO())).add([SignalTarget(*self.key, "other")])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


@pytest.fixture
def stranger(gpu: Any) -> Iterator[Callable[[], Stranger]]:
    made: list[Stranger] = []

    def make() -> Stranger:
        s = Stranger(gpu)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()




@needs_credentials
def test_a_recorded_process_whose_sigcont_fails_stays_on_record_across_restarts(gpu, make_config, stranger):
    """A restarted enforcer that cannot continue a recorded process (EPERM) keeps it in the state
    file and retries it; exiting leaves it on record, so the next enforcer that can continues it."""
    held = stranger()
    config = make_config({"other": {}})
    gpu.write(gpu.device_with())

    first = gpu.enforcer(config, wrap=NO_CAPS)
    # Still stopped, still on record: the failed SIGCONT is not forgotten.
    assert _stopped_file(gpu) == [held.key]
    assert proc_state(held.pid) == "T"
    recovered = first.events("stopped_state_recovered")[0]
    assert recovered["recorded"] == 1 and recovered["continued"] == 0 and recovered["unreleased"] == 1
    failed = first.events("sigcont", pid=held.pid, reason="recover_stopped_state")[0]
    assert failed["outcome"] == "failed" and "Operation not permitted" in failed["detail"]
    # ... and it is retried (the throttle executor's retry of failed SIGCONTs).
    first.wait_event("sigcont", 5, pid=held.pid, reason="retry_sigcont", outcome="failed")
    assert first.stop() == 0
    # Exiting does not clear the record of a process it could not continue.
    assert _stopped_file(gpu) == [held.key]
    assert proc_state(held.pid) == "T"

    # The next enforcer may signal it (CAP_KILL): it continues it before anything else.
    second = gpu.enforcer(config)
    wait_state(held.pid, lambda s: s not in ("T", None), 5)
    assert second.events("stopped_state_recovered")[0]["continued"] == 1
    assert _stopped_file(gpu) == []
    assert second.stop() == 0


@needs_credentials
def test_a_recorded_process_that_is_gone_is_dropped_from_the_record(gpu, make_config, stranger):
    held = stranger()
    gpu.write(gpu.device_with())
    enforcer = gpu.enforcer(make_config({"other": {}}), "--log-level", "debug", wrap=NO_CAPS)
    enforcer.wait_event("sigcont", 5, pid=held.pid, reason="retry_sigcont", outcome="failed")
    assert _stopped_file(gpu) == [held.key]
    held.close()
    # The next retry finds it gone: nothing to continue, and no longer on record.
    enforcer.wait_event("sigcont", 5, pid=held.pid, reason="retry_sigcont", outcome="gone")
    assert enforcer.stop() == 0  # the file is rewritten right after that line: read it once it exited
    assert _stopped_file(gpu) == []
    assert not enforcer.events("sigcont", pid=held.pid, outcome="refused")


# -- pending SIGKILLs ----------------------------------------------------------------------------

GIB = 1 << 30


def _kill_deadlines(gpu: Any) -> dict[str, Any]:
    return json.loads((gpu.state_dir / "kill_deadlines.json").read_text())


def _sigterms(workload: Any) -> int:
    return sum(1 for line in workload.out.snapshot() if line == "got SIGTERM")


def test_a_grace_period_that_ran_out_while_the_sidecar_was_down_ends_in_sigkill_at_once(gpu, make_config):
    """A workload that traps SIGTERM and kills its sidecar gets no new grace period: the restarted
    enforcer SIGKILLs it before its first poll, once it checked the PID still names that process."""
    stubborn = gpu.workload("stubborn", ignore_term=True)
    decoy = gpu.workload("decoy")
    gpu.write(gpu.device_with(gpu.proc(stubborn, 3 * GIB)))
    config = make_config({"stubborn": {"memoryBytes": 2 * GIB}, "decoy": {}}, grace=1)
    first = gpu.enforcer(config)
    stubborn.wait_line("ignored SIGTERM", 5)
    term_seen = time.monotonic()
    first.proc.kill()  # within the grace period (what a workload that kills its sidecar does)
    assert first.proc.wait(5) == -signal.SIGKILL

    doc = _kill_deadlines(gpu)
    (recorded,) = doc["processes"]
    stat = read_stat(stubborn.pid)
    assert stat is not None and (recorded["pid"], recorded["start_time_ticks"]) == (stubborn.pid, stat.start_time_ticks)
    # A record whose PID now names another process (its start time differs): never signalled.
    decoy_stat = read_stat(decoy.pid)
    assert decoy_stat is not None
    doc["processes"].append({**recorded, "pid": decoy.pid, "start_time_ticks": decoy_stat.start_time_ticks + 1})
    (gpu.state_dir / "kill_deadlines.json").write_text(json.dumps(doc))
    # The grace period runs out while no enforcer runs (a deadline, not an event: nothing to await).
    time.sleep(max(0.0, term_seen + 1 - time.monotonic()))

    second = gpu.enforcer(config)
    assert stubborn.proc.wait(5) == -signal.SIGKILL
    kill = second.wait_event("sigkill", 5, pid=stubborn.pid)
    assert kill["outcome"] == "sent" and kill["reason"] == "grace_period_expired"
    events = [r["event"] for r in second.records()]
    assert events.index("sigkill") < events.index("started")  # at once, before the first poll
    assert second.events("sigterm") == [] and _sigterms(stubborn) == 1  # no second SIGTERM, no new grace
    # The decoy's record names a process that is gone (its PID names another now): dropped unsignalled.
    assert second.events("sigkill", pid=decoy.pid) == [] and second.events("terminated", pid=decoy.pid)
    assert decoy.alive() and not decoy.said("got SIGTERM")
    assert second.stop() == 0
    assert _kill_deadlines(gpu)["processes"] == []


def test_a_restart_within_the_grace_period_keeps_the_first_deadline(gpu, make_config):
    grace = 3.0
    stubborn = gpu.workload("stubborn", ignore_term=True)
    gpu.write(gpu.device_with(gpu.proc(stubborn, 3 * GIB)))
    config = make_config({"stubborn": {"memoryBytes": 2 * GIB}}, grace=grace)
    first = gpu.enforcer(config)
    stubborn.wait_line("ignored SIGTERM", 5)
    term_seen = time.monotonic()  # just after the enforcer's SIGTERM
    first.proc.kill()
    assert first.proc.wait(5) == -signal.SIGKILL

    second = gpu.enforcer(config)
    assert stubborn.proc.wait(grace + 5) == -signal.SIGKILL
    killed = time.monotonic()
    # Killed when the first grace period ended: without a second SIGTERM, and not before.
    assert second.events("sigterm") == [] and _sigterms(stubborn) == 1
    assert killed - term_seen >= grace - 0.2
    assert second.wait_event("sigkill", 5, pid=stubborn.pid)["outcome"] == "sent"
    recovered = second.events("kill_deadlines_recovered")[0]
    assert recovered["processes"] == 1 and recovered["overdue"] == 0
    assert second.stop() == 0
