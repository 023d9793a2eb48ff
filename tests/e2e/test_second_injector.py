"""gpufence beside a second injector shaped like Istio's: both run, neither undoes the other.

The peer is a small TLS webhook written here. Like Istio's sidecar injector it adds a native
sidecar (``istio-proxy``, an init container with ``restartPolicy: Always``) in FRONT of the
existing init containers, records a status annotation, skips pods that already carry it, and is
registered with ``reinvocationPolicy: IfNeeded``. The API server calls the webhooks in order of
their configuration names and reinvokes each once when a later one changed the pod.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes import client

from gpufence.certs import pki
from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane, free_port
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.test_admission import assert_contract_mutation, assert_stable

PEER_NAME = "istio-proxy"
PEER_STATUS = "sidecar.istio.io/status"


def peer_patch(pod: dict[str, Any]) -> list[dict[str, Any]]:
    annotations = pod["metadata"].get("annotations") or {}
    if PEER_STATUS in annotations:
        return []
    proxy = {"name": PEER_NAME, "image": "example.com/proxyv2:1", "restartPolicy": "Always",
             "resources": {"requests": {"cpu": "10m", "memory": "40Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}}
    ops: list[dict[str, Any]] = []
    if pod["spec"].get("initContainers"):
        ops.append({"op": "add", "path": "/spec/initContainers/0", "value": proxy})
    else:
        ops.append({"op": "add", "path": "/spec/initContainers", "value": [proxy]})
    if not annotations:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    ops.append({"op": "add", "path": "/metadata/annotations/sidecar.istio.io~1status",
                "value": json.dumps({"containers": [PEER_NAME]})})
    return ops


class PeerInjector:
    def __init__(self, cert: Path, key: Path, patch: Any = None) -> None:
        self.patch = patch or peer_patch
        self.port = free_port()
        self.calls: list[list[str]] = []  # container names of each pod it was asked about
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ctx.load_cert_chain(str(cert), str(key))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _mutate(self, request: web.Request) -> web.Response:
        review = await request.json()
        pod = review["request"]["object"]
        self.calls.append(kube.container_names(pod))
        response: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": True}
        ops = self.patch(pod)
        if ops:
            response |= {"patchType": "JSONPatch", "patch": base64.b64encode(json.dumps(ops).encode()).decode()}
        return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                  "response": response})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/inject", self._mutate)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port, ssl_context=self._ctx).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> PeerInjector:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(params=["istio-like-sidecar-injector", "a-istio-like-sidecar-injector"],
                ids=["peer-runs-second", "peer-runs-first"])
def peer(cluster: ControlPlane, gpufence: WebhookProcess, tmp_path: Path,
         request: pytest.FixtureRequest) -> Iterator[PeerInjector]:
    """The peer's configuration name decides whether the API server calls it before or after gpufence."""
    ca = pki.make_ca("istio-like-ca")
    serving = pki.make_serving_cert(ca, ["127.0.0.1"])
    (tmp_path / "peer.crt").write_bytes(serving.cert_pem)
    (tmp_path / "peer.key").write_bytes(serving.key_pem)
    with PeerInjector(tmp_path / "peer.crt", tmp_path / "peer.key") as injector:
        config = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": request.param},
            "webhooks": [{
                "name": "sidecar-injector.istio.example", "admissionReviewVersions": ["v1"],
                "sideEffects": "None", "reinvocationPolicy": "IfNeeded", "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "clientConfig": {"url": f"https://127.0.0.1:{injector.port}/inject",
                                 "caBundle": base64.b64encode(ca.cert_pem).decode()},
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                           "resources": ["pods"]}],
                "namespaceSelector": {"matchLabels": {"istio-injection": "enabled"}},
            }],
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(config))
        try:
            yield injector
        finally:
            cluster.kubectl("delete", "mutatingwebhookconfiguration", request.param)


def test_both_injectors_apply_and_neither_undoes_the_other(admin: client.ApiClient, webhook: WebhookProcess,
                                                          peer: PeerInjector):
    namespace = kube.create_namespace(admin, "mesh", {**kube.OPT_IN, "istio-injection": "enabled"})
    kube.wait_for(lambda: kube.create_pod(admin, namespace, kube.plain_pod(), dry_run=True).obj["spec"]
                  .get("initContainers"), "the peer's configuration to take effect")
    peer.calls.clear()

    created = kube.create_pod(admin, namespace, kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"}))
    assert created.admitted, created.message
    assert peer.calls, "the peer injector was called"
    stored = created.obj
    names = kube.container_names(stored)
    assert names.count(PEER_NAME) == 1 and names.count(SIDECAR_NAME) == 1, names
    assert_contract_mutation_with_peer(stored)
    assert_stable(webhook, namespace, stored)
    assert peer_patch(kube.without_server_fields(stored)) == [], "the peer would change the stored pod again"


def assert_contract_mutation_with_peer(pod: dict[str, Any]) -> None:
    """The contract's mutation, allowing the peer's sidecar to sit in front of the enforcer."""
    inits = pod["spec"]["initContainers"]
    without_peer = {**pod, "spec": {**pod["spec"], "initContainers": [c for c in inits if c["name"] != PEER_NAME]}}
    assert_contract_mutation(without_peer, {"trainer"})


def weakening_patch(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """A mutating webhook that takes the enforcer's liveness probe away whenever it sees one: every
    time it is called, so gpufence's reinvocation and its own ping-pong to the last word."""
    for i, c in enumerate(pod["spec"].get("initContainers") or []):
        if c["name"] == SIDECAR_NAME and "livenessProbe" in c:
            return [{"op": "remove", "path": f"/spec/initContainers/{i}/livenessProbe"}]
    return []


def test_a_later_webhook_that_weakens_the_enforcer_gets_the_pod_refused(
    cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path,
):
    """Ordered after gpufence's (its configuration name sorts after "gpufence") and reinvoked after
    gpufence's reinvocation, the weakener has the last mutating word; verify.gpufence.io, which runs
    after every mutating step, refuses the pod and says where it differs."""
    ca = pki.make_ca("weakener-ca")
    serving = pki.make_serving_cert(ca, ["127.0.0.1"])
    (tmp_path / "weak.crt").write_bytes(serving.cert_pem)
    (tmp_path / "weak.key").write_bytes(serving.key_pem)
    namespace = kube.create_namespace(admin, "weak", {**kube.OPT_IN, "weaken": "yes"})
    with PeerInjector(tmp_path / "weak.crt", tmp_path / "weak.key", weakening_patch) as weakener:
        config = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "zz-weakener"},
            "webhooks": [{
                "name": "weaken.gpufence-tests.example", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "reinvocationPolicy": "IfNeeded", "failurePolicy": "Fail", "timeoutSeconds": 10,
                "clientConfig": {"url": f"https://127.0.0.1:{weakener.port}/inject",
                                 "caBundle": base64.b64encode(ca.cert_pem).decode()},
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
                "namespaceSelector": {"matchLabels": {"weaken": "yes"}},
            }],
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(config))
        try:
            refused = kube.wait_for(lambda: (c := kube.create_pod(admin, namespace, kube.gpu_pod())).status != 201
                                    and weakener.calls and c, "the weakener's configuration to take effect")
            assert kube.denied_by(refused, "verify.gpufence.io"), refused.message
            assert "livenessProbe" in refused.message and "after gpufence's webhook" in refused.message
            assert len(weakener.calls) >= 2, "the weakener was not reinvoked after gpufence's reinvocation"
        finally:
            cluster.kubectl("delete", "mutatingwebhookconfiguration", "zz-weakener")
