"""The enforcer's runtime edges: Kubernetes Events (against a tiny fake API server, with the real
``kubernetes`` client), the HTTP endpoints and metric names, ``--simulate``."""

from __future__ import annotations

import io
import json
import pathlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import EventRecorder, PodRef

GIB = 1 << 30


class FakeEventsApi:
    """Answers POST /api/v1/namespaces/{ns}/events with a fixed status; records the bodies."""

    def __init__(self, status: int = 201, delay: float = 0.0) -> None:
        self.status = status
        self.delay = delay
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append((self.path, body))
                time.sleep(fake.delay)
                if fake.status == 201:
                    reply = {**body, "metadata": {**body["metadata"], "name": "e1", "namespace": "team"}}
                else:
                    reply = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": fake.status,
                             "reason": "Forbidden", "message": "events is forbidden"}
                data = json.dumps(reply).encode()
                self.send_response(fake.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def client(self) -> Any:
        from kubernetes import client

        configuration = client.Configuration(host=f"http://127.0.0.1:{self.server.server_port}")
        return client.ApiClient(configuration)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_api():
    apis: list[FakeEventsApi] = []

    def make(**kwargs: Any) -> FakeEventsApi:
        api = FakeEventsApi(**kwargs)
        apis.append(api)
        return api

    yield make
    for api in apis:
        api.close()


def _log() -> tuple[DecisionLog, io.StringIO]:
    stream = io.StringIO()
    return DecisionLog(namespace="team", pod="train-0", stream=stream), stream


def _records(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_event_posted_on_the_pod(fake_api):
    api = fake_api()
    log, _ = _log()
    recorder = EventRecorder(log, PodRef("team", "train-0", "uid-1"), api.client(), host="node-a")
    recorder.record("GPUMemoryOverShare", "container train over its share: SIGTERM to pid 42", action="Terminate")
    assert recorder.flush(10)
    recorder.close()
    assert recorder.posted == 1
    [(path, body)] = api.bodies
    assert path == "/api/v1/namespaces/team/events"
    assert body["involvedObject"] == {
        "apiVersion": "v1", "kind": "Pod", "name": "train-0", "namespace": "team", "uid": "uid-1"
    }
    assert body["reason"] == "GPUMemoryOverShare" and body["type"] == "Warning"
    assert body["metadata"]["generateName"] == "train-0.gpufence."
    assert body["source"] == {"component": "gpufence-enforcer", "host": "node-a"}


def test_forbidden_is_logged_once_then_events_are_skipped(fake_api):
    api = fake_api(status=403)
    log, stream = _log()
    recorder = EventRecorder(log, PodRef("team", "train-0", None), api.client())
    for i in range(3):
        recorder.record("GPUComputeOverShare", f"throttle {i}")
        assert recorder.flush(10)
    recorder.close()
    assert len(api.bodies) == 1  # after the 403, nothing more is sent
    assert not recorder.enabled
    assert [r["event"] for r in _records(stream)] == ["events_forbidden"]


def test_record_never_blocks_and_the_queue_is_bounded(fake_api):
    api = fake_api(delay=0.3)
    log, _ = _log()
    recorder = EventRecorder(log, PodRef("team", "train-0", None), api.client(), queue_size=2)
    started = time.monotonic()
    for i in range(50):
        recorder.record("GPUMemoryOverShare", f"kill {i}")
    assert time.monotonic() - started < 1.0  # a slow API server never holds up the caller
    assert recorder.dropped >= 45
    recorder.close(timeout=0.01)


def test_off_outside_a_cluster(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    log, stream = _log()
    recorder = EventRecorder.from_environment(log, PodRef("team", "train-0", None))
    recorder.record("GPUMemoryOverShare", "ignored")
    assert not recorder.enabled
    assert [r["event"] for r in _records(stream)] == ["events_disabled"]


def test_http_endpoints_and_metric_names(gpu, make_config):
    hog = gpu.workload("train")
    gpu.write(gpu.device_with(gpu.proc(hog, GIB, sm=40), uuid="GPU-abc"))
    config = make_config({"train": {"memoryPercent": 50, "computePercent": 60}}, interval=0.1)
    enforcer = gpu.enforcer(config, env={"GPUFENCE_POD_NAME": "train-0", "GPUFENCE_POD_NAMESPACE": "team"})
    started = enforcer.started
    assert started["pod"] == "train-0" and started["namespace"] == "team"
    assert isinstance(started["metrics_port"], int) and started["metrics_port"] > 0
    enforcer.wait_ready()
    # Liveness first, then the mechanism holding each container's memory share (no driver limit here).
    assert enforcer.http("/healthz") == (200, "ok\nmemory train: polling\n")
    labels = {"namespace": "team", "pod": "train-0", "container": "train", "UUID": "GPU-abc", "gpu": "0"}
    assert enforcer.metric("gpufence_container_gpu_memory_used_bytes", **labels) == GIB
    assert enforcer.metric("gpufence_container_gpu_memory_limit_bytes", **labels) == 40 * GIB
    assert enforcer.metric("gpufence_container_sm_utilization_ratio", **labels) == pytest.approx(0.4)
    assert enforcer.metric("gpufence_container_compute_share_ratio", container="train") == pytest.approx(0.6)
    assert enforcer.metric("gpufence_nvml_up") == 1
    assert enforcer.metric("gpufence_last_successful_poll_timestamp_seconds") > time.time() - 5
    assert enforcer.metric("gpufence_poll_duration_seconds_count") >= 1
    _, text = enforcer.http("/metrics")
    for name in ("gpufence_enforcement_actions_total", "gpufence_nvml_errors_total", "gpufence_container_throttled"):
        assert f"# TYPE {name.removesuffix('_total')}" in text
    for line in enforcer.out.snapshot():
        record = json.loads(line)  # every stdout line is one JSON object
        assert {"time", "level", "event"} <= set(record) and record["time"].endswith("Z")
    # Each thread carries its name in the kernel too (top -H, ps -L, make bench-node's split).
    tasks = pathlib.Path(f"/proc/{enforcer.proc.pid}/task")
    names = {(task / "comm").read_text().strip() for task in tasks.iterdir()}
    assert {"poll", "heartbeat", "nvml", "http", "throttle"} <= names, names
    assert enforcer.stop() == 0


def test_simulate_flag(gpu, make_config):
    """--simulate builds the simulated library itself and points it at the state file: no
    LD_LIBRARY_PATH needed."""
    hog = gpu.workload("hog")
    gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB)))
    env = {"LD_LIBRARY_PATH": "", "GPUFENCE_SIM_STATE": ""}
    enforcer = gpu.enforcer(
        make_config({"hog": {"memoryBytes": 2 * GIB}}, grace=2, interval=0.1),
        "--simulate", str(gpu.state_path), env=env,
    )
    assert enforcer.started["driver_version"]
    hog.wait_line("got SIGTERM", 5)
    assert enforcer.stop() == 0


