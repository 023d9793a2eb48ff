"""The guard policy compiled, cost-checked and evaluated by the API server itself ("fail open, guard closed")."""

from __future__ import annotations

import json
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


def test_api_server_accepts_the_policy_and_its_binding(cluster: ControlPlane, gpufence: WebhookProcess):
    policy = json.loads(cluster.kubectl("get", "validatingadmissionpolicy", "gpufence-guard", "-o", "json").stdout)
    # The API server type-checks every expression and reports problems in status.typeChecking.
    kube.wait_for(lambda: json.loads(cluster.kubectl(
        "get", "validatingadmissionpolicy", "gpufence-guard", "-o", "json").stdout).get("status", {})
        .get("observedGeneration") == policy["metadata"]["generation"], "the policy's type check")
    status = json.loads(cluster.kubectl("get", "validatingadmissionpolicy", "gpufence-guard", "-o", "json").stdout)
    warnings = status["status"].get("typeChecking", {}).get("expressionWarnings", [])
    assert warnings == [], warnings
    binding = json.loads(cluster.kubectl("get", "validatingadmissionpolicybinding", "gpufence-guard",
                                         "-o", "json").stdout)
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_with_the_webhook_down_only_unenforced_gpu_pods_are_refused(
    admin: client.ApiClient, webhook: WebhookProcess, opted_in: str, not_opted_in: str,
):
    webhook.stop("KILL")  # failurePolicy Ignore: the API server admits without the webhook
    gpu = kube.create_pod(admin, opted_in, kube.gpu_pod())
    assert not gpu.admitted
    assert gpu.status == 403
    assert "gpufence-guard" in gpu.message
    assert "has no gpufence-enforcer sidecar" in gpu.message
    assert "shareProcessNamespace" in gpu.message

    plain = kube.create_pod(admin, opted_in, kube.plain_pod())
    assert not plain.admitted and "requests no GPU and has no NVIDIA_VISIBLE_DEVICES" in plain.message, plain.message
    voided = kube.plain_pod()
    voided["spec"]["containers"][0]["env"].append(VOID)
    assert (created := kube.create_pod(admin, opted_in, voided)).admitted, created.message
    elsewhere = kube.create_pod(admin, not_opted_in, kube.gpu_pod())
    assert elsewhere.admitted, elsewhere.message
    assert not kube.is_mutated(elsewhere.obj)

    webhook.start()
    again = kube.create_pod(admin, opted_in, kube.gpu_pod())
    assert again.admitted, again.message
    assert kube.is_mutated(again.obj)


def test_opt_out_is_the_namespace_admins_choice(admin: client.ApiClient, webhook: WebhookProcess, opted_in: str):
    """A pod's opt-out label counts only where the namespace allows it, for webhook and guard alike."""
    opted_out = kube.gpu_pod(labels={"gpufence.io/inject": "false"})
    refused = kube.create_pod(admin, opted_in, opted_out)
    assert not refused.admitted and "gpufence.io/allow-opt-out" in refused.message, refused.message

    lenient = kube.create_namespace(admin, "lenient", kube.OPT_IN, annotations={"gpufence.io/allow-opt-out": "true"})
    created = kube.wait_for(lambda: (c := kube.create_pod(admin, lenient, kube.gpu_pod(
        labels={"gpufence.io/inject": "false"}))).admitted and c, "the namespace annotation to reach the webhook")
    assert not kube.is_mutated(created.obj)

    webhook.stop("KILL")  # the guard alone must draw the same line
    assert kube.create_pod(admin, lenient, kube.gpu_pod(labels={"gpufence.io/inject": "false"})).admitted
    guarded = kube.create_pod(admin, opted_in, kube.gpu_pod(labels={"gpufence.io/inject": "false"}))
    assert not guarded.admitted and "gpufence-guard" in guarded.message, guarded.message


def test_with_the_webhook_down_a_container_without_a_device_needs_the_void(
    webhook: WebhookProcess, tenant: Tenant,
):
    """The tenant hands a container the node's GPUs through the NVIDIA container toolkit, which the
    device plugin never counted: NVIDIA_VISIBLE_DEVICES=all from a ConfigMap (envFrom) or from a
    CUDA image's config, neither of which admission sees. The webhook adds an explicit void that wins
    over both; with the webhook down the guard refuses a pod without it."""
    client.CoreV1Api(tenant.api).create_namespaced_config_map(
        tenant.namespace, {"metadata": {"name": "gpus"}, "data": {"NVIDIA_VISIBLE_DEVICES": "all"}})
    webhook.stop("KILL")  # failurePolicy Ignore: only the guard stands between the pod and the cluster
    through_env_from = kube.plain_pod()
    through_env_from["spec"]["containers"][0]["envFrom"] = [{"configMapRef": {"name": "gpus"}}]
    through_image = kube.plain_pod()
    through_image["spec"]["containers"][0]["image"] = CUDA_IMAGE
    init = kube.plain_pod()
    init["spec"]["containers"][0]["env"].append(VOID)
    init["spec"]["initContainers"] = [{"name": "fetch", "image": CUDA_IMAGE, "command": ["true"]}]
    for pod, container in ((through_env_from, "trainer"), (through_image, "trainer"), (init, "fetch")):
        refused = kube.create_pod(tenant.api, tenant.namespace, pod)
        assert not refused.admitted and refused.status == 403 and "gpufence-guard" in refused.message, refused.message
        assert f'container "{container}" requests no GPU and has no NVIDIA_VISIBLE_DEVICES' in refused.message
        assert "NVIDIA_VISIBLE_DEVICES, value: void" in refused.message, refused.message  # the accepted form

    for pod in (through_env_from, through_image, init):  # with the void in every container: admitted
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            container["env"] = [*[e for e in container.get("env", []) if e != VOID], VOID]
        pod["metadata"]["name"] = kube.unique("voided")
        created = kube.create_pod(tenant.api, tenant.namespace, pod)
        assert created.admitted, created.message


def test_a_mirror_annotation_written_by_a_tenant_exempts_nothing(webhook: WebhookProcess, tenant: Tenant):
    """Only a node (user system:node:*) creates a static pod's mirror; the annotation alone, with a
    nodeName, is the tenant's to write and must not take a GPU pod past the webhook or the guard."""
    def forged() -> dict:
        pod = kube.gpu_pod(annotations={"kubernetes.io/config.mirror": "forged", "gpufence.io/memory": "4Gi",
                                        "gpufence.io/compute": "25"})
        pod["spec"]["nodeName"] = "gpu-node-1"
        return pod

    # The webhook learns of the tenant's new namespace from a watch: wait until it applies the ceilings.
    up = kube.wait_for(lambda: (c := kube.create_pod(tenant.api, tenant.namespace, forged())).admitted and c,
                       "the webhook to see the new namespace")
    assert kube.is_mutated(up.obj), "a tenant's 'mirror pod' was stored without the enforcer"

    webhook.stop("KILL")
    down = kube.create_pod(tenant.api, tenant.namespace, forged())
    assert not down.admitted and down.status == 403 and "gpufence-guard" in down.message, down.message
    assert "has no gpufence-enforcer sidecar" in down.message, down.message


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
    """What a node creates (its static pods' mirrors) is neither injected nor refused: the kubelet
    runs the static pod from its manifest, not this object."""
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
