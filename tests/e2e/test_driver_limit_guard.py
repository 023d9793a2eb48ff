"""The driver's GPU memory limit variables on the real kube-apiserver (1.30 and 1.37).

With the webhook up, a GPU pod pinned to nodes labelled gpufence.io/driver-memory-limits=true
(driver-memory-limits: auto, as shipped) gets NVIDIA_GPU_MEMORY_LIMIT / _REQUEST from its share,
and an author's own value is replaced. With the webhook killed (failurePolicy Ignore), the guard
alone judges: it admits a true copy of the webhook's output and refuses each of
tests/unit/guard/test_limit_env.py's ``LIMIT_FORGERIES`` (missing, different, referenced, repeated
or unasked-for limit variables), evaluated by the API server's own CEL with its cost budget.
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
from tests.unit.guard.test_limit_env import LIMIT_FORGERIES, SHARES, workload_env


def _pinned_gpu_pod(env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    pod = kube.gpu_pod(annotations=dict(SHARES))
    pod["spec"]["nodeSelector"] = {DRIVER_LIMITS_NODE_LABEL: "true"}
    if env:
        pod["spec"]["containers"][0]["env"].extend(env)
    return pod


def _limits(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in workload_env(pod)
            if e["name"] in (ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST)}


def test_the_guard_refuses_wrong_driver_limits_while_the_webhook_is_down(
    cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path,
):
    tenant = make_tenant(cluster, admin, tmp_path, annotations={})  # no ceilings: the shares as asked
    # The webhook learns of the new namespace from a watch: wait until it mutates there.
    real = kube.wait_for(lambda: (c := kube.create_pod(tenant.api, tenant.namespace, _pinned_gpu_pod(),
                                                       dry_run=True)).admitted and kube.is_mutated(c.obj) and c,
                         "the webhook to see the new namespace")
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
    webhook.stop("KILL")  # failurePolicy Ignore: only the guard stands between the pod and the cluster
    copied = copy.deepcopy(template)
    copied["metadata"]["name"] = kube.unique("copy")
    untouched = kube.create_pod(tenant.api, tenant.namespace, copied)
    assert untouched.admitted, untouched.message

    wrong = kube.forgeries_not_refused(tenant.api, tenant.namespace, template, LIMIT_FORGERIES)
    assert not wrong, wrong


def test_a_large_gpu_pod_stays_within_the_guards_cost_budget(
    cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path,
):
    """The limit check walks every GPU container's env: with 8 GPU containers of 250 variables each
    (and a driver limit to find in each), the API server's runtime cost budget still admits the pod."""
    tenant = make_tenant(cluster, admin, tmp_path, annotations={})
    pod = _pinned_gpu_pod([{"name": f"SETTING_{i}", "value": "x" * 40} for i in range(250)])
    first = pod["spec"]["containers"][0]
    pod["spec"]["containers"] = [{**copy.deepcopy(first), "name": f"trainer-{n}"} for n in range(8)]

    def settled() -> kube.Created | None:
        """The answer once the webhook mutates in the new namespace, or a refusal for cost."""
        created = kube.create_pod(tenant.api, tenant.namespace, copy.deepcopy(pod), dry_run=True)
        if (created.admitted and kube.is_mutated(created.obj)) or (not created.admitted and "cost" in created.message):
            return created
        return None

    result = kube.wait_for(settled, "the webhook to see the new namespace")
    assert result.admitted, result.message
    (env,) = {tuple(e["name"] for e in c["env"] if e["name"].startswith("NVIDIA_GPU_MEMORY"))
              for c in result.obj["spec"]["containers"] if c["name"].startswith("trainer-")}
    assert env == (ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST)
