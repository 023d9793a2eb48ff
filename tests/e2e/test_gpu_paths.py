"""Every way a pod gets a GPU, through the real API server as a tenant (``edit``) submits it.

The webhook takes these for GPU pods (gpufence/webhook/core/gpu_paths.py, on /mutate and on /validate):
renamed time-sliced GPUs (``nvidia.com/gpu.shared``), MIG slices
(``nvidia.com/mig-1g.10gb``) and DRA claims. A container that gets a device never gets
``NVIDIA_VISIBLE_DEVICES=void``: the kubelet appends the container's own env after the device
plugin's, so ``void`` would take the device away.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.kube import container, enforcer_config
from tests.e2e.tenant import Tenant
from tests.support.prerequisites import skip_by_design

SHARE = {"gpufence.io/memory": "4Gi", "gpufence.io/compute": "20"}  # within the tenant's ceilings


def served(api: client.ApiClient, group_version: str) -> bool:
    """Whether the API server serves ``group_version`` (e.g. resource.k8s.io/v1)."""
    try:
        client.CustomObjectsApi(api).get_api_resources(*group_version.split("/"))
        return True
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise


def device_pod(resources: dict[str, Any], *, claims: list[dict[str, str]] | None = None,
               voided: bool = False) -> dict[str, Any]:
    """A tenant's training pod whose container gets its device through ``resources``, beside a log
    shipper that gets none (``voided``: with the ``NVIDIA_VISIBLE_DEVICES=void`` the webhook gives it)."""
    pod = kube.gpu_pod(annotations=dict(SHARE))
    trainer = pod["spec"]["containers"][0]
    trainer["resources"] = {"requests": {"cpu": "500m"}, **resources}
    logs = {"name": "logs", "image": "example.com/fluent-bit:3"}
    if voided:
        logs["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    pod["spec"]["containers"].append(logs)
    if claims is not None:
        pod["spec"]["resourceClaims"] = claims
    return pod


@pytest.mark.parametrize("resource", ["nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb"])
def test_renamed_and_mig_gpus_are_injected_and_keep_their_device(
    tenant: Tenant, webhook: WebhookProcess, resource: str,
):
    created = kube.create_pod(tenant.api, tenant.namespace, device_pod({"limits": {resource: "1"}}))
    assert created.admitted, created.message
    stored = created.obj
    assert kube.is_mutated(stored)
    assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(container(stored, "trainer"))  # the plugin's value stands
    assert kube.env_of(container(stored, "logs"))["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert enforcer_config(stored)["containers"] == {
        "trainer": {"computePercent": 20, "gpus": 1, "memoryBytes": 4 << 30}}

    webhook.stop("KILL")  # failurePolicy Fail: the API server refuses what gpufence cannot judge
    down = kube.create_pod(tenant.api, tenant.namespace, device_pod({"limits": {resource: "1"}}))
    assert kube.outage_problem(down) is None, down.message


def test_a_dra_claim_from_a_template_is_injected_and_refused_while_the_webhook_is_down(
    cluster: ControlPlane, admin: client.ApiClient, tenant: Tenant, webhook: WebhookProcess,
):
    if not served(admin, "resource.k8s.io/v1"):
        skip_by_design("dra-not-served", f"Kubernetes {cluster.version} does not serve resource.k8s.io/v1")
    device_class = kube.unique("gpu.nvidia.com")
    kube.create(admin, "/apis/resource.k8s.io/v1/deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": device_class},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}})
    assert tenant.can(cluster, "create", "resourceclaimtemplates.resource.k8s.io")
    templates = f"/apis/resource.k8s.io/v1/namespaces/{tenant.namespace}/resourceclaimtemplates"
    template = kube.create(tenant.api, templates, {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "single-gpu"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]}}}})
    assert template.admitted, template.message

    def claim_pod() -> dict[str, Any]:
        return device_pod({"claims": [{"name": "gpu"}]},
                          claims=[{"name": "gpu", "resourceClaimTemplateName": "single-gpu"}])

    created = kube.create_pod(tenant.api, tenant.namespace, claim_pod())
    assert created.admitted, created.message
    stored = created.obj
    assert kube.is_mutated(stored)
    # The sidecar holds the pod's GPU claim, so the runtime hands it the devices (CDI) and NVML sees them.
    assert container(stored, SIDECAR_NAME)["resources"]["claims"] == [{"name": "gpu"}]
    assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(container(stored, "trainer"))
    assert kube.env_of(container(stored, "logs"))["NVIDIA_VISIBLE_DEVICES"] == "void"
    # No "gpus": the claim's device count is in the ResourceClaim, not the pod.
    assert enforcer_config(stored)["containers"] == {"trainer": {"computePercent": 20, "memoryBytes": 4 << 30}}

    webhook.stop("KILL")
    assert kube.outage_problem(kube.create_pod(tenant.api, tenant.namespace, claim_pod())) is None


def test_claims_beside_a_gpu_resource_break_nothing_with_or_without_dra(
    admin: client.ApiClient, tenant: Tenant, webhook: WebhookProcess,
):
    """On every version: where DRA is off (1.30's default) the API server drops the claims after the
    mutating webhook and before validation, so /validate judges the pod without them; where DRA is
    served the sidecar holds the claim too."""
    dra = served(admin, "resource.k8s.io/v1")
    pod = device_pod({"limits": {"nvidia.com/gpu": "1"}, "claims": [{"name": "gpu"}]},
                     claims=[{"name": "gpu", "resourceClaimTemplateName": "absent-template"}])
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted, created.message
    stored = created.obj
    assert kube.is_mutated(stored)
    assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(container(stored, "trainer"))
    assert ("resourceClaims" in stored["spec"]) is dra
    assert container(stored, SIDECAR_NAME)["resources"].get("claims") == ([{"name": "gpu"}] if dra else None)
    # Held to its device plugin count, which /validate sees whether or not the claims survive.
    assert enforcer_config(stored)["containers"]["trainer"]["gpus"] == 1

    # A claim alone: the webhook injects. Where the claims are dropped before validation, the
    # trainer would be left with no device and no void (a CUDA image's own NVIDIA_VISIBLE_DEVICES=all
    # would then reach the node's GPUs): /validate refuses it, saying why.
    claim_only = device_pod({"claims": [{"name": "gpu"}]},
                            claims=[{"name": "gpu", "resourceClaimTemplateName": "absent-template"}])
    created = kube.create_pod(tenant.api, tenant.namespace, claim_only)
    if dra:
        assert created.admitted, created.message
        assert kube.is_mutated(created.obj)
        assert "gpus" not in enforcer_config(created.obj)["containers"]["trainer"]
    else:
        assert kube.denied_by(created, "verify.gpufence.io"), created.message
        assert "re-checked the pod after every mutating admission step" in created.message, created.message


def test_an_exclusive_mig_profile_gets_no_sidecar_and_keeps_its_device(
    tenant: Tenant, webhook: WebhookProcess, set_policy: Callable[[dict[str, str]], None],
):
    """The admin declares a MIG profile never time-sliced: the webhook lets its pods run without the
    enforcer, the slice's container keeps its device, and other MIG profiles stay shared."""
    exclusive = {"limits": {"nvidia.com/mig-3g.40gb": "1"}}
    set_policy({"exclusive-gpu-resource-name": "nvidia.com/mig-3g.40gb"})
    created = kube.wait_for(lambda: (c := kube.create_pod(tenant.api, tenant.namespace, device_pod(exclusive)))
                            .admitted and not kube.is_mutated(c.obj) and c, "the webhook to read the new policy")
    stored = created.obj
    assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(container(stored, "trainer"))
    assert kube.env_of(container(stored, "logs"))["NVIDIA_VISIBLE_DEVICES"] == "void"

    shared = kube.create_pod(tenant.api, tenant.namespace, device_pod({"limits": {"nvidia.com/mig-1g.10gb": "1"}}))
    assert shared.admitted and kube.is_mutated(shared.obj), shared.message
