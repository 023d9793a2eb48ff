"""TLS edge hardening: old protocols refused, no plaintext listener, stalled clients bounded.

Stalled clients run against an in-process server with short limits (``ServerLimits``); the
listener construction is the production one (``webhook.server.start_server``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from gpufence.webhook.server import ServerLimits, create_app, start_server
from gpufence.webhook.settings import AllNamespacesOptedIn, InjectionSettings
from gpufence.webhook.tls import CertReloader
from tests.support.sample_pods import admission_review, small_pod
from tests.support.server_process import gpufence_server
from tests.support.tlsutil import LocalPKI, make_pki

pytestmark = pytest.mark.timeout(60)

LIMITS = ServerLimits(handshake_timeout=1.0, header_timeout=1.0, body_timeout=1.0, lingering_time=0.2,
                      shutdown_timeout=5.0)
BODY = json.dumps(admission_review(small_pod())).encode()
REQUEST = (b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


@pytest.fixture
def pki(tmp_path: Path) -> LocalPKI:
    return make_pki(tmp_path / "pki")


@pytest.fixture
async def port(pki: LocalPKI) -> AsyncIterator[int]:
    reloader = CertReloader(pki.volume.cert_file, pki.volume.key_file, interval=0.1)
    app = create_app(InjectionSettings(), AllNamespacesOptedIn(), reloader, limits=LIMITS)
    running = await start_server(app, host="127.0.0.1", port=0)
    try:
        yield running.port
    finally:
        await running.close()


async def _mutate(port: int, ctx: ssl.SSLContext, timeout: float = 5.0) -> tuple[int, float]:
    t = time.monotonic()
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
        writer.write(REQUEST)
        status = int((await reader.readline()).split()[1])
        writer.close()
    return status, time.monotonic() - t


def _old_tls_client(pki: LocalPKI, version: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.ca_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.maximum_version = version
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # let OpenSSL 3 at least offer the old protocol
    return ctx


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1], ids=["TLSv1.0", "TLSv1.1"])
async def test_protocols_below_tls12_are_refused(port: int, pki: LocalPKI, version: ssl.TLSVersion):
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        async with asyncio.timeout(5):
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_old_tls_client(pki, version),
                                                      server_hostname="localhost")
            writer.close()


async def test_tls12_and_13_are_served(port: int, pki: LocalPKI):
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        ctx = pki.client_context()
        ctx.minimum_version = ctx.maximum_version = version
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
        expected = {"TLSv1_2": "TLSv1.2", "TLSv1_3": "TLSv1.3"}[version.name]
        assert writer.get_extra_info("ssl_object").version() == expected
        writer.close()
    status, _ = await _mutate(port, pki.client_context())
    assert status == 200


async def _plaintext_answer(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    try:
        async with asyncio.timeout(5):
            return await reader.read(1024)
    except ConnectionError:
        return b""
    finally:
        writer.close()


async def test_plaintext_http_gets_no_http_answer(port: int):
    assert not (await _plaintext_answer(port)).startswith(b"HTTP/")


def test_the_cli_server_has_no_plaintext_listener(pki: LocalPKI):
    with gpufence_server(pki) as (proc, port):
        listening = {c.laddr.port for c in psutil.Process(proc.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {port}
        for p in listening:
            assert not asyncio.run(_plaintext_answer(p)).startswith(b"HTTP/")


def _client_hello(pki: LocalPKI) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = pki.client_context().wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


async def _stall(port: int, pki: LocalPKI, kind: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if kind == "half-client-hello":
        hello = _client_hello(pki)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(hello[: len(hello) // 2])
        return reader, writer
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=pki.client_context(),
                                                  server_hostname="localhost")
    head_end = REQUEST.index(b"\r\n\r\n") + 4
    writer.write(REQUEST[: head_end // 2] if kind == "half-headers" else REQUEST[: head_end + len(BODY) // 2])
    return reader, writer


async def _closed_after(reader: asyncio.StreamReader, limit: float) -> float:
    t = time.monotonic()
    async with asyncio.timeout(limit):
        while True:
            try:
                chunk = await reader.read(65536)
            except (ConnectionError, ssl.SSLError):
                break
            if not chunk:
                break
    return time.monotonic() - t


@pytest.mark.parametrize("kind", ["half-client-hello", "half-headers", "half-body"])
async def test_stalled_clients_time_out_without_holding_the_server(port: int, pki: LocalPKI, kind: str):
    stalled = [await _stall(port, pki, kind) for _ in range(30)]
    try:
        # Meanwhile other clients are served, promptly.
        for _ in range(5):
            status, took = await _mutate(port, pki.client_context())
            assert status == 200 and took < 2.0
        # Each stalled connection is closed by the server after its bound (1 s) plus drain slack.
        bound = {"half-client-hello": LIMITS.handshake_timeout, "half-headers": LIMITS.header_timeout,
                 "half-body": LIMITS.body_timeout + LIMITS.lingering_time}[kind]
        results = await asyncio.gather(*(_closed_after(r, bound + 3.0) for r, _ in stalled))
        assert max(results) <= bound + 3.0
    finally:
        for _, w in stalled:
            w.close()
    status, _ = await _mutate(port, pki.client_context())
    assert status == 200


def test_default_limits_bound_every_stall():
    d = ServerLimits()
    assert 0 < d.handshake_timeout <= 30 and 0 < d.header_timeout <= 60 and 0 < d.body_timeout <= 30
    assert 0 <= d.lingering_time <= 10 and d.max_body_bytes <= 16 << 20
