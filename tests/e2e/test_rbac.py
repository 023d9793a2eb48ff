"""The install's ServiceAccounts, with real bound tokens, can do their jobs and nothing more."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest
from kubernetes import client

from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import EventRecorder, PodRef
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import (
    NAMESPACE,
    POLICY_CONFIGMAP,
    WEBHOOK_CONFIGURATION,
    WebhookProcess,
    cli,
    service_account_kubeconfig,
)

WEBHOOK_SA = f"system:serviceaccount:{NAMESPACE}:gpufence-webhook"
CERTS_SA = f"system:serviceaccount:{NAMESPACE}:gpufence-certs"


def can_i(cp: ControlPlane, user: str, verb: str, resource: str, namespace: str | None = None) -> bool:
    args = ["auth", "can-i", verb, resource, "--as", user]
    args += ["-n", namespace] if namespace else ["--all-namespaces"] if verb in ("list", "watch") else []
    result = cp.kubectl(*args, check=False)
    assert result.stdout.strip() in ("yes", "no"), result.stderr
    return result.stdout.strip() == "yes"


@pytest.mark.parametrize(("user", "verb", "resource", "namespace", "allowed"), [
    (WEBHOOK_SA, "list", "namespaces", None, True),
    (WEBHOOK_SA, "watch", "namespaces", None, True),
    (WEBHOOK_SA, "update", "namespaces", None, False),
    (WEBHOOK_SA, "list", "nodes", None, True),
    (WEBHOOK_SA, "watch", "nodes", None, True),
    (WEBHOOK_SA, "get", "nodes", None, False),
    (WEBHOOK_SA, "patch", "nodes", None, False),
    (WEBHOOK_SA, "get", "nodes/proxy", None, False),
    (WEBHOOK_SA, "get", "secrets", NAMESPACE, False),
    (WEBHOOK_SA, "create", "pods", "default", False),
    (WEBHOOK_SA, "patch", f"mutatingwebhookconfigurations/{WEBHOOK_CONFIGURATION}", None, False),
    (WEBHOOK_SA, "get", f"configmaps/{POLICY_CONFIGMAP}", NAMESPACE, True),
    (WEBHOOK_SA, "watch", f"configmaps/{POLICY_CONFIGMAP}", NAMESPACE, True),
    (WEBHOOK_SA, "update", f"configmaps/{POLICY_CONFIGMAP}", NAMESPACE, False),
    (WEBHOOK_SA, "get", "configmaps/another", NAMESPACE, False),
    (WEBHOOK_SA, "list", "configmaps", NAMESPACE, False),
    (WEBHOOK_SA, "get", f"configmaps/{POLICY_CONFIGMAP}", "default", False),
    (CERTS_SA, "get", "secrets/gpufence-webhook-tls", NAMESPACE, True),
    (CERTS_SA, "update", "secrets/gpufence-webhook-tls", NAMESPACE, True),
    (CERTS_SA, "create", "secrets", NAMESPACE, True),
    (CERTS_SA, "get", "secrets/some-other-secret", NAMESPACE, False),
    (CERTS_SA, "list", "secrets", NAMESPACE, False),
    (CERTS_SA, "get", "secrets", "kube-system", False),
    (CERTS_SA, "patch", f"mutatingwebhookconfigurations/{WEBHOOK_CONFIGURATION}", None, True),
    (CERTS_SA, "patch", "mutatingwebhookconfigurations/someone-elses", None, False),
    (CERTS_SA, "patch", f"validatingwebhookconfigurations/{WEBHOOK_CONFIGURATION}", None, True),
    (CERTS_SA, "patch", "validatingwebhookconfigurations/someone-elses", None, False),
    (CERTS_SA, "delete", f"mutatingwebhookconfigurations/{WEBHOOK_CONFIGURATION}", None, False),
    (CERTS_SA, "create", "pods", NAMESPACE, False),
])
def test_service_account_permissions(cluster: ControlPlane, gpufence: WebhookProcess, user: str, verb: str,
                                     resource: str, namespace: str | None, allowed: bool):
    assert can_i(cluster, user, verb, resource, namespace) is allowed


@pytest.mark.parametrize(("verb", "resource", "namespace", "allowed"), [
    *((verb, plural, None, True) for verb in ("get", "list", "watch")
      for plural in ("deviceclasses", "resourceclaims", "resourceclaimtemplates")),
    ("get", "resourceclaims", "default", True),
    ("create", "resourceclaims", "default", False),
    ("update", "deviceclasses", None, False),
    ("list", "resourceslices", None, False),
    ("get", "resourceclaims/status", "default", False),
])
def test_the_webhook_reads_exactly_the_dra_objects_a_claim_leads_to(
    admin: client.ApiClient, gpufence: WebhookProcess, verb: str, resource: str, namespace: str | None, allowed: bool,
):
    """Asked of the authorizer directly (a SubjectAccessReview): kubectl auth can-i maps names through
    discovery, which knows no resource.k8s.io where the API server does not serve it (1.30)."""
    name, _, sub = resource.partition("/")
    attributes = {"group": "resource.k8s.io", "resource": name, "verb": verb, "subresource": sub,
                  **({"namespace": namespace} if namespace else {})}
    review = client.AuthorizationV1Api(admin).create_subject_access_review(
        {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
         "spec": {"user": WEBHOOK_SA, "resourceAttributes": attributes}})
    assert review.status.allowed is allowed


def test_webhook_token_reads_its_policy_configmap_by_name_only(gpufence: WebhookProcess):
    """The webhook's list and watch select the ConfigMap by metadata.name, which resourceNames allows."""
    core = client.CoreV1Api(kube.api_client(gpufence.kubeconfig))
    selector = f"metadata.name={POLICY_CONFIGMAP}"
    (item,) = core.list_namespaced_config_map(NAMESPACE, field_selector=selector).items
    assert item.metadata.name == POLICY_CONFIGMAP
    stream = core.list_namespaced_config_map(NAMESPACE, field_selector=selector, watch=True, timeout_seconds=1,
                                             _preload_content=False)
    assert stream.status == 200
    stream.release_conn()
    for call in (lambda: core.list_namespaced_config_map(NAMESPACE),
                 lambda: core.read_namespaced_config_map("kube-root-ca.crt", NAMESPACE)):
        with pytest.raises(client.ApiException) as refused:
            call()
        assert refused.value.status == 403


