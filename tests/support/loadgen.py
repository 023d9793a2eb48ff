"""HTTPS load generator for the webhook benchmarks and the soak test: open model (fixed arrival
rate) or closed loop.

    python -m tests.support.loadgen --port P --ca CA.crt (--body FILE ... | --mixed)
                                    (--rate R | --closed N) [--duration S] [--warmup S] [--connections N]
                                    [--reconnect-every K] [--timeout S] [--path /mutate]

Prints one JSON object (the result) on the last line of stdout.

* Open model (``--rate R``): request i is *scheduled* at ``t0 + i/R`` whatever happened before,
  and its latency is measured from that scheduled time, not from when a connection became free,
  so a slow server shows up as latency instead of silently lowering the offered load (no
  coordinated omission). Requests wait for one of ``--connections`` keep-alive connections.
  ``max_lag_ms`` reports how late the generator itself ran behind its schedule.
* Closed loop (``--closed N``): N connections each send the next request as soon as the previous
  answer arrived: saturation throughput.

The client is a minimal HTTP/1.1 protocol over asyncio TLS (verifying the server against
``--ca``, hostname ``localhost``) with pre-built request bytes: much cheaper per request than a
general-purpose client, so that on a small machine the generator is not the bottleneck.
``--reconnect-every K`` closes each connection after K requests (new TLS handshakes: certificate
rotation tests); the serial numbers of the certificates seen at handshakes are reported.
Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.sample_pods import mixed_bodies
from tests.support.stats import percentile


class HttpError(Exception):
    pass


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request in flight at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.closed = False
        self.must_close = False
        self.used = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionResetError(f"connection closed by the server: {exc}"))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None or self.waiter.done():
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        try:
            status = int(head[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            self.waiter.set_exception(HttpError(f"bad status line {head[0]!r}"))
            return
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            lname = name.strip().lower()
            if lname == "content-length":
                length = int(value.strip())
            elif lname == "connection" and value.strip().lower() == "close":
                self.must_close = True
            elif lname == "transfer-encoding":
                self.waiter.set_exception(HttpError("chunked answers are not supported by this client"))
                return
        total = end + 4 + length
        if len(self.buf) < total:
            return
        body = bytes(self.buf[end + 4:total])
        del self.buf[:total]
        self.waiter.set_result((status, body))

    async def request(self, data: bytes, timeout: float) -> tuple[int, bytes]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        self.used += 1
        try:
            async with asyncio.timeout(timeout):
                return await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


@dataclass
class Stats:
    started: float = 0.0
    window_start: float = 0.0
    window_end: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    handshakes: int = 0
    handshake_failures: int = 0
    serials: collections.Counter[str] = field(default_factory=collections.Counter)
    sent: int = 0
    max_lag: float = 0.0


class Client:
    def __init__(self, port: int, ctx: ssl.SSLContext, stats: Stats, *, host: str = "127.0.0.1",
                 server_hostname: str = "localhost", reconnect_every: int = 0, timeout: float = 10.0) -> None:
        self.port, self.ctx, self.stats, self.host = port, ctx, stats, host
        self.server_hostname = server_hostname
        self.reconnect_every = reconnect_every
        self.timeout = timeout

    async def connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        self.stats.handshakes += 1
        try:
            async with asyncio.timeout(self.timeout):
                transport, conn = await loop.create_connection(
                    _Conn, self.host, self.port, ssl=self.ctx, server_hostname=self.server_hostname)
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            self.stats.handshake_failures += 1
            self.stats.errors[f"handshake: {type(exc).__name__}: {exc}"[:160]] += 1
            raise
        ssl_object = transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if der:
            from cryptography import x509

            self.stats.serials[format(x509.load_der_x509_certificate(der).serial_number, "x")] += 1
        return conn

    async def send(self, conn: _Conn | None, data: bytes, kind: str, scheduled: float,
                   record: bool) -> _Conn | None:
        """One request on ``conn`` (connecting first if needed); returns the connection to reuse."""
        try:
            if conn is None or conn.closed:
                conn = await self.connect()
            status, _ = await conn.request(data, self.timeout)
        except (OSError, ssl.SSLError, TimeoutError, HttpError) as exc:
            if record:
                self.stats.errors[f"{type(exc).__name__}: {exc}"[:160]] += 1
            if conn is not None:
                conn.close()
            return None
        done = time.perf_counter()
        if record:
            self.stats.latencies.append(done - scheduled)
            self.stats.statuses[str(status)] += 1
            self.stats.kinds[f"{kind} {status}"] += 1
            self.stats.window_end = max(self.stats.window_end, done)
        if conn.must_close or (self.reconnect_every and conn.used >= self.reconnect_every):
            conn.close()
            return None
        return conn


def build_requests(bodies: list[tuple[str, bytes]], path: str) -> list[tuple[str, bytes]]:
    return [(kind, (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nAccept: application/json\r\n\r\n").encode() + body)
            for kind, body in bodies]


async def open_model(client: Client, requests: list[tuple[str, bytes]], rate: float, duration: float,
                     warmup: float, connections: int) -> None:
    stats = client.stats
    pool: asyncio.Queue[_Conn | None] = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(None)  # connect lazily, inside the measured request's own latency
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int, scheduled: float, record: bool) -> None:
        conn = await pool.get()
        kind, data = requests[i % len(requests)]
        try:
            conn = await client.send(conn, data, kind, scheduled, record)
        finally:
            pool.put_nowait(conn)

    total = int((warmup + duration) * rate)
    t0 = time.perf_counter() + 0.05
    stats.started = t0
    stats.window_start = t0 + warmup
    i = 0
    while i < total:
        now = time.perf_counter()
        while i < total and t0 + i / rate <= now:
            scheduled = t0 + i / rate
            stats.max_lag = max(stats.max_lag, now - scheduled)
            record = scheduled >= stats.window_start
            stats.sent += record
            task = asyncio.create_task(one(i, scheduled, record))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if i < total:
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
    if tasks:
        await asyncio.wait(tasks, timeout=client.timeout + 5)
    stats.window_end = max(stats.window_end, t0 + warmup + duration)
    while not pool.empty():
        conn = pool.get_nowait()
        if conn is not None:
            conn.close()


async def closed_loop(client: Client, requests: list[tuple[str, bytes]], duration: float, warmup: float,
                      connections: int) -> None:
    stats = client.stats
    t0 = time.perf_counter()
    stats.started = t0
    stats.window_start = t0 + warmup
    deadline = stats.window_start + duration

    async def worker(w: int) -> None:
        conn: _Conn | None = None
        i = w
        while True:
            now = time.perf_counter()
            if now >= deadline:
                break
            record = now >= stats.window_start
            stats.sent += record
            kind, data = requests[i % len(requests)]
            conn = await client.send(conn, data, kind, now, record)
            i += connections
        if conn is not None:
            conn.close()

    await asyncio.gather(*(worker(w) for w in range(connections)))
    stats.window_end = deadline


def summarize(stats: Stats, mode: str, **extra: Any) -> dict[str, Any]:
    window = max(stats.window_end - stats.window_start, 1e-9)
    lat = [x * 1000 for x in stats.latencies]
    ok = sum(n for s, n in stats.statuses.items() if s.startswith("2"))
    return {
        "mode": mode, **extra,
        "sent": stats.sent, "completed": len(lat), "ok": ok,
        "failed": stats.sent - len(lat),
        "status_5xx": sum(n for s, n in stats.statuses.items() if s.startswith("5")),
        "statuses": dict(stats.statuses), "kinds": dict(stats.kinds), "errors": dict(stats.errors),
        "handshakes": stats.handshakes, "handshake_failures": stats.handshake_failures,
        "serials": dict(stats.serials),
        "window_s": round(window, 3), "rps": len(lat) / window,
        "p50_ms": percentile(lat, 50), "p90_ms": percentile(lat, 90), "p99_ms": percentile(lat, 99),
        "max_ms": max(lat) if lat else float("nan"), "max_lag_ms": stats.max_lag * 1000,
    }


async def run(port: int, ca_file: str | Path, bodies: list[tuple[str, bytes]], *, rate: float | None = None,
              closed: int | None = None, duration: float = 10.0, warmup: float = 1.0, connections: int = 8,
              reconnect_every: int = 0, timeout: float = 10.0, path: str = "/mutate") -> dict[str, Any]:
    """In-process entry point (tests use it); exactly one of ``rate`` and ``closed``."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    stats = Stats()
    client = Client(port, ctx, stats, reconnect_every=reconnect_every, timeout=timeout)
    requests = build_requests(bodies, path)
    if rate is not None:
        await open_model(client, requests, rate, duration, warmup, connections)
        return summarize(stats, "open", rate=rate, connections=connections, duration=duration)
    assert closed is not None
    await closed_loop(client, requests, duration, warmup, closed)
    return summarize(stats, "closed", connections=closed, duration=duration)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ca", required=True)
    parser.add_argument("--body", action="append", default=[], help="request body file (repeatable: cycled)")
    parser.add_argument("--mixed", action="store_true", help="mixed valid/invalid reviews (tests.support.sample_pods)")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--rate", type=float, help="open model: requests per second")
    group.add_argument("--closed", type=int, metavar="N", help="closed loop over N connections")
    parser.add_argument("--connections", type=int, default=8, help="open model: keep-alive connections")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--reconnect-every", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--path", default="/mutate")
    args = parser.parse_args(argv)
    bodies = [(Path(b).name, Path(b).read_bytes()) for b in args.body]
    if args.mixed:
        bodies += mixed_bodies()
    if not bodies:
        parser.error("give --body FILE or --mixed")
    result = asyncio.run(run(args.port, args.ca, bodies, rate=args.rate, closed=args.closed,
                             duration=args.duration, warmup=args.warmup, connections=args.connections,
                             reconnect_every=args.reconnect_every, timeout=args.timeout, path=args.path))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
