"""The signalling door, the stopped-state file and the throttle executor, in process, against real
child processes (tests/support/workload.py) receiving real signals."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufence.enforcer.act.signals import Outcome, SafeSignaller, SignalTarget
from gpufence.enforcer.act.stopped_state import StoppedState, recover
from gpufence.enforcer.act.throttle import PERIOD_JITTER, ThrottleExecutor, ThrottlePlan
from gpufence.enforcer.observe.procfs import read_stat
from gpufence.enforcer.report.decision_log import DecisionLog
from tests.support.enforcer_harness import WORKLOAD, LineReader, proc_state, wait_state
from tests.support.prerequisites import needs


class Child:
    def __init__(self, tmp_path, ignore_term: bool = False, new_session: bool = False) -> None:
        device = tmp_path / "nvidia0"
        device.touch()
        argv = [sys.executable, str(WORKLOAD), str(device)] + (["--ignore-term"] if ignore_term else [])
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=new_session)
        self.out = LineReader(self.proc.stdout, "child")
        self.out.wait_for(lambda s: s.startswith("ready"), 15)
        self.pid = self.proc.pid
        stat = read_stat(self.pid)
        assert stat is not None
        self.start = stat.start_time_ticks

    def target(self, container: str | None = "c", start: int | None = None) -> SignalTarget:
        return SignalTarget(self.pid, self.start if start is None else start, container)

    def lines(self) -> list[str]:
        return self.out.snapshot()[1:]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(5)


@pytest.fixture
def child(tmp_path):
    children: list[Child] = []

    def make(**kwargs) -> Child:
        c = Child(tmp_path, **kwargs)
        children.append(c)
        return c

    yield make
    for c in children:
        c.close()


@pytest.fixture
def log():
    stream = io.StringIO()
    decision_log = DecisionLog(namespace="ns", pod="p", level="debug", stream=stream)
    decision_log.records = lambda: [json.loads(line) for line in stream.getvalue().splitlines()]  # type: ignore[attr-defined]
    return decision_log


def test_sends_to_an_attributed_process_and_logs_it(child, log):
    c = child()
    door = SafeSignaller(log)
    door.authorize([c.target()])
    assert door.send(c.target(), signal.SIGTERM, reason="test", used_bytes=5) is Outcome.SENT
    assert c.proc.wait(5) == 0
    assert c.lines() == ["got SIGTERM"]
    record = log.records()[-1]
    assert record["event"] == "sigterm" and record["outcome"] == "sent" and record["pid"] == c.pid
    assert record["container"] == "c" and record["used_bytes"] == 5 and record["namespace"] == "ns"


def test_refusals(child, log):
    c = child()
    door = SafeSignaller(log)
    # Not authorized (not in this pod's attribution) -> refused, nothing sent.
    assert door.send(c.target(), signal.SIGTERM, reason="test") is Outcome.REFUSED
    door.authorize([c.target(), SignalTarget(os.getpid(), 1, "c"), SignalTarget(os.getppid(), 1, "c")])
    # Named unattributed although attributed, PID <= 1, the enforcer itself, its parent chain.
    assert door.send(c.target(container=None), signal.SIGTERM, reason="test") is Outcome.REFUSED
    assert door.send(SignalTarget(1, 1, "c"), signal.SIGTERM, reason="test") is Outcome.REFUSED
    assert door.send(SignalTarget(0, 1, "c"), signal.SIGKILL, reason="test") is Outcome.REFUSED
    me = read_stat(os.getpid())
    parent = read_stat(os.getppid())
    assert me is not None and parent is not None
    for pid, stat in ((os.getpid(), me), (os.getppid(), parent)):
        target = SignalTarget(pid, stat.start_time_ticks, "c")
        assert door.send(target, signal.SIGSTOP, reason="t") is Outcome.REFUSED
    # Attributed to another container than the one the caller names.
    assert door.send(c.target(container="other"), signal.SIGTERM, reason="test") is Outcome.REFUSED
    assert c.proc.poll() is None and c.lines() == []
    refused = [r for r in log.records() if r["outcome"] == "refused"]
    assert len(refused) == 7 and all(r["level"] == "warning" and r["why"] for r in refused)


def test_unattributed_pod_processes_and_admitted_members_may_be_signalled(child, log):
    """The pod budget terminates unattributed GPU processes; a container's termination reaches the
    processes of its cgroup that hold no GPU context. Both only while they are the pod's."""
    anonymous, launcher, stranger = child(), child(), child()
    door = SafeSignaller(log)
    door.authorize([anonymous.target(container=None)])
    door.admit_members([launcher.target()])
    assert door.send(stranger.target(), signal.SIGTERM, reason="t") is Outcome.REFUSED
    assert door.send(anonymous.target(container=None), signal.SIGTERM, reason="t") is Outcome.SENT
    assert door.send(launcher.target(), signal.SIGTERM, reason="t") is Outcome.SENT
    assert anonymous.proc.wait(5) == 0 and launcher.proc.wait(5) == 0
    assert stranger.proc.poll() is None and stranger.lines() == []


