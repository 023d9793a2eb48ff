"""The TLS edge and misbehaving clients: protocols below TLS 1.2 refused, no plaintext answer on any
listener, stalled clients cut off within their bounds without holding the server, malformed HTTP
answered 400.

The server is the production listener (``start_server``) in process, with short bounds
(``ServerLimits``); the listener check also runs the real CLI process.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import warnings
from collections.abc import AsyncIterator

import psutil
import pytest

from gpufence.webhook.server import ServerLimits
from tests.support.sample_pods import admission_review, small_pod
from tests.support.server_process import gpufence_server
from tests.support.tlsutil import FAST_LIMITS, LocalPKI, Webhook, running_webhook

pytestmark = [
    pytest.mark.timeout(60),
    # pytest-asyncio's replacement (a conftest hook) would give every test of the folder a loop parameter;
    # this fixture is the one module's.
    pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture is deprecated"),
]


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Every bound on both event loops the webhook runs on (``--event-loop``: uvloop where it imports)."""
    if request.param == "uvloop":
        import uvloop

        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()

SLACK = 2.0  # scheduling slack on a shared 2-core machine; the defaults would be 10-75 s
# Longer bounds for the crowd of stalled clients, so that the clients served meanwhile are served
# while the stalled ones still hold their connections.
CROWD_LIMITS = ServerLimits(handshake_timeout=1.0, header_timeout=1.0, body_timeout=1.0, lingering_time=0.2,
                            shutdown_timeout=5.0)
BODY = json.dumps(admission_review(small_pod())).encode()
REQUEST = (b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
STALLS = ["half-client-hello", "half-headers", "half-body"]


@pytest.fixture
async def hook(pki: LocalPKI) -> AsyncIterator[Webhook]:
    async with running_webhook(pki, limits=FAST_LIMITS) as hook:
        yield hook


@pytest.fixture
async def crowd_hook(pki: LocalPKI) -> AsyncIterator[Webhook]:
    async with running_webhook(pki, limits=CROWD_LIMITS) as hook:
        yield hook


def bound_of(kind: str, limits: ServerLimits, *, lingering: bool = True) -> float:
    """How long the server waits for a client stalled so (and, after a 408, drains its body)."""
    return {"half-client-hello": limits.handshake_timeout, "half-headers": limits.header_timeout,
            "half-body": limits.body_timeout + (limits.lingering_time if lingering else 0)}[kind]  # fmt: skip


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except (ConnectionError, ssl.SSLError):
        pass
    return data


async def tls_connect(port: int, pki: LocalPKI) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, ssl=pki.client_context(), server_hostname="localhost")


async def mutate(port: int, pki: LocalPKI, timeout: float = 5.0) -> tuple[int, float]:
    started = time.monotonic()
    async with asyncio.timeout(timeout):
        reader, writer = await tls_connect(port, pki)
        writer.write(REQUEST)
        status = int((await reader.readline()).split()[1])
        writer.close()
    return status, time.monotonic() - started


# -- protocols ------------------------------------------------------------------------------------


def legacy_client(pki: LocalPKI, version: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = pki.client_context()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.0/1.1 are deprecated: that is the point
        ctx.minimum_version = ctx.maximum_version = version
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # OpenSSL 3 would not even offer TLS 1.0/1.1 otherwise
    return ctx


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1], ids=["TLSv1.0", "TLSv1.1"])
async def test_protocols_below_tls12_are_refused(hook: Webhook, pki: LocalPKI, version: ssl.TLSVersion):
    with pytest.raises((ssl.SSLError, ConnectionError)) as refused:
        async with asyncio.timeout(SLACK):
            _, writer = await asyncio.open_connection("127.0.0.1", hook.port, server_hostname="localhost",
                                                      ssl=legacy_client(pki, version))
            writer.close()
    # The client did offer the old protocol (a local "no protocols available" would prove nothing).
    assert "NO_PROTOCOLS_AVAILABLE" not in str(refused.value)


