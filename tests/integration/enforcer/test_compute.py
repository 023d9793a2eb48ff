"""End to end: compute shares. A workload over its compute share is duty-cycled with real
SIGSTOP/SIGCONT (observed as state 'T' in /proc and through the workload's own SIGCONT handler),
and nothing is ever left stopped: not after the plan drops it, a config change, the enforcer's
SIGTERM, or even its SIGKILL (the restarted enforcer continues what the state file records)."""

from __future__ import annotations

import json
import signal

from tests.support.enforcer_harness import proc_state, wait_state

GIB = 1 << 30
INTERVAL = 0.1
# Short window and period keep the tests quick; the tracker needs one period of data to start.
FAST = ("--compute-window", "0.5", "--compute-period", "0.3")


def _stopped_file(gpu) -> list[dict]:
    path = gpu.state_dir / "stopped.json"
    return json.loads(path.read_text())["stopped"] if path.exists() else []


def test_over_compute_share_is_duty_cycled_and_continued_on_sigterm(gpu, make_config):
    busy = gpu.workload("busy")
    calm = gpu.workload("calm")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100), gpu.proc(calm, GIB, sm=10)))
    config = make_config({"busy": {"computePercent": 30}, "calm": {"computePercent": 50}}, interval=INTERVAL)
    enforcer = gpu.enforcer(config, *FAST)

    start = enforcer.wait_event("throttle_start", 10, container="busy")
    assert start["compute_share"] == 0.3 and start["action"] == "throttle_start"
    assert busy.pid in start["pids"]
    # Stopped, continued (the workload's own SIGCONT handler), stopped again, continued again.
    wait_state(busy.pid, lambda s: s == "T", 5)
    busy.wait_line("got SIGCONT 1", 5)
    wait_state(busy.pid, lambda s: s == "T", 5)
    busy.wait_line("got SIGCONT 2", 5)
    # While stopped it is on record in the state file, with its start time.
    wait_state(busy.pid, lambda s: s == "T", 5)
    assert {e["pid"] for e in _stopped_file(gpu)} <= {busy.pid}
    assert enforcer.metric("gpufence_container_throttled", container="busy") == 1
    assert enforcer.metric("gpufence_container_compute_share_ratio", container="busy") == 0.3
    assert enforcer.metric("gpufence_enforcement_actions_total", container="busy", action="throttle_start") == 1

    assert enforcer.stop(signal.SIGTERM) == 0
    assert proc_state(busy.pid) not in ("T", None)
    assert _stopped_file(gpu) == []
    # calm was never throttled nor signalled.
    assert calm.out.snapshot() == [f"ready {calm.pid}"]
    assert enforcer.events("throttle_start", container="calm") == []


def test_throttle_ends_when_usage_drops(gpu, make_config):
    busy = gpu.workload("busy")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    enforcer = gpu.enforcer(make_config({"busy": {"computePercent": 40}}, interval=INTERVAL), *FAST)
    enforcer.wait_event("throttle_start", 10, container="busy")
    wait_state(busy.pid, lambda s: s == "T", 5)

    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=0)))
    stop = enforcer.wait_event("throttle_stop", 10, container="busy")
    assert stop["action"] == "throttle_stop"
    wait_state(busy.pid, lambda s: s not in ("T", None), 2)
    # Later polls do not stop it again.
    enforcer.wait_polls(5)
    assert busy.state() not in ("T", None)
    assert _stopped_file(gpu) == []
    assert enforcer.metric("gpufence_container_throttled", container="busy") == 0
    assert enforcer.stop() == 0
    assert busy.state() not in ("T", None)


def test_config_change_continues_everything(gpu, make_config, tmp_path):
    busy = gpu.workload("busy")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(make_config({"busy": {"computePercent": 20}}, interval=INTERVAL)))
    enforcer = gpu.enforcer(None, "--config", str(config_file), *FAST)
    enforcer.wait_event("throttle_start", 10, container="busy")
    wait_state(busy.pid, lambda s: s == "T", 5)

    config_file.write_text(json.dumps(make_config({"busy": {}}, interval=INTERVAL)))
    enforcer.wait_event("config_changed", 5)
    stop = enforcer.wait_event("throttle_stop", 5, container="busy")
    assert stop["reason"] == "config changed"
    wait_state(busy.pid, lambda s: s not in ("T", None), 2)
    assert _stopped_file(gpu) == []

    # An invalid edit is reported and ignored: the previous config stays in force.
    config_file.write_text('{"containers": {"busy": {"computePercent": 500}}}')
    invalid = enforcer.wait_event("config_invalid", 5)
    assert "computePercent" in invalid["error"]
    assert enforcer.proc.poll() is None
    assert enforcer.stop() == 0


