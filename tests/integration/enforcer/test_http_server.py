"""The enforcer's own HTTP endpoint (gpufence/enforcer/report/http_server.py) over real sockets: what
Prometheus and curl send is answered; what a neighbour container could send to hold it is bounded."""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Iterator

import pytest

from gpufence.enforcer.report import http_server
from gpufence.enforcer.report.health import Health, make_app
from gpufence.enforcer.report.http_server import answer, start_server
from gpufence.enforcer.report.metrics import EnforcerMetrics


@pytest.fixture
def port() -> Iterator[int]:
    health = Health(0.5)
    health.tick_completed()
    metrics = EnforcerMetrics("ns", "pod")
    metrics.declare_containers(["trainer"])
    server, bound = start_server(make_app(metrics, health), "127.0.0.1", 0)
    try:
        yield bound
    finally:
        server.close()


def _get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _raw(port: int, data: bytes, *, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:  # closed with our request unread: refused all the same
            pass
        return b"".join(chunks)


def test_the_three_routes_answer_like_the_framework_did(port: int) -> None:
    status, headers, body = _get(port, "/healthz")
    assert (status, body) == (200, b"ok\n") and headers["connection"] == "close"
    status, _, body = _get(port, "/readyz")
    assert status == 503 and body == b"NVML is not available\n"
    status, headers, body = _get(port, "/metrics?name[]=x")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=")
    assert b"\ngpufence_nvml_up 0.0\n" in body
    assert int(headers["content-length"]) == len(body)


def test_head_unknown_paths_and_other_methods(port: int) -> None:
    status, headers, body = _get(port, "/healthz", "HEAD")
    assert status == 200 and body == b"" and headers["content-length"] == "3"
    assert (_get(port, "/"))[0] == 404
    status, headers, _ = _get(port, "/metrics", "POST")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert (_raw(port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400 ")


def test_an_oversized_head_is_refused_and_a_silent_client_is_dropped(port: int, monkeypatch) -> None:
    big = b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * (2 * http_server.MAX_HEAD_BYTES) + b"\r\n\r\n"
    assert (_raw(port, big)).startswith(b"HTTP/1.1 431 ")
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_SECONDS", 0.3)
    started = time.monotonic()
    answer_ = _raw(port, b"GET /healthz HTTP/1.1\r\n")  # never ends its head
    assert answer_.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 5


def test_idle_connections_cannot_keep_a_request_out(port: int) -> None:
    """More connections waiting for their head than the cap: the longest-waiting are closed, and a
    client that sends its request is answered."""

    def crowd_then_ask() -> tuple[int, bytes]:
        idle = []
        try:
            for _ in range(2 * http_server.MAX_WAITING):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # a head never finished
                idle.append(sock)
            status = _get(port, "/healthz")[0]
            return status, idle[0].recv(1)
        finally:
            for sock in idle:
                sock.close()

    status, first = crowd_then_ask()
    assert status == 200
    assert first == b"", "the longest-waiting connection was not closed"


def test_answer_is_pure() -> None:
    routes = {"/x": lambda: (200, "text/plain", b"body")}
    assert answer(routes, b"GET /x HTTP/1.0\r\n\r\n").endswith(b"\r\n\r\nbody")
    assert answer(routes, b"GET /y HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    broken = {"/x": lambda: 1 // 0}
    assert answer(broken, b"GET /x HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 500 ")  # type: ignore[arg-type]
