"""The enforcer's HTTP endpoint: a few fixed GET routes on one thread with a selector, nothing else.

The sidecar runs in every GPU pod, and what it serves is three small documents (``/metrics``,
``/healthz``, ``/readyz``) to Prometheus and to people with ``curl``. A web framework costs far
more than that: importing aiohttp was over half of the enforcer's start-up CPU and about a fifth
of its resident memory, which a CPU-limited sidecar pays before its startup probe can pass. So
this is HTTP/1.1 reduced to what those clients send: one request per connection (``Connection:
close``), GET or HEAD, no body, the path without its query. It runs on a thread of its own with
the standard library's ``selectors``: leaving asyncio out cut the enforcer's start-up CPU, paid
before the workload may start (measured when it changed: CHANGELOG.md).

Any container of the pod can reach the port (the network namespace is shared), so the server
bounds what a client can hold: the request head must arrive within ``HEAD_TIMEOUT_SECONDS`` and
fit in ``MAX_HEAD_BYTES``, and at most ``MAX_WAITING`` connections may wait for their head at once:
a new one closes the one that has waited longest, so idle connections (a slowloris) cannot keep a
client that sends its request out. None of that touches enforcement: the kubelet's probes read
the heartbeat, not this port.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping

MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_SECONDS = 5.0
MAX_WAITING = 64

# A route answers (status, content type, body); it runs on the server's thread, so it must not block.
Route = Callable[[], tuple[int, str, bytes]]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"


def _response(status: int, content_type: str, body: bytes, *, head_only: bool = False,
              extra: str = "") -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


def answer(routes: Mapping[str, Route], head: bytes) -> bytes:
    """The whole response to one request head (the request line and headers, CRLF CRLF included)."""
    line = head.split(b"\r\n", 1)[0]
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return _response(400, _TEXT, b"malformed request line\n")
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    route = routes.get(target.decode("latin-1"))
    if route is None:
        return _response(404, _TEXT, b"not found\n", head_only=method == b"HEAD")
    if method not in (b"GET", b"HEAD"):
        return _response(405, _TEXT, b"only GET and HEAD\n", extra="Allow: GET, HEAD\r\n")
    try:
        status, content_type, body = route()
    except Exception as exc:  # a route's bug is the client's 500, never the server's end
        status, content_type, body = 500, _TEXT, f"{type(exc).__name__}\n".encode()
    return _response(status, content_type, body, head_only=method == b"HEAD")


class _Connection:
    __slots__ = ("deadline", "head", "out")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.head = bytearray()
        self.out = b""  # the response, once the head is complete


class HttpServer:
    """What :func:`start_server` returns: ``close()`` stops serving and closes every connection."""

    def __init__(self, routes: Mapping[str, Route], listener: socket.socket) -> None:
        self.port = int(listener.getsockname()[1])
        self._routes = routes
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._connections: dict[socket.socket, _Connection] = {}  # insertion order: the longest-waiting first
        self._wake_read, self._wake_write = socket.socketpair()
        self._thread = threading.Thread(target=self._run, name="gpufence-http", daemon=True)

    def start(self) -> None:
        for sock in (self._listener, self._wake_read):
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ)
        self._thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        self._thread.join(2)
        self._wake_write.close()

    def _run(self) -> None:
        try:
            while True:
                now = time.monotonic()
                deadline = min((c.deadline for c in self._connections.values()), default=None)
                for key, _ in self._selector.select(None if deadline is None else max(deadline - now, 0)):
                    sock = key.fileobj
                    if sock is self._wake_read:
                        return
                    try:
                        if sock is self._listener:
                            self._accept()
                        elif sock in self._connections:
                            self._serve(sock, self._connections[sock])
                    except Exception:  # one connection's trouble is that connection's end, not the server's
                        if sock is not self._listener:
                            self._drop(sock)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            for sock in [*self._connections, self._listener, self._wake_read]:
                self._drop(sock)
            self._selector.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        waiting = [s for s, c in self._connections.items() if not c.out]
        if len(waiting) >= MAX_WAITING:
            self._drop(waiting[0])  # the one that has waited longest for its head
        sock.setblocking(False)
        self._connections[sock] = _Connection(time.monotonic() + HEAD_TIMEOUT_SECONDS)
        self._selector.register(sock, selectors.EVENT_READ)

    def _serve(self, sock: socket.socket, connection: _Connection) -> None:
        if connection.out:
            self._send(sock, connection)
            return
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return
        connection.head += data
        end = connection.head.find(b"\r\n\r\n")
        if end >= 0 and end + 4 <= MAX_HEAD_BYTES:
            response = answer(self._routes, bytes(connection.head[: end + 4]))
        elif end >= 0 or len(connection.head) >= MAX_HEAD_BYTES:
            response = _response(431, _TEXT, b"request head too large\n")
        else:
            return
        self._respond(sock, connection, response)

    def _respond(self, sock: socket.socket, connection: _Connection, response: bytes) -> None:
        # With its answer set it no longer counts as waiting (_accept); a client that does not read
        # the answer gets as long again.
        connection.out, connection.deadline = response, time.monotonic() + HEAD_TIMEOUT_SECONDS
        self._selector.modify(sock, selectors.EVENT_WRITE)
        self._send(sock, connection)

    def _send(self, sock: socket.socket, connection: _Connection) -> None:
        try:
            sent = sock.send(connection.out)
        except BlockingIOError:
            return
        except OSError:
            self._drop(sock)
            return
        connection.out = connection.out[sent:]
        if not connection.out:
            self._drop(sock)

    def _expire(self, now: float) -> None:
        for sock, connection in list(self._connections.items()):
            if connection.deadline > now:
                continue
            if connection.out:
                self._drop(sock)  # it does not read its answer
            else:
                self._respond(sock, connection, _response(408, _TEXT, b"request head not received in time\n"))

    def _drop(self, sock: socket.socket) -> None:
        self._connections.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(sock)
        with contextlib.suppress(OSError):
            sock.close()


def start_server(routes: Mapping[str, Route], host: str, port: int) -> tuple[HttpServer, int]:
    """Serve ``routes`` on ``host:port`` (0: any free port) on a thread of its own; returns the
    server and the bound port. OSError when the address cannot be bound."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    listener = socket.create_server((host, port), family=family, backlog=128)
    server = HttpServer(routes, listener)
    server.start()
    return server, server.port
