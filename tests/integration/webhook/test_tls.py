"""Certificate hot reload: Secret-volume rotations while requests run, and broken pairs."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufence.webhook.server import ServerLimits
from gpufence.webhook.tls import CertReloader, load_pair, new_server_context
from tests.support.tlsutil import LocalPKI, Webhook, peer_serial, pod_review, running_webhook, wait_until

# Long keep-alive so the keep-alive hammer's connections live through the rotations.
LIMITS = ServerLimits(handshake_timeout=2, header_timeout=10, body_timeout=2, lingering_time=0.2,
                      shutdown_timeout=5)


def test_context_refuses_old_protocols():
    assert new_server_context().minimum_version == ssl.TLSVersion.TLSv1_2


async def _session_after_one_request(hook: Webhook, ctx: ssl.SSLContext) -> ssl.SSLSession | None:
    """One connection, one request answered (so any ticket sent after the handshake has arrived):
    the TLS session the client holds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", hook.port, ssl=ctx, server_hostname="localhost",
                                                   ssl_handshake_timeout=10)
    ssl_object = writer.get_extra_info("ssl_object")
    assert ssl_object is not None
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 200")
        return ssl_object.session
    finally:
        writer.close()


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2])
async def test_no_session_tickets_are_issued(pki: LocalPKI, version: ssl.TLSVersion):
    """The API server's webhook client keeps no session cache, so a ticket would be work for nothing:
    a client that asks for one (Python's, TLS 1.3 and 1.2) holds a session without a ticket."""
    ctx = pki.client_context()
    ctx.minimum_version = ctx.maximum_version = version
    async with running_webhook(pki) as hook:
        session = await _session_after_one_request(hook, ctx)
    assert session is not None and not session.has_ticket


def test_load_pair_rejects_a_key_that_does_not_match(pki: LocalPKI):
    pki.write_broken()
    with pytest.raises(ssl.SSLError):
        load_pair(pki.volume.cert_file, pki.volume.key_file)


def test_reloader_refuses_to_start_without_a_usable_pair(pki: LocalPKI, tmp_path: Path):
    pki.write_broken()
    with pytest.raises(ssl.SSLError):
        CertReloader(pki.volume.cert_file, pki.volume.key_file)
    with pytest.raises(OSError):
        CertReloader(tmp_path / "missing.crt", tmp_path / "missing.key")


async def test_check_sees_a_symlink_swap_and_ignores_unchanged_files(pki: LocalPKI):
    reloader = CertReloader(pki.volume.cert_file, pki.volume.key_file)
    assert await reloader.check() is None
    mtime = pki.volume.cert_file.lstat().st_mtime_ns
    new = pki.rotate()
    assert pki.volume.cert_file.lstat().st_mtime_ns == mtime  # the symlink itself did not change
    assert await reloader.check() is True
    assert reloader.cert.serial_number == new.cert.serial_number
    assert await reloader.check() is None
    assert (reloader.successes, reloader.failures, reloader.attempts) == (1, 0, 1)


def reload_counts(text: str) -> dict[str, float]:
    family = next(f for f in text_string_to_metric_families(text) if f.name == "gpufence_webhook_certificate_reloads")
    return {s.labels["result"]: s.value for s in family.samples if s.name.endswith("_total")}


async def test_rotation_while_requests_run(pki: LocalPKI):
    """Two rotations under load: zero failed requests, new handshakes see the new certificate."""
    ctx = pki.client_context()
    body = json.dumps(pod_review()).encode()
    stop = asyncio.Event()
    done = 0
    failures: list[BaseException] = []

    async def hammer(session: aiohttp.ClientSession, hook: Webhook) -> None:
        nonlocal done
        while not stop.is_set():
            try:
                async with session.post(hook.url + "/mutate", data=body,
                                        headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == 200, resp.status
                    assert (await resp.json())["response"]["allowed"] is True
                done += 1
            except Exception as exc:
                failures.append(exc)

    async with (
        running_webhook(pki, limits=LIMITS, reload_interval=0.02) as hook,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=4)) as keep_alive,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True)) as fresh,
    ):
        tasks = [asyncio.create_task(hammer(s, hook)) for s in (keep_alive, keep_alive, fresh, fresh)]
        await wait_until(lambda: done >= 20)
        for rotation in (1, 2):
            new = pki.rotate()
            await asyncio.wait_for(hook.reloader.wait_attempts(rotation), 5)
            assert hook.reloader.cert.serial_number == new.cert.serial_number
            # Over SNI and without it (an IP address): both go through the callback.
            assert await peer_serial(hook.port, ctx, "localhost") == new.cert.serial_number
            assert await peer_serial(hook.port, ctx, "127.0.0.1") == new.cert.serial_number
            target = done + 20
            await wait_until(lambda t=target: done >= t)  # requests keep succeeding after the switch
        stop.set()
        await asyncio.gather(*tasks)
        assert failures == []
        async with fresh.get(hook.url + "/metrics") as resp:
            assert reload_counts(await resp.text()) == {"success": 2, "failure": 0}


async def test_broken_pair_keeps_the_old_certificate(pki: LocalPKI):
    ctx = pki.client_context()
    async with (
        running_webhook(pki, limits=LIMITS, reload_interval=0.02) as hook,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True)) as session,
    ):
        good = pki.serving
        pki.write_broken()
        await asyncio.wait_for(hook.reloader.wait_attempts(1), 5)
        assert hook.reloader.failures == 1
        assert await peer_serial(hook.port, ctx) == good.cert.serial_number
        async with session.post(hook.url + "/mutate", json=pod_review()) as resp:
            assert resp.status == 200
        async with session.get(hook.url + "/metrics") as resp:
            text = await resp.text()
        assert reload_counts(text) == {"success": 0, "failure": 1}
        expiry = next(f for f in text_string_to_metric_families(text)
                      if f.name == "gpufence_webhook_certificate_expiry_timestamp_seconds").samples[0].value
        assert expiry == good.cert.not_valid_after_utc.timestamp()

        # The broken pair is not retried every poll; the next good one is taken.
        fixed = pki.rotate()
        await asyncio.wait_for(hook.reloader.wait_attempts(2), 5)
        assert (hook.reloader.successes, hook.reloader.failures) == (1, 1)
        assert await peer_serial(hook.port, ctx) == fixed.cert.serial_number
