"""A sidecar of the pod author's own making, judged through the real API server.

The forgeries (tests/support/forgeries.py's FORGERIES, all of them) start from a pod the webhook
really mutated for the tenant (right image, command, status annotation), as the API server stored
it after its defaulting; each weakens one thing. They are sent by the tenant (an ``edit``
ServiceAccount, tests/e2e/tenant.py). With the webhook up, the webhook rebuilds what is gpufence's
or denies the pod; with it killed, the API server refuses every one (failurePolicy Fail), the
untouched copy included: nothing is stored that gpufence did not judge.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant, make_tenant
from tests.support.forgeries import CEILINGS, FORGERIES

SHARES = {"gpufence.io/memory": "4Gi", "gpufence.io/compute": "50"}


def _injected_template(tenant: Tenant) -> dict[str, Any]:
    """What the webhook makes of the tenant's GPU pod, as stored (dry run), without server fields."""
    real = kube.create_pod(tenant.api, tenant.namespace, kube.gpu_pod(annotations=SHARES), dry_run=True)
    assert real.admitted and kube.is_mutated(real.obj), real.message
    template = kube.without_server_fields(real.obj)
    template["metadata"].pop("name")
    template["spec"].pop("nodeName", None)
    return template


def test_a_forged_sidecar_is_rebuilt_or_denied_and_with_the_webhook_down_refused(
    cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path,
):
    tenant = make_tenant(cluster, admin, tmp_path, annotations=CEILINGS)
    template = _injected_template(tenant)
    copied = copy.deepcopy(template)
    copied["metadata"]["name"] = kube.unique("copy")
    untouched = kube.create_pod(tenant.api, tenant.namespace, copied)
    assert untouched.admitted, untouched.message  # a true copy of an injection is what the webhook makes
    wrong = kube.forgeries_misjudged(tenant.api, tenant.namespace, template, FORGERIES, webhook_up=True)
    assert not wrong, wrong

    webhook.stop("KILL")
    wrong = kube.forgeries_misjudged(tenant.api, tenant.namespace, template, FORGERIES, webhook_up=False)
    assert not wrong, wrong
    copied["metadata"]["name"] = kube.unique("copy")
    assert kube.outage_problem(kube.create_pod(tenant.api, tenant.namespace, copied)) is None


def test_with_the_webhook_up_a_workload_may_not_use_the_enforcers_volume_or_port(
    cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path,
):
    """The injected gpufence-state volume need not exist in the submitted pod for a workload to
    mount it (the API server validates after the webhook added it): the webhook denies the mount,
    and the metrics port (declaring it made the enforcer fall back to an exec probe)."""
    tenant = make_tenant(cluster, admin, tmp_path, annotations=CEILINGS)
    _injected_template(tenant)  # the webhook knows the namespace
    mounts = kube.gpu_pod(annotations=SHARES)
    mounts["spec"]["containers"][0]["volumeMounts"] = [{"name": "gpufence-state", "mountPath": "/var/run/gpufence"}]
    refused = kube.create_pod(tenant.api, tenant.namespace, mounts)
    assert not refused.admitted and refused.status == 400, refused.message
    assert 'container "trainer" mounts volume "gpufence-state"' in refused.message, refused.message

    port = kube.gpu_pod(annotations=SHARES)
    port["spec"]["containers"][0]["ports"] = [{"containerPort": 9401, "name": "metrics"}]
    refused = kube.create_pod(tenant.api, tenant.namespace, port)
    assert not refused.admitted and refused.status == 400, refused.message
    assert 'container "trainer" declares port 9401' in refused.message, refused.message

    fine = kube.gpu_pod(annotations=SHARES)
    fine["spec"]["containers"][0]["ports"] = [{"containerPort": 9402, "name": "metrics"}]
    admitted = kube.create_pod(tenant.api, tenant.namespace, fine)
    assert admitted.admitted and kube.is_mutated(admitted.obj), admitted.message
