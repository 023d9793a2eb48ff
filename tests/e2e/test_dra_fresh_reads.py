"""/mutate and /validate of one create agree when the webhook's DRA watch lags behind a claim just
created (gpufence/webhook/cluster/dra_cache.py ``for_review``; docs/internals/architecture.md).

The webhook (its real server, in this process, over real TLS) resolves claims through its watch
cache of the real kube-apiserver. Its ResourceClaim watch is held back (stopped after its list,
so it sees no event) while a claim is created; the pod naming that claim goes to /mutate; then the
watch catches up (a new list) before the mutated pod goes to /validate, as when a busy machine
delays the watch between the two calls of one create. Both calls must compute the same pod: the
mutated pod passes /validate and carries the claim's memory as its share.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest
from kubernetes import client

from gpufence.webhook.client import pod_admission_review
from gpufence.webhook.cluster.dra_cache import DraCache, ObjectWatch, _claim
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings
from gpufence.webhook.server import create_app, start_server
from gpufence.webhook.tls import CertReloader
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.kube import enforcer_config
from tests.e2e.test_dra import API, device_class, dra  # noqa: F401  (fixture)
from tests.support.tlsutil import make_pki

GIB = 1 << 30


@pytest.fixture
async def served_webhook(dra: None, cluster: ControlPlane,  # noqa: F811
                         tmp_path: Path) -> AsyncIterator[tuple[str, DraCache, Any]]:
    pki = make_pki(tmp_path / "pki")
    # The webhook's own client (its pool and watches), as in its process; never the tests' admin client.
    cache = DraCache(client.CustomObjectsApi(kube.api_client(cluster.admin_kubeconfig)), min_backoff=0.1,
                     max_backoff=1.0)
    reloader = CertReloader(pki.volume.cert_file, pki.volume.key_file)
    app = create_app(InjectionSettings(), AllNamespacesOptedIn(), reloader, claims=cache)
    running = await start_server(app, host="127.0.0.1", port=0)  # starts the cache with the app
    try:
        yield f"https://127.0.0.1:{running.port}", cache, pki
    finally:
        await running.close()


async def judge(session: aiohttp.ClientSession, url: str, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    body = pod_admission_review(pod, uid=str(uuid.uuid4()), namespace=namespace, username="tenant")
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        response: dict[str, Any] = (await resp.json())["response"]
        return response


def claim_pod(namespace: str, claim_name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": namespace},
            "spec": {"containers": [{"name": "trainer", "image": "example.com/cuda:12",
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}]}}


async def test_mutate_and_validate_agree_while_the_claim_watch_lags(
    served_webhook: tuple[str, DraCache, Any], admin: client.ApiClient, cluster: ControlPlane,
) -> None:
    url, cache, pki = served_webhook
    gpu_class = kube.unique("fresh-gpu")
    assert kube.create(admin, f"{API}/deviceclasses", device_class(gpu_class, "gpu.nvidia.com")).admitted
    assert cache.classes.wait_for(lambda w: ("", gpu_class) in w.items, timeout=60), "the class never arrived"
    assert cache.claims.wait_for(lambda w: w.has_synced(), timeout=60)
    held = cache.claims
    held.stop(5)  # the claim watch is held back: it sees no event from here on

    ns = kube.create_namespace(admin, "fresh-dra")
    claim = kube.unique("fresh-claim")
    made = kube.create(admin, f"{API}/namespaces/{ns}/resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": gpu_class, "capacity": {"requests": {"memory": "6Gi"}}}}]}}})
    assert made.admitted, made.message
    assert (ns, claim) not in held.items  # what /mutate's cache shows: no such claim

    pod = claim_pod(ns, claim)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pki.client_context())) as session:
        mutated = await judge(session, f"{url}/mutate", ns, pod)
        assert mutated["allowed"], mutated
        pod = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(mutated["patch"])))

        # The watch catches up (a new list) before /validate, as a delayed watch does.
        caught_up = ObjectWatch(client.CustomObjectsApi(kube.api_client(cluster.admin_kubeconfig)), "resourceclaims",
                                _claim, kind="ResourceClaim")
        caught_up.start()
        try:
            assert caught_up.wait_for(lambda w: (ns, claim) in w.items, timeout=60), "the claim never listed"
            cache.claims = caught_up
            verified = await judge(session, f"{url}/validate", ns, pod)
        finally:
            caught_up.stop(5)
    assert verified["allowed"], verified["status"]["message"]
    assert not any("could not be resolved" in w for w in mutated.get("warnings") or []), mutated["warnings"]
    assert enforcer_config(pod)["containers"]["trainer"]["memoryBytes"] == 6 * GIB
