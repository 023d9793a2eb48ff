"""The sidecar's probe (``gpufence.contract.PROBE_COMMAND``, gpufence/enforcer/probe.py) against the real
enforcer process: it follows the enforcer's heartbeat, not its HTTP port. A process holding the port
does not stop enforcement; a stopped enforcer fails the probe within the heartbeat's bound; and a
workload that rewrites every file it can reach (the heartbeat, the port file of earlier versions)
while it holds the enforcer stopped cannot make the probe pass."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufence.contract import DEFAULT_STATE_DIR, ENV_STATE_DIR, POST_START_COMMAND, PROBE_COMMAND
from gpufence.enforcer.probe import HEARTBEAT_FILE
from gpufence.enforcer.probe import clock as probe_clock
from gpufence.enforcer.report.health import HEARTBEAT_PERIOD_SECONDS, HEARTBEAT_STALE_AFTER_SECONDS
from tests.support.enforcer_harness import GpuSandbox, wait_state
from tests.support.prerequisites import needs

GIB = 1 << 30
INTERVAL = 0.1


def probe_argv() -> list[str]:
    """The kubelet's command, with this interpreter for the image's ``python3`` on PATH."""
    assert PROBE_COMMAND[0] == "python3"
    return [sys.executable, *PROBE_COMMAND[1:]]


def run_probe(state_dir: Path | None) -> subprocess.CompletedProcess[str]:
    env = {ENV_STATE_DIR: str(state_dir)} if state_dir is not None else {}
    return subprocess.run(probe_argv(), cwd="/", capture_output=True, text=True, timeout=30, env=env)


def wait_probe(state_dir: Path, passes: bool, timeout: float) -> tuple[float, str]:
    """Run the probe until it passes (or fails); the seconds that took and its last output."""
    started = time.monotonic()
    while True:
        result = run_probe(state_dir)
        if (result.returncode == 0) == passes:
            return time.monotonic() - started, result.stdout
        assert time.monotonic() - started < timeout, f"probe {result.returncode} after {timeout}s: {result.stdout}"


def test_the_probe_follows_the_running_enforcer(gpu: GpuSandbox, make_config) -> None:
    result = run_probe(gpu.state_dir)
    assert result.returncode == 1 and "has not started" in result.stdout, result.stdout
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 1 << 30}}, interval=INTERVAL))
    wait_probe(gpu.state_dir, True, 10)
    enforcer.stop()
    result = run_probe(gpu.state_dir)
    assert result.returncode == 1 and "gone" in result.stdout, result.stdout


def test_the_post_start_hook_returns_once_the_enforcer_is_up_and_not_before(gpu: GpuSandbox, make_config) -> None:
    """The hook (POST_START_COMMAND) is started before the enforcer, as the kubelet starts it right
    after the container's process: it returns 0 only after the heartbeat passes, which the
    enforcer writes after its ``started`` record (so the workload starts after enforcement)."""
    assert POST_START_COMMAND[0] == "python3"
    hook = subprocess.Popen([sys.executable, *POST_START_COMMAND[1:]], cwd="/", stdout=subprocess.PIPE, text=True,
                            env={ENV_STATE_DIR: str(gpu.state_dir)})
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            hook.wait(timeout=0.5)  # no enforcer yet: the hook keeps waiting
        enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 1 << 30}}, interval=INTERVAL), wait=False)
        assert hook.wait(timeout=30) == 0, hook.stdout.read() if hook.stdout else ""
        assert run_probe(gpu.state_dir).returncode == 0
        assert enforcer.wait_started()["event"] == "started"
    finally:
        if hook.poll() is None:
            hook.kill()
            hook.wait()


def test_the_post_start_hook_fails_with_the_reason_when_the_enforcer_never_comes_up(tmp_path: Path) -> None:
    """The kubelet then kills and restarts the sidecar, and the workload never starts."""
    code = POST_START_COMMAND[-1].replace("wait()", f"raise SystemExit(wait_until_up({str(tmp_path)!r}, timeout=0.3))")
    code = code.replace("import wait;", "import wait_until_up;")
    assert code != POST_START_COMMAND[-1]
    result = subprocess.run([sys.executable, "-I", "-c", code], cwd="/", capture_output=True, text=True, timeout=30)
    assert result.returncode == 1, result
    assert "not up within 0.3s" in result.stdout and "has not started" in result.stdout, result.stdout


def test_the_probe_without_a_state_dir_looks_where_the_webhook_mounts_it() -> None:
    """The sidecar carries no GPUFENCE_STATE_DIR: the state volume's mount is the probe's default."""
    result = run_probe(None)
    assert result.returncode == 1 and f"no heartbeat at {DEFAULT_STATE_DIR}/heartbeat" in result.stdout, result.stdout


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process of the pod took first (the network namespace is shared)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_an_enforcer_whose_port_is_taken_keeps_enforcing_and_passes_its_probe(gpu: GpuSandbox, make_config,
                                                                             held_port: int) -> None:
    hog = gpu.workload("hog")
    gpu.write(gpu.device_with(gpu.proc(hog, 1 * GIB)))
    enforcer = gpu.enforcer(make_config({"hog": {"memoryBytes": 2 * GIB}}, grace=5, interval=INTERVAL),
                            "--metrics-port", str(held_port))
    assert "metrics_port" not in enforcer.started
    failed = enforcer.events("http_failed")
    assert len(failed) == 1 and "in use" in failed[0]["error"], failed
    _, output = wait_probe(gpu.state_dir, True, 10)
    assert f"no /metrics, /healthz, /readyz: cannot serve on 127.0.0.1:{held_port}" in output, output

    gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB)))
    hog.wait_line("got SIGTERM", timeout=5)
    assert enforcer.wait_event("sigterm", 5, pid=hog.pid)["container"] == "hog"
    assert enforcer.proc.poll() is None
    assert len(enforcer.events("http_failed")) == 1, "said once"


def test_a_stopped_enforcer_fails_its_probe_within_the_bound(gpu: GpuSandbox, make_config) -> None:
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 1 << 30}}, interval=INTERVAL))
    wait_probe(gpu.state_dir, True, 10)
    os.kill(enforcer.proc.pid, signal.SIGSTOP)
    took, output = wait_probe(gpu.state_dir, False, HEARTBEAT_STALE_AFTER_SECONDS + 2)
    print(f"\nprobe failed {took:.2f}s after SIGSTOP (bound {HEARTBEAT_STALE_AFTER_SECONDS}s): {output.strip()}")
    assert "stopped" in output
    os.kill(enforcer.proc.pid, signal.SIGCONT)
    wait_probe(gpu.state_dir, True, HEARTBEAT_STALE_AFTER_SECONDS + 2)


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.fixture
def freezer_group() -> Iterator[Path]:
    """A cgroup v1 freezer group: frozen processes are not stopped (no ``T``), they just do not run."""
    group = FREEZER / f"gpufence-probe-test-{os.getpid()}"
    group.mkdir()
    try:
        yield group
    finally:
        (group / "freezer.state").write_text("THAWED")
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (FREEZER / "cgroup.procs").write_text(pid)
        group.rmdir()


@needs(os.geteuid() == 0 and (FREEZER / "cgroup.procs").exists(),
       reason="needs root and the cgroup v1 freezer to freeze the enforcer without stopping it")
def test_a_frozen_enforcer_fails_its_probe_once_its_heartbeat_outlives_the_bound(gpu: GpuSandbox, make_config,
                                                                                 freezer_group: Path) -> None:
    """Not stopped, not gone, just not running (frozen, or wedged): only the heartbeat's age tells."""
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 1 << 30}}, interval=INTERVAL))
    wait_probe(gpu.state_dir, True, 10)
    (freezer_group / "cgroup.procs").write_text(str(enforcer.proc.pid))
    (freezer_group / "freezer.state").write_text("FROZEN")
    # In the freezer group the enforcer is in another cgroup than the probe, which fails it at once;
    # what this test is about is the heartbeat's age, which the probe says once it is past the bound.
    started = time.monotonic()
    while True:
        result = run_probe(gpu.state_dir)
        assert result.returncode == 1, result.stdout
        output = result.stdout
        if "old (bound" in output:
            break
        assert time.monotonic() - started < HEARTBEAT_STALE_AFTER_SECONDS + 3, output
    took = time.monotonic() - started
    print(f"\nprobe failed {took:.2f}s after freezing (bound {HEARTBEAT_STALE_AFTER_SECONDS}s): {output.strip()}")
    assert "old (bound 5.0s)" in output, output
    # The last heartbeat came at most one period before the freeze.
    assert took >= HEARTBEAT_STALE_AFTER_SECONDS - HEARTBEAT_PERIOD_SECONDS - 0.5, took
    (freezer_group / "freezer.state").write_text("THAWED")
    # Back in the probe's cgroup (the probe passes only for an enforcer in its own cgroup).
    (FREEZER / "cgroup.procs").write_text(str(enforcer.proc.pid))
    wait_probe(gpu.state_dir, True, HEARTBEAT_STALE_AFTER_SECONDS + 2)


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_healthz() -> Iterator[int]:
    """The workload's own /healthz, answering 200 to anyone."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def other_root(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A running process with another root directory, as a workload container's process is."""
    root = tmp_path / "other-root"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", f"import os, time; os.chroot({str(root)!r}); os.chdir('/'); "
                             "print('chrooted', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "chrooted"
    yield proc
    proc.kill()
    proc.wait()


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