def test_webhook_watch_cache_sees_namespace_changes_live(admin: client.ApiClient, webhook: WebhookProcess):
    """The webhook (with its own ServiceAccount token) learns namespace labels and defaults by watch."""
    namespace = kube.create_namespace(admin, "late")
    assert not kube.create_pod(admin, namespace, kube.gpu_pod(), dry_run=True).obj["spec"].get("initContainers")

    core = client.CoreV1Api(admin)
    core.patch_namespace(namespace, {"metadata": {"labels": kube.OPT_IN,
                                                  "annotations": {"gpufence.io/default-memory": "3Gi"}}})

    def injected_share() -> str | None:
        created = kube.create_pod(admin, namespace, kube.gpu_pod(), dry_run=True)
        if not created.admitted or not kube.is_mutated(created.obj):
            return None
        config = json.loads(kube.env_of(created.obj["spec"]["initContainers"][0])["GPUFENCE_CONFIG"])
        return config["containers"]["trainer"].get("memoryBytes")

    # Only the webhook's namespace cache knows the annotation: the API server does not send it.
    assert kube.wait_for(lambda: injected_share() == 3 << 30, "the namespace default to reach the webhook",
                         timeout=30)
    core.patch_namespace(namespace, {"metadata": {"annotations": {"gpufence.io/default-memory": "5Gi"}}})
    assert kube.wait_for(lambda: injected_share() == 5 << 30, "the changed default to reach the webhook",
                         timeout=30)


