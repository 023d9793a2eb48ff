"""Attacks on a running GPU pod, as a tenant runs them, against the real API servers (1.30, 1.37).

The tenant (tests/e2e/tenant.py: an ``edit`` ServiceAccount with a real token, in an opted-in
namespace with ceilings) creates a GPU pod, which the webhook injects, and then tries what ``edit``
allows on it: patching the sidecar's image or the gpufence.io/status annotation, exec and attach
into the sidecar, and, with the ``pods/ephemeralcontainers`` right many clusters grant on top of
``edit``, ephemeral containers that ask the NVIDIA toolkit for GPUs or reach into the sidecar. Each
attack passes only when the API server refuses it with the gpufence-protect policy's message
(k8s/base/protect-policy.yaml). The other side is tested too: what a pod's ordinary life sends
(labels, a workload container's new image, the kubelet's status writes, the garbage collector's
ownerReferences patch, a finalizer's removal) still passes, and so does exec into the workload
container. There is no node: the API server decides admission before it looks for one, so an exec
that admission lets through fails afterwards with "does not have a host assigned", never with
gpufence's denial.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpufence.certs import pki
from gpufence.contract import ANNOTATION_STATUS, SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.cluster_pki import client_cert
from tests.e2e.controlplane import ControlPlane, write_kubeconfig
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant

POLICY = "gpufence-protect"
CUDA_IMAGE = "nvidia/cuda:12.4.1-base-ubuntu22.04"  # its image config sets NVIDIA_VISIBLE_DEVICES=all
NO_HOST = "does not have a host assigned"  # what the API server says after admission, with no node


@dataclass(frozen=True)
class Answer:
    status: int
    message: str

    @property
    def refused_by_gpufence(self) -> bool:
        return self.status == 403 and POLICY in self.message


def call(api: client.ApiClient, method: str, path: str, *, body: Any = None,
         content_type: str = "application/json", query: list[tuple[str, str]] | None = None) -> Answer:
    """One request as ``api``'s user: the status and the API server's message (or the body)."""
    method, url, headers, data, _ = api.param_serialize(
        method, path, query_params=query or [], body=body, auth_settings=["BearerToken"],
        header_params={"Content-Type": content_type, "Accept": "application/json"})
    resp = api.call_api(method, url, header_params=headers, body=data)
    raw = resp.read()
    try:
        message = json.loads(raw).get("message", "") if resp.status >= 300 else raw.decode()
    except (TypeError, ValueError):
        message = raw.decode(errors="replace")
    return Answer(resp.status, message)


def pod_path(namespace: str, name: str, sub: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}" + (f"/{sub}" if sub else "")


def read_pod(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return api.sanitize_for_serialization(client.CoreV1Api(api).read_namespaced_pod(name, namespace))


def json_patch(api: client.ApiClient, namespace: str, name: str, ops: list[dict[str, Any]],
               sub: str = "") -> Answer:
    return call(api, "PATCH", pod_path(namespace, name, sub), body=ops, content_type="application/json-patch+json")


def sidecar_index(pod: dict[str, Any]) -> tuple[str, int]:
    for key in ("initContainers", "containers"):
        for i, container in enumerate(pod["spec"].get(key) or []):
            if container["name"] == SIDECAR_NAME:
                return key, i
    raise AssertionError(f"no {SIDECAR_NAME} in {kube.container_names(pod)}")


@pytest.fixture
def tenant_pod(tenant: Tenant, gpufence: WebhookProcess) -> str:
    """A GPU pod the tenant created within its ceilings, as the webhook injected it."""
    gpufence.wait_until_known(tenant.namespace)
    created = kube.create_pod(tenant.api, tenant.namespace, kube.gpu_pod(
        annotations={"gpufence.io/memory": "4Gi", "gpufence.io/compute": "20"}))
    assert created.admitted, created.message
    assert kube.is_mutated(created.obj)
    return created.obj["metadata"]["name"]


def grant(cluster: ControlPlane, admin: client.ApiClient, tenant: Tenant, role: str, resource: str) -> None:
    """A Role on top of ``edit`` giving the tenant ``resource`` (as many clusters do)."""
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role(tenant.namespace, {
        "metadata": {"name": role},
        "rules": [{"apiGroups": [""], "resources": [resource], "verbs": ["get", "patch", "update"]}],
    })
    rbac.create_namespaced_role_binding(tenant.namespace, {
        "metadata": {"name": f"tenant-{role}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": tenant.namespace}],
    })
    kube.wait_for(lambda: tenant.can(cluster, "patch", resource), f"the {role} Role")


@pytest.fixture
def debugging_tenant(cluster: ControlPlane, admin: client.ApiClient, tenant: Tenant) -> Tenant:
    """The tenant with the right to add ephemeral containers (``kubectl debug``), which ``edit`` lacks."""
    grant(cluster, admin, tenant, "debugger", "pods/ephemeralcontainers")
    return tenant


def cert_user(cluster: ControlPlane, tmp_path: Path, user: str, groups: tuple[str, ...]) -> client.ApiClient:
    """A client of ``user`` in ``groups``, with a certificate of the cluster's CA (as a node or an
    operator authenticates)."""
    assert cluster.pki.ca_key is not None
    ca = pki.KeyPair(pki.load_cert(cluster.pki.ca_cert.read_bytes()), pki.load_key(cluster.pki.ca_key.read_bytes()))
    identity = client_cert(ca, user, groups)
    stem = user.replace(":", "-")
    (tmp_path / f"{stem}.crt").write_bytes(identity.cert_pem)
    (tmp_path / f"{stem}.key").write_bytes(identity.key_pem)
    kubeconfig = write_kubeconfig(tmp_path / f"{stem}.kubeconfig", cluster.server, cluster.pki.ca_cert,
                                  cert=tmp_path / f"{stem}.crt", key=tmp_path / f"{stem}.key", user=user)
    return kube.api_client(kubeconfig)


# --- the policy as the API server holds it ---------------------------------------------------------


@pytest.mark.parametrize("name", [POLICY, f"{POLICY}-exec"])
def test_the_api_server_accepts_the_protect_policies(cluster: ControlPlane, gpufence: WebhookProcess,
                                                     name: str) -> None:
    """Compiled and type-checked by the API server (status.typeChecking lists what does not check)."""
    def current() -> dict[str, Any]:
        return json.loads(cluster.kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout)

    generation = current()["metadata"]["generation"]
    kube.wait_for(lambda: current().get("status", {}).get("observedGeneration") == generation,
                  "the policy's type check")
    assert current()["status"].get("typeChecking", {}).get("expressionWarnings", []) == []


# --- row 2: the sidecar's image, and what the enforcer reads, on UPDATE ---------------------------


def test_patching_the_sidecars_image_is_refused(cluster: ControlPlane, tenant: Tenant, tenant_pod: str) -> None:
    before = read_pod(tenant.api, tenant.namespace, tenant_pod)
    key, i = sidecar_index(before)
    answer = json_patch(tenant.api, tenant.namespace, tenant_pod, [
        {"op": "replace", "path": f"/spec/{key}/{i}/image", "value": "busybox:1.36"}])
    assert answer.refused_by_gpufence, answer
    assert f'to "busybox:1.36", of container "{SIDECAR_NAME}"' in answer.message

    # kubectl as a tenant types it: a strategic merge patch through `kubectl set image`.
    result = tenant.kubectl(cluster, "set", "image", f"pod/{tenant_pod}", f"{SIDECAR_NAME}=busybox:1.36",
                            check=False)
    assert result.returncode != 0 and POLICY in result.stderr and "changes the image" in result.stderr, result
    after = read_pod(tenant.api, tenant.namespace, tenant_pod)
    assert after["spec"][key][i]["image"] == before["spec"][key][i]["image"]


def test_resizing_the_sidecar_is_refused(cluster: ControlPlane, admin: client.ApiClient, tenant: Tenant,
                                         tenant_pod: str) -> None:
    """A sidecar starved of CPU polls late. A pod UPDATE cannot change resources (the API server's own
    validation); from 1.33 pods/resize can, which edit does not grant and a cluster may: the tenant
    gets it here, and the sidecar's resources must still not change."""
    key, i = sidecar_index(read_pod(tenant.api, tenant.namespace, tenant_pod))
    # Down to its request (10m), a limit the API server itself accepts.
    ops = [{"op": "replace", "path": f"/spec/{key}/{i}/resources/limits/cpu", "value": "10m"}]
    update = json_patch(tenant.api, tenant.namespace, tenant_pod, ops)
    assert update.status == 422 and "pod updates may not change fields" in update.message, update

    grant(cluster, admin, tenant, "resizer", "pods/resize")
    resize = json_patch(tenant.api, tenant.namespace, tenant_pod, ops, sub="resize")
    if resize.status == 404:  # Kubernetes < 1.33 has no pods/resize: nothing to protect
        assert int(cluster.binaries.version.lstrip("v").split(".")[1]) < 33, resize
        return
    assert resize.refused_by_gpufence, resize
    assert 'changes the resources of container "gpufence-enforcer"' in resize.message


