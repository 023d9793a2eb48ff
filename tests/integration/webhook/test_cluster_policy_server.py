"""The cluster policy ConfigMap in the running server: not ready before a first valid policy, each
change applied without a restart, and the watch against a small fake API server (as
tests/integration/webhook/test_namespaces.py does). The pure parsing: tests/unit/webhook/test_cluster_policy.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from gpufence.webhook.cluster.policy import ClusterPolicy, PolicyWatch
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings
from gpufence.webhook.server import create_app, start_server
from gpufence.webhook.tls import CertReloader
from tests.support.tlsutil import FAST_LIMITS, LocalPKI, pod_review
from tests.unit.webhook.test_cluster_policy import configmap

TLS = ["--tls-cert-file", "c.crt", "--tls-private-key-file", "c.key"]
SOURCE = "gpufence/gpufence-policy"
EVENT_ATTRIBUTE = "gpufence_event"  # where gpufence.logs.log_event puts the event name on the record


# --- the server with a policy from the ConfigMap ---------------------------------------------------


@asynccontextmanager
async def webhook_with(pki: LocalPKI, policy: ClusterPolicy) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    reloader = CertReloader(pki.volume.cert_file, pki.volume.key_file, interval=60)
    app = create_app(policy, AllNamespacesOptedIn(), reloader, limits=FAST_LIMITS)
    running = await start_server(app, host="127.0.0.1", port=0)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pki.client_context())) as session:
            yield f"https://127.0.0.1:{running.port}", session
    finally:
        await running.close()


def pod_with_memory(memory: str) -> dict[str, Any]:
    review = pod_review()
    review["request"]["object"]["metadata"]["annotations"] = {"gpufence.io/memory": memory}
    return review


async def decision(session: aiohttp.ClientSession, url: str, memory: str) -> tuple[int, Any]:
    async with session.post(url + "/mutate", json=pod_with_memory(memory)) as resp:
        return resp.status, await resp.json()


def policy_metrics(text: str) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    reloads = {s.labels["result"]: s.value for s in families["gpufence_webhook_policy_reloads"].samples
               if s.name.endswith("_total")}
    return {"valid": families["gpufence_webhook_policy_valid"].samples[0].value, **reloads}


async def test_not_ready_until_a_valid_policy_then_each_change_applies_without_a_restart(pki: LocalPKI) -> None:
    policy = ClusterPolicy(source=SOURCE)
    async with webhook_with(pki, policy) as (url, session):
        async with session.get(url + "/readyz") as resp:
            assert resp.status == 503
            assert "no valid cluster policy yet" in (await resp.json())["reasons"][0]
        status, answer = await decision(session, url, "4Gi")
        # failurePolicy Fail: the API server refuses the pod, naming the webhook.
        assert status == 503 and "gpufence/gpufence-policy" in answer["error"]

        policy.offer(configmap({"max-memory": "8Gi"}, rv=2))
        async with session.get(url + "/readyz") as resp:
            assert resp.status == 200
        status, answer = await decision(session, url, "12Gi")
        assert status == 200 and answer["response"]["allowed"] is False
        assert "8Gi" in answer["response"]["status"]["message"]
        status, answer = await decision(session, url, "4Gi")
        assert status == 200 and answer["response"]["allowed"] is True and "patch" in answer["response"]

        policy.offer(configmap({"max-memory": "16Gi"}, rv=3))  # raised: the same server admits 12Gi now
        status, answer = await decision(session, url, "12Gi")
        assert answer["response"]["allowed"] is True and "patch" in answer["response"]

        policy.offer(configmap({"max-memory": "lots"}, rv=4))  # invalid: 16Gi stays, and the metrics say so
        status, answer = await decision(session, url, "20Gi")
        assert answer["response"]["allowed"] is False and "16Gi" in answer["response"]["status"]["message"]
        async with session.get(url + "/readyz") as resp:
            assert resp.status == 200  # a valid policy is in use
        async with session.get(url + "/metrics") as resp:
            assert policy_metrics(await resp.text()) == {"valid": 0.0, "success": 2.0, "failure": 1.0}


async def test_flags_alone_are_a_valid_policy(pki: LocalPKI) -> None:
    async with webhook_with(pki, ClusterPolicy(InjectionSettings(max_memory="8Gi"))) as (url, session):
        async with session.get(url + "/readyz") as resp:
            assert resp.status == 200
        _, answer = await decision(session, url, "12Gi")
        assert answer["response"]["allowed"] is False
        async with session.get(url + "/metrics") as resp:
            assert policy_metrics(await resp.text()) == {"valid": 1.0, "success": 0.0, "failure": 0.0}


# --- the watch, against a fake API server ----------------------------------------------------------


class FakeConfigMaps:
    """``GET /api/v1/namespaces/gpufence/configmaps`` (list) and ``?watch=true`` (events the test pushes)."""

    def __init__(self) -> None:
        self.queries: list[dict[str, str]] = []
        self.items: list[dict[str, Any]] = []
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.forbidden = False  # answer lists as the API server does without the Role

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.queries.append(dict(request.query))
        if self.forbidden:
            return web.json_response({"kind": "Status", "code": 403, "reason": "Forbidden",
                                      "message": 'configmaps "gpufence-policy" is forbidden'}, status=403)
        if request.query.get("watch") != "true":
            return web.json_response({"kind": "ConfigMapList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": "10"}, "items": self.items})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        while (event := await self.events.get()) is not None:
            await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response


@pytest.fixture
async def fake_api() -> AsyncIterator[tuple[FakeConfigMaps, client.CoreV1Api]]:
    fake = FakeConfigMaps()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/gpufence/configmaps", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    configuration = client.Configuration()
    configuration.host = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake, client.CoreV1Api(client.ApiClient(configuration))
    finally:
        for _ in range(3):
            fake.events.put_nowait(None)
        await runner.cleanup()


async def test_the_watch_selects_the_configmap_by_name_and_follows_it(
        fake_api: tuple[FakeConfigMaps, client.CoreV1Api]) -> None:
    fake, api = fake_api
    policy = ClusterPolicy(source=SOURCE)
    watch = PolicyWatch(api, "gpufence", "gpufence-policy", policy, min_backoff=0.01)
    watch.start()
    try:
        assert await asyncio.to_thread(watch.wait_for, lambda w: w.has_synced(), 5.0)
        assert policy.current is None and "does not exist" in (policy.problem or "")  # listed: none yet
        fake.events.put_nowait({"type": "ADDED", "object": configmap({"max-memory": "8Gi"}, rv=11)})
        assert await asyncio.to_thread(watch.wait_for, lambda w: w.policy.current is not None, 5.0)
        assert policy.current is not None and policy.current.max_memory == "8Gi"
        fake.events.put_nowait({"type": "MODIFIED", "object": configmap({"max-memory": "4Gi"}, rv=12)})
        fake.events.put_nowait({"type": "DELETED", "object": configmap({"max-memory": "4Gi"}, rv=13)})
        assert await asyncio.to_thread(watch.wait_for, lambda w: w.policy.failures == 2, 5.0)
        assert policy.current.max_memory == "4Gi" and not policy.valid  # deleted: the last valid one stays
        for query in fake.queries:
            assert query["fieldSelector"] == "metadata.name=gpufence-policy"
        assert [q.get("watch") for q in fake.queries] == [None, "true"]
    finally:
        await asyncio.to_thread(watch.stop, 5.0)


async def test_an_unreadable_configmap_is_the_readiness_reason(
        fake_api: tuple[FakeConfigMaps, client.CoreV1Api]) -> None:
    fake, api = fake_api
    fake.forbidden = True
    policy = ClusterPolicy(source=SOURCE)
    watch = PolicyWatch(api, "gpufence", "gpufence-policy", policy, min_backoff=0.01, max_backoff=0.05)
    watch.start()
    try:
        assert await asyncio.to_thread(watch.wait_for, lambda w: "403" in (w.policy.problem or ""), 5.0)
        reason = policy.not_ready_reason() or ""
        assert "cannot read ConfigMap gpufence/gpufence-policy" in reason and "Forbidden" in reason, reason
        fake.forbidden = False  # the Role arrives: the watch recovers by itself
        fake.items = [configmap({"max-memory": "8Gi"})]
        assert await asyncio.to_thread(watch.wait_for, lambda w: w.policy.current is not None, 5.0)
        assert policy.not_ready_reason() is None
    finally:
        await asyncio.to_thread(watch.stop, 5.0)