def test_reused_pid_is_not_signalled(child, log):
    """The PID is ours, but the start time differs: another process has the number now."""
    c = child()
    door = SafeSignaller(log)
    stale = c.target(start=c.start - 1)
    door.authorize([stale])
    assert door.send(stale, signal.SIGKILL, reason="test") is Outcome.REUSED
    assert c.proc.poll() is None
    assert log.records()[-1]["outcome"] == "reused"


def test_process_gone_or_zombie_is_normal(child, log):
    gone, zombie = child(), child()
    door = SafeSignaller(log)
    door.authorize([gone.target(), zombie.target()])
    gone.proc.kill()
    gone.proc.wait(5)
    assert door.send(gone.target(), signal.SIGTERM, reason="test") is Outcome.GONE
    os.kill(zombie.pid, signal.SIGKILL)
    wait_state(zombie.pid, lambda s: s == "Z", 5)
    assert door.send(zombie.target(), signal.SIGTERM, reason="test") is Outcome.GONE
    assert not door.alive(zombie.target())


def test_follow_up_signals_outlive_the_attribution(child, log):
    stopped, stubborn = child(), child(ignore_term=True)
    door = SafeSignaller(log)
    door.authorize([stopped.target(), stubborn.target()])
    assert door.send(stopped.target(), signal.SIGSTOP, reason="t") is Outcome.SENT
    assert door.send(stubborn.target(), signal.SIGTERM, reason="t") is Outcome.SENT
    stubborn.out.wait_for(lambda s: s == "ignored SIGTERM", 5)
    door.authorize([])  # both left NVML's list
    # New stops/terms need the attribution; the follow-ups SIGCONT and SIGKILL do not.
    assert door.send(stubborn.target(), signal.SIGSTOP, reason="t") is Outcome.REFUSED
    assert door.send(stopped.target(), signal.SIGCONT, reason="t") is Outcome.SENT
    stopped.out.wait_for(lambda s: s == "got SIGCONT 1", 5)
    assert door.send(stubborn.target(), signal.SIGKILL, reason="t") is Outcome.SENT
    assert stubborn.proc.wait(5) == -signal.SIGKILL
    # One SIGCONT per SIGSTOP: a second one is not ours to send.
    assert door.send(stopped.target(), signal.SIGCONT, reason="t") is Outcome.REFUSED


def test_stopped_state_file_and_recovery(child, log, tmp_path):
    held, reused = child(), child()
    door = SafeSignaller(log)
    door.authorize([held.target(), reused.target()])
    state = StoppedState(tmp_path / "state", log)
    state.add([held.target(), reused.target(start=reused.start + 7)])
    doc = json.loads((tmp_path / "state" / "stopped.json").read_text())
    assert doc["version"] == 1
    assert {(e["pid"], e["start_time_ticks"]) for e in doc["stopped"]} == {
        (held.pid, held.start), (reused.pid, reused.start + 7)
    }
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["stopped.json"]  # no temp files left
    os.kill(held.pid, signal.SIGSTOP)
    os.kill(reused.pid, signal.SIGSTOP)
    wait_state(held.pid, lambda s: s == "T", 5)
    wait_state(reused.pid, lambda s: s == "T", 5)

    # A new enforcer (new signaller, nothing authorized yet) continues only the matching record.
    fresh = SafeSignaller(log)
    assert recover(StoppedState(tmp_path / "state", log), fresh, log).continued == 1
    wait_state(held.pid, lambda s: s not in ("T", None), 5)
    assert proc_state(reused.pid) == "T"  # start time differs: "another process", left alone
    assert json.loads((tmp_path / "state" / "stopped.json").read_text())["stopped"] == []
    os.kill(reused.pid, signal.SIGCONT)


def test_corrupt_stopped_state_is_reported_not_fatal(log, tmp_path):
    (tmp_path / "stopped.json").write_text("{torn")
    assert recover(StoppedState(tmp_path, log), SafeSignaller(log), log).continued == 0
    assert any(r["event"] == "stopped_state_unreadable" for r in log.records())


