"""The webhook is the one implementation of the pod rules: the API server refuses what it could not
judge (failurePolicy Fail), on real API servers.

With the webhook down (its process killed), every new pod of an opted-in namespace is refused,
naming the webhook, and nothing else changes: pods elsewhere, a static pod's mirror from its node.
With it up, the same pods are rebuilt or denied by the webhook. A namespace the webhook's cache has
not seen yet is read fresh, so its ceilings hold from its first pod.
"""

from __future__ import annotations

from pathlib import Path

from kubernetes import client

from gpufence.certs import pki
from tests.e2e import kube
from tests.e2e.cluster_pki import client_cert
from tests.e2e.controlplane import ControlPlane, write_kubeconfig
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant

VOID = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}
CUDA_IMAGE = "nvidia/cuda:12.4.1-base-ubuntu22.04"  # its image config sets NVIDIA_VISIBLE_DEVICES=all


def test_with_the_webhook_down_every_new_pod_of_an_opted_in_namespace_is_refused(
    admin: client.ApiClient, webhook: WebhookProcess, opted_in: str, not_opted_in: str,
):
    webhook.stop("KILL")
    voided = kube.plain_pod()
    voided["spec"]["containers"][0]["env"].append(VOID)
    for pod in (kube.gpu_pod(), kube.plain_pod(), voided):
        assert kube.outage_problem(kube.create_pod(admin, opted_in, pod)) is None
    elsewhere = kube.create_pod(admin, not_opted_in, kube.gpu_pod())
    assert elsewhere.admitted, elsewhere.message
    assert not kube.is_mutated(elsewhere.obj)

    webhook.start()
    again = kube.create_pod(admin, opted_in, kube.gpu_pod())
    assert again.admitted, again.message
    assert kube.is_mutated(again.obj)
    plain = kube.create_pod(admin, opted_in, kube.plain_pod())
    assert plain.admitted and VOID in plain.obj["spec"]["containers"][0]["env"], plain.message