def test_enforcer_events_with_the_documented_binding(cluster: ControlPlane, admin: client.ApiClient,
                                                     gpufence: WebhookProcess, tmp_path: Path):
    namespace = kube.create_namespace(admin, "events", kube.OPT_IN)
    kubeconfig = service_account_kubeconfig(cluster, namespace, "default", tmp_path / "pod.kubeconfig")
    pod_api = kube.api_client(kubeconfig)
    log = DecisionLog(stream=open(tmp_path / "decisions.log", "w"))  # noqa: SIM115 - closed with the test dir

    denied = EventRecorder(log, PodRef(namespace, "trainer-0", None), pod_api)
    denied.record("GpuMemoryOverShare", "before the binding")
    assert denied.flush()
    assert denied.posted == 0 and not denied.enabled, "events must be refused without the binding"

    # The binding docs/install.md tells namespace admins to create.
    cluster.kubectl("create", "rolebinding", "gpufence-enforcer-events", "-n", namespace,
                    "--clusterrole=gpufence-enforcer-events", f"--serviceaccount={namespace}:default")
    recorder = EventRecorder(log, PodRef(namespace, "trainer-0", None), pod_api)
    kube.wait_for(lambda: can_i(cluster, f"system:serviceaccount:{namespace}:default", "create", "events",
                                namespace), "the RoleBinding to take effect")
    recorder.record("GpuMemoryOverShare", "container trainer used 9Gi of its 8Gi share")
    assert recorder.flush()
    recorder.close()
    assert recorder.posted == 1
    events = client.CoreV1Api(admin).list_namespaced_event(namespace).items
    assert [(e.reason, e.involved_object.name, e.source.component) for e in events] == [
        ("GpuMemoryOverShare", "trainer-0", "gpufence-enforcer")]
    assert not can_i(cluster, f"system:serviceaccount:{namespace}:default", "list", "events", namespace)


def test_cert_bootstrap_with_its_service_account_creates_and_rotates(
    cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, opted_in: str, tmp_path: Path,
):
    kubeconfig = service_account_kubeconfig(cluster, NAMESPACE, "gpufence-certs", tmp_path / "certs.kubeconfig")

    def bootstrap(*args: str) -> None:
        result = subprocess.run([cli("gpufence-certs"), "bootstrap", "--kubeconfig", str(kubeconfig),
                                 "--dns-name", "127.0.0.1", *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr

    def secret() -> dict[str, bytes]:
        raw = client.CoreV1Api(admin).read_namespaced_secret("gpufence-webhook-tls", NAMESPACE).data
        return {k: base64.b64decode(v) for k, v in raw.items()}

    def serve_secret() -> None:
        """What the kubelet does for the webhook's Secret volume, then the webhook's CA for our checks."""
        data = secret()
        webhook.secret.write(data["tls.crt"], data["tls.key"])
        ca_file = tmp_path / f"ca-{webhook.secret.version}.crt"
        ca_file.write_bytes(data["ca.crt"])
        ca_key_file = tmp_path / f"ca-{webhook.secret.version}.key"
        ca_key_file.write_bytes(data["ca.key"])
        webhook.ca_file, webhook.ca_key_file = ca_file, ca_key_file

    def ca_bundle() -> bytes:
        """The CA every gpufence webhook trusts (one, in both configurations)."""
        (bundle,) = {hook["clientConfig"]["caBundle"]
                     for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration")
                     for hook in json.loads(cluster.kubectl("get", kind, WEBHOOK_CONFIGURATION,
                                                            "-o", "json").stdout)["webhooks"]}
        return base64.b64decode(bundle)

    bootstrap("--days", "2", "--renew-before-days", "1")
    first = secret()
    assert ca_bundle() == first["ca.crt"], "bootstrap patches the caBundle to its new CA"
    serve_secret()

    def admitted_and_mutated() -> bool:
        created = kube.create_pod(admin, opted_in, kube.gpu_pod())
        return created.admitted and kube.is_mutated(created.obj)

    # The API server now verifies the webhook's new certificate against the new caBundle.
    kube.wait_for(admitted_and_mutated, "a mutated pod after the webhook switched certificates", timeout=30)

    bootstrap("--days", "10", "--renew-before-days", "5")  # 2 days left < 5: reissue under the same CA
    second = secret()
    assert second["tls.crt"] != first["tls.crt"] and second["ca.crt"] == first["ca.crt"]
    serve_secret()
    kube.wait_for(admitted_and_mutated, "a mutated pod after rotation", timeout=30)
