"""The enforcer's Events client against a real HTTPS server: the test PKI's serving certificate, a
bearer token checked on every request, the service-account directory laid out as the kubelet
projects it, and ``EventRecorder.from_environment`` as the sidecar builds it."""

from __future__ import annotations

import email.utils
import io
import json
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import COMPONENT, EventRecorder, PodRef
from gpufence.enforcer.report.kube_events_api import EventsApi, parse_retry_after
from tests.support.tlsutil import LocalPKI, make_pki

REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float


@dataclass
class HttpsEventsApi:
    """POST /api/v1/namespaces/{ns}/events over TLS; 401 unless ``Bearer <token>``; scripted answers."""

    pki: LocalPKI
    token: str = "token-1"
    answers: list[tuple[int, dict[str, str]]] = field(default_factory=list)  # consumed in order, then 201
    seen: list[Seen] = field(default_factory=list)
    hold: threading.Event = field(default_factory=threading.Event)  # cleared: requests wait until set
    arrived: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))

    def __post_init__(self) -> None:
        self.hold.set()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.seen.append(Seen(self.path, dict(self.headers), body, time.monotonic()))
                fake.arrived.release()
                fake.hold.wait(10)
                extra: dict[str, str] = {}
                if self.headers.get("Authorization") != f"Bearer {fake.token}":
                    status = 401
                elif fake.answers:
                    status, extra = fake.answers.pop(0)
                else:
                    status = 201
                reply = ({**body, "metadata": {**body["metadata"], "name": "e1"}} if status == 201 else
                         {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                          "reason": {401: "Unauthorized", 403: "Forbidden"}.get(status, "TooManyRequests"),
                          "message": f"answered {status}"})
                data = json.dumps(reply).encode()
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.pki.volume.cert_file, self.pki.volume.key_file)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


class ServiceAccountDir:
    """token and ca.crt behind ``..data`` as the kubelet projects them; ``rotate`` swaps ``..data``."""

    def __init__(self, root: Path, token: str, ca_pem: bytes) -> None:
        self.root = root
        self.version = 0
        root.mkdir()
        self.write(token, ca_pem)
        for name in ("token", "ca.crt"):
            (root / name).symlink_to(f"..data/{name}")

    def write(self, token: str, ca_pem: bytes | None = None) -> None:
        previous = self.root / f"..v{self.version}"
        self.version += 1
        versioned = self.root / f"..v{self.version}"
        versioned.mkdir()
        (versioned / "token").write_text(token)
        (versioned / "ca.crt").write_bytes(ca_pem if ca_pem is not None else (previous / "ca.crt").read_bytes())
        (self.root / "..data_tmp").symlink_to(versioned.name)
        os.replace(self.root / "..data_tmp", self.root / "..data")


@pytest.fixture
def pki(tmp_path: Path) -> LocalPKI:
    return make_pki(tmp_path / "pki")


@pytest.fixture
def api(pki: LocalPKI) -> Iterator[HttpsEventsApi]:
    server = HttpsEventsApi(pki)
    yield server
    server.close()


@pytest.fixture
def sa(tmp_path: Path, pki: LocalPKI, api: HttpsEventsApi) -> ServiceAccountDir:
    return ServiceAccountDir(tmp_path / "serviceaccount", api.token, pki.ca.cert_pem)


@pytest.fixture
def in_cluster(monkeypatch: pytest.MonkeyPatch, api: HttpsEventsApi) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))


POD = PodRef("team", "train-0", "uid-1")


def _log() -> tuple[DecisionLog, io.StringIO]:
    stream = io.StringIO()
    return DecisionLog(namespace="team", pod="train-0", stream=stream), stream


def _events(stream: io.StringIO) -> list[str]:
    return [json.loads(line)["event"] for line in stream.getvalue().splitlines()]