def test_a_share_in_two_units_is_the_smaller_and_says_so(gpu, make_config):
    """10Gi asked under a 25% ceiling on a 16 GiB GPU: the limit is 4 GiB, from the percentage;
    the log says the share has two units and the metric which one is the limit here."""
    hog = gpu.workload("train", ignore_term=True)  # alive through the grace period: its series stay
    gpu.write(gpu.device_with(gpu.proc(hog, 5 * GIB), uuid="GPU-abc", total=16 * GIB))
    config = make_config({"train": {"memoryBytes": 10 * GIB, "memoryPercent": 25}}, grace=30, interval=0.1)
    enforcer = gpu.enforcer(config, env={"GPUFENCE_POD_NAME": "train-0", "GPUFENCE_POD_NAMESPACE": "team"})
    said = enforcer.wait_event("memory_share_two_units", 5)
    assert said["container"] == "train" and said["share_bytes"] == 10 * GIB and said["share_percent"] == 25
    hog.wait_line("got SIGTERM", 5)  # 5 GiB is under 10 GiB but over 25% of 16 GiB
    enforcer.wait_polls(1)  # a poll reports what it saw after acting on it
    labels = {"namespace": "team", "pod": "train-0", "container": "train", "UUID": "GPU-abc", "gpu": "0"}
    assert enforcer.metric("gpufence_container_gpu_memory_limit_bytes", **labels) == 4 * GIB
    assert enforcer.metric("gpufence_container_gpu_memory_limit_from_percent", **labels) == 1
    assert enforcer.stop() == 0


def test_a_container_on_more_gpus_than_it_requested_is_terminated(gpu, make_config):
    """gpus=1 in the config, processes on two GPUs (NVIDIA_VISIBLE_DEVICES=all from envFrom would do
    that): the container is terminated, the log and metrics name the GPUs, a steady one is untouched."""
    wide = gpu.workload("wide")
    steady = gpu.workload("steady")
    gpu.write(gpu.device_with(gpu.proc(wide, GIB), gpu.proc(steady, GIB), uuid="GPU-0"),
              gpu.device_with(gpu.proc(wide, GIB), uuid="GPU-1"))
    config = make_config({"wide": {"gpus": 1}, "steady": {"gpus": 1}}, grace=5, interval=0.1)
    enforcer = gpu.enforcer(config, env={"GPUFENCE_POD_NAME": "train-0", "GPUFENCE_POD_NAMESPACE": "team"})
    said = enforcer.wait_event("gpus_over_request", 5)
    assert said["container"] == "wide" and said["gpus_requested"] == 1 and said["gpus_used"] == [0, 1]
    wide.wait_line("got SIGTERM", 5)
    # The workload can print before the tick that signalled it has counted the action; the next
    # completed poll comes after that count.
    enforcer.wait_polls(1)
    assert enforcer.metric("gpufence_enforcement_actions_total", container="wide", action="sigterm",
                           resource="gpus") == 1
    assert enforcer.metric("gpufence_enforcement_actions_total", container="steady", action="sigterm",
                           resource="gpus") == 0
    assert steady.proc.poll() is None
    assert enforcer.stop() == 0
