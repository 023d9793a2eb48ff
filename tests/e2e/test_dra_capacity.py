"""DRA consumable capacity placed by the real kube-scheduler 1.37 and held by gpufence
(gpufence/webhook/core/dra.py ``claim_memory``; docs/gpu-paths.md, "DRA consumable capacity").

A ResourceSlice publishes two shareable GPUs (``allowMultipleAllocations: true``, ``memory: 80Gi``,
a ``requestPolicy`` with a 1Gi step) for a Node object (no kubelet: scheduling needs none). Pods in
an opted-in namespace use claims from templates that ask 30, 30, 30, 30 and 40 GiB: the scheduler
places the four 30 GiB claims two to a GPU and cannot place the 40 GiB one anywhere (each GPU has
20 GiB left, in any order of placement), which stays Pending with the scheduler's reason. Every pod
the webhook injected carries its claim's amount as its memory share, and that share equals the
``consumedCapacity`` the scheduler recorded in the claim's allocation (the amounts are whole steps,
so the requestPolicy rounds nothing up). 1.30 has no consumable capacity (nor resource.k8s.io/v1):
a by-design skip.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from gpufence.quantity import parse_bytes
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.kube import enforcer_config
from tests.e2e.test_dra import API, device_class, resolved
from tests.e2e.test_gpu_paths import served
from tests.support.prerequisites import skip_by_design

DRIVER = "gpu.nvidia.com"  # the policy's default dra-gpu-driver-name
GIB = 1 << 30
ASKED = (30, 30, 30, 30, 40)  # GiB, created in this order


@pytest.fixture
def capacity_cluster(cluster: ControlPlane, admin: client.ApiClient) -> ControlPlane:
    if not served(admin, "resource.k8s.io/v1"):
        skip_by_design("dra-not-served", f"Kubernetes {cluster.version} does not serve resource.k8s.io/v1, "
                                         "nor consumable capacity (beta from 1.36)")
    assert cluster.binaries.kube_scheduler is not None, f"no kube-scheduler runs with Kubernetes {cluster.version}"
    return cluster


@pytest.fixture
def gpu_node(capacity_cluster: ControlPlane, admin: client.ApiClient) -> Iterator[tuple[str, str]]:
    """A Node object with two shareable 80Gi GPUs in a ResourceSlice, and the DeviceClass selecting
    them; all removed afterwards (the other tests' pods must stay unschedulable)."""
    core = client.CoreV1Api(admin)
    node, device_class_name = kube.unique("gpu-node"), kube.unique("shared-gpu")
    core.create_node({"metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}}})
    resources = {"cpu": "16", "memory": "128Gi", "pods": "110"}
    core.patch_node_status(node, {"status": {
        "capacity": resources, "allocatable": resources,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e stand-in"}]}})
    policy = {"default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}
    made = kube.create(admin, f"{API}/resourceslices", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpus"},
        "spec": {"driver": DRIVER, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": f"gpu-{i}", "allowMultipleAllocations": True,
                              "capacity": {"memory": {"value": "80Gi", "requestPolicy": policy}}}
                             for i in range(2)]}})
    assert made.admitted, made.message
    assert made.obj is not None
    assert all(d.get("allowMultipleAllocations") for d in made.obj["spec"]["devices"]), \
        "the API server dropped allowMultipleAllocations: the DRAConsumableCapacity gate is off"
    assert kube.create(admin, f"{API}/deviceclasses", device_class(device_class_name, DRIVER)).admitted
    try:
        yield node, device_class_name
    finally:
        custom = client.CustomObjectsApi(admin)
        custom.delete_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", f"{node}-gpus")
        custom.delete_cluster_custom_object("resource.k8s.io", "v1", "deviceclasses", device_class_name)
        core.delete_node(node)


def template(name: str, device_class_name: str, gib: int) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": device_class_name, "capacity": {"requests": {"memory": f"{gib}Gi"}}}}]}}}}


def capacity_pod(name: str, template_name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "trainer", "image": "registry.invalid/trainer:1",
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template_name}],
                     # No kubelet heartbeats the Node: the node controller taints it unreachable.
                     "tolerations": [{"operator": "Exists"}]}}


def get(api: client.ApiClient, path: str) -> dict[str, Any]:
    """The object at ``path`` as the API server sends it (the typed models drop newer fields)."""
    method, url, headers, _, _ = api.param_serialize("GET", path, auth_settings=["BearerToken"],
                                                     header_params={"Accept": "application/json"})
    resp = api.call_api(method, url, header_params=headers)
    raw = resp.read()
    assert 200 <= resp.status < 300, raw
    return dict(json.loads(raw))


def scheduled_or_refused(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The pod once the scheduler has decided: bound to a node, or marked Unschedulable."""
    pod = get(api, f"/api/v1/namespaces/{namespace}/pods/{name}")
    if pod["spec"].get("nodeName"):
        return pod
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition["type"] == "PodScheduled" and condition["status"] == "False" \
                and condition.get("reason") == "Unschedulable":
            return pod
    return None


def allocation(admin: client.ApiClient, pod: dict[str, Any]) -> dict[str, Any]:
    """The allocation result of the claim the control plane made for the pod's template."""
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = get(admin, f"{API}/namespaces/{pod['metadata']['namespace']}/resourceclaims/"
                       f"{status['resourceClaimName']}")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return dict(result)


def test_the_real_scheduler_places_claims_by_memory_and_each_share_is_what_it_reserved(
    gpu_node: tuple[str, str], admin: client.ApiClient, opted_in: str, webhook: WebhookProcess,
):
    node, device_class_name = gpu_node
    ns, core = opted_in, client.CoreV1Api(admin)
    templates = {gib: kube.unique(f"gpu-{gib}g") for gib in set(ASKED)}
    for gib, name in templates.items():
        made = kube.create(admin, f"{API}/namespaces/{ns}/resourceclaimtemplates",
                           template(name, device_class_name, gib))
        assert made.admitted, made.message
        # Created after the webhook listed them: wait for its watch to bring them.
        assert resolved(webhook, ns, {"resourceClaimTemplateName": name}) == []

    decided: list[tuple[int, dict[str, Any]]] = []
    for i, gib in enumerate(ASKED):
        name = f"train-{i}-{gib}g"
        created = kube.create_pod(admin, ns, capacity_pod(name, templates[gib]))
        assert created.admitted, created.message
        assert created.obj is not None
        # The webhook's share is the claim's amount, before the scheduler has seen the pod.
        assert enforcer_config(created.obj)["containers"]["trainer"]["memoryBytes"] == gib * GIB
        pod = kube.wait_for(lambda name=name: scheduled_or_refused(admin, ns, name),
                            f"the scheduler to decide on {name}", timeout=90)
        decided.append((gib, pod))

    placed = [(gib, pod) for gib, pod in decided if pod["spec"].get("nodeName")]
    pending = [(gib, pod) for gib, pod in decided if not pod["spec"].get("nodeName")]
    assert [gib for gib, _ in placed] == [30, 30, 30, 30]
    ((gib, refused),) = pending
    assert gib == 40
    (condition,) = [c for c in refused["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert condition["reason"] == "Unschedulable", condition
    print(f"the 40 GiB pod stays Pending: {condition['message']}")

    used: dict[str, int] = defaultdict(int)
    for gib, pod in placed:
        assert pod["spec"]["nodeName"] == node
        result = allocation(admin, pod)
        consumed = parse_bytes(result["consumedCapacity"]["memory"])
        share = enforcer_config(pod)["containers"]["trainer"]["memoryBytes"]
        assert share == consumed == gib * GIB, (pod["metadata"]["name"], result)
        assert result.get("shareID"), result  # a shared allocation of a device
        used[result["device"]] += consumed
    assert sorted(used.values()) == [60 * GIB, 60 * GIB], dict(used)

    for _, pod in decided:  # bound to a node without a kubelet: nothing else would ever end them
        core.delete_namespaced_pod(pod["metadata"]["name"], ns, grace_period_seconds=0)