@needs(os.geteuid() == 0, reason="needs root to give a process another root directory (chroot)")
def test_a_workload_rewriting_what_it_can_reach_cannot_make_the_probe_pass(
        gpu: GpuSandbox, make_config, fake_healthz: int, other_root: subprocess.Popen[str]) -> None:
    """The attack on the earlier exec probe (which asked /healthz on the port recorded in the state
    directory): the workload points the record at its own /healthz and stops the enforcer. Here it
    also forges the heartbeat, with the stopped enforcer's pid or with a process of its own."""
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 1 << 30}}, interval=INTERVAL))
    wait_probe(gpu.state_dir, True, 10)
    heartbeat = gpu.state_dir / HEARTBEAT_FILE
    genuine = heartbeat.read_text()
    os.kill(enforcer.proc.pid, signal.SIGSTOP)
    wait_state(enforcer.proc.pid, lambda s: s == "T", 5)
    (gpu.state_dir / "http-port").write_text(f"{fake_healthz}\n")

    def forge(pid: int, start: int) -> str:
        fields = genuine.split("\n")[0].split()
        fields[2], fields[3], fields[5], fields[6] = "1", f"{probe_clock():.3f}", str(pid), str(start)
        heartbeat.write_text(" ".join(fields) + "\nok\n")
        return run_probe(gpu.state_dir).stdout

    for _ in range(3):  # a fresh forgery each time, as a loop in the workload would write it
        output = forge(enforcer.proc.pid, _start_time(enforcer.proc.pid))
        assert "stopped" in output, output
        output = forge(other_root.pid, _start_time(other_root.pid))
        assert "another container" in output, output
    assert run_probe(gpu.state_dir).returncode == 1

    # Continued, the enforcer's next heartbeat replaces the forgery.
    os.kill(enforcer.proc.pid, signal.SIGCONT)
    wait_probe(gpu.state_dir, True, HEARTBEAT_STALE_AFTER_SECONDS + 2)