def test_throttle_executor_cycles_and_releases(child, log, tmp_path):
    a, b = child(), child()
    door = SafeSignaller(log)
    door.authorize([a.target(), b.target()])
    state = StoppedState(tmp_path, log)
    executor = ThrottleExecutor(door, state, log, period_seconds=0.2)
    executor.start()
    try:
        executor.update({"c": ThrottlePlan(0.25, (a.target(), b.target()))})
        for n in (1, 2):
            wait_state(a.pid, lambda s: s == "T", 5)
            a.out.wait_for(lambda s, n=n: s == f"got SIGCONT {n}", 5)
        # b leaves the plan's targets: it is continued if held and not stopped again.
        executor.update({"c": ThrottlePlan(0.25, (a.target(),))})
        wait_state(a.pid, lambda s: s == "T", 5)
        assert proc_state(b.pid) != "T"
        # exempt: continued and never stopped again (the memory enforcer is about to SIGTERM it).
        executor.exempt(a.target())
        wait_state(a.pid, lambda s: s not in ("T", None), 5)
        executor.update({"c": ThrottlePlan(0.25, (a.target(), b.target()))})
        wait_state(b.pid, lambda s: s == "T", 5)
        assert proc_state(a.pid) != "T"
        # The container leaves the plan: continued at once.
        executor.update({})
        wait_state(b.pid, lambda s: s not in ("T", None), 1)
        executor.update({"c": ThrottlePlan(0.05, (b.target(),))})
        wait_state(b.pid, lambda s: s == "T", 5)
    finally:
        executor.close()
    # close(): nothing left stopped, nothing left on record.
    wait_state(b.pid, lambda s: s not in ("T", None), 1)
    assert proc_state(a.pid) != "T"
    assert json.loads((tmp_path / "stopped.json").read_text())["stopped"] == []
    assert executor.throttled() == set()


def _cycle_lengths(child, log, tmp_path, **executor_args) -> list[tuple[float, float]]:
    """Drive the executor's phase switches on a clock of our own (no thread) for 40 s of duty cycles
    at run fraction 0.3; each cycle's (length, run time) from the switches it made to the real child."""
    c = child()
    door = SafeSignaller(log)
    door.authorize([c.target()])
    now = [0.0]
    executor = ThrottleExecutor(door, StoppedState(tmp_path, log), log, period_seconds=1.0,
                                clock=lambda: now[0], **executor_args)
    switches: list[tuple[float, bool]] = []
    try:
        executor.update({"c": ThrottlePlan(0.3, (c.target(),))})
        while now[0] < 40:
            with executor._cond:
                executor._step_locked()
                running = executor._cycles["c"].running
            if not switches or switches[-1][1] != running:
                switches.append((now[0], running))
            now[0] = round(now[0] + 0.001, 3)
    finally:
        executor.close()
    assert proc_state(c.pid) not in ("T", None)
    starts = [t for t, running in switches if running]
    stops = [t for t, running in switches if not running]
    return [(round(b - a, 3), round(stop - a, 3)) for a, b, stop in zip(starts, starts[1:], stops, strict=False)]


def test_duty_cycles_vary_in_length_around_the_period_with_the_run_fraction_kept(child, log, tmp_path):
    """A cycle kept to the period would hold its run phase at the same instants of the driver's
    fixed sampling clock; each cycle's length is drawn within PERIOD_JITTER of the period instead,
    its run phase the plan's fraction of that length, the mean the period."""
    cycles = _cycle_lengths(child, log, tmp_path, rng=random.Random(7))
    assert len(cycles) >= 35
    lengths = [length for length, _ in cycles]
    assert all(1 - PERIOD_JITTER - 0.002 <= length <= 1 + PERIOD_JITTER + 0.002 for length in lengths)
    assert len(set(lengths)) > len(lengths) // 2  # drawn anew, not one length repeated
    assert statistics.mean(lengths) == pytest.approx(1.0, abs=0.03)
    assert all(run == pytest.approx(0.3 * length, abs=0.003) for length, run in cycles)
    # Without jitter every cycle is the period exactly.
    assert {length for length, _ in _cycle_lengths(child, log, tmp_path, jitter=0.0)} == {1.0}


