"""The namespace watch cache against a small fake Kubernetes API server (plain HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes import client

from gpufence.contract import INJECTION_LABEL, NAMESPACE_DEFAULT_MEMORY
from gpufence.webhook.cluster.namespaces import NamespaceCache, load_namespace_lookup
from gpufence.webhook.core.settings import AllNamespacesOptedIn

END = None  # pushed on the event queue: end the current watch stream


def namespace(name: str, rv: int, labels: dict[str, str] | None = None,
              annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "resourceVersion": str(rv), "labels": labels or {},
                         "annotations": annotations or {}}}


class FakeApiServer:
    """Serves ``GET /api/v1/namespaces`` (list) and ``?watch=true`` (events pushed by the test)."""

    def __init__(self) -> None:
        self.items = {"team-a": namespace("team-a", 5, {INJECTION_LABEL: "enabled"}),
                      "default": namespace("default", 3)}
        self.resource_version = 10
        self.requests: list[dict[str, str]] = []
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.fail_lists = 0  # answer this many list calls with a 500
        self.watching = asyncio.Event()
        self._arrived = asyncio.Condition()

    async def wait_requests(self, count: int) -> None:
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: len(self.requests) >= count), 5)

    def list_calls(self) -> list[dict[str, str]]:
        return [q for q in self.requests if q.get("watch") != "true"]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        async with self._arrived:
            self.requests.append(dict(request.query))
            self._arrived.notify_all()
        if request.query.get("watch") != "true":
            if self.fail_lists:
                self.fail_lists -= 1
                return web.json_response({"kind": "Status", "code": 500, "message": "boom"}, status=500)
            return web.json_response({"kind": "NamespaceList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.resource_version)},
                                      "items": list(self.items.values())})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        self.watching.set()
        while (event := await self.events.get()) is not END:
            await response.write(json.dumps(event).encode() + b"\n")
        self.watching.clear()
        await response.write_eof()
        return response

    def push(self, kind: str, obj: dict[str, Any]) -> None:
        self.events.put_nowait({"type": kind, "object": obj})


@pytest.fixture
async def fake_api() -> AsyncIterator[tuple[FakeApiServer, str]]:
    fake = FakeApiServer()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        for _ in range(4):
            fake.events.put_nowait(END)
        await runner.cleanup()


def api_for(host: str) -> client.CoreV1Api:
    configuration = client.Configuration()
    configuration.host = host
    return client.CoreV1Api(client.ApiClient(configuration))


async def wait_for(cache: NamespaceCache, predicate: Any) -> None:
    assert await asyncio.to_thread(cache.wait_for, predicate, 5.0)


async def test_lists_then_watches_and_applies_updates(fake_api: tuple[FakeApiServer, str]):
    fake, host = fake_api
    cache = NamespaceCache(api_for(host), watch_timeout_seconds=60)
    assert not cache.has_synced() and cache.get("team-a") is None
    cache.start()
    try:
        await wait_for(cache, lambda c: c.has_synced())
        assert cache.get("team-a").opted_in and not cache.get("default").opted_in
        await asyncio.wait_for(fake.watching.wait(), 5)
        list_query, watch_query = fake.requests
        assert "watch" not in list_query
        assert watch_query["watch"] == "true" and watch_query["resourceVersion"] == "10"
        assert watch_query["allowWatchBookmarks"] == "true" and watch_query["timeoutSeconds"] == "60"

        fake.push("MODIFIED", namespace("default", 11, {INJECTION_LABEL: "enabled"}, {NAMESPACE_DEFAULT_MEMORY: "8Gi"}))
        fake.push("ADDED", namespace("team-b", 12, {"x": "y"}))
        fake.push("DELETED", namespace("team-a", 13))
        await wait_for(cache, lambda c: c.get("team-a") is None and c.get("team-b") is not None)
        default = cache.get("default")
        assert default.opted_in and default.annotations[NAMESPACE_DEFAULT_MEMORY] == "8Gi"
        assert cache.get("team-b").labels == {"x": "y"}

        # The server ends the watch: the cache resumes from the last resourceVersion, without a relist.
        fake.push("BOOKMARK", {"kind": "Namespace", "metadata": {"resourceVersion": "20"}})
        fake.events.put_nowait(END)
        await fake.wait_requests(3)
        assert fake.requests[2]["watch"] == "true" and fake.requests[2]["resourceVersion"] == "20"
        assert len(fake.list_calls()) == 1
    finally:
        await asyncio.to_thread(cache.stop, 5.0)


async def test_410_gone_relists(fake_api: tuple[FakeApiServer, str]):
    fake, host = fake_api
    cache = NamespaceCache(api_for(host), min_backoff=0.01)
    cache.start()
    try:
        await asyncio.wait_for(fake.watching.wait(), 5)
        fake.items["late"] = namespace("late", 30)  # created while the watch was broken
        fake.resource_version = 30
        fake.events.put_nowait({"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                            "message": "too old resource version"}})
        fake.events.put_nowait(END)
        await wait_for(cache, lambda c: c.get("late") is not None)
        assert len(fake.list_calls()) == 2
    finally:
        await asyncio.to_thread(cache.stop, 5.0)


async def test_list_errors_are_retried_with_backoff(fake_api: tuple[FakeApiServer, str]):
    fake, host = fake_api
    fake.fail_lists = 2
    cache = NamespaceCache(api_for(host), min_backoff=0.01, max_backoff=0.05)
    cache.start()
    try:
        await wait_for(cache, lambda c: c.has_synced())
        assert len(fake.list_calls()) == 3
    finally:
        await asyncio.to_thread(cache.stop, 5.0)


def test_no_cluster_means_all_namespaces_opted_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="webhook.cluster.namespaces"):
        lookup = load_namespace_lookup()
    assert isinstance(lookup, AllNamespacesOptedIn)
    assert [r.getMessage() for r in caplog.records if "namespace defaults are off" in r.getMessage()]
    assert len(caplog.records) == 1


async def test_kubeconfig_gives_a_watch_cache(fake_api: tuple[FakeApiServer, str], tmp_path: Path):
    _, host = fake_api
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": host}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
    }))
    lookup = await asyncio.to_thread(load_namespace_lookup, str(kubeconfig))
    assert isinstance(lookup, NamespaceCache)
    lookup.start()
    try:
        await wait_for(lookup, lambda c: c.has_synced())
        assert lookup.get("team-a").opted_in
    finally:
        await asyncio.to_thread(lookup.stop, 5.0)
