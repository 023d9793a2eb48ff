"""Misbehaving clients are refused or cut off within the configured bounds (short ones here)."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.tlsutil import FAST_LIMITS, LocalPKI, Webhook, make_pki, pod_review, running_webhook

SLACK = 2.0  # scheduling slack on a shared 2-core machine; the defaults would be 10-75 s


@pytest.fixture
def pki(tmp_path: Path) -> LocalPKI:
    return make_pki(tmp_path)


@pytest.fixture
async def hook(pki: LocalPKI) -> AsyncIterator[Webhook]:
    async with running_webhook(pki, limits=FAST_LIMITS) as hook:
        yield hook


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except (ConnectionError, ssl.SSLError):
        pass
    return data


async def tls_connect(hook: Webhook, pki: LocalPKI) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", hook.port, ssl=pki.client_context(),
                                         server_hostname="localhost")


async def test_half_headers_are_cut_off(hook: Webhook, pki: LocalPKI):
    reader, writer = await tls_connect(hook, pki)
    started = time.monotonic()
    writer.write(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Ty")
    await writer.drain()
    data = await asyncio.wait_for(read_until_closed(reader), FAST_LIMITS.header_timeout + SLACK)
    elapsed = time.monotonic() - started
    assert data == b""
    assert elapsed >= FAST_LIMITS.header_timeout * 0.8
    writer.close()


async def test_half_body_is_answered_408_and_cut_off(hook: Webhook, pki: LocalPKI):
    body = json.dumps(pod_review()).encode()
    reader, writer = await tls_connect(hook, pki)
    started = time.monotonic()
    writer.write(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[: len(body) // 2])
    await writer.drain()
    bound = FAST_LIMITS.body_timeout + FAST_LIMITS.lingering_time + SLACK
    data = await asyncio.wait_for(read_until_closed(reader), bound)
    elapsed = time.monotonic() - started
    assert data.startswith(b"HTTP/1.1 408 ")
    assert b'{"error":"timed out reading the request body"}' in data
    assert elapsed >= FAST_LIMITS.body_timeout * 0.8
    writer.close()


async def test_half_client_hello_is_cut_off(hook: Webhook):
    reader, writer = await asyncio.open_connection("127.0.0.1", hook.port)
    started = time.monotonic()
    writer.write(bytes.fromhex("16030100c8010000c40303"))  # a ClientHello record that stops early
    await writer.drain()
    data = await asyncio.wait_for(read_until_closed(reader), FAST_LIMITS.handshake_timeout + SLACK)
    assert data == b""
    assert time.monotonic() - started >= FAST_LIMITS.handshake_timeout * 0.8
    writer.close()


async def test_plain_http_to_the_tls_port_is_not_served(hook: Webhook):
    reader, writer = await asyncio.open_connection("127.0.0.1", hook.port)
    body = json.dumps(pod_review()).encode()
    writer.write(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    data = await asyncio.wait_for(read_until_closed(reader), SLACK)
    assert b"HTTP/" not in data  # closed, at most a TLS alert
    writer.close()


def legacy_client(pki: LocalPKI, version: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = pki.client_context()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TLS 1.1 is deprecated: that is the point
        ctx.minimum_version = ctx.maximum_version = version
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # OpenSSL 3 would not even offer TLS 1.1 otherwise
    return ctx


async def test_tls_1_1_is_refused_and_1_2_accepted(hook: Webhook, pki: LocalPKI):
    with pytest.raises((ssl.SSLError, ConnectionError)) as refused:
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", hook.port, server_hostname="localhost",
                                                       ssl=legacy_client(pki, ssl.TLSVersion.TLSv1_1)), SLACK)
    # The client did offer TLS 1.1 (a local "no protocols available" would prove nothing).
    assert "NO_PROTOCOLS_AVAILABLE" not in str(refused.value)

    _, writer = await asyncio.open_connection("127.0.0.1", hook.port, server_hostname="localhost",
                                              ssl=legacy_client(pki, ssl.TLSVersion.TLSv1_2))
    assert writer.get_extra_info("ssl_object").version() == "TLSv1.2"
    writer.close()


async def test_malformed_http_is_answered_400_without_a_traceback(hook: Webhook, pki: LocalPKI):
    # aiohttp's parser answers these itself, before any middleware; make sure nothing leaks or hangs.
    reader, writer = await tls_connect(hook, pki)
    writer.write(b"POST /mutate HTTP/9.9\r\nHost: localhost\r\nno colon here\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(read_until_closed(reader), FAST_LIMITS.header_timeout + SLACK)
    assert data.startswith(b"HTTP/1.")
    assert b" 400 " in data.split(b"\r\n")[0]
    assert b"Traceback" not in data
    writer.close()