def test_restarted_enforcer_continues_what_a_killed_one_left_stopped(gpu, make_config):
    busy = gpu.workload("busy")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    config = make_config({"busy": {"computePercent": 10}}, interval=INTERVAL)
    first = gpu.enforcer(config, *FAST)
    first.wait_event("throttle_start", 10, container="busy")
    for _attempt in range(20):
        wait_state(busy.pid, lambda s: s == "T", 5)
        # Freeze the enforcer so the duty cycle cannot continue the workload under our feet,
        # then check the workload is (still) stopped; if a run phase began in between, retry.
        first.proc.send_signal(signal.SIGSTOP)
        wait_state(first.proc.pid, lambda s: s == "T", 5)
        if proc_state(busy.pid) == "T":
            break
        first.proc.send_signal(signal.SIGCONT)
    else:
        raise AssertionError("never caught the workload stopped")
    first.proc.kill()
    assert first.proc.wait(5) == -signal.SIGKILL
    # Nobody continues it now: the SIGKILLed enforcer left it stopped, on record.
    assert proc_state(busy.pid) == "T"
    recorded = _stopped_file(gpu)
    assert [e["pid"] for e in recorded] == [busy.pid]
    cont_before = sum(1 for line in busy.out.snapshot() if line.startswith("got SIGCONT"))

    # The restarted enforcer (no compute limit now) continues it before anything else.
    second = gpu.enforcer(make_config({"busy": {}}, interval=INTERVAL))
    records = second.records()
    events = [r["event"] for r in records]
    recovered = next(r for r in records if r["event"] == "stopped_state_recovered")
    assert recovered["continued"] == 1 and recovered["recorded"] == 1
    assert events.index("stopped_state_recovered") < events.index("started")
    wait_state(busy.pid, lambda s: s not in ("T", None), 2)
    busy.wait_line(f"got SIGCONT {cont_before + 1}", 2)
    assert _stopped_file(gpu) == []
    assert second.stop() == 0


def test_memory_victim_held_stopped_is_continued_to_act_on_sigterm(gpu, make_config):
    busy = gpu.workload("busy")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    config = make_config({"busy": {"computePercent": 10, "memoryBytes": 2 * GIB}}, grace=5, interval=INTERVAL)
    enforcer = gpu.enforcer(config, *FAST)
    enforcer.wait_event("throttle_start", 10, container="busy")
    wait_state(busy.pid, lambda s: s == "T", 5)

    gpu.write(gpu.device_with(gpu.proc(busy, 3 * GIB, sm=100)))
    # SIGTERM is only acted on once continued: it must exit well within the 5 s grace period.
    busy.wait_line("got SIGTERM", 3)
    assert busy.proc.wait(3) == 0
    assert enforcer.events("sigkill") == []
    assert _stopped_file(gpu) == []
    assert enforcer.stop() == 0


def test_with_queued_kernel_lag_a_container_is_held_at_its_share(gpu, make_config):
    """The simulated driver keeps a stopped process's utilisation up for a while (queued kernels,
    ``util_lag_ms``). The controller holds the measured use of a container wanting 100 % at its 30 %
    share within 0.1 (the old use/fraction estimate collapsed to the 5 % floor here), and a neighbour
    exactly at its share is never throttled."""
    busy = gpu.workload("busy")
    at_share = gpu.workload("even")
    procs = (gpu.proc(busy, GIB, sm=100), gpu.proc(at_share, GIB, sm=40))
    gpu.write(gpu.device_with(*procs), util_lag_ms=200)
    config = make_config({"busy": {"computePercent": 30}, "even": {"computePercent": 40}}, interval=INTERVAL)
    enforcer = gpu.enforcer(config, "--compute-window", "1", "--compute-period", "0.3")
    enforcer.wait_event("throttle_start", 10, container="busy")
    enforcer.wait_polls(30)  # settle: a few seconds of the loop
    measured = []
    for _ in range(40):
        enforcer.wait_polls(1)
        measured.append(enforcer.metric("gpufence_container_sm_utilization_ratio", container="busy") or 0.0)
    mean = sum(measured) / len(measured)
    print(f"\nheld at {mean:.3f} for a 0.30 share (samples {min(measured):.2f}..{max(measured):.2f})")
    assert abs(mean - 0.30) <= 0.1
    assert enforcer.events("throttle_start", container="even") == []
    assert enforcer.stop() == 0
    assert proc_state(busy.pid) not in ("T", None)