@pytest.mark.parametrize("change", ["overwrite", "remove"])
def test_rewriting_the_status_annotation_is_refused(cluster: ControlPlane, tenant: Tenant, tenant_pod: str,
                                                    change: str) -> None:
    before = read_pod(tenant.api, tenant.namespace, tenant_pod)["metadata"]["annotations"][ANNOTATION_STATUS]
    forged = before.replace('"enforce"', '"audit"')
    args = ([f"{ANNOTATION_STATUS}={forged}", "--overwrite"] if change == "overwrite" else [f"{ANNOTATION_STATUS}-"])
    result = tenant.kubectl(cluster, "annotate", f"pod/{tenant_pod}", *args, check=False)
    assert result.returncode != 0 and POLICY in result.stderr, result
    verb = "changes" if change == "overwrite" else "removes"
    assert f"{verb} the annotation {ANNOTATION_STATUS}" in result.stderr
    after = read_pod(tenant.api, tenant.namespace, tenant_pod)["metadata"]["annotations"][ANNOTATION_STATUS]
    assert after == before


def test_ordinary_updates_of_a_gpu_pod_pass(cluster: ControlPlane, tenant: Tenant, tenant_pod: str) -> None:
    tenant.kubectl(cluster, "label", f"pod/{tenant_pod}", "release=2")
    tenant.kubectl(cluster, "annotate", f"pod/{tenant_pod}", "example.com/note=checked")
    tenant.kubectl(cluster, "set", "image", f"pod/{tenant_pod}", "trainer=example.com/train:2")
    tolerations = read_pod(tenant.api, tenant.namespace, tenant_pod)["spec"].get("tolerations") or []
    answer = json_patch(tenant.api, tenant.namespace, tenant_pod, [
        {"op": "add", "path": "/spec/tolerations", "value": [
            *tolerations, {"key": "maintenance", "operator": "Exists", "effect": "NoSchedule"}]},
        {"op": "add", "path": "/spec/activeDeadlineSeconds", "value": 86400},
    ])
    assert answer.status == 200, answer
    pod = read_pod(tenant.api, tenant.namespace, tenant_pod)
    assert pod["metadata"]["labels"]["release"] == "2"
    assert pod["metadata"]["annotations"]["example.com/note"] == "checked"
    assert pod["spec"]["containers"][0]["image"] == "example.com/train:2"
    assert pod["spec"]["activeDeadlineSeconds"] == 86400