async def test_tls12_and_13_are_served(hook: Webhook, pki: LocalPKI):
    for version, name in ((ssl.TLSVersion.TLSv1_2, "TLSv1.2"), (ssl.TLSVersion.TLSv1_3, "TLSv1.3")):
        ctx = pki.client_context()
        ctx.minimum_version = ctx.maximum_version = version
        _, writer = await asyncio.open_connection("127.0.0.1", hook.port, ssl=ctx, server_hostname="localhost")
        assert writer.get_extra_info("ssl_object").version() == name
        writer.close()
    # Also from a client that offers old ciphers and protocols: it gets TLS 1.2, not a refusal.
    _, writer = await asyncio.open_connection("127.0.0.1", hook.port, server_hostname="localhost",
                                              ssl=legacy_client(pki, ssl.TLSVersion.TLSv1_2))
    assert writer.get_extra_info("ssl_object").version() == "TLSv1.2"
    writer.close()
    status, _ = await mutate(hook.port, pki)
    assert status == 200


# -- plaintext ------------------------------------------------------------------------------------


async def plaintext_answer(port: int) -> bytes:
    """What a plain-HTTP request to ``port`` gets before the server closes (within SLACK)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(REQUEST)
        await writer.drain()
        return await asyncio.wait_for(read_until_closed(reader), SLACK)
    finally:
        writer.close()


async def test_plain_http_to_the_tls_port_is_not_served(hook: Webhook):
    assert b"HTTP/" not in await plaintext_answer(hook.port)  # closed, at most a TLS alert


def test_the_cli_server_has_no_plaintext_listener(pki: LocalPKI):
    with gpufence_server(pki) as (proc, port):
        listening = {c.laddr.port for c in psutil.Process(proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}  # fmt: skip
        assert listening == {port}
        for p in listening:
            assert b"HTTP/" not in asyncio.run(plaintext_answer(p))


# -- stalled clients ------------------------------------------------------------------------------


def client_hello(pki: LocalPKI) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = pki.client_context().wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


async def stall(port: int, pki: LocalPKI, kind: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that sends part of its ClientHello, of its request headers, or of its body, and waits."""
    if kind == "half-client-hello":
        hello = client_hello(pki)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello[: len(hello) // 2])
    else:
        reader, writer = await tls_connect(port, pki)
        head_end = REQUEST.index(b"\r\n\r\n") + 4
        writer.write(REQUEST[: head_end // 2] if kind == "half-headers" else REQUEST[: head_end + len(BODY) // 2])
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("kind", STALLS)
async def test_a_stalled_client_is_cut_off_at_its_bound(hook: Webhook, pki: LocalPKI, kind: str):
    reader, writer = await stall(hook.port, pki, kind)
    started = time.monotonic()
    bound = bound_of(kind, FAST_LIMITS)
    data = await asyncio.wait_for(read_until_closed(reader), bound + SLACK)
    elapsed = time.monotonic() - started
    writer.close()
    # Not before its bound: a slow client within the limits is not cut off.
    assert elapsed >= bound_of(kind, FAST_LIMITS, lingering=False) * 0.8
    if kind == "half-body":  # the request line and headers arrived: it gets an answer
        assert data.startswith(b"HTTP/1.1 408 ")
        assert b'{"error":"timed out reading the request body"}' in data
    else:
        assert data == b""


@pytest.mark.parametrize("kind", STALLS)
async def test_stalled_clients_do_not_hold_the_server(crowd_hook: Webhook, pki: LocalPKI, kind: str):
    port = crowd_hook.port
    stalled = [await stall(port, pki, kind) for _ in range(30)]
    try:
        # Meanwhile other clients are served, promptly.
        for _ in range(5):
            status, took = await mutate(port, pki)
            assert status == 200 and took < 2.0
        # Each stalled connection is closed by the server after its bound (1 s) plus drain slack.
        bound = bound_of(kind, CROWD_LIMITS)
        results = await asyncio.gather(*(asyncio.wait_for(read_until_closed(r), bound + 3.0) for r, _ in stalled))
        assert all(data == b"" or data.startswith(b"HTTP/1.1 408 ") for data in results)
    finally:
        for _, w in stalled:
            w.close()
    status, _ = await mutate(port, pki)
    assert status == 200


# -- malformed HTTP -------------------------------------------------------------------------------


async def test_malformed_http_is_answered_400_without_a_traceback(hook: Webhook, pki: LocalPKI):
    # aiohttp's parser answers these itself, before any middleware; make sure nothing leaks or hangs.
    reader, writer = await tls_connect(hook.port, pki)
    writer.write(b"POST /mutate HTTP/9.9\r\nHost: localhost\r\nno colon here\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(read_until_closed(reader), FAST_LIMITS.header_timeout + SLACK)
    assert data.startswith(b"HTTP/1.")
    assert b" 400 " in data.split(b"\r\n")[0]
    assert b"Traceback" not in data
    writer.close()
