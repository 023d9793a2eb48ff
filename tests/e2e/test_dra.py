"""DRA claims resolved through their DeviceClasses, on the real API server (gpufence/webhook/core/dra.py,
its watch cache gpufence/webhook/cluster/dra_cache.py, reading as the webhook's ServiceAccount).

The pod a tenant creates gets what the admin's list decides (a claim not listed in
``non-gpu-resource-claims`` is a GPU claim, whatever it holds: a watch cache may lag behind a claim
just created): the resolution tells the author, in
admission warnings, where a claim holds no GPU, could not be resolved, or is listed but selects GPUs.
Where the API server does not serve ``resource.k8s.io/v1`` (1.30's default) nothing changes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from gpufence.contract import ANNOTATION_STATUS, SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.kube import container, enforcer_config
from tests.e2e.tenant import Tenant
from tests.e2e.test_gpu_paths import device_pod, served
from tests.e2e.test_policy_reload import logged
from tests.support.prerequisites import skip_by_design

API = "/apis/resource.k8s.io/v1"
_WARNING = re.compile(r'\d{3} \S+ "((?:[^"\\]|\\.)*)"')


def create_warned(api: client.ApiClient, path: str, body: dict[str, Any]) -> tuple[kube.Created, list[str]]:
    """``kube.create`` that also returns the API server's ``Warning`` headers (admission warnings)."""
    method, url, headers, data, _ = api.param_serialize(
        "POST", path, body=body, auth_settings=["BearerToken"],
        header_params={"Content-Type": "application/json", "Accept": "application/json"})
    resp = api.call_api(method, url, header_params=headers, body=data)
    raw = resp.read()
    warnings = [re.sub(r"\\(.)", r"\1", m.group(1)) for value in resp.headers.getlist("Warning")
                if (m := _WARNING.match(value))]
    if 200 <= resp.status < 300:
        return kube.Created(json.loads(raw), resp.status, ""), warnings
    try:
        message = json.loads(raw).get("message", "")
    except (TypeError, ValueError):
        message = raw.decode(errors="replace")
    return kube.Created(None, resp.status, message), warnings


def claim_warnings(warnings: list[str]) -> list[str]:
    return [w for w in warnings if w.startswith("gpufence: claim ")]


