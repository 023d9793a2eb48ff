"""The enforcer's HTTP endpoint: a few fixed GET routes on asyncio's streams, nothing else.

The sidecar runs in every GPU pod, and what it serves is three small documents (``/metrics``,
``/healthz``, ``/readyz``) to Prometheus and to people with ``curl``. A web framework costs far
more than that: importing aiohttp was over half of the enforcer's start-up CPU and about a fifth
of its resident memory, which a CPU-limited sidecar pays before its startup probe can pass. So
this is HTTP/1.1 reduced to what those clients send: one request per connection (``Connection:
close``), GET or HEAD, no body, the path without its query.

Any container of the pod can reach the port (the network namespace is shared), so the server
bounds what a client can hold: the request head must arrive within ``HEAD_TIMEOUT_SECONDS`` and
fit in ``MAX_HEAD_BYTES``, and at most ``MAX_WAITING`` connections may wait for their head at once:
a new one closes the one that has waited longest, so idle connections (a slowloris) cannot keep a
client that sends its request out. None of that touches enforcement: the kubelet's probes read
the heartbeat, not this port.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_SECONDS = 5.0
MAX_WAITING = 64

# A route answers (status, content type, body); it runs on the event loop, so it must not block.
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


class HttpServer:
    """What :func:`start_server` returns: ``await cleanup()`` stops listening and closes connections."""

    def __init__(self, server: asyncio.Server, port: int) -> None:
        self._server = server
        self.port = port

    async def cleanup(self) -> None:
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)


async def start_server(routes: Mapping[str, Route], host: str, port: int) -> tuple[HttpServer, int]:
    """Serve ``routes`` on ``host:port`` (0: any free port); returns the server and the bound port.
    OSError when the address cannot be bound."""
    waiting: dict[asyncio.StreamWriter, None] = {}  # insertion order: the longest-waiting first

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(waiting) >= MAX_WAITING:
            next(iter(waiting)).close()  # its read ends at once (EOF): the handler below returns
            waiting.pop(next(iter(waiting)))
        waiting[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_SECONDS)
            except (asyncio.LimitOverrunError, ValueError):
                response = _response(431, _TEXT, b"request head too large\n")
            except TimeoutError:
                response = _response(408, _TEXT, b"request head not received in time\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            else:
                response = answer(routes, head)
            finally:
                waiting.pop(writer, None)
            writer.write(response)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT_SECONDS)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_HEAD_BYTES)
    bound = port
    for sock in server.sockets:
        bound = int(sock.getsockname()[1])
        break
    return HttpServer(server, bound), bound