@needs(os.geteuid() == 0, reason="needs root to take CAP_KILL away and give it back")
def test_a_failed_sigcont_stays_recorded_and_is_retried(child, log, tmp_path):
    """SIGCONT fails for real (EPERM: this process is briefly uid 65534 without CAP_KILL, the child
    is root): the child stays stopped, in the executor and in the state file, and is continued by
    the retry once the permission is back."""
    c = child(new_session=True)  # the kernel lets SIGCONT through within one session, whoever sends it
    door = SafeSignaller(log)
    door.authorize([c.target()])
    tmp_path.chmod(0o777)  # the state file is rewritten while this process is uid 65534
    state = StoppedState(tmp_path, log)
    executor = ThrottleExecutor(door, state, log, period_seconds=0.2)
    executor.start()
    try:
        executor.update({"c": ThrottlePlan(0.05, (c.target(),))})
        wait_state(c.pid, lambda s: s == "T", 5)
        with executor._cond:  # its thread waits: no retry between the permission's return and the checks
            os.setresuid(65534, 65534, 0)  # the saved uid 0 lets us come back; effective caps are gone
            try:
                executor._release_all_locked("test")
            finally:
                os.setresuid(0, 0, 0)
            assert proc_state(c.pid) == "T"
            assert list(executor._unreleased) == [c.target().key]
            recorded = json.loads((tmp_path / "stopped.json").read_text())["stopped"]
            assert [(e["pid"], e["start_time_ticks"]) for e in recorded] == [c.target().key]
            executor._cond.notify_all()
        # Permission back: the executor's own retry continues it and clears the record.
        c.out.wait_for(lambda s: s.startswith("got SIGCONT"), 5)
        wait_state(c.pid, lambda s: s not in ("T", None), 5)
        assert executor.stopped_targets() == []
        assert json.loads((tmp_path / "stopped.json").read_text())["stopped"] == []
        failed = [r for r in log.records() if r["event"] == "sigcont" and r["outcome"] == "failed"]
        assert failed and "Operation not permitted" in failed[0]["detail"]
    finally:
        executor.close()
    assert proc_state(c.pid) not in ("T", None)


def test_a_throttle_plan_not_renewed_within_its_lease_is_released(child, log, tmp_path):
    """The poll loop renews the plans every poll; if it stops (stuck), the executor continues
    everything by itself when the lease runs out, and says so."""
    c = child()
    door = SafeSignaller(log)
    door.authorize([c.target()])
    state = StoppedState(tmp_path, log)
    executor = ThrottleExecutor(door, state, log, period_seconds=0.2)
    executor.start()
    try:
        executor.update({"c": ThrottlePlan(0.05, (c.target(),))}, lease_seconds=0.5)
        wait_state(c.pid, lambda s: s == "T", 5)
        # No renewal: when the lease runs out the executor drops the plan by itself.
        deadline = time.monotonic() + 5
        while executor.throttled():
            assert time.monotonic() < deadline, "the lease never expired"
            time.sleep(0.01)
        assert any(r["event"] == "throttle_lease_expired" for r in log.records())
        wait_state(c.pid, lambda s: s not in ("T", None), 5)
        assert executor.throttled() == set() and executor.stopped_targets() == []
        assert json.loads((tmp_path / "stopped.json").read_text())["stopped"] == []
    finally:
        executor.close()


def test_throttle_executor_stops_again_a_process_continued_once_and_does_not_report_it(child, log, tmp_path):
    """One SIGCONT from elsewhere (a race, a one-off) buys the process one check interval: it is
    stopped again at once and, seen stopped through the following phases, never reported."""
    c = child()
    door = SafeSignaller(log)
    door.authorize([c.target()])
    # A stopped phase of about 1.9 s: the SIGCONT below lands in it even when this test runs late on a
    # busy machine, and "stopped again at once" (a check every EVASION_CHECK_SECONDS) is told apart
    # from "stopped at the next phase" (seconds later) with a wide margin.
    executor = ThrottleExecutor(door, StoppedState(tmp_path, log), log, period_seconds=2.0)
    executor.start()
    try:
        executor.update({"c": ThrottlePlan(0.05, (c.target(),))})
        wait_state(c.pid, lambda s: s == "T", 5)
        time.sleep(0.1)  # into the stopped phase, past the settle time (a phase has no event)
        os.kill(c.pid, signal.SIGCONT)
        took = wait_state(c.pid, lambda s: s == "T", 2)
        assert took < 1.0
        # Two more duty cycles, held stopped all through: the streak ended, nothing reported.
        n = sum(1 for line in c.lines() if line.startswith("got SIGCONT"))
        c.out.wait_for(lambda s, n=n: s == f"got SIGCONT {n + 2}", 15)
        assert executor.take_evasions() == []
        found = [r for r in log.records() if r["event"] == "throttle_found_running"]
        assert [(r["pid"], r["phases"]) for r in found] == [(c.pid, 1)]
        again = [r for r in log.records() if r["event"] == "sigstop" and r["reason"].endswith("_found_running")]
        assert [r["outcome"] for r in again] == ["sent"]
    finally:
        executor.close()
    assert proc_state(c.pid) not in ("T", None)


