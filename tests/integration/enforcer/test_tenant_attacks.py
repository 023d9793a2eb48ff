"""End to end: what a tenant's own processes do to get past the enforcer, done as they would do it,
against the real enforcer on the simulated driver.

* a GPU process re-execs itself with GPUFENCE_CONTAINER set to a name that is no container of the
  pod: unattributed, so held to the pod's memory and compute budgets;
* two GPU processes in one cgroup (a real cgroup v2 group) claim different names: the cgroup is
  unattributed and its processes are throttled against the pod's compute budget;
* unattributed processes on two GPUs when the pod requested one: terminated;
* a helper process sends SIGCONT to the throttled process every millisecond: the throttle sees it
  running while it should be stopped and terminates the container.

Each test fails against an enforcer that takes a claim as a key, enforces compute for attributed
containers only, counts GPUs per container only, or trusts its SIGSTOP to hold."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.enforcer_harness import LineReader, proc_state, wait_state

GIB = 1 << 30
INTERVAL = 0.1
FAST = ("--compute-window", "0.5", "--compute-period", "0.3")
# The grace period of the tests that wait for the workload to handle its SIGTERM: long enough that
# the SIGKILL never comes first on a busy machine (a 0.5 s grace did once, issue 38 row 6); they
# wait on the workload's own "got SIGTERM" and its exit, never on the grace.
TERM_GRACE = 30
# Re-exec the command that follows with GPUFENCE_CONTAINER set to a name of its choosing: the PID,
# the cgroup and every other fact stay; only the claim changes.
REEXEC = (
    sys.executable, "-c",
    "import os, sys; os.environ['GPUFENCE_CONTAINER'] = 'not-a-container'; os.execv(sys.argv[1], sys.argv[1:])",
)
# A helper of the same user: SIGCONT to the target every millisecond until it is gone, then it waits
# (a helper of the container stays until the container goes: one that exited on its own as the
# target went could beat the enforcer's SIGTERM to it on a busy machine).
ATTACKER = """
import os, signal, sys, time
pid = int(sys.argv[1])
print("attacking", flush=True)
while True:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        print("target gone", flush=True)
        break
    time.sleep(0.001)
while True:
    time.sleep(3600)