def test_the_kubelets_status_writes_pass(admin: client.ApiClient, cluster: ControlPlane, tenant: Tenant,
                                         tenant_pod: str, tmp_path: Path) -> None:
    """As the kubelet sends them: its own identity (Node authorizer), pods/status of a pod bound to it."""
    node = kube.unique("node")
    bound = call(admin, "POST", pod_path(tenant.namespace, tenant_pod, "binding"), body={
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": tenant_pod},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node}})
    assert bound.status == 201, bound
    kubelet = cert_user(cluster, tmp_path, f"system:node:{node}", ("system:nodes",))
    status = {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    # The Node authorizer learns of the binding from its own watch: until then the kubelet gets 403.
    answer = kube.wait_for(lambda: (a := call(kubelet, "PATCH", pod_path(tenant.namespace, tenant_pod, "status"),
                                              body=status, content_type="application/strategic-merge-patch+json"))
                           .status != 403 and a, "the Node authorizer to see the binding")
    assert answer.status == 200, answer
    assert read_pod(admin, tenant.namespace, tenant_pod)["status"]["phase"] == "Running"


def test_the_garbage_collector_and_finalizers_pass(admin: client.ApiClient, tenant: Tenant,
                                                   gpufence: WebhookProcess) -> None:
    """The garbage collector orphans the pod (an UPDATE of its ownerReferences, as its own
    ServiceAccount), and a finalizer the tenant set is removed by an UPDATE during deletion."""
    gpufence.wait_until_known(tenant.namespace)
    core = client.CoreV1Api(tenant.api)
    owner = core.create_namespaced_config_map(tenant.namespace, {"metadata": {"name": kube.unique("owner")}})
    pod = kube.gpu_pod(annotations={"gpufence.io/memory": "4Gi", "gpufence.io/compute": "20"})
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner.metadata.name,
                                           "uid": owner.metadata.uid}]
    pod["metadata"]["finalizers"] = ["example.com/hold"]
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted and kube.is_mutated(created.obj), created.message
    name = created.obj["metadata"]["name"]

    client.CoreV1Api(admin).delete_namespaced_config_map(owner.metadata.name, tenant.namespace,
                                                         propagation_policy="Orphan")
    kube.wait_for(lambda: not read_pod(admin, tenant.namespace, name)["metadata"].get("ownerReferences"),
                  "the garbage collector to orphan the pod")

    core.delete_namespaced_pod(name, tenant.namespace, grace_period_seconds=0)
    assert read_pod(admin, tenant.namespace, name)["metadata"].get("deletionTimestamp")
    answer = json_patch(tenant.api, tenant.namespace, name, [{"op": "remove", "path": "/metadata/finalizers"}])
    assert answer.status == 200, answer

    def gone() -> bool:
        try:
            read_pod(admin, tenant.namespace, name)
        except ApiException as exc:
            return exc.status == 404
        return False

    kube.wait_for(gone, "the pod to go once its finalizer is removed")


# --- exec and attach (rows 3 and 4: a shell in the sidecar) -----------------------------------------


def connect(api: client.ApiClient, namespace: str, name: str, what: str, container: str) -> Answer:
    query = [("container", container), ("stdout", "true"), ("stderr", "true")]
    if what == "exec":
        query += [("command", "sh"), ("command", "-c"), ("command", "kill -STOP 1")]
    return call(api, "POST", pod_path(namespace, name, what), query=query)


@pytest.mark.parametrize("what", ["exec", "attach"])
def test_exec_and_attach_into_the_sidecar_are_refused(tenant: Tenant, tenant_pod: str, what: str) -> None:
    answer = connect(tenant.api, tenant.namespace, tenant_pod, what, SIDECAR_NAME)
    assert answer.refused_by_gpufence, answer
    assert f'{what} into container "{SIDECAR_NAME}" of pod "{tenant_pod}" is refused' in answer.message


def test_kubectl_exec_into_the_sidecar_is_refused(cluster: ControlPlane, tenant: Tenant, tenant_pod: str) -> None:
    result = tenant.kubectl(cluster, "exec", tenant_pod, "-c", SIDECAR_NAME, "--", "sh", "-c", "kill 1",
                            check=False)
    assert result.returncode != 0 and POLICY in result.stderr, result


@pytest.mark.parametrize("what", ["exec", "attach"])
def test_exec_into_the_workload_container_is_admitted(tenant: Tenant, tenant_pod: str, what: str) -> None:
    answer = connect(tenant.api, tenant.namespace, tenant_pod, what, "trainer")
    assert not answer.refused_by_gpufence and "gpufence" not in answer.message, answer
    assert NO_HOST in answer.message, answer  # admission passed; only the missing node stops it


def test_the_admin_group_may_exec_into_the_sidecar(cluster: ControlPlane, admin: client.ApiClient, tenant: Tenant,
                                                   tenant_pod: str, tmp_path: Path) -> None:
    client.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(tenant.namespace, {
        "metadata": {"name": "gpufence-admins-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "Group", "name": "gpufence:admins", "apiGroup": "rbac.authorization.k8s.io"}],
    })
    operator = cert_user(cluster, tmp_path, "oncall", ("gpufence:admins",))
    answer = kube.wait_for(lambda: (a := connect(operator, tenant.namespace, tenant_pod, "exec", SIDECAR_NAME))
                           .status != 403 and a, "the operator's RoleBinding")
    assert NO_HOST in answer.message, answer


# --- row 11: ephemeral containers ----------------------------------------------------------------


def add_ephemeral(tenant: Tenant, pod: str, container: dict[str, Any]) -> Answer:
    body = {"spec": {"ephemeralContainers": [container]}}
    return call(tenant.api, "PATCH", pod_path(tenant.namespace, pod, "ephemeralcontainers"), body=body,
                content_type="application/strategic-merge-patch+json")


@pytest.fixture(params=["gpu-pod", "non-gpu-pod"])
def any_pod(request: pytest.FixtureRequest, debugging_tenant: Tenant, gpufence: WebhookProcess) -> str:
    if request.param == "gpu-pod":
        return request.getfixturevalue("tenant_pod")
    gpufence.wait_until_known(debugging_tenant.namespace)
    created = kube.create_pod(debugging_tenant.api, debugging_tenant.namespace, kube.plain_pod())
    assert created.admitted, created.message
    return created.obj["metadata"]["name"]


def test_an_ephemeral_cuda_container_asking_for_every_gpu_is_refused(debugging_tenant: Tenant, any_pod: str) -> None:
    answer = add_ephemeral(debugging_tenant, any_pod, {
        "name": "smi", "image": CUDA_IMAGE, "command": ["nvidia-smi"],
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})
    assert answer.refused_by_gpufence, answer
    assert 'ephemeral container "smi" sets NVIDIA_VISIBLE_DEVICES' in answer.message


def test_kubectl_debug_gets_the_void(cluster: ControlPlane, debugging_tenant: Tenant, any_pod: str) -> None:
    """An ordinary `kubectl debug` with a CUDA image is admitted, without the toolkit's GPUs."""
    debugging_tenant.kubectl(cluster, "debug", any_pod, f"--image={CUDA_IMAGE}", "-c", "debugger")
    pod = read_pod(debugging_tenant.api, debugging_tenant.namespace, any_pod)
    (debugger,) = [c for c in pod["spec"]["ephemeralContainers"] if c["name"] == "debugger"]
    assert kube.env_of(debugger)["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_kubectl_debug_targeting_the_sidecar_is_refused(cluster: ControlPlane, debugging_tenant: Tenant,
                                                        tenant_pod: str) -> None:
    result = debugging_tenant.kubectl(cluster, "debug", tenant_pod, "--image=busybox:1.36", "-c", "peek",
                                      f"--target={SIDECAR_NAME}", check=False)
    assert result.returncode != 0 and POLICY in result.stderr, result
    assert f"targetContainerName: {SIDECAR_NAME}" in result.stderr


def test_an_ephemeral_container_mounting_the_sidecars_state_is_refused(debugging_tenant: Tenant,
                                                                      tenant_pod: str) -> None:
    answer = add_ephemeral(debugging_tenant, tenant_pod, {
        "name": "peek", "image": "busybox:1.36", "volumeMounts": [{"name": "gpufence-state", "mountPath": "/s"}]})
    assert answer.refused_by_gpufence, answer
    assert 'mounts volume "gpufence-state"' in answer.message


@pytest.fixture
def webhook_down(webhook: WebhookProcess) -> Iterator[WebhookProcess]:
    webhook.stop("KILL")  # debug.gpufence.io fails open: the protect policy alone judges kubectl debug
    yield webhook  # the webhook fixture restarts it


def test_with_the_webhook_down_kubectl_debug_is_refused(cluster: ControlPlane, debugging_tenant: Tenant,
                                                        tenant_pod: str, webhook_down: WebhookProcess) -> None:
    result = debugging_tenant.kubectl(cluster, "debug", tenant_pod, f"--image={CUDA_IMAGE}", "-c", "debugger",
                                      check=False)
    assert result.returncode != 0 and POLICY in result.stderr, result
    assert "has no NVIDIA_VISIBLE_DEVICES=void" in result.stderr and "retry" in result.stderr
