"""The driver's GPU memory limit variables on the real kube-apiserver (1.30 and 1.37).

With the webhook up, a GPU pod pinned to nodes labelled gpufence.io/driver-memory-limits=true
(driver-memory-limits: auto, as shipped) gets NVIDIA_GPU_MEMORY_LIMIT / _REQUEST from its share,
and an author's own value is replaced: so is each of tests/support/forgeries.py's
``LIMIT_FORGERIES`` (missing, different, referenced, repeated or unasked-for limit variables) sent
as the tenant. With the webhook killed the API server refuses them all (failurePolicy Fail). And a
pod of 200 GPU containers is admitted and enforced: no CEL cost budget caps a pod any more.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kubernetes import client

from gpufence.contract import DRIVER_LIMITS_NODE_LABEL, ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import make_tenant
from tests.support.forgeries import LIMIT_FORGERIES, SHARES, workload_env


def _pinned_gpu_pod(env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    pod = kube.gpu_pod(annotations=dict(SHARES))
    pod["spec"]["nodeSelector"] = {DRIVER_LIMITS_NODE_LABEL: "true"}
    if env:
        pod["spec"]["containers"][0]["env"].extend(env)
    return pod


def _limits(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in workload_env(pod)
            if e["name"] in (ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST)}


def test_driver_limits_are_the_shares_whatever_the_author_wrote_and_refused_while_the_webhook_is_down(
    cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path,
):
    tenant = make_tenant(cluster, admin, tmp_path, annotations={})  # no ceilings: the shares as asked
    real = kube.create_pod(tenant.api, tenant.namespace, _pinned_gpu_pod(), dry_run=True)
    assert real.admitted and kube.is_mutated(real.obj), real.message
    assert _limits(real.obj) == {ENV_DRIVER_MEMORY_LIMIT: "4096", ENV_DRIVER_MEMORY_REQUEST: "4096"}

    # An author's own limit (a reference too) is replaced by the share's, as stored.
    authored = kube.create_pod(tenant.api, tenant.namespace, _pinned_gpu_pod([
        {"name": ENV_DRIVER_MEMORY_LIMIT, "value": "81920"},
        {"name": ENV_DRIVER_MEMORY_REQUEST, "valueFrom": {"configMapKeyRef": {"name": "limits", "key": "request"}}},
    ]))
    assert authored.admitted, authored.message
    assert _limits(authored.obj) == {ENV_DRIVER_MEMORY_LIMIT: "4096", ENV_DRIVER_MEMORY_REQUEST: "4096"}

    template = kube.without_server_fields(real.obj)
    template["metadata"].pop("name")
    template["spec"].pop("nodeName", None)
    wrong: dict[str, str] = {}
    for name, forge in LIMIT_FORGERIES.items():
        forged = copy.deepcopy(template)
        forged["metadata"]["name"] = kube.unique("forged")
        forge(forged)
        stored = kube.create_pod(tenant.api, tenant.namespace, forged)
        pinned = bool(forged["spec"].get("nodeSelector"))
        expected = {ENV_DRIVER_MEMORY_LIMIT: "4096", ENV_DRIVER_MEMORY_REQUEST: "4096"} if pinned else {}
        if not stored.admitted or _limits(stored.obj) != expected:
            wrong[name] = stored.message or f"stored with {_limits(stored.obj)}"
    assert not wrong, wrong

    webhook.stop("KILL")
    for name, forge in {"untouched": lambda _: None, **LIMIT_FORGERIES}.items():
        forged = copy.deepcopy(template)
        forged["metadata"]["name"] = kube.unique("down")
        forge(forged)
        problem = kube.outage_problem(kube.create_pod(tenant.api, tenant.namespace, forged))
        assert problem is None, (name, problem)


def test_a_pod_of_200_gpu_containers_is_admitted_and_enforced(
    cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path,
):
    """Each of 200 GPU containers, with 20 variables of its own, gets its share in the enforcer's
    config and the driver's limit in its env; with the guard's CEL the API server refused such a pod
    for its runtime cost budget."""
    tenant = make_tenant(cluster, admin, tmp_path, annotations={})
    pod = _pinned_gpu_pod([{"name": f"SETTING_{i}", "value": "x" * 40} for i in range(20)])
    first = pod["spec"]["containers"][0]
    pod["spec"]["containers"] = [{**copy.deepcopy(first), "name": f"trainer-{n}"} for n in range(200)]
    result = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert result.admitted and kube.is_mutated(result.obj), result.message
    config = kube.enforcer_config(result.obj)["containers"]
    assert set(config) == {f"trainer-{n}" for n in range(200)}
    assert {c["memoryBytes"] for c in config.values()} == {4 << 30}
    (env,) = {tuple(e["name"] for e in c["env"] if e["name"].startswith("NVIDIA_GPU_MEMORY"))
              for c in result.obj["spec"]["containers"] if c["name"].startswith("trainer-")}
    assert set(env) == {ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST}