def device_class(name: str, driver: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{driver}'"}}], **spec}}


def claim_spec(device_class_name: str) -> dict[str, Any]:
    return {"devices": {"requests": [{"name": "dev", "exactly": {"deviceClassName": device_class_name}}]}}


@pytest.fixture
def dra(cluster: ControlPlane, admin: client.ApiClient) -> None:
    if not served(admin, "resource.k8s.io/v1"):
        skip_by_design("dra-not-served", f"Kubernetes {cluster.version} does not serve resource.k8s.io/v1")


def claim_pod(pod_claim: dict[str, str], *, voided: bool = False) -> dict[str, Any]:
    return device_pod({"claims": [{"name": "dev"}]}, claims=[{"name": "dev", **pod_claim}], voided=voided)


def resolved(webhook: WebhookProcess, namespace: str, pod_claim: dict[str, str]) -> list[str]:
    """The webhook's claim warnings for a pod using ``pod_claim``, once its cache knows the objects
    (they were created after its lists: the watches bring them)."""
    def answer() -> list[str] | None:
        warnings = claim_warnings(webhook.review(namespace, claim_pod(pod_claim)).get("warnings") or [])
        return None if any("could not be resolved" in w for w in warnings) else warnings
    return kube.wait_for(lambda: (w := answer()) is not None and [w], "the webhook's DRA cache")[0]


def test_claims_resolve_through_their_device_classes(
    dra: None, admin: client.ApiClient, tenant: Tenant, webhook: WebhookProcess,
    set_policy: Callable[[dict[str, str]], None],
):
    gpu_class, nic_class = kube.unique("gpu"), kube.unique("nic")
    for obj in (device_class(gpu_class, "gpu.nvidia.com"), device_class(nic_class, "nic.example.com")):
        assert kube.create(admin, f"{API}/deviceclasses", obj).admitted
    ns = tenant.namespace
    gpu_template, nic_template = kube.unique("single-gpu"), kube.unique("nic")
    shared_gpu, shared_nic = kube.unique("shared-gpu"), kube.unique("shared-nic")
    for name, cls in ((gpu_template, gpu_class), (nic_template, nic_class)):
        made = kube.create(tenant.api, f"{API}/namespaces/{ns}/resourceclaimtemplates", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": claim_spec(cls)}})
        assert made.admitted, made.message
    for name, cls in ((shared_gpu, gpu_class), (shared_nic, nic_class)):
        made = kube.create(tenant.api, f"{API}/namespaces/{ns}/resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": claim_spec(cls)})
        assert made.admitted, made.message

    # GPU claims, from a template or shared: injected as before, nothing to say.
    for pod_claim in ({"resourceClaimTemplateName": gpu_template}, {"resourceClaimName": shared_gpu}):
        assert resolved(webhook, ns, pod_claim) == []
        created, warnings = create_warned(tenant.api, f"/api/v1/namespaces/{ns}/pods", claim_pod(pod_claim))
        assert created.admitted, created.message
        assert claim_warnings(warnings) == []
        assert container(created.obj, SIDECAR_NAME)["resources"]["claims"] == [{"name": "dev"}]
        assert enforcer_config(created.obj)["containers"] == {
            "trainer": {"computePercent": 20, "memoryBytes": 4 << 30}}

    # Claims that hold no GPU: the pod still gets the enforcer (only the admin's list exempts a
    # claim), and the author is told how an admin can spare it.
    for pod_claim, listed in (({"resourceClaimTemplateName": nic_template}, nic_template),
                              ({"resourceClaimName": shared_nic}, shared_nic)):
        (said,) = resolved(webhook, ns, pod_claim)
        created, warnings = create_warned(tenant.api, f"/api/v1/namespaces/{ns}/pods", claim_pod(pod_claim))
        assert created.admitted, created.message
        assert kube.is_mutated(created.obj)
        assert claim_warnings(warnings) == [said]
        assert f'DeviceClass "{nic_class}" (nic.example.com)' in said and f'list "{listed}"' in said
        # Kept for the enforcer, which posts it as an Event (a controller's pods show no admission warnings).
        assert said in json.loads(created.obj["metadata"]["annotations"][ANNOTATION_STATUS])["warnings"]
        assert not said.endswith("...")  # within the 256 characters a warning may have

    # A template deleted: its watch event takes it out of the cache, and its claim is unresolved again.
    gone = kube.unique("gone")
    assert kube.create(tenant.api, f"{API}/namespaces/{ns}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": gone},
        "spec": {"spec": claim_spec(nic_class)}}).admitted
    assert "holds no GPU" in resolved(webhook, ns, {"resourceClaimTemplateName": gone})[0]
    client.CustomObjectsApi(tenant.api).delete_namespaced_custom_object(
        "resource.k8s.io", "v1", ns, "resourceclaimtemplates", gone)
    kube.wait_for(lambda: any("could not be resolved" in w for w in claim_warnings(
        webhook.review(ns, claim_pod({"resourceClaimTemplateName": gone})).get("warnings") or [])),
        "the webhook to see the template deleted")

    # A claim whose template does not exist (yet): a GPU claim, said so; never a refusal.
    created, warnings = create_warned(tenant.api, f"/api/v1/namespaces/{ns}/pods",
                                      claim_pod({"resourceClaimTemplateName": "not-there"}))
    assert created.admitted and kube.is_mutated(created.obj)
    assert claim_warnings(warnings) == [
        'gpufence: claim "dev" (ResourceClaimTemplate "not-there") is taken for a GPU (share and enforcer): it '
        f'could not be resolved: the webhook does not know ResourceClaimTemplate "not-there" in namespace "{ns}"']

    # The admin lists the NIC template: no sidecar, the container keeps its claim (never void),
    # and /validate admits the pod it made. A listed name whose class
    # selects GPUs runs on the admin's word, and the author is told.
    set_policy({"non-gpu-resource-claims": f"{nic_template},{gpu_template}"})
    nic = {"resourceClaimTemplateName": nic_template}
    created = kube.wait_for(lambda: (c := kube.create_pod(tenant.api, ns, claim_pod(nic))).admitted
                            and not kube.is_mutated(c.obj) and c, "the webhook to read the new policy")
    assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(container(created.obj, "trainer"))
    assert kube.env_of(container(created.obj, "logs"))["NVIDIA_VISIBLE_DEVICES"] == "void"
    created, warnings = create_warned(tenant.api, f"/api/v1/namespaces/{ns}/pods",
                                      claim_pod({"resourceClaimTemplateName": gpu_template}))
    assert created.admitted and not kube.is_mutated(created.obj)
    assert claim_warnings(warnings) == [
        f'gpufence: claim "dev" (ResourceClaimTemplate "{gpu_template}") is listed in non-gpu-resource-claims, so '
        f'it runs without the enforcer, but DeviceClass "{gpu_class}" selects devices of driver "gpu.nvidia.com"']

    webhook.stop("KILL")  # failurePolicy Fail: nothing in an opted-in namespace without the webhook
    for pod_claim in (nic, {"resourceClaimName": shared_nic}):
        down = kube.create_pod(tenant.api, ns, claim_pod(pod_claim, voided=True))
        assert kube.outage_problem(down) is None, down.message


