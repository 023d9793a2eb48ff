"""End to end: faults. The enforcer keeps serving through NVML trouble, per-device errors and
processes that vanish under it; only a bad configuration stops it, at once, with exit status 2, and
a dead poll thread, with exit status 3 (for the kubelet to restart it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from gpufence.simnvml import SimProcess
from tests.support.enforcer_harness import REPO_ROOT, proc_state, wait_state

GIB = 1 << 30
INTERVAL = 0.1


def _run_cli(*args: str, config: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFENCE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if config is not None:
        env["GPUFENCE_CONFIG"] = config
    return subprocess.run(
        [sys.executable, "-m", "gpufence.enforcer", "--metrics-port", "0", *args],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
    )


@pytest.mark.parametrize(
    ("config", "args", "message"),
    [
        ("{not json", (), "not valid JSON"),
        ('{"containers": {"train": {"computePercent": 150}}}', (), "containers.train: computePercent"),
        ('{"pollIntervalSeconds": 0}', (), "pollIntervalSeconds"),
        (None, (), "no configuration"),
        (None, ("--config", "/nonexistent/gpufence.json"), "cannot read /nonexistent/gpufence.json"),
    ],
)
def test_invalid_config_exits_2_before_anything_else(config, args, message):
    result = _run_cli(*args, config=config)
    assert result.returncode == 2, result
    assert "invalid configuration" in result.stderr and message in result.stderr, result.stderr
    assert result.stdout == ""  # nothing started, nothing logged


def test_bad_flag_exits_2():
    result = _run_cli("--metrics-port", "70000", config='{"containers": {}}')
    assert result.returncode == 2
    assert "port out of range" in result.stderr


def test_nvml_init_error_keeps_serving_then_recovers(gpu, make_config):
    hog = gpu.workload("hog")
    gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB)), init_error="DRIVER_NOT_LOADED")
    enforcer = gpu.enforcer(make_config({"hog": {"memoryBytes": 2 * GIB}}, grace=2, interval=INTERVAL))
    assert enforcer.started.get("driver_version") is None
    failure = enforcer.wait_event("nvml_unavailable", 5)
    assert "DRIVER_NOT_LOADED" in failure["error"]
    assert enforcer.http("/healthz")[0] == 200
    status, body = enforcer.http("/readyz")
    assert status == 503 and "NVML" in body
    assert enforcer.metric("gpufence_nvml_up") == 0
    assert enforcer.metric("gpufence_nvml_errors_total", function="nvmlInit", error="DRIVER_NOT_LOADED") >= 1
    # It is retried with backoff; nothing is signalled meanwhile.
    enforcer.wait_event("nvml_unavailable", 5, start=enforcer.mark())
    assert hog.alive() and enforcer.events("sigterm") == []

    gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB)))
    opened = enforcer.wait_event("nvml_opened", 10)
    assert opened["driver_version"]
    hog.wait_line("got SIGTERM", 5)
    enforcer.wait_ready()
    assert enforcer.metric("gpufence_nvml_up") == 1
    assert enforcer.stop() == 0


def test_nvml_library_missing_keeps_serving(gpu, make_config, tmp_path):
    missing = str(tmp_path / "no" / "libnvidia-ml.so.1")
    enforcer = gpu.enforcer(make_config({}, interval=INTERVAL), "--nvml-library", missing)
    failure = enforcer.wait_event("nvml_unavailable", 5)
    assert "does not exist" in failure["error"]
    assert enforcer.http("/healthz")[0] == 200
    assert enforcer.http("/readyz")[0] == 503
    assert enforcer.metric("gpufence_nvml_up") == 0
    assert enforcer.metric("gpufence_nvml_errors_total", function="nvmlInit", error="LIBRARY_NOT_FOUND") >= 1
    enforcer.wait_event("nvml_unavailable", 5, start=enforcer.mark())  # still retrying, still alive
    assert enforcer.proc.poll() is None
    assert enforcer.stop() == 0


def test_device_lost_mid_run(gpu, make_config):
    calm = gpu.workload("calm")
    hog = gpu.workload("hog")

    def state(lost: bool, hog_used: int) -> None:
        gpu.write(
            gpu.device_with(gpu.proc(calm, GIB), uuid="GPU-0", lost=lost),
            gpu.device_with(gpu.proc(hog, hog_used), uuid="GPU-1"),
        )

    state(False, GIB)
    shares = {"calm": {"memoryBytes": 2 * GIB}, "hog": {"memoryBytes": 2 * GIB}}
    config = make_config(shares, grace=2, interval=INTERVAL)
    enforcer = gpu.enforcer(config)
    enforcer.wait_ready()

    state(True, GIB)
    lost = enforcer.wait_event("device_lost", 5)
    assert lost["device"] == 0
    enforcer.wait_event("nvml_error", 5, error="GPU_IS_LOST")
    assert enforcer.metric("gpufence_nvml_errors_total", error="GPU_IS_LOST") >= 1
    # The other device is still enforced.
    state(True, 3 * GIB)
    hog.wait_line("got SIGTERM", 5)
    assert enforcer.wait_event("sigterm", 5, pid=hog.pid)["uuid"] == "GPU-1"
    assert enforcer.http("/healthz")[0] == 200
    enforcer.wait_ready()

    state(False, GIB)
    enforcer.wait_event("device_recovered", 5, device=0)
    assert calm.alive() and not calm.said("got SIGTERM")
    assert enforcer.events("poll_error") == []
    assert enforcer.stop() == 0


def test_utilization_not_supported(gpu, make_config):
    """Memory enforcement goes on; compute is never throttled blind; the error is logged once."""
    busy = gpu.workload("busy")
    gpu.write(
        gpu.device_with(gpu.proc(busy, GIB, sm=100)),
        failures={"nvmlDeviceGetProcessUtilization": "NOT_SUPPORTED"},
    )
    config = make_config({"busy": {"memoryBytes": 2 * GIB, "computePercent": 10}}, grace=2, interval=INTERVAL)
    enforcer = gpu.enforcer(config, "--compute-window", "0.5", "--compute-period", "0.3")
    error = enforcer.wait_event("nvml_error", 5, function="nvmlDeviceGetProcessUtilization")
    assert error["error"] == "NOT_SUPPORTED"
    enforcer.wait_polls(8)  # more than a compute window: would have throttled with data
    assert enforcer.events("throttle_start") == []
    assert busy.state() != "T"
    assert len(enforcer.events("nvml_error")) == 1  # rate-limited, but counted every time
    # One read per compute period (0.3 s) over eight polls: at least two calls, each counted.
    assert enforcer.metric("gpufence_nvml_errors_total", function="nvmlDeviceGetProcessUtilization") >= 2
    enforcer.wait_ready()

    gpu.write(
        gpu.device_with(gpu.proc(busy, 3 * GIB, sm=100)),
        failures={"nvmlDeviceGetProcessUtilization": "NOT_SUPPORTED"},
    )
    busy.wait_line("got SIGTERM", 5)
    assert enforcer.stop() == 0


def test_process_exiting_between_listing_and_signalling(gpu, make_config):
    """NVML still lists processes that already exited: a zombie nobody reaped yet (attributed while
    it was alive) and a PID that no longer exists at all. Neither is signalled (a dead process is
    dropped from the attribution; the signalling door's own GONE outcome for a process that dies in
    the microseconds before the kill is covered in test_enforcer_signals), nothing breaks, and the
    enforcer keeps enforcing: a live container going over afterwards is still terminated."""
    doomed = gpu.workload("doomed")
    reaped = gpu.workload("reaped")
    live = gpu.workload("live")
    ghost_pid = reaped.pid
    gpu.write(gpu.device_with(gpu.proc(doomed, GIB), gpu.proc(live, GIB)))
    config = make_config({"doomed": {"memoryBytes": 2 * GIB}, "live": {"memoryBytes": 2 * GIB}},
                         grace=0, interval=INTERVAL)
    enforcer = gpu.enforcer(config)
    enforcer.wait_polls(2)

    # Exit (and stay unreaped: a zombie, /proc/<pid> still there) but remain in NVML's list, now over.
    os.kill(doomed.pid, signal.SIGKILL)
    wait_state(doomed.pid, lambda s: s == "Z", 5)
    reaped.proc.kill()
    reaped.proc.wait(5)
    gpu.write(gpu.device_with(gpu.proc(doomed, 3 * GIB), SimProcess(ghost_pid, 9 * GIB), gpu.proc(live, GIB)))
    enforcer.wait_polls(5)
    gpu.write(gpu.device_with(gpu.proc(doomed, 3 * GIB), SimProcess(ghost_pid, 9 * GIB), gpu.proc(live, 3 * GIB)))
    term = enforcer.wait_event("sigterm", 5, pid=live.pid)
    assert term["outcome"] == "sent"
    assert enforcer.events("sigterm", pid=doomed.pid) == []
    assert enforcer.events("sigterm", pid=ghost_pid) == []
    assert enforcer.events("poll_error") == []
    assert enforcer.http("/healthz")[0] == 200
    doomed.proc.wait(5)
    assert enforcer.stop() == 0


def test_sigterm_with_nothing_throttled_exits_0_and_logs_shutdown(gpu, make_config):
    gpu.write(gpu.device_with())
    enforcer = gpu.enforcer(make_config({}, interval=INTERVAL))
    assert enforcer.stop(signal.SIGINT) == 0
    shutdown = enforcer.wait_event("shutdown", 5)
    assert shutdown["signal"] == "SIGINT"
    assert json.loads(enforcer.out.snapshot()[-1])["event"] == "shutdown"


def test_nvml_stops_answering_mid_run_releases_throttles_then_recovers(gpu, make_config):
    busy = gpu.workload("busy")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    config = make_config({"busy": {"computePercent": 10}}, interval=INTERVAL)
    enforcer = gpu.enforcer(config, "--compute-window", "0.5", "--compute-period", "0.3")
    enforcer.wait_event("throttle_start", 10, container="busy")
    wait_state(busy.pid, lambda s: s == "T", 5)

    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)), failures={"*": "UNINITIALIZED"})
    lost = enforcer.wait_event("nvml_unavailable", 5, function="sample")
    assert "UNINITIALIZED" in lost["error"]
    stop = enforcer.wait_event("throttle_stop", 5, container="busy")
    assert stop["reason"] == "nvml unavailable"  # never duty-cycle blind
    wait_state(busy.pid, lambda s: s not in ("T", None), 2)
    assert enforcer.metric("gpufence_nvml_up") == 0
    assert enforcer.http("/readyz")[0] == 503 and enforcer.http("/healthz")[0] == 200

    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=0)))
    enforcer.wait_ready()
    # Readiness comes over HTTP, the log line through a pipe this test reads on a thread, which a
    # busy machine can leave behind: wait for the second nvml_opened line, do not count a snapshot.
    def opened(line: str) -> bool:
        return '"nvml_opened"' in line

    first, _ = enforcer.out.wait_for(opened, 5)
    enforcer.out.wait_for(opened, 5, start=first + 1)
    assert len(enforcer.events("nvml_opened")) == 2
    assert enforcer.metric("gpufence_nvml_up") == 1
    assert busy.state() != "T"
    assert enforcer.stop() == 0


def test_a_hung_nvml_call_leaves_nothing_stopped_fires_sigkills_and_fails_liveness(gpu, make_config):
    """A GPU that falls off the bus can make an NVML call block for ever. The call's deadline turns
    it into an error: throttled processes are continued, a pending SIGKILL still fires on time,
    /healthz turns 503 (only a new process can use NVML again); when the call finally returns the
    enforcer reopens NVML and /healthz is 200 again."""
    busy = gpu.workload("busy")
    stubborn = gpu.workload("stubborn", ignore_term=True)
    procs = (gpu.proc(busy, GIB, sm=100), gpu.proc(stubborn, GIB))
    gpu.write(gpu.device_with(*procs))
    config = make_config(
        {"busy": {"computePercent": 20}, "stubborn": {"memoryBytes": 2 * GIB}}, grace=1.5, interval=INTERVAL
    )
    enforcer = gpu.enforcer(config, "--compute-window", "0.5", "--compute-period", "0.3", "--nvml-timeout", "0.5")
    enforcer.wait_event("throttle_start", 10, container="busy")
    wait_state(busy.pid, lambda s: s == "T", 5)
    assert enforcer.http("/healthz")[0] == 200

    # Over its share, then the driver hangs inside the grace period.
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100), gpu.proc(stubborn, 3 * GIB)))
    stubborn.wait_line("ignored SIGTERM", 5)
    gpu.write(gpu.device_with(*procs), hangs=("nvmlDeviceGetComputeRunningProcesses",))
    hung = enforcer.wait_event("nvml_hung", 5)
    assert "did not return within 0.5s" in hung["error"]
    enforcer.wait_event("throttle_stop", 5, container="busy")
    assert proc_state(busy.pid) not in ("T", None)
    assert _stopped_file(gpu) == []
    # The SIGKILL timer is not the poll's: it fires although NVML is hung.
    assert stubborn.proc.wait(5) == -signal.SIGKILL
    assert enforcer.wait_event("sigkill", 5, pid=stubborn.pid)["outcome"] == "sent"
    status, body = enforcer.http("/healthz")
    assert status == 503 and "NVML call is hung" in body
    assert enforcer.metric("gpufence_nvml_up") == 0
    assert enforcer.metric("gpufence_nvml_errors_total", function="sample", error="HUNG") >= 1
    mark = enforcer.mark()
    enforcer.wait_polls(3)  # still hung: the loop goes on, busy is never stopped again
    assert proc_state(busy.pid) not in ("T", None)
    assert enforcer.http("/healthz")[0] == 503

    # The call returns: NVML is reopened and liveness recovers.
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    enforcer.wait_event("nvml_opened", 10, start=mark)
    deadline_ok = enforcer.wait_event("throttle_start", 10, start=mark, container="busy")
    assert deadline_ok["action"] == "throttle_start"
    assert enforcer.http("/healthz")[0] == 200
    assert enforcer.stop() == 0
    assert proc_state(busy.pid) not in ("T", None)
    assert _stopped_file(gpu) == []


def _stopped_file(gpu) -> list[dict]:
    path = gpu.state_dir / "stopped.json"
    return json.loads(path.read_text())["stopped"] if path.exists() else []


# The real CLI with one fault injected: SIGUSR1 raises an exception in the poll thread at its next
# bytecode (CPython's PyThreadState_SetAsyncExc), wherever it is in the loop. No input at the NVML
# boundary escapes the loop (it catches every Exception of a tick, and nvml.py turns driver errors
# into values), so this stands for what does: an exception the loop does not catch (BaseException,
# a failure in its own error handling). The enforcer's code is not touched.
POLL_THREAD_FAULT = """
import ctypes, signal, sys, threading
from gpufence.enforcer.cli import main

