"""Enforcer faults not covered by the other tests/integration/enforcer tests: the log reader gone (stdout closed),
the metrics port flooded with stalled clients, and many GPU processes, while a container goes over
its memory share. In each case the SIGTERM must still come within a few poll intervals.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.support.enforcer_harness import REPO_ROOT, wait_enforcer_polls

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30
INTERVAL = 0.1


def _config() -> dict:
    return {"version": 1, "mode": "enforce", "gracePeriodSeconds": 0.5, "pollIntervalSeconds": INTERVAL,
            "containers": {"hog": {"memoryBytes": 2 * GIB}, "calm": {"memoryBytes": 2 * GIB}}}


def test_enforcing_goes_on_when_stdout_is_closed(gpu):
    """Nobody reads the decision log any more (pipe closed): writes fail with EPIPE; enforcement continues."""
    hog, calm = gpu.workload("hog"), gpu.workload("calm")
    gpu.write(gpu.device_with(gpu.proc(hog, GIB), gpu.proc(calm, GIB)))
    env = gpu.env()
    env["GPUFENCE_CONFIG"] = json.dumps(_config())
    argv = [sys.executable, "-m", "gpufence.enforcer", "--metrics-port", "0", "--bind-address", "127.0.0.1",
            "--nvidia-device-prefix", gpu.device_prefix, "--state-dir", str(gpu.state_dir)]
    proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "enforcer exited before starting"
            started = json.loads(line)
            if started.get("event") == "started":
                break
        assert started.get("event") == "started", "no started event within 20 s"
        port = started["metrics_port"]
        wait_enforcer_polls(port, 3)
        proc.stdout.close()  # the log reader is gone
        wait_enforcer_polls(port, 3)
        over_at = time.monotonic()
        gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB), gpu.proc(calm, GIB)))
        hog.wait_line("got SIGTERM", timeout=INTERVAL + 3)
        assert time.monotonic() - over_at < INTERVAL + 3
        assert proc.poll() is None, "the enforcer died with its log reader"
        assert calm.alive() and not calm.said("got SIGTERM")
    finally:
        if proc.poll() is None:
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.poll() is None:
            proc.kill()


def test_stalled_metrics_clients_do_not_delay_enforcement(gpu):
    hog, calm = gpu.workload("hog"), gpu.workload("calm")
    gpu.write(gpu.device_with(gpu.proc(hog, GIB), gpu.proc(calm, GIB)))
    enforcer = gpu.enforcer(_config())
    socks = []
    try:
        for i in range(200):  # half requests, idle connections: a slowloris on the metrics port
            s = socket.create_connection(("127.0.0.1", enforcer.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GE")
            socks.append(s)
        over_at = time.monotonic()
        gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB), gpu.proc(calm, GIB)))
        hog.wait_line("got SIGTERM", timeout=INTERVAL + 3)
        assert time.monotonic() - over_at < INTERVAL + 3
        # The metrics endpoint itself still answers other clients.
        status, _ = enforcer.http("/healthz")
        assert status == 200
    finally:
        for s in socks:
            s.close()
    assert calm.alive() and not calm.said("got SIGTERM")


def test_many_gpu_processes_then_one_over_share(gpu, tmp_path):
    """255 attributed processes of a container under its share plus another container's one
    process that grows: only that container (its one process) is signalled."""
    fd = os.open(gpu.device, os.O_RDONLY)
    crowd = []
    try:
        for _ in range(255):
            # All in the neighbour container: the hog container is terminated as a whole.
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GPUFENCE_CONTAINER": "calm"}
            crowd.append(subprocess.Popen(["sleep", "120"], pass_fds=(fd,), env=env))
        hog = gpu.workload("hog")
        base = tuple(gpu.proc(p.pid, 1 << 20) for p in crowd)
        gpu.write(gpu.device_with(*base, gpu.proc(hog, GIB)))
        enforcer = gpu.enforcer(_config())
        enforcer.wait_polls(3)
        over_at = time.monotonic()
        gpu.write(gpu.device_with(*base, gpu.proc(hog, 3 * GIB)))
        hog.wait_line("got SIGTERM", timeout=INTERVAL + 3)
        assert time.monotonic() - over_at < INTERVAL + 3
        enforcer.wait_event("sigterm", 5, pid=hog.pid)  # its log line, read on a thread, may lag the signal
        enforcer.wait_polls(3)  # a few more decisions: none of them may touch the crowd
        assert all(p.poll() is None for p in crowd)
        signalled = {r["pid"] for r in enforcer.events("sigterm")} | {r["pid"] for r in enforcer.events("sigkill")}
        assert signalled == {hog.pid}
        assert enforcer.events("poll_error") == []
    finally:
        os.close(fd)
        for p in crowd:
            p.kill()
        for p in crowd:
            p.wait()