def test_throttle_executor_reports_a_process_a_helper_keeps_running(child, log, tmp_path):
    c = child()
    door = SafeSignaller(log)
    door.authorize([c.target()])
    executor = ThrottleExecutor(door, StoppedState(tmp_path, log), log, period_seconds=0.2)
    executor.start()
    helper = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys, time\n"
        "while True:\n    os.kill(int(sys.argv[1]), signal.SIGCONT); time.sleep(0.001)\n"), str(c.pid)])
    try:
        executor.update({"c": ThrottlePlan(0.25, (c.target(),))})
        deadline = time.monotonic() + 5
        found: list = []
        while not found:
            assert time.monotonic() < deadline, "the evasion was never reported"
            found = executor.take_evasions()
            time.sleep(0.01)  # the report has no event of its own: the poll loop asks for it too
        [evasion] = found
        assert (evasion.pid, evasion.start_time_ticks, evasion.container) == (c.pid, c.start, "c")
        assert evasion.phases == 2 and evasion.state not in ("T", "t", "D")
        # Reported once per throttle, however long the helper goes on.
        c.out.wait_for(lambda s: s.startswith("got SIGCONT"), 5)
        assert executor.take_evasions() == []
    finally:
        helper.kill()
        helper.wait(5)
        executor.close()
    wait_state(c.pid, lambda s: s not in ("T", None), 1)
    assert json.loads((tmp_path / "stopped.json").read_text())["stopped"] == []


ALTERNATE = Path(__file__).parent / "alternate_sigcont.py"


def test_throttle_executor_reports_a_process_continued_in_every_other_stopped_phase(child, log, tmp_path):
    """Issue 32 row 5: a helper continues the process in one stopped phase, leaves the next alone,
    continues it in the one after. Two phases in a row never come; two within the window do."""
    c = child()
    door = SafeSignaller(log)
    door.authorize([c.target()])
    executor = ThrottleExecutor(door, StoppedState(tmp_path, log), log, period_seconds=0.4, jitter=0.0)
    executor.start()
    helper = subprocess.Popen([sys.executable, str(ALTERNATE), str(c.pid), "0.15"], stdout=subprocess.PIPE,
                              text=True)
    out = LineReader(helper.stdout, "helper")
    try:
        out.wait_for(lambda s: s == "attacking", 10)
        executor.update({"c": ThrottlePlan(0.25, (c.target(),))})
        deadline = time.monotonic() + 10
        found: list = []
        while not found:
            assert time.monotonic() < deadline, f"the evasion was never reported: {out.snapshot()}"
            found = executor.take_evasions()
            time.sleep(0.01)
        [evasion] = found
        assert (evasion.pid, evasion.container, evasion.phases) == (c.pid, "c", 2)
        out.wait_for(lambda s: s.startswith("acted") and s != "acted 1", 5)  # said after its burst
        said = out.snapshot()
        acted = [int(s.split()[1]) for s in said if s.startswith("acted")]
        skipped = [int(s.split()[1]) for s in said if s.startswith("skipped")]
        # Reported on the second phase the helper acted in, with a phase left alone between them.
        assert acted[:2] == [acted[0], acted[0] + 2] and acted[0] + 1 in skipped, said
        seen = [r["phases"] for r in log.records() if r["event"] == "throttle_found_running"]
        assert seen[:2] == [1, 2], seen
    finally:
        helper.kill()
        helper.wait(5)
        executor.close()
    wait_state(c.pid, lambda s: s not in ("T", None), 1)
    assert json.loads((tmp_path / "stopped.json").read_text())["stopped"] == []


def test_a_stop_signal_still_pending_is_seen_as_pending(child, log):
    """A SIGSTOP not yet acted on (here: sent to a process already stopped, which acts on nothing)
    shows in its pending set, and a SIGCONT discards it: how the throttle tells a late SIGSTOP on a
    loaded node from a process someone else continued."""
    c = child()
    door = SafeSignaller(log)
    door.authorize([c.target()])
    assert not door.stop_pending(c.target())
    os.kill(c.pid, signal.SIGSTOP)
    wait_state(c.pid, lambda s: s == "T", 5)
    assert not door.stop_pending(c.target())  # acted on: no longer pending
    os.kill(c.pid, signal.SIGSTOP)
    assert door.stop_pending(c.target())
    os.kill(c.pid, signal.SIGCONT)
    wait_state(c.pid, lambda s: s not in ("T", None), 5)
    assert not door.stop_pending(c.target())