"""


def _stopped_file(gpu) -> list[dict]:
    path = gpu.state_dir / "stopped.json"
    return json.loads(path.read_text())["stopped"] if path.exists() else []


@pytest.fixture
def attackers() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def sigcont_loop(attackers: list[subprocess.Popen[str]], pid: int) -> tuple[subprocess.Popen[str], LineReader]:
    proc = subprocess.Popen([sys.executable, "-c", ATTACKER, str(pid)], stdout=subprocess.PIPE, text=True)
    attackers.append(proc)
    out = LineReader(proc.stdout, "attacker")
    out.wait_for(lambda s: s == "attacking", 10)
    return proc, out


# -- a name that is no container of the pod --------------------------------------------------------


def test_a_reexec_under_a_made_up_name_is_held_to_the_pod_memory_budget(gpu, make_config):
    spoof = gpu.workload("train", wrap=REEXEC)
    assert proc_state(spoof.pid) not in (None, "Z")
    gpu.write(gpu.device_with(gpu.proc(spoof, 9 * GIB, sm=100)))
    config = make_config({"train": {"memoryBytes": 8 * GIB, "computePercent": 20}}, grace=TERM_GRACE)
    enforcer = gpu.enforcer(config)

    seen = enforcer.wait_event("unattributed_process", 10, pid=spoof.pid)
    assert seen["claim"] == "not-a-container"
    assert "no container of this pod" in seen["why"]
    over = enforcer.wait_event("pod_over_budget", 10)
    assert over["victims"] == [spoof.pid]
    assert over["used_bytes"] == 9 * GIB and over["limit_bytes"] == 8 * GIB
    spoof.wait_line("got SIGTERM", 5)
    assert spoof.proc.wait(5) == 0
    term = enforcer.events("sigterm", pid=spoof.pid, outcome="sent")
    assert [t["reason"] for t in term] == ["pod_over_budget"]
    assert enforcer.metric("gpufence_enforcement_actions_total", container="", action="sigterm",
                           resource="memory") == 1
    assert enforcer.stop() == 0


def test_a_reexec_under_a_made_up_name_is_held_to_the_pod_compute_budget(gpu, make_config):
    spoof = gpu.workload("train", wrap=REEXEC)
    gpu.write(gpu.device_with(gpu.proc(spoof, GIB, sm=100)))
    config = make_config({"train": {"computePercent": 20}}, interval=INTERVAL)
    enforcer = gpu.enforcer(config, *FAST)

    start = enforcer.wait_event("throttle_start", 10, unattributed=True)
    assert start.get("container") is None and start["pod_compute_budget"] == 0.2
    assert start["pids"] == [spoof.pid] and start["action"] == "throttle_start"
    wait_state(spoof.pid, lambda s: s == "T", 5)
    spoof.wait_line("got SIGCONT 2", 5)
    assert enforcer.metric("gpufence_container_throttled", container="") == 1
    assert enforcer.metric("gpufence_enforcement_actions_total", container="", action="throttle_start",
                           resource="compute") == 1
    assert enforcer.stop() == 0
    assert proc_state(spoof.pid) not in ("T", None)
    assert _stopped_file(gpu) == []


# -- two names in one cgroup -----------------------------------------------------------------------


def test_a_cgroup_claiming_two_names_is_throttled_against_the_pod_compute_budget(cgroups, gpu, make_config):
    """120 % SM (two processes at 60 %) on a 20 % share, the cgroup's processes claiming "train" and
    "eval": the cgroup is unattributed, so both are duty-cycled; the neighbour within its share is not."""
    train_cg, calm_cg = cgroups.make("train"), cgroups.make("calm")
    first, second = gpu.workload("train"), gpu.workload("eval")
    calm = gpu.workload("calm")
    for w in (first, second):
        cgroups.move(train_cg, w.pid)
    cgroups.move(calm_cg, calm.pid)
    gpu.write(gpu.device_with(gpu.proc(first, GIB, sm=60), gpu.proc(second, GIB, sm=60)),
              gpu.device_with(gpu.proc(calm, GIB, sm=5), uuid="GPU-1"))
    config = make_config({"train": {"computePercent": 20}, "calm": {"computePercent": 10}}, interval=INTERVAL)
    enforcer = gpu.enforcer(config, *FAST)

    start = enforcer.wait_event("throttle_start", 10, unattributed=True)
    assert sorted(start["pids"]) == sorted([first.pid, second.pid])
    assert start["sm_utilization"] == 1.0 and start["pod_compute_budget"] == pytest.approx(0.3)
    for w in (first, second):
        wait_state(w.pid, lambda s: s == "T", 5)
        w.wait_line("got SIGCONT 2", 5)
    why = {r["pid"]: r for r in enforcer.events("unattributed_process")}
    assert set(why) == {first.pid, second.pid}
    assert "claim different names" in why[first.pid]["why"]
    assert enforcer.events("throttle_start", container="calm") == []
    assert calm.out.snapshot() == [f"ready {calm.pid}"]
    assert enforcer.stop() == 0
    for w in (first, second):
        assert proc_state(w.pid) not in ("T", None)


# -- more GPUs than requested ----------------------------------------------------------------------


def test_unattributed_processes_on_more_gpus_than_the_pod_requested_are_terminated(gpu, make_config):
    """envFrom NVIDIA_VISIBLE_DEVICES=all hands the pod every GPU: its unattributed processes run on
    two with one requested. The attributed container, on its one GPU, stays."""
    train = gpu.workload("train")
    stray = gpu.workload(None)
    spoof = gpu.workload("train", wrap=REEXEC)
    gpu.write(
        gpu.device_with(gpu.proc(train, GIB), gpu.proc(stray, GIB)),
        gpu.device_with(gpu.proc(spoof, GIB), uuid="GPU-1"),
    )
    config = make_config({"train": {"gpus": 1}}, grace=TERM_GRACE)
    enforcer = gpu.enforcer(config)

    over = enforcer.wait_event("gpus_over_request", 10, unattributed=True)
    assert over["gpus_requested"] == 1 and over["gpus_used"] == [0, 1]
    assert sorted(over["victims"]) == sorted([stray.pid, spoof.pid])
    for w in (stray, spoof):
        w.wait_line("got SIGTERM", 5)
        assert w.proc.wait(5) == 0
    terms = enforcer.events("sigterm", outcome="sent")
    assert {t["pid"] for t in terms} == {stray.pid, spoof.pid}
    assert {t["reason"] for t in terms} == {"gpus_over_request"}
    assert enforcer.metric("gpufence_enforcement_actions_total", container="", action="sigterm",
                           resource="gpus") == 2
    enforcer.wait_polls(3)
    assert train.alive() and not train.said("got SIGTERM")
    assert enforcer.stop() == 0


# -- SIGCONT from a helper -------------------------------------------------------------------------


def _stopped_fraction(pid: int, seconds: float) -> float:
    """The share of ``seconds`` in which /proc says ``pid`` is stopped (sampled every 2 ms)."""
    stopped = samples = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state = proc_state(pid)
        if state is None:
            break
        samples += 1
        stopped += state == "T"
        time.sleep(0.002)
    return stopped / max(samples, 1)


def test_a_process_continued_by_a_helper_is_terminated_with_its_container(gpu, make_config, attackers):
    busy = gpu.workload("train")
    calm = gpu.workload("calm")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100), gpu.proc(calm, GIB, sm=5)))
    config = make_config({"train": {"computePercent": 10}, "calm": {"computePercent": 50}}, grace=TERM_GRACE,
                         interval=INTERVAL)
    enforcer = gpu.enforcer(config, *FAST)
    enforcer.wait_event("throttle_start", 10, container="train")
    # Honest duty cycles first: held stopped most of the time, and never taken for an evasion.
    busy.wait_line("got SIGCONT 5", 10)
    honest = _stopped_fraction(busy.pid, 1.0)
    assert enforcer.events("throttle_evaded") == []
    assert enforcer.events("throttle_found_running") == []

    mark = enforcer.mark()
    attacked = time.monotonic()
    sigcont_loop(attackers, busy.pid)
    evaded = enforcer.wait_event("throttle_evaded", 10, start=mark, container="train")
    detected = time.monotonic() - attacked
    assert evaded["evaded_pids"] == [busy.pid] and evaded["phases"] >= 2
    assert evaded["victims"] == [busy.pid] and evaded["action"] == "sigterm"
    busy.wait_line("got SIGTERM", 5)
    assert busy.proc.wait(5) == 0
    ended = time.monotonic() - attacked
    term = enforcer.events("sigterm", pid=busy.pid, outcome="sent")
    assert [t["reason"] for t in term] == ["throttle_evaded"]
    assert enforcer.metric("gpufence_enforcement_actions_total", container="train", action="throttle_evaded",
                           resource="compute") == 1
    assert enforcer.metric("gpufence_enforcement_actions_total", container="train", action="sigterm",
                           resource="compute") == 1
    print(f"\nstopped {honest:.0%} of the time before the attack; evasion reported {detected:.2f}s and the "
          f"process gone {ended:.2f}s after the helper started")
    assert honest >= 0.6
    # The neighbour was never throttled nor signalled; nothing is left stopped.
    assert calm.out.snapshot() == [f"ready {calm.pid}"]
    assert _stopped_file(gpu) == []
    assert enforcer.stop() == 0


ALTERNATE = Path(__file__).parent / "alternate_sigcont.py"


def test_a_helper_continuing_every_other_stopped_phase_gets_the_container_terminated(gpu, make_config, attackers):
    """Issue 32 row 5: SIGCONT in every other stopped phase only (no two in a row) took the running
    time from 18-19 % to 37-38 % on a 20 % share, never escalated. Two phases within the window are
    enough now."""
    busy = gpu.workload("train")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    enforcer = gpu.enforcer(make_config({"train": {"computePercent": 20}}, grace=TERM_GRACE, interval=INTERVAL), *FAST)
    enforcer.wait_event("throttle_start", 10, container="train")
    busy.wait_line("got SIGCONT 3", 10)
    mark = enforcer.mark()
    helper = subprocess.Popen([sys.executable, str(ALTERNATE), str(busy.pid), "0.1"], stdout=subprocess.PIPE,
                              text=True)
    attackers.append(helper)
    out = LineReader(helper.stdout, "alternate")
    out.wait_for(lambda s: s == "attacking", 10)
    attacked = time.monotonic()
    evaded = enforcer.wait_event("throttle_evaded", 10, start=mark, container="train")
    detected = time.monotonic() - attacked
    assert evaded["evaded_pids"] == [busy.pid] and evaded["phases"] == 2 and evaded["action"] == "sigterm"
    busy.wait_line("got SIGTERM", 5)
    assert busy.proc.wait(5) == 0
    said = out.snapshot()
    assert any(s.startswith("skipped") for s in said), said  # it did leave phases alone
    assert [t["reason"] for t in enforcer.events("sigterm", pid=busy.pid, outcome="sent")] == ["throttle_evaded"]
    assert enforcer.metric("gpufence_enforcement_actions_total", container="train", action="throttle_evaded",
                           resource="compute") == 1
    print(f"\nevery-other-phase helper: evasion reported {detected:.2f}s after it started ({said[1:]})")
    assert _stopped_file(gpu) == []
    assert enforcer.stop() == 0


def test_gpu_work_that_runs_while_its_process_is_stopped_gets_the_container_terminated(gpu, make_config):
    """Issue 32 row 6: the simulated driver reports 100 % SM use whether the process runs or not
    (long or persistent kernels keep running while it is stopped): held at the minimum run fraction,
    still over its 20 % share, the container is terminated (``throttle_ineffective``) after the stated
    time, instead of being reported throttled for ever. The neighbour within its share stays."""
    busy = gpu.workload("train")
    calm = gpu.workload("calm")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100), gpu.proc(calm, GIB, sm=5)))
    config = make_config({"train": {"computePercent": 20}, "calm": {"computePercent": 50}}, grace=TERM_GRACE,
                         interval=INTERVAL)
    enforcer = gpu.enforcer(config, *FAST, "--throttle-ineffective-after", "2")
    started = enforcer.wait_event("throttle_start", 10, container="train")
    began = time.monotonic()
    held = enforcer.wait_event("throttle_ineffective", 15, container="train")
    took = time.monotonic() - began
    assert held["sm_utilization"] == 1.0 and held["compute_share"] == 0.2 and held["held_seconds"] >= 2.0
    assert held["victims"] == [busy.pid] and held["action"] == "sigterm"
    busy.wait_line("got SIGTERM", 5)
    assert busy.proc.wait(5) == 0
    assert [t["reason"] for t in enforcer.events("sigterm", pid=busy.pid, outcome="sent")] == ["throttle_ineffective"]
    assert enforcer.metric("gpufence_enforcement_actions_total", container="train", action="throttle_ineffective",
                           resource="compute") == 1
    assert enforcer.metric("gpufence_enforcement_actions_total", container="train", action="sigterm",
                           resource="compute") == 1
    print(f"\nthrottle started at run fraction {started.get('run_fraction')}; "
          f"judged ineffective {took:.2f}s later (bound 2 s pinned at the minimum)")
    assert calm.alive() and not calm.said("got SIGTERM")
    assert _stopped_file(gpu) == []
    assert enforcer.stop() == 0


def test_the_helper_goes_with_the_container_it_shares(cgroups, gpu, make_config, attackers):
    """In a pod the helper is a process of the container (its cgroup): it is terminated with it."""
    train_cg = cgroups.make("train")
    busy = gpu.workload("train")
    cgroups.move(train_cg, busy.pid)
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    enforcer = gpu.enforcer(make_config({"train": {"computePercent": 10}}, grace=TERM_GRACE, interval=INTERVAL), *FAST)
    enforcer.wait_event("throttle_start", 10, container="train")
    wait_state(busy.pid, lambda s: s == "T", 5)
    helper, _ = sigcont_loop(attackers, busy.pid)
    cgroups.move(train_cg, helper.pid)

    enforcer.wait_event("throttle_evaded", 10, container="train")
    assert busy.proc.wait(5) == 0
    assert helper.wait(5) == -signal.SIGTERM
    terms = {t["pid"] for t in enforcer.events("sigterm", outcome="sent", reason="throttle_evaded")}
    assert terms == {busy.pid, helper.pid}
    assert (train_cg / "cgroup.procs").read_text().split() == []
    assert _stopped_file(gpu) == []
    assert enforcer.stop() == 0