class InjectedFault(BaseException):
    def __init__(self):
        super().__init__("injected into the poll thread")

set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)

def inject(signum, frame):
    (poll,) = [t for t in threading.enumerate() if t.name == "gpufence-poll"]
    assert set_async_exc(poll.ident, InjectedFault) == 1

signal.signal(signal.SIGUSR1, inject)
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_poll_thread_exits_non_zero_and_leaves_nothing_stopped(gpu, make_config):
    """Nothing is enforced without the poll thread: the sidecar must exit non-zero so the kubelet
    restarts it under every restart policy that restarts on failure (a plain container in a Job
    with OnFailure restarts only then), after continuing whatever it held stopped."""
    from tests.support.enforcer_harness import Enforcer

    busy = gpu.workload("busy")
    gpu.write(gpu.device_with(gpu.proc(busy, GIB, sm=100)))
    env = gpu.env()
    env["GPUFENCE_CONFIG"] = json.dumps(make_config({"busy": {"computePercent": 10}}, interval=INTERVAL))
    argv = [
        sys.executable, "-c", POLL_THREAD_FAULT, "--metrics-port", "0", "--bind-address", "127.0.0.1",
        "--nvidia-device-prefix", gpu.device_prefix, "--state-dir", str(gpu.state_dir),
        "--compute-window", "0.5", "--compute-period", "0.3", "--termination-log", str(gpu.root / "termination-log"),
    ]
    (gpu.root / "termination-log").write_text("")  # the kubelet's file exists before the container starts
    stderr_path = gpu.root / "enforcer-fault.stderr"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    enforcer = Enforcer(proc, stderr_path)
    gpu.enforcers.append(enforcer)
    enforcer.wait_started()
    enforcer.wait_event("throttle_start", 10, container="busy")
    wait_state(busy.pid, lambda s: s == "T", 5)

    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(10) == 3, enforcer.stderr()
    died = enforcer.wait_event("poll_thread_died", 5)
    assert died["level"] == "error" and "InjectedFault: injected into the poll thread" in died["error"]
    assert enforcer.wait_event("shutdown", 5)["exit_status"] == 3
    # The kubelet shows why in the container's last state.
    message = (gpu.root / "termination-log").read_text()
    assert message.startswith("poll_thread_died: ") and "InjectedFault: injected into the poll thread" in message
    # Whatever it held stopped is continued on the way out, and nothing is left on record.
    wait_state(busy.pid, lambda s: s not in ("T", None), 2)
    assert _stopped_file(gpu) == []


def test_healthz_fails_from_the_moment_the_poll_thread_died():
    """Between the poll thread's death and the exit (continuing what it held stopped, closing the
    server) the liveness probe must not pass."""
    from gpufence.enforcer.report.health import Health, make_app
    from gpufence.enforcer.report.http_server import start_server
    from gpufence.enforcer.report.metrics import EnforcerMetrics
    from tests.support.enforcer_harness import enforcer_http

    health = Health(INTERVAL)
    health.tick_completed()
    server, port = start_server(make_app(EnforcerMetrics("ns", "p"), health), "127.0.0.1", 0)
    try:
        before = enforcer_http(port, "/healthz")
        health.poll_thread_died("InjectedFault: injected into the poll thread")
        after = enforcer_http(port, "/healthz")
    finally:
        server.close()
    assert before == (200, "ok\n")
    assert after[0] == 503 and "the poll thread died (InjectedFault: injected into the poll thread)" in after[1]
