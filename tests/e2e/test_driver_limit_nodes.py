"""Issue 32 row 8: the driver limit follows the node, not the author's choice of how to name it.

Under ``driver-memory-limits: auto`` (as shipped) a GPU pod that can only land on nodes labelled
``gpufence.io/driver-memory-limits=true`` gets ``NVIDIA_GPU_MEMORY_LIMIT`` / ``_REQUEST``: through
the real API servers (1.30, 1.37), as the ``edit`` tenant (tests/e2e/tenant.py), pods pinned by
``nodeName``, by a ``kubernetes.io/hostname`` nodeSelector and by ``matchFields`` on
``metadata.name`` get them, as stored (the mutating and the validating call agree); the same pods
pinned to an unlabelled node, or able to land on one, get none. The webhook learns the nodes'
labels from its node watch cache (webhook.cluster.nodes) under its own ServiceAccount's RBAC (list and
watch nodes). The control plane has no kubelet: the admin creates the Node objects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from gpufence.contract import DRIVER_LIMITS_NODE_LABEL, ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST
from gpufence.webhook.cluster.nodes import METADATA_LIST, METADATA_WATCH
from tests.e2e import kube
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant

HOSTNAME = "kubernetes.io/hostname"
LIMITED = {ENV_DRIVER_MEMORY_LIMIT: "4096", ENV_DRIVER_MEMORY_REQUEST: "4096"}


@pytest.fixture
def nodes(admin: client.ApiClient) -> Iterator[tuple[str, str]]:
    """A node labelled for driver limits and one not, as an admin (or a kubelet) registers them."""
    core = client.CoreV1Api(admin)
    labelled, plain = kube.unique("r615"), kube.unique("r595")
    for name, labels in ((labelled, {DRIVER_LIMITS_NODE_LABEL: "true"}), (plain, {})):
        core.create_node({"apiVersion": "v1", "kind": "Node",
                          "metadata": {"name": name, "labels": {HOSTNAME: name, **labels}}})
    yield labelled, plain
    for name in (labelled, plain):
        core.delete_node(name)


def pod_on(how: str, *names: str) -> dict[str, Any]:
    pod = kube.gpu_pod(annotations={"gpufence.io/memory": "4Gi"})
    spec = pod["spec"]
    if how == "nodeName":
        (spec["nodeName"],) = names
    elif how == "hostname":
        (name,) = names
        spec["nodeSelector"] = {HOSTNAME: name}
    else:
        # One name per term: the API server accepts a single value for In on a field; terms are ORed.
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [name]}]} for name in names]}}}
    return pod


def limits(pod: dict[str, Any]) -> dict[str, Any]:
    env = kube.env_of(kube.container(pod, "trainer"))
    return {k: v for k, v in env.items() if k in LIMITED}


def stored(tenant: Tenant, pod: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    created = kube.create_pod(tenant.api, tenant.namespace, pod, dry_run=dry_run)
    assert created.admitted and kube.is_mutated(created.obj), created.message
    return created.obj


@pytest.mark.parametrize("how", ["nodeName", "hostname", "matchFields"])
def test_a_pod_pinned_to_a_labelled_node_gets_the_driver_limit_however_it_names_it(
    admin: client.ApiClient, tenant: Tenant, webhook: WebhookProcess, nodes: tuple[str, str], how: str,
) -> None:
    labelled, plain = nodes
    webhook.wait_until_known(tenant.namespace)
    # The webhook's watch sees a new node a moment after the API server stores it.
    kube.wait_for(lambda: limits(stored(tenant, pod_on("nodeName", labelled), dry_run=True)) == LIMITED,
                  "the webhook's node cache to see the labelled node")

    assert limits(stored(tenant, pod_on(how, labelled))) == LIMITED
    # The control: the same pod pinned to the unlabelled node, or free to land on it.
    assert limits(stored(tenant, pod_on(how, plain))) == {}
    if how == "matchFields":
        assert limits(stored(tenant, pod_on(how, labelled, plain))) == {}


def test_the_driver_limit_follows_a_nodes_label_as_it_changes(
    admin: client.ApiClient, tenant: Tenant, webhook: WebhookProcess, nodes: tuple[str, str],
) -> None:
    labelled, plain = nodes
    webhook.wait_until_known(tenant.namespace)
    kube.wait_for(lambda: limits(stored(tenant, pod_on("hostname", labelled), dry_run=True)) == LIMITED,
                  "the webhook's node cache to see the labelled node")
    core = client.CoreV1Api(admin)
    core.patch_node(labelled, {"metadata": {"labels": {DRIVER_LIMITS_NODE_LABEL: None}}})
    core.patch_node(plain, {"metadata": {"labels": {DRIVER_LIMITS_NODE_LABEL: "true"}}})
    kube.wait_for(lambda: limits(stored(tenant, pod_on("hostname", plain), dry_run=True)) == LIMITED,
                  "the webhook's node cache to see the label move")
    assert limits(stored(tenant, pod_on("hostname", labelled))) == {}
    assert limits(stored(tenant, pod_on("nodeName", plain))) == LIMITED


def test_the_webhooks_token_lists_and_watches_nodes_as_metadata_only(webhook: WebhookProcess,
                                                                     nodes: tuple[str, str]) -> None:
    """What webhook.cluster.nodes asks for, with the webhook's own token: names and labels, no status."""
    core = client.CoreV1Api(kube.api_client(webhook.kubeconfig))
    listed = json.loads(core.list_node(_headers={"Accept": METADATA_LIST}, _preload_content=False).data)
    assert listed["kind"] == "PartialObjectMetadataList", listed.get("kind")
    assert {nodes[0], nodes[1]} <= {item["metadata"]["name"] for item in listed["items"]}
    assert all("status" not in item and "spec" not in item for item in listed["items"])
    stream = core.list_node(_headers={"Accept": METADATA_WATCH}, watch=True, timeout_seconds=1,
                            resource_version=listed["metadata"]["resourceVersion"], _preload_content=False)
    assert stream.status == 200
    stream.release_conn()
    # And the webhook's own cache did so without a failure (a 403 would be "node watch ended").
    assert '"nodes_listed"' in webhook.log() and "node watch ended" not in webhook.log()