def test_a_namespace_the_webhook_has_not_seen_is_read_fresh(admin: client.ApiClient, webhook: WebhookProcess):
    """Created and used at once, before the webhook's watch delivers it: its ceiling holds from the
    first pod (no waiting for the cache, no pod reviewed without the namespace's policy)."""
    namespace = kube.create_namespace(admin, "fresh", kube.OPT_IN, annotations={"gpufence.io/max-memory": "4Gi"})
    above = kube.create_pod(admin, namespace, kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"}))
    assert kube.denied_by(above) and "4Gi" in above.message, above.message
    within = kube.create_pod(admin, namespace, kube.gpu_pod(annotations={"gpufence.io/memory": "2Gi"}))
    assert within.admitted and kube.enforcer_config(within.obj)["containers"]["trainer"]["memoryBytes"] == 2 << 30


def test_opt_out_is_the_namespace_admins_choice(admin: client.ApiClient, webhook: WebhookProcess, opted_in: str):
    """A pod's opt-out label counts only where the namespace allows it; during an outage the webhook
    cannot tell, so the pod is refused either way."""
    opted_out = kube.gpu_pod(labels={"gpufence.io/inject": "false"})
    refused = kube.create_pod(admin, opted_in, opted_out)
    assert kube.denied_by(refused) and "gpufence.io/allow-opt-out" in refused.message, refused.message

    lenient = kube.create_namespace(admin, "lenient", kube.OPT_IN, annotations={"gpufence.io/allow-opt-out": "true"})
    created = kube.create_pod(admin, lenient, kube.gpu_pod(labels={"gpufence.io/inject": "false"}))
    assert created.admitted and not kube.is_mutated(created.obj), created.message

    webhook.stop("KILL")
    for namespace in (lenient, opted_in):
        problem = kube.outage_problem(kube.create_pod(admin, namespace, kube.gpu_pod(
            labels={"gpufence.io/inject": "false"})))
        assert problem is None, problem


def test_a_container_without_a_device_gets_the_void_or_no_pod_is_made(webhook: WebhookProcess, tenant: Tenant):
    """The tenant hands a container the node's GPUs through the NVIDIA container toolkit, which the
    device plugin never counted: NVIDIA_VISIBLE_DEVICES=all from a ConfigMap (envFrom) or from a
    CUDA image's config, neither of which admission sees. The webhook adds an explicit void that wins
    over both; with the webhook down the API server refuses the pod."""
    client.CoreV1Api(tenant.api).create_namespaced_config_map(
        tenant.namespace, {"metadata": {"name": "gpus"}, "data": {"NVIDIA_VISIBLE_DEVICES": "all"}})
    through_env_from = kube.plain_pod()
    through_env_from["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "gpus"}}]
    through_image = kube.plain_pod()
    through_image["spec"]["containers"][0]["image"] = CUDA_IMAGE
    init = kube.plain_pod()
    init["spec"]["initContainers"] = [{"name": "fetch", "image": CUDA_IMAGE, "command": ["true"]}]
    pods = ((through_env_from, "trainer"), (through_image, "trainer"), (init, "fetch"))
    for pod, name in pods:
        created = kube.create_pod(tenant.api, tenant.namespace, pod)
        assert created.admitted and VOID in kube.container(created.obj, name)["env"], created.message

    webhook.stop("KILL")
    for pod, _ in pods:
        pod["metadata"]["name"] = kube.unique("down")
        assert kube.outage_problem(kube.create_pod(tenant.api, tenant.namespace, pod)) is None


def test_a_mirror_annotation_written_by_a_tenant_exempts_nothing(webhook: WebhookProcess, tenant: Tenant):
    """Only a node (user system:node:*) creates a static pod's mirror; the annotation alone, with a
    nodeName, is the tenant's to write and must not take a GPU pod past the webhook."""
    def forged() -> dict:
        pod = kube.gpu_pod(annotations={"kubernetes.io/config.mirror": "forged", "gpufence.io/memory": "4Gi",
                                        "gpufence.io/compute": "25"})
        pod["spec"]["nodeName"] = "gpu-node-1"
        return pod

    up = kube.create_pod(tenant.api, tenant.namespace, forged())
    assert up.admitted and kube.is_mutated(up.obj), "a tenant's 'mirror pod' was stored without the enforcer"

    webhook.stop("KILL")
    assert kube.outage_problem(kube.create_pod(tenant.api, tenant.namespace, forged())) is None


def node_api(cp: ControlPlane, name: str, workdir: Path) -> client.ApiClient:
    """A client authenticated as the kubelet of node ``name`` (user system:node:<name>, group
    system:nodes, a certificate of the cluster CA), as tests/node/node.py's kubelet is."""
    assert cp.pki.ca_key is not None
    ca = pki.KeyPair(pki.load_cert(cp.pki.ca_cert.read_bytes()), pki.load_key(cp.pki.ca_key.read_bytes()))
    identity = client_cert(ca, f"system:node:{name}", ("system:nodes",))
    (cert := workdir / f"{name}.crt").write_bytes(identity.cert_pem)
    (key := workdir / f"{name}.key").write_bytes(identity.key_pem)
    return kube.api_client(write_kubeconfig(workdir / f"{name}.kubeconfig", cp.server, cp.pki.ca_cert,
                                            cert=cert, key=key, user=f"system:node:{name}"))


def test_a_static_pods_mirror_from_its_node_stays_exempt(cluster: ControlPlane, webhook: WebhookProcess,
                                                         tenant: Tenant, tmp_path: Path):
    """What a node creates (its static pods' mirrors) is neither injected nor refused, up or down (the
    webhooks' matchConditions): the kubelet runs the static pod from its manifest, not this object."""
    node = node_api(cluster, "gpu-node-1", tmp_path)

    def mirror() -> dict:
        pod = kube.gpu_pod(annotations={"kubernetes.io/config.mirror": "abc123"})
        pod["spec"]["nodeName"] = "gpu-node-1"
        return pod

    up = kube.create_pod(node, tenant.namespace, mirror())
    assert up.admitted and not kube.is_mutated(up.obj), up.message
    webhook.stop("KILL")
    down = kube.create_pod(node, tenant.namespace, mirror())
    assert down.admitted and not kube.is_mutated(down.obj), down.message