def test_the_gpu_drivers_are_policy(
    dra: None, admin: client.ApiClient, tenant: Tenant, webhook: WebhookProcess,
    set_policy: Callable[[dict[str, str]], None],
):
    """An admin whose GPUs come from another DRA driver names it in dra-gpu-driver-name."""
    other = kube.unique("other-gpu")
    assert kube.create(admin, f"{API}/deviceclasses", device_class(other, "gpu.example.com")).admitted
    template = kube.unique("other")
    assert kube.create(tenant.api, f"{API}/namespaces/{tenant.namespace}/resourceclaimtemplates", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": template},
        "spec": {"spec": claim_spec(other)}}).admitted
    pod_claim = {"resourceClaimTemplateName": template}
    (said,) = resolved(webhook, tenant.namespace, pod_claim)
    assert "holds no GPU" in said
    set_policy({"dra-gpu-driver-name": "gpu.nvidia.com,gpu.example.com"})
    kube.wait_for(lambda: resolved(webhook, tenant.namespace, pod_claim) == [], "the webhook to read the new policy")


def test_a_plain_gpu_request_served_through_dra_is_injected(
    dra: None, admin: client.ApiClient, tenant: Tenant, webhook: WebhookProcess,
):
    """A DeviceClass with extendedResourceName serves ``nvidia.com/gpu`` through DRA (the scheduler
    records the claim in the pod's status.extendedResourceClaimStatus): the pod still names
    ``nvidia.com/gpu``, so it is a GPU pod like any other."""
    name = kube.unique("gpu-extended")
    made = kube.create(admin, f"{API}/deviceclasses",
                       device_class(name, "gpu.nvidia.com", extendedResourceName="nvidia.com/gpu"))
    assert made.admitted, made.message
    assert made.obj["spec"]["extendedResourceName"] == "nvidia.com/gpu"  # served, not dropped, on 1.37
    created = kube.create_pod(tenant.api, tenant.namespace, device_pod({"limits": {"nvidia.com/gpu": "1"}}))
    assert created.admitted, created.message
    assert kube.is_mutated(created.obj)
    assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(container(created.obj, "trainer"))
    assert enforcer_config(created.obj)["containers"] == {
        "trainer": {"computePercent": 20, "gpus": 1, "memoryBytes": 4 << 30}}


def test_without_dra_served_nothing_breaks(admin: client.ApiClient, tenant: Tenant, webhook: WebhookProcess):
    """On every version: the webhook is ready whether or not resource.k8s.io/v1 is served (its DRA
    cache never gates /readyz), says once that it is not, and a claim pod is injected where DRA is
    served (refused where the API server drops its claims: it would get no device and no void)."""
    dra = served(admin, "resource.k8s.io/v1")
    assert bool(logged(webhook, "dra_api_not_served")) is not dra
    # Not served is said once, at info; the retries that follow are not warnings.
    assert not [e for e in logged(webhook, "log") if e.get("level") == "warning"
                and str(e.get("message", "")).startswith(("DeviceClass", "ResourceClaim"))]
    created, warnings = create_warned(tenant.api, f"/api/v1/namespaces/{tenant.namespace}/pods",
                                      claim_pod({"resourceClaimTemplateName": "absent"}))
    if dra:
        assert created.admitted, created.message
        assert kube.is_mutated(created.obj)
    else:
        # The claims are dropped after the mutating webhook where DRA is off: the trainer would run
        # with no device and no void, so verify.gpufence.io refuses the final pod.
        assert kube.denied_by(created, "verify.gpufence.io"), created.message
    if dra:
        assert claim_warnings(warnings) == [
            'gpufence: claim "dev" (ResourceClaimTemplate "absent") is taken for a GPU (share and enforcer): it could '
            'not be resolved: the webhook does not know ResourceClaimTemplate "absent" in namespace '
            f'"{tenant.namespace}"']
    else:
        # 1.30's pod API spells a claim's object under "source": the API server drops the field this
        # webhook reads before the webhook sees the pod, so there is no claim to speak of.
        assert claim_warnings(warnings) == []
        answer = webhook.review(tenant.namespace, claim_pod({"resourceClaimTemplateName": "absent"}))
        assert claim_warnings(answer["warnings"]) == [
            'gpufence: claim "dev" (ResourceClaimTemplate "absent") is taken for a GPU (share and enforcer): it could '
            "not be resolved: the API server does not serve resource.k8s.io/v1"]
