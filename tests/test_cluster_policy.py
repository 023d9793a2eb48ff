"""The cluster policy ConfigMap: parsing with the flags' converters, reloading, and what the server
does before a first valid policy and after a change (gpufence/webhook/cluster_policy.py).

The watch runs against a small fake API server here (as tests/test_namespaces.py does) and against
the real kube-apiserver in tests/e2e/test_policy_reload.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from gpufence.webhook.cli import POLICY_FLAGS, parse_args, settings_from_args
from gpufence.webhook.cluster_policy import ClusterPolicy, PolicyError, PolicyWatch, parse_policy
from gpufence.webhook.server import create_app, start_server
from gpufence.webhook.settings import AllNamespacesOptedIn, InjectionSettings
from gpufence.webhook.tls import CertReloader
from tests.tlsutil import FAST_LIMITS, LocalPKI, make_pki, pod_review

TLS = ["--tls-cert-file", "c.crt", "--tls-private-key-file", "c.key"]
SOURCE = "gpufence/gpufence-policy"
EVENT_ATTRIBUTE = "gpufence_event"  # where gpufence.logs.log_event puts the event name on the record

# A non-default value for every InjectionSettings field, as ConfigMap data (repeatable flags comma-separated).
EVERY_KEY = {
    "sidecar-image": "img:2", "sidecar-image-pull-policy": "Always",
    "gpu-resource-name": "nvidia.com/gpu, nvidia.com/mig-1g.10gb", "sidecar-mode": "container",
    "sidecar-metrics-port": "9500", "sidecar-cpu-request": "20m", "sidecar-cpu-limit": "1",
    "sidecar-memory-request": "64Mi", "sidecar-memory-limit": "384Mi", "default-memory": "25%",
    "default-compute": "50", "max-memory": "40Gi", "max-compute": "25", "default-mode": "audit",
    "allow-audit": "true", "allow-opt-out": "yes", "default-grace-period": "30s", "sidecar-poll-interval": "250ms",
    "sidecar-nvidia-visible-devices": "void", "sidecar-nvidia-driver-capabilities": "utility,compute",
    "sidecar-mount-host-proc": "true", "sidecar-host-proc-mount-path": "/hp", "void-non-gpu-containers": "false",
    "mps-limits": "true", "preload-library": "/opt/libvgpu.so", "preload-library-mount-dir": "/pre",
    "gpu-memory": "nvidia.com/gpu=80Gi,nvidia.com/mig-1g.10gb=10Gi", "pytorch-memory-fraction": "true",
    "framework-memory-headroom": "1Gi",
}


def configmap(data: dict[str, str] | None, rv: int = 1) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": "gpufence-policy", "namespace": "gpufence", "resourceVersion": str(rv)}}
    if data is not None:
        obj["data"] = data
    return obj


# --- parsing ---------------------------------------------------------------------------------------


def test_every_policy_flag_is_a_key_and_parses_as_the_flag_does() -> None:
    assert set(EVERY_KEY) == {f.name for f in POLICY_FLAGS}
    from_configmap = parse_policy(EVERY_KEY)
    argv = [f"--{key}={item.strip()}" for key, value in EVERY_KEY.items()
            for item in (value.split(",") if next(f for f in POLICY_FLAGS if f.name == key).repeat else [value])]
    assert from_configmap == settings_from_args(parse_args(TLS + argv, environ={}))
    defaults = InjectionSettings()
    assert [f.name for f in dataclasses.fields(InjectionSettings)
            if getattr(from_configmap, f.name) == getattr(defaults, f.name)] == []


def test_absent_and_empty_keys_are_the_defaults() -> None:
    assert parse_policy(None) == parse_policy({}) == InjectionSettings()
    assert parse_policy(dict.fromkeys(EVERY_KEY, "")) == InjectionSettings()
    assert parse_policy({"max-memory": "25%", "default-memory": ""}) == InjectionSettings(max_memory="25%")


@pytest.mark.parametrize(("data", "needles"), [
    ({"max-memory": "lots"}, ['key "max-memory"', "'lots'", "quantity", 'e.g. max-memory: "25%"']),
    ({"allow-audit": "maybe"}, ['key "allow-audit"', "'maybe'", '"true" or "false"', 'e.g. allow-audit: "false"']),
    ({"sidecar-poll-interval": "1ms"}, ["'1ms'", "between 0.05s and 60s", 'e.g. sidecar-poll-interval: "500ms"']),
    ({"gpu-resource-name": "nvidia.com/gpu,,x"}, ['key "gpu-resource-name"', "(comma-separated)", "must not be empty",
                                                  'e.g. gpu-resource-name: "nvidia.com/gpu"']),
    ({"gpu-memory": "80Gi"}, ["RESOURCE=QUANTITY", 'e.g. gpu-memory: "nvidia.com/gpu=80Gi"']),
    ({"default-mode": "Audit"}, ["'Audit'", "use one of enforce, audit", 'e.g. default-mode: "enforce"']),
    ({"max-mem": "25%"}, ['unknown key "max-mem"', 'did you mean "max-memory"?', "--help"]),
    ({"poll-interval": "1s"}, ['"poll-interval" is the old name of "sidecar-poll-interval"']),
    ({"port": "9443"}, ['"port" is a server flag', "(--port)"]),
    ({"policy-configmap": "a/b"}, ['"policy-configmap" is a server flag']),
    ({"allow-audit": False}, ['key "allow-audit" is not a string']),  # a YAML boolean written unquoted
])
def test_bad_keys_and_values_name_the_key_the_value_the_rule_and_an_example(data: dict[str, Any],
                                                                             needles: list[str]) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(data)
    message = str(raised.value)
    assert message.startswith(f"ConfigMap {SOURCE}: ")
    for needle in needles:
        assert needle in message, message


@given(st.sampled_from(sorted(EVERY_KEY)), st.text(max_size=40))
def test_any_text_in_any_key_is_a_policy_or_a_policy_error(key: str, text: str) -> None:
    """Whatever an admin writes, the webhook gets settings or a message, never a traceback."""
    try:
        parse_policy({key: text})
    except PolicyError as exc:
        assert f'key "{key}"' in str(exc)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy({"max-memory": "lots", "max-compute": "150", "colour": "blue"}, binary_keys=("blob",))
    message = str(raised.value)
    for key in ("max-memory", "max-compute", "colour", "blob"):
        assert f'"{key}"' in message, message
    assert "binaryData" in message


# --- reloading --------------------------------------------------------------------------------------


def events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int]]:
    return [(getattr(r, EVENT_ATTRIBUTE, ""), r.levelno) for r in caplog.records if r.name.endswith("cluster_policy")]


def test_a_valid_version_is_swapped_in_whole_and_an_invalid_one_keeps_the_last(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    policy = ClusterPolicy(source=SOURCE)
    assert policy.current is None and not policy.valid
    assert "has not been read yet" in (policy.not_ready_reason() or "")

    assert policy.offer(configmap({"max-memory": "20Gi"}, rv=5))
    first = policy.current
    assert first is not None and first.max_memory == "20Gi" and policy.valid and policy.not_ready_reason() is None
    assert policy.offer(configmap({"max-memory": "8Gi"}, rv=6))
    assert policy.current is not first and policy.current.max_memory == "8Gi" and first.max_memory == "20Gi"
    assert (policy.successes, policy.failures, policy.applied_version) == (2, 0, "6")

    kept = policy.current
    assert not policy.offer(configmap({"max-memory": "lots"}, rv=7))
    assert policy.current is kept and not policy.valid and "'lots'" in (policy.problem or "")
    assert policy.not_ready_reason() is None  # still serving the last valid version
    assert not policy.offer(None)  # deleted
    assert policy.current is kept and "does not exist" in (policy.problem or "")
    assert (policy.successes, policy.failures) == (2, 2)

    assert policy.offer(configmap({"max-memory": "8Gi"}, rv=9))  # fixed: the same policy, valid again
    assert policy.valid and policy.successes == 3
    assert policy.offer(configmap({"max-memory": "8Gi"}, rv=9))  # a relist of the same version: no news
    assert policy.successes == 3
    assert events(caplog) == [("policy_loaded", logging.INFO), ("policy_loaded", logging.INFO),
                              ("policy_invalid", logging.ERROR), ("policy_missing", logging.ERROR),
                              ("policy_loaded", logging.INFO)]
    invalid = next(r for r in caplog.records if getattr(r, EVENT_ATTRIBUTE, "") == "policy_invalid")
    assert "keeping the last valid version (resourceVersion 6)" in invalid.getMessage()


def test_an_invalid_first_version_leaves_no_policy_and_says_why() -> None:
    policy = ClusterPolicy(source=SOURCE)
    assert not policy.offer(configmap({"max-compute": "150"}))
    assert policy.current is None
    reason = policy.not_ready_reason() or ""
    assert reason.startswith("no valid cluster policy yet:") and 'key "max-compute"' in reason


# --- the server with a policy from the ConfigMap ---------------------------------------------------


@pytest.fixture
def pki(tmp_path: Any) -> LocalPKI:
    return make_pki(tmp_path)


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
        # failurePolicy Ignore: the API server admits unmutated and the guard decides.
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