def test_the_probe_loads_nothing_heavy_and_what_it_costs(gpu: GpuSandbox, make_config) -> None:
    """It runs every 10 s for the life of every GPU pod, in a sidecar limited to 250m of CPU."""
    code = PROBE_COMMAND[-1].replace(";run()", ";import sys; print(sorted(sys.modules))")
    assert code != PROBE_COMMAND[-1]
    loaded = set(json.loads(subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                                           check=True, cwd="/").stdout.replace("'", '"')))
    bare = set(json.loads(subprocess.run([sys.executable, "-I", "-c", "import sys; print(sorted(sys.modules))"],
                                         capture_output=True, text=True, check=True, cwd="/")
                          .stdout.replace("'", '"')))
    assert loaded - bare <= {"__future__", "gpufence", "gpufence.enforcer", "gpufence.enforcer.probe"}, loaded - bare

    gpu.enforcer(make_config({"train": {"memoryBytes": 1 << 30}}, interval=INTERVAL))
    wait_probe(gpu.state_dir, True, 10)
    runs = 20
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    for _ in range(runs):
        assert run_probe(gpu.state_dir).returncode == 0
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - started
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / runs
    print(f"\nprobe: {cpu * 1000:.1f} ms CPU and {wall / runs * 1000:.1f} ms wall per run "
          f"({cpu / 10 * 100:.2f}% of a core at one run every 10 s)")


