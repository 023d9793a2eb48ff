"""The webhook over real HTTPS: admission answers, bad requests, health, readiness, metrics, shutdown."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jsonpatch
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufence.contract import SIDECAR_NAME
from gpufence.webhook import server as server_module
from gpufence.webhook.server import MAX_BODY_BYTES, METRICS, RELOADER, ServerLimits, start_webhook
from tests.support.tlsutil import LocalPKI, Webhook, gpu_pod, pod_review, running_webhook, wait_until

JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def hook(pki: LocalPKI) -> AsyncIterator[Webhook]:
    async with running_webhook(pki, limits=ServerLimits(header_timeout=5, body_timeout=5, lingering_time=1)) as hook:
        yield hook


@pytest.fixture
async def session(pki: LocalPKI) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pki.client_context())) as session:
        yield session


async def post(session: aiohttp.ClientSession, hook: Webhook, body: Any, *, headers: dict[str, str] | None = None,
               path: str = "/mutate") -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(hook.url + path, data=data, headers=headers or JSON) as resp:
        assert resp.content_type == "application/json"
        return resp.status, await resp.json()


def patch_of(answer: dict[str, Any]) -> list[dict[str, Any]] | None:
    response = answer["response"]
    if "patch" not in response:
        return None
    assert response["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(response["patch"]))


def request_counts(text: str) -> dict[str, float]:
    for family in text_string_to_metric_families(text):
        if family.name == "gpufence_webhook_requests":
            return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}
    raise AssertionError("no request counter")


async def test_gpu_pod_is_patched_and_the_patched_pod_is_left_alone(hook: Webhook, session: aiohttp.ClientSession):
    status, answer = await post(session, hook, pod_review("uid-1"))
    assert status == 200
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == "uid-1" and answer["response"]["allowed"] is True
    patch = patch_of(answer)
    assert patch
    patched = jsonpatch.apply_patch(gpu_pod(), patch)
    spec = patched["spec"]
    names = [c["name"] for c in spec.get("initContainers", []) + spec["containers"]]
    assert SIDECAR_NAME in names

    status, again = await post(session, hook, pod_review("uid-2", pod=patched))
    assert status == 200 and again["response"]["allowed"] is True
    assert patch_of(again) is None


def memo_lookups(text: str) -> dict[tuple[str, str], float]:
    for family in text_string_to_metric_families(text):
        if family.name == "gpufence_webhook_verdict_memo_lookups":
            return {(s.labels["judge"], s.labels["result"]): s.value for s in family.samples
                    if s.name.endswith("_total")}
    raise AssertionError("no memo counter")


def connections(text: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == "gpufence_webhook_connections":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no connection counter")


async def test_a_second_pod_of_one_template_is_answered_from_the_memo_with_its_own_uid(
        hook: Webhook, session: aiohttp.ClientSession):
    _, first = await post(session, hook, pod_review("uid-1"))
    _, second = await post(session, hook, pod_review("uid-2"))
    assert second["response"]["uid"] == "uid-2"
    assert {**second["response"], "uid": "uid-1"} == first["response"]
    async with session.get(hook.url + "/metrics") as resp:
        assert memo_lookups(await resp.text()) == {("review", "hit"): 1.0, ("review", "miss"): 1.0,
                                                   ("verify", "hit"): 0.0, ("verify", "miss"): 0.0}


async def test_connections_are_counted_one_per_tls_handshake(hook: Webhook, pki: LocalPKI):
    """Three clients of their own, each one connection kept alive over two requests (the first one's
    session also reads the metrics): the counter says three, not six."""
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pki.client_context(), limit=1))
                for _ in range(3)]
    try:
        for s in sessions:
            for uid in ("a", "b"):
                assert (await post(s, hook, pod_review(uid)))[0] == 200
        async with sessions[0].get(hook.url + "/metrics") as resp:
            assert connections(await resp.text()) == 3.0
    finally:
        for s in sessions:
            await s.close()


@pytest.mark.parametrize(("kind", "operation"), [("Deployment", "CREATE"), ("Pod", "UPDATE"), ("Pod", "DELETE")])
async def test_non_pod_or_non_create_is_allowed_unpatched(hook: Webhook, session: aiohttp.ClientSession,
                                                          kind: str, operation: str):
    status, answer = await post(session, hook, pod_review(kind=kind, operation=operation))
    assert status == 200
    assert answer["response"]["allowed"] is True and patch_of(answer) is None


async def test_charset_utf8_is_accepted(hook: Webhook, session: aiohttp.ClientSession):
    status, _ = await post(session, hook, pod_review(), headers={"Content-Type": "application/json; charset=UTF-8"})
    assert status == 200


def assert_error(status: int, body: Any, expected: int) -> None:
    assert status == expected, body
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    assert "Traceback" not in body["error"]


async def test_wrong_method_is_405(hook: Webhook, session: aiohttp.ClientSession):
    async with session.get(hook.url + "/mutate") as resp:
        assert resp.headers["Allow"] == "POST"
        assert_error(resp.status, await resp.json(), 405)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1", None])
async def test_wrong_content_type_is_415(hook: Webhook, session: aiohttp.ClientSession, content_type: str | None):
    headers = {"Content-Type": content_type} if content_type else {}
    data = json.dumps(pod_review()).encode()
    async with session.post(hook.url + "/mutate", data=data, headers=headers,
                            skip_auto_headers=["Content-Type"]) as resp:
        assert_error(resp.status, await resp.json(), 415)


@pytest.mark.parametrize("body", [b"", b"{", b"\xff\xfe{", b'{"a": 1', b"[" * 100_000, b"1" * 5000])
async def test_empty_or_malformed_json_is_400(hook: Webhook, session: aiohttp.ClientSession, body: bytes):
    status, answer = await post(session, hook, body)
    assert_error(status, answer, 400)


@pytest.mark.parametrize("review", [
    {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "u"}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "Pod", "request": {"uid": "u"}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"operation": "CREATE"}},
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
    [1, 2, 3],
])
async def test_invalid_review_is_400(hook: Webhook, session: aiohttp.ClientSession, review: Any):
    status, answer = await post(session, hook, review)
    assert_error(status, answer, 400)


def padded_review(size: int) -> bytes:
    """A valid review of exactly ``size`` bytes (padding in an annotation)."""
    review = pod_review()
    review["request"]["object"]["metadata"]["annotations"]["example.com/pad"] = ""
    base = len(json.dumps(review).encode())
    review["request"]["object"]["metadata"]["annotations"]["example.com/pad"] = "x" * (size - base)
    body = json.dumps(review).encode()
    assert len(body) == size
    return body


async def test_body_at_the_limit_is_served_and_one_byte_over_is_413(hook: Webhook, session: aiohttp.ClientSession):
    status, answer = await post(session, hook, padded_review(MAX_BODY_BYTES))
    assert status == 200 and answer["response"]["uid"] == "uid-1"
    status, answer = await post(session, hook, padded_review(MAX_BODY_BYTES + 1))
    assert_error(status, answer, 413)


async def test_chunked_body_over_the_limit_is_413(hook: Webhook, session: aiohttp.ClientSession):
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(7):
            yield b" " * (1024 * 1024)

    async with session.post(hook.url + "/mutate", data=chunks(), headers=JSON) as resp:
        assert_error(resp.status, await resp.json(), 413)


async def test_unknown_path_is_json_404(hook: Webhook, session: aiohttp.ClientSession):
    async with session.get(hook.url + "/nope") as resp:
        assert_error(resp.status, await resp.json(), 404)


async def test_unexpected_exception_is_a_json_500_logged_with_traceback(
        hook: Webhook, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture):
    def broken(*_: Any) -> Any:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server_module, "review", broken)
    with caplog.at_level(logging.ERROR, logger="webhook.server"):
        status, answer = await post(session, hook, pod_review())
    assert_error(status, answer, 500)
    assert "secret" not in answer["error"]
    assert any(r.exc_info and "secret internal detail" in str(r.exc_info[1]) for r in caplog.records)
    assert request_counts(await hook_metrics(session, hook))["error"] == 1


async def hook_metrics(session: aiohttp.ClientSession, hook: Webhook) -> str:
    async with session.get(hook.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        return await resp.text()


async def test_health_readiness_and_metrics(hook: Webhook, session: aiohttp.ClientSession):
    async with session.get(hook.url + "/healthz") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "ok"
    async with session.get(hook.url + "/readyz") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "ready"

    before = request_counts(await hook_metrics(session, hook))
    assert set(before) == {"mutated", "unchanged", "denied", "skipped", "verified", "refused", "invalid", "error"}
    assert all(v == 0 for v in before.values())
    await post(session, hook, pod_review())
    await post(session, hook, pod_review(kind="Service"))
    await post(session, hook, b"{")
    text = await hook_metrics(session, hook)
    after = request_counts(text)
    assert after["mutated"] == 1 and after["invalid"] == 1 and after["skipped"] + after["unchanged"] == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    count = next(s.value for s in families["gpufence_webhook_request_duration_seconds"].samples
                 if s.name.endswith("_count"))
    assert count == 3
    buckets = [s.labels["le"] for s in families["gpufence_webhook_request_duration_seconds"].samples
               if s.name.endswith("_bucket")]
    assert "0.001" in buckets  # fine enough for millisecond latencies
    expiry = families["gpufence_webhook_certificate_expiry_timestamp_seconds"].samples[0].value
    assert expiry == hook.reloader.cert.not_valid_after_utc.timestamp()
    reloads = {s.labels["result"]: s.value for s in families["gpufence_webhook_certificate_reloads"].samples
               if s.name.endswith("_total")}
    assert reloads == {"success": 0, "failure": 0}


class FakeWatchedLookup:
    """A BackgroundLookup that syncs when the test says so."""

    def __init__(self) -> None:
        self.synced = asyncio.Event()
        self.started = self.stopped = False

    def get(self, name: str) -> None:
        return None

    def start(self) -> None:
        self.started = True

    def stop(self, timeout: float | None = None) -> None:
        self.stopped = True

    def has_synced(self) -> bool:
        return self.synced.is_set()


async def test_readyz_waits_for_the_namespace_cache(pki: LocalPKI, session: aiohttp.ClientSession):
    lookup = FakeWatchedLookup()
    async with running_webhook(pki, namespaces=lookup) as hook:
        assert lookup.started
        async with session.get(hook.url + "/readyz") as resp:
            assert resp.status == 503 and "namespace" in (await resp.json())["reasons"][0]
        lookup.synced.set()
        async with session.get(hook.url + "/readyz") as resp:
            assert resp.status == 200
    assert lookup.stopped


async def test_shutdown_finishes_in_flight_requests(pki: LocalPKI):
    """A request whose body is still arriving when shutdown starts is answered, not dropped."""
    async with running_webhook(pki) as hook:
        body = json.dumps(pod_review()).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", hook.port, ssl=pki.client_context(),
                                                       server_hostname="localhost")
        writer.write(b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        await writer.drain()
        await wait_until(lambda: hook.running.runner.server.requests_count == 1)  # dispatched: in flight
        closing = asyncio.create_task(hook.running.close())
        await wait_until(lambda: not hook.running.server.is_serving())  # shutdown has begun
        assert not closing.done()
        writer.write(body[10:])
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(closing, 5)
        writer.close()


async def test_start_webhook_in_one_call(pki: LocalPKI, session: aiohttp.ClientSession):
    running = await start_webhook(pki.volume.cert_file, pki.volume.key_file)
    try:
        status, answer = await post(session, Webhook(running, running.app[RELOADER], running.app[METRICS]),
                                    pod_review())
        assert status == 200 and patch_of(answer)
    finally:
        await running.close()
    assert not running.server.is_serving()


def test_metrics_count_each_outcome_through_the_looked_up_children() -> None:
    from gpufence.webhook.metrics import WebhookMetrics

    metrics = WebhookMetrics()
    metrics.observe("mutated", 0.001)
    metrics.observe("mutated", 0.002)
    metrics.observe("unexpected", 0.001)  # not pre-created: still counted
    text = metrics.render()[0].decode()
    assert 'gpufence_webhook_requests_total{outcome="mutated"} 2.0' in text
    assert 'gpufence_webhook_requests_total{outcome="unexpected"} 1.0' in text
    assert 'gpufence_webhook_requests_total{outcome="denied"} 0.0' in text
    assert "gpufence_webhook_request_duration_seconds_count 3.0" in text