def _records(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def _recorder(sa: ServiceAccountDir) -> tuple[EventRecorder, io.StringIO]:
    """As the sidecar builds it: from KUBERNETES_SERVICE_HOST/PORT and the service-account directory."""
    log, stream = _log()
    recorder = EventRecorder.from_environment(log, POD, service_account_dir=sa.root)
    assert recorder.enabled, stream.getvalue()
    return recorder, stream


def _direct(api: HttpsEventsApi, sa: ServiceAccountDir, **kwargs: Any) -> tuple[EventRecorder, io.StringIO]:
    log, stream = _log()
    client = EventsApi.in_cluster("127.0.0.1", str(api.port), sa.root)
    return EventRecorder(log, POD, client, **kwargs), stream


@pytest.mark.usefixtures("in_cluster")
def test_event_posted_with_the_body_and_headers(api: HttpsEventsApi, sa: ServiceAccountDir):
    recorder, stream = _recorder(sa)
    recorder.record("GPUMemoryOverShare", "container train over its share: SIGTERM to pid 42", action="Terminate")
    assert recorder.flush(10)
    recorder.close()
    assert (recorder.posted, recorder.failed, recorder.dropped) == (1, 0, 0)
    [seen] = api.seen
    assert seen.path == "/api/v1/namespaces/team/events"
    assert seen.headers["Authorization"] == "Bearer token-1"
    assert seen.headers["Content-Type"] == "application/json"
    host = os.uname().nodename
    body = dict(seen.body)
    stamp = body.pop("firstTimestamp")
    assert body.pop("lastTimestamp") == stamp and stamp.endswith("+00:00")
    assert body == {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": "train-0.gpufence."},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "train-0", "namespace": "team", "uid": "uid-1"},
        "reason": "GPUMemoryOverShare", "message": "container train over its share: SIGTERM to pid 42",
        "type": "Warning", "action": "Terminate",
        "source": {"component": COMPONENT, "host": host},
        "reportingComponent": COMPONENT, "reportingInstance": recorder.instance, "count": 1,
    }
    enabled = _records(stream)[0]
    assert (enabled["event"], enabled["api"]) == ("events_enabled", f"https://127.0.0.1:{api.port}")
    # Issue 32 row 9: the instance is this incarnation's (the pod's UID and a token drawn at start),
    # and its log line names it: an Event posted by anyone else carries none of the enforcer's tokens.
    assert enabled["reporting_instance"] == recorder.instance
    uid, _, token = recorder.instance.partition(".")
    assert uid == "uid-1" and len(token) == 16 and int(token, 16) >= 0
    again, _ = _recorder(sa)
    assert again.instance != recorder.instance  # per start
    again.close()


@pytest.mark.usefixtures("in_cluster")
def test_a_server_the_service_account_ca_did_not_sign_is_refused(api: HttpsEventsApi, tmp_path: Path):
    other_ca = make_pki(tmp_path / "other").ca.cert_pem
    sa = ServiceAccountDir(tmp_path / "wrong-ca", api.token, other_ca)
    recorder, stream = _recorder(sa)
    recorder.record("GPUMemoryOverShare", "never sent")
    assert recorder.flush(10)
    recorder.close()
    assert (recorder.posted, recorder.failed) == (0, 1)
    assert api.seen == []  # the handshake failed before any request
    [failure] = [r for r in _records(stream) if r["event"] == "event_post_failed"]
    assert "CERTIFICATE_VERIFY_FAILED" in failure["error"]


@pytest.mark.usefixtures("in_cluster")
def test_forbidden_turns_the_recorder_off_with_one_log_line(api: HttpsEventsApi, sa: ServiceAccountDir):
    api.answers = [(403, {})]
    recorder, stream = _recorder(sa)
    for i in range(3):
        recorder.record("GPUComputeOverShare", f"throttle {i}")
        assert recorder.flush(10)
    recorder.close()
    assert len(api.seen) == 1 and not recorder.enabled and recorder.posted == 0
    assert _events(stream) == ["events_enabled", "events_forbidden"]


@pytest.mark.usefixtures("in_cluster")
def test_too_many_requests_waits_for_retry_after_then_posts(api: HttpsEventsApi, sa: ServiceAccountDir):
    api.answers = [(429, {"Retry-After": "1"})]
    recorder, stream = _recorder(sa)
    recorder.record("GPUMemoryOverShare", "after a pause")
    assert recorder.flush(10)
    recorder.close()
    assert (recorder.posted, recorder.failed) == (1, 0)
    first, second = api.seen
    assert second.at - first.at >= 0.95  # Retry-After: 1 was respected
    assert second.body == first.body
    assert _events(stream) == ["events_enabled"]


@pytest.mark.usefixtures("in_cluster")
def test_server_errors_drop_the_event_after_a_bounded_wait_and_log_once(api: HttpsEventsApi,
                                                                        sa: ServiceAccountDir):
    api.answers = [(503, {})] * 20
    recorder, stream = _direct(api, sa, max_retry_wait=0.6)
    started = time.monotonic()
    recorder.record("GPUMemoryOverShare", "first")
    recorder.record("GPUMemoryOverShare", "second")
    assert recorder.flush(10)
    recorder.close()
    assert time.monotonic() - started < 3
    assert (recorder.posted, recorder.failed) == (0, 2)
    assert 2 <= len(api.seen) <= 6  # retried with backoff (0.5 s, 1 s ...), not hammered
    failures = [r for r in _records(stream) if r["event"] == "event_post_failed"]
    assert len(failures) == 1 and "503" in failures[0]["error"] and "dropped" in failures[0]["error"]


@pytest.mark.usefixtures("in_cluster")
def test_a_rotated_token_file_is_used_for_the_next_request(api: HttpsEventsApi, sa: ServiceAccountDir):
    recorder, _ = _recorder(sa)
    recorder.record("GPUMemoryOverShare", "with the first token")
    assert recorder.flush(10)
    api.token = "token-2"  # the API server now accepts only the rotated token
    sa.write("token-2")
    recorder.record("GPUMemoryOverShare", "with the rotated token")
    assert recorder.flush(10)
    recorder.close()
    assert [s.headers["Authorization"] for s in api.seen] == ["Bearer token-1", "Bearer token-2"]
    assert (recorder.posted, recorder.failed) == (2, 0)


@pytest.mark.usefixtures("in_cluster")
def test_a_full_queue_drops_and_counts_without_blocking(api: HttpsEventsApi, sa: ServiceAccountDir):
    recorder, _ = _direct(api, sa, queue_size=3)
    api.hold.clear()
    recorder.record("GPUMemoryOverShare", "in flight")
    assert api.arrived.acquire(timeout=10)  # the thread is inside its request: the queue is empty
    started = time.monotonic()
    for i in range(8):
        recorder.record("GPUMemoryOverShare", f"queued or dropped {i}")
    # A record() that blocked would wait for the held request, released only below: any bound
    # shows it does not, and a wide one holds on a busy machine.
    assert time.monotonic() - started < 5
    assert recorder.dropped == 5
    api.hold.set()
    assert recorder.flush(10)
    recorder.close()
    assert recorder.posted == 4 and len(api.seen) == 4


def test_off_with_one_line_without_service_account_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    log, stream = _log()
    recorder = EventRecorder.from_environment(log, POD, service_account_dir=tmp_path / "absent")
    recorder.record("GPUMemoryOverShare", "ignored")
    assert not recorder.enabled
    [record] = _records(stream)
    assert record["event"] == "events_disabled" and str(tmp_path / "absent" / "token") in record["reason"]


def test_the_enforcer_never_imports_the_kubernetes_client(tmp_path: Path, pki: LocalPKI):
    """Every enforcer module, and a recorder built in a cluster, leave ``kubernetes`` unloaded."""
    sa = ServiceAccountDir(tmp_path / "serviceaccount", "token-1", pki.ca.cert_pem)
    script = """
import io, pkgutil, importlib, sys
from pathlib import Path
import gpufence.enforcer
for module in pkgutil.walk_packages(gpufence.enforcer.__path__, "gpufence.enforcer."):
    if module.name.endswith("__main__"):  # runs the CLI
        continue
    importlib.import_module(module.name)
from gpufence.enforcer.report.events import EventRecorder, PodRef
from gpufence.enforcer.report.decision_log import DecisionLog
log = DecisionLog(stream=io.StringIO())
recorder = EventRecorder.from_environment(log, PodRef("team", "train-0", None), service_account_dir=Path(sys.argv[1]))
assert recorder.enabled, log
recorder.close()
loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("kubernetes", "urllib3", "yaml"))
print(loaded)
"""
    env = {**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script, str(sa.root)], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(("header", "seconds"), [
    ("3", 3.0), (" 0 ", 0.0), (None, None), ("soon", None), ("Wed, 21 Oct 2015 07:28:00", None),  # no zone
])
def test_retry_after_header_forms(header: str | None, seconds: float | None):
    assert parse_retry_after(header) == seconds


def test_retry_after_as_an_http_date():
    in_five = email.utils.formatdate(time.time() + 5, usegmt=True)
    assert 3 <= parse_retry_after(in_five) <= 5  # type: ignore[operator]
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: no wait


def test_decisions_on_what_no_container_can_be_charged_for_and_on_evasion_are_events(
    api: HttpsEventsApi, sa: ServiceAccountDir, tmp_path: Path,
):
    """The pod's GPU count and compute budget held against unattributed processes, and a throttle
    evaded with SIGCONT: each decision reaches the API server as an Event saying why (the real
    recorder, the real terminator signalling real processes)."""
    from gpufence.contract import ContainerShare, EnforcerConfig, Mode
    from gpufence.enforcer.act.signals import SafeSignaller, SignalTarget
    from gpufence.enforcer.act.stopped_state import StoppedState
    from gpufence.enforcer.act.terminate import Terminator
    from gpufence.enforcer.act.throttle import ThrottleExecutor
    from gpufence.enforcer.decide.machine import Core, ThrottleChange, Transition
    from gpufence.enforcer.decide.rules import UNATTRIBUTED, Evasion
    from gpufence.enforcer.facts import Attribution, PodProcess
    from gpufence.enforcer.observe.procfs import read_start_time
    from gpufence.enforcer.report.metrics import EnforcerMetrics
    from gpufence.enforcer.report.reporter import Reporter
    from tests.support.enforcer_harness import WORKLOAD

    plain = tmp_path / "device"
    plain.touch()
    children = [subprocess.Popen([sys.executable, str(WORKLOAD), str(plain)], stdout=subprocess.PIPE, text=True)
                for _ in range(2)]
    try:
        for c in children:
            assert c.stdout is not None and c.stdout.readline().startswith("ready")
        train, stray = (PodProcess(c.pid, c.pid, read_start_time(c.pid) or 0, name, device, f"GPU-{device}", 1 << 30,
                                   100) for c, name, device in zip(children, ("train", None), (0, 1), strict=True))
        recorder, _ = _direct(api, sa)
        log = DecisionLog(stream=io.StringIO())
        metrics = EnforcerMetrics("team", "train-0")
        door = SafeSignaller(log)
        throttle = ThrottleExecutor(door, StoppedState(tmp_path, log), log)
        terminator = Terminator(door, throttle, log, metrics, recorder)
        core = Core(EnforcerConfig(containers={"train": ContainerShare(compute_percent=20, gpus=1)}))
        attribution = Attribution((train, stray), ())
        door.authorize(SignalTarget.of(p) for p in attribution.processes)

        over_count = core.step(0.0, attribution, {0: 80 << 30, 1: 80 << 30})
        terminator.enforce(over_count, attribution, Mode.ENFORCE, 5.0)
        evaded = core.step(0.1, attribution, {0: 80 << 30, 1: 80 << 30},
                           evasions=[Evasion("train", train.pid, train.start_time_ticks, "R", 2)])
        terminator.enforce(evaded, attribution, Mode.ENFORCE, 5.0)
        Reporter(log, metrics, recorder).throttle(
            ThrottleChange(UNATTRIBUTED, Transition.START, 0.2, 0.2, 1.0, 1.0), Mode.ENFORCE, [stray.pid])
        for c in children:
            assert c.wait(5) == 0  # its SIGTERM handler exits 0
        assert recorder.flush(10)
        recorder.close()
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
            c.wait(5)
    by_reason = {seen.body["reason"]: seen.body["message"] for seen in api.seen}
    assert set(by_reason) == {"GPUDevicesOverRequest", "GPUThrottleEvaded", "GPUPodComputeOverBudget"}
    assert f"unattributed pid {stray.pid}" in by_reason["GPUDevicesOverRequest"]
    assert "more than the 1 it" in by_reason["GPUDevicesOverRequest"]
    assert "container train" in by_reason["GPUThrottleEvaded"] and "SIGCONT" in by_reason["GPUThrottleEvaded"]
    assert f"[{train.pid}]" in by_reason["GPUThrottleEvaded"]
    assert "compute budget 20%" in by_reason["GPUPodComputeOverBudget"]


def test_a_driver_limit_asked_for_and_absent_is_an_event_once(api: HttpsEventsApi, sa: ServiceAccountDir,
                                                               tmp_path: Path):
    """A container whose environment asks for a driver memory limit (NVIDIA_GPU_MEMORY_LIMIT, which
    the toolkit's hook applies) on a driver without the limit calls: one Warning Event, with why."""
    from gpufence.enforcer.decide.memory_mechanism import enforcement_by_container
    from gpufence.enforcer.decide.rules import ContainerDeviceUsage
    from gpufence.enforcer.facts import HINT_VARIABLES, DriverLimit, DriverLimitState, DriverReading
    from gpufence.enforcer.observe.procfs import read_environ
    from gpufence.enforcer.report.driver_limits import DriverLimits
    from gpufence.enforcer.report.metrics import EnforcerMetrics
    from tests.support.enforcer_harness import WORKLOAD

    plain = tmp_path / "device"
    plain.touch()
    env = {**os.environ, "NVIDIA_GPU_MEMORY_LIMIT": "2048", "NVIDIA_GPU_MEMORY_REQUEST": "2048"}
    child = subprocess.Popen([sys.executable, str(WORKLOAD), str(plain)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().startswith("ready")
        recorder, _ = _direct(api, sa)
        log, stream = _log()
        limits = DriverLimits(log, EnforcerMetrics("team", "train-0"), recorder)
        ns = "/sys/fs/cgroup/kubepods/pod1/train"
        reading = DriverReading(
            namespaces={("train", 0): ns},
            limits={("train", 0): DriverLimit(DriverLimitState.NO_CALL, error="FUNCTION_NOT_FOUND")},
            cgroups={"train": ns}, environ={"train": read_environ(child.pid, HINT_VARIABLES)},
        )
        usage = (ContainerDeviceUsage("train", 0, "GPU-0", 1 << 30, 2 << 30, ()),)
        for _ in range(3):  # every poll: one Event, one log line
            limits.report(enforcement_by_container(reading, usage), ())
        assert recorder.flush(10)
        recorder.close()
    finally:
        child.kill()
        child.wait(5)
    assert [seen.body["reason"] for seen in api.seen] == ["GPUDriverMemoryLimitMissing"]
    message = api.seen[0].body["message"]
    assert "container train" in message and "older than R615" in message, message
    assert api.seen[0].body["type"] == "Warning"
    assert [r["mechanism"] for r in _records(stream) if r["event"] == "memory_enforcement"] == ["polling"]


def test_an_ineffective_throttle_is_an_event(api: HttpsEventsApi, sa: ServiceAccountDir, tmp_path: Path):
    """Issue 32 row 6: SM use that stays over the share while the throttle holds the process at its
    minimum run fraction ends in termination, and the Event says why (the real recorder and
    terminator, a real process)."""
    from gpufence.contract import ContainerShare, EnforcerConfig, Mode
    from gpufence.enforcer.act.signals import SafeSignaller, SignalTarget
    from gpufence.enforcer.act.stopped_state import StoppedState
    from gpufence.enforcer.act.terminate import Terminator
    from gpufence.enforcer.act.throttle import ThrottleExecutor
    from gpufence.enforcer.decide.machine import Core
    from gpufence.enforcer.facts import Attribution, PodProcess
    from gpufence.enforcer.observe.procfs import read_start_time
    from gpufence.enforcer.report.metrics import EnforcerMetrics
    from tests.support.enforcer_harness import WORKLOAD

    plain = tmp_path / "device"
    plain.touch()
    child = subprocess.Popen([sys.executable, str(WORKLOAD), str(plain)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().startswith("ready")
        train = PodProcess(child.pid, child.pid, read_start_time(child.pid) or 0, "train", 0, "GPU-0", 1 << 30, 100)
        recorder, _ = _direct(api, sa)
        log = DecisionLog(stream=io.StringIO())
        metrics = EnforcerMetrics("team", "train-0")
        door = SafeSignaller(log)
        throttle = ThrottleExecutor(door, StoppedState(tmp_path, log), log)
        terminator = Terminator(door, throttle, log, metrics, recorder)
        core = Core(EnforcerConfig(containers={"train": ContainerShare(compute_percent=20)}),
                    compute_window_seconds=1.0, compute_period_seconds=0.5, compute_ineffective_seconds=2.0)
        attribution = Attribution((train,), ())
        door.authorize(SignalTarget.of(p) for p in attribution.processes)
        now = 0.0
        while not (decisions := core.step(now, attribution, {0: 80 << 30})).orders:
            now += 0.1
            assert now < 10, "never judged ineffective"
        terminator.enforce(decisions, attribution, Mode.ENFORCE, 5.0)
        assert child.wait(5) == 0  # its SIGTERM handler exits 0
        assert recorder.flush(10)
        recorder.close()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(5)
    [seen] = api.seen
    assert seen.body["reason"] == "GPUThrottleIneffective" and seen.body["type"] == "Warning"
    message = seen.body["message"]
    assert "container train" in message and "100% over its compute share of 20%" in message, message
    assert f"SIGTERM to pids [{child.pid}]" in message