PIDS_V1 = Path("/sys/fs/cgroup/pids")


@pytest.fixture
def other_cgroup() -> Iterator[Path]:
    """A cgroup (v1 ``pids`` hierarchy) other than the one the enforcer and the probe run in: a
    workload container's, which the probe's own cgroup (the sidecar's) is not."""
    group = PIDS_V1 / f"gpufence-probe-decoy-{os.getpid()}"
    group.mkdir()
    try:
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                group.rmdir()
                break
            except OSError:
                assert time.monotonic() < deadline, f"cannot remove {group}"
                time.sleep(0.01)


# The decoy of issue 32 row 1: chroot()s into the enforcer's root (/proc/<pid>/root), then writes a fresh
# heartbeat naming itself, live, every 0.2 s, as a loop in a root workload would.
_DECOY = """
import os, sys, time
from gpufence.enforcer.probe import heartbeat_text, own_start_time, clock
enforcer, state_dir = int(sys.argv[1]), sys.argv[2]
start = own_start_time()
os.chroot(f"/proc/{enforcer}/root")
os.chdir("/")
print("decoy up", flush=True)
while True:
    text = heartbeat_text(True, "ok", clock(), 5.0, os.getpid(), start)
    tmp = os.path.join(state_dir, ".decoy")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(state_dir, "heartbeat"))
    time.sleep(0.2)
"""


@needs(os.geteuid() == 0 and (PIDS_V1 / "cgroup.procs").exists(),
       reason="needs root (chroot) and the cgroup v1 pids hierarchy to put the decoy in another cgroup")
def test_a_decoy_in_another_cgroup_forging_a_heartbeat_for_a_stopped_enforcer_fails_the_probe(
        gpu: GpuSandbox, make_config, other_cgroup: Path) -> None:
    """Issue 32 row 1, with real processes: the decoy shares the enforcer's root directory (it chrooted
    into ``/proc/<enforcer>/root``), runs, and names itself with its real start time, so the pid,
    start time, state and root checks all pass for it; only its cgroup, which is not the probe's
    (the sidecar container's), tells it from the enforcer. Control: with the enforcer running and
    its own heartbeat, the probe passes."""
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 1 << 30}}, interval=INTERVAL))
    wait_probe(gpu.state_dir, True, 10)  # the control: the real enforcer passes
    decoy = subprocess.Popen([sys.executable, "-c", _DECOY, str(enforcer.proc.pid), str(gpu.state_dir)],
                             cwd=str(Path(__file__).resolve().parents[3]), stdout=subprocess.PIPE, text=True)
    try:
        (other_cgroup / "cgroup.procs").write_text(str(decoy.pid))
        assert decoy.stdout is not None and decoy.stdout.readline().strip() == "decoy up"
        os.kill(enforcer.proc.pid, signal.SIGSTOP)
        wait_state(enforcer.proc.pid, lambda s: s == "T", 5)
        failures = []
        deadline = time.monotonic() + HEARTBEAT_STALE_AFTER_SECONDS + 3  # past the stale bound: the decoy's stays fresh
        while time.monotonic() < deadline:
            result = run_probe(gpu.state_dir)
            assert result.returncode == 1, f"the decoy's heartbeat passed: {result.stdout}"
            failures.append(result.stdout)
        named = [f for f in failures if f"pid {decoy.pid} " in f]
        assert named, failures[-3:]
        assert all("another cgroup" in f for f in named), named[:3]
        print(f"\n{len(failures)} probes while the enforcer was stopped, all failed; {len(named)} on the decoy's "
              f"heartbeat: {named[-1].strip()}")
    finally:
        decoy.kill()
        decoy.wait()
        os.kill(enforcer.proc.pid, signal.SIGCONT)
    wait_probe(gpu.state_dir, True, HEARTBEAT_STALE_AFTER_SECONDS + 2)
    paused = enforcer.wait_event("enforcer_was_paused", 5)
    assert paused["seconds"] >= HEARTBEAT_STALE_AFTER_SECONDS, paused
    assert enforcer.metric("gpufence_enforcer_paused_seconds_total") == pytest.approx(paused["seconds"], abs=0.01)
