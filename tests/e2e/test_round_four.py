"""Issue 38 rows 1-3, performed as a tenant would: through the API server (1.30, 1.37) as the
``edit`` ServiceAccount of tests/e2e/tenant.py, in opted-in namespaces.

Row 1: an annotation that a GPU node's components turn into devices (NVIDIA's container toolkit NRI
plugin injects the CDI devices named by ``nvidia.cdi.k8s.io/container.<name>``,
``nvidia.cdi.k8s.io/pod`` or ``nvidia.cdi.k8s.io``): it used to be stored as is in all nine forms
(three keys on a non-GPU pod, a non-GPU container of a GPU pod, a GPU container), and could be
patched onto a running pod. Now the webhook refuses it at creation and gpufence-protect on update,
naming the key; a member of admin-groups may set it.

Row 2: a GPU container under Pod Security ``baseline`` with a pod-level ``runAsUser: 1000`` (its
sidecar then runs as uid 1000) and no ``allowPrivilegeEscalation``: a setuid-root binary could start
a root process out of the sidecar's reach. Now the GPU container is stored with
``allowPrivilegeEscalation: false``, and one that asks for ``true`` is refused, naming the field;
where Pod Security is unset (root sidecar) it is kept.

Row 3: an MPI/NCCL worker with ``hostPath: /dev/shm`` was refused as device access; it is admitted
with its sidecar and share, while device hostPaths and a mount the toolkit reads as a GPU request
stay refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant, make_tenant
from tests.e2e.test_running_pod_attacks import POLICY, cert_user, json_patch, read_pod
from tests.e2e.test_share_annotations import annotation_op

POD_SECURITY = "pod-security.kubernetes.io/enforce"
NRI_KEYS = ("nvidia.cdi.k8s.io/container.{name}", "nvidia.cdi.k8s.io/pod", "nvidia.cdi.k8s.io")
ALL_GPUS = "nvidia.com/gpu=all"


def _refused_by_the_webhook(created: kube.Created, *needles: str) -> None:
    assert not created.admitted, f"admitted: {created.obj and created.obj['metadata']}"
    assert created.status == 400, (created.status, created.message)
    for needle in needles:
        assert needle in created.message, (needle, created.message)


def _plain(name: str = "plain") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": kube.unique(name)},
            "spec": {"containers": [{"name": "helper", "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
                                     "command": ["nvidia-smi"]}]}}


def _with_helper(pod: dict[str, Any]) -> dict[str, Any]:
    pod["spec"]["containers"].append({"name": "helper", "image": "busybox:1.36", "command": ["sleep", "1d"]})
    return pod


# --- row 1 -----------------------------------------------------------------------------------------


def test_annotations_that_hand_out_gpus_are_refused_at_creation(tenant: Tenant, gpufence: WebhookProcess):
    gpufence.wait_until_known(tenant.namespace)
    forms = [  # (pod, the container the annotation targets)
        (_plain, "helper"),  # a pod that requests no GPU
        (lambda: _with_helper(kube.gpu_pod(annotations={"gpufence.io/memory": "4Gi"})), "helper"),
        (lambda: kube.gpu_pod(annotations={"gpufence.io/memory": "4Gi"}), "trainer"),
    ]
    for make, target in forms:
        for form in NRI_KEYS:
            key = form.format(name=target)
            pod = make()
            pod["metadata"].setdefault("annotations", {})[key] = ALL_GPUS
            answer = kube.create_pod(tenant.api, tenant.namespace, pod)
            _refused_by_the_webhook(answer, f'annotation {key}="{ALL_GPUS}"', "NRI plugin",
                                    'resources.limits["nvidia.com/gpu"]')
    cdi = _plain("cdi")
    cdi["metadata"]["annotations"] = {"cdi.k8s.io/tenant_all": ALL_GPUS}
    _refused_by_the_webhook(kube.create_pod(tenant.api, tenant.namespace, cdi), "annotation cdi.k8s.io/tenant_all=")
    # The control: the same pods with another annotation are admitted.
    control = _plain("control")
    control["metadata"]["annotations"] = {"example.com/nvidia.cdi.k8s.io": ALL_GPUS}
    assert kube.create_pod(tenant.api, tenant.namespace, control).admitted


def test_an_annotation_that_hands_out_gpus_cannot_be_added_after_admission(
        cluster: ControlPlane, admin: client.ApiClient, tenant: Tenant, gpufence: WebhookProcess,
        tmp_path: Path) -> None:
    gpufence.wait_until_known(tenant.namespace)
    created = kube.create_pod(tenant.api, tenant.namespace, _plain("gated"))
    assert created.admitted, created.message
    assert created.obj is not None
    name = str(created.obj["metadata"]["name"])
    for key in ("nvidia.cdi.k8s.io/container.helper", "nvidia.cdi.k8s.io/pod", "nvidia.cdi.k8s.io"):
        answer = json_patch(tenant.api, tenant.namespace, name, [
            {"op": "add", "path": "/metadata/annotations", "value": {key: ALL_GPUS}}])
        assert answer.refused_by_gpufence, answer
        assert f'adds the annotation {key}="{ALL_GPUS}"' in answer.message and "admin-groups" in answer.message
    # As a tenant types it.
    result = tenant.kubectl(cluster, "annotate", f"pod/{name}", f"nvidia.cdi.k8s.io/pod={ALL_GPUS}", check=False)
    assert result.returncode != 0 and POLICY in result.stderr, result
    assert "nvidia.cdi.k8s.io" not in str(read_pod(tenant.api, tenant.namespace, name)["metadata"].get("annotations"))
    # Other annotations still change.
    tenant.kubectl(cluster, "annotate", f"pod/{name}", "example.com/note=checked")

    # A member of admin-groups may.
    client.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(tenant.namespace, {
        "metadata": {"name": "gpufence-admins-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "Group", "name": "gpufence:admins", "apiGroup": "rbac.authorization.k8s.io"}],
    })
    operator = cert_user(cluster, tmp_path, "oncall", ("gpufence:admins",))
    ops = [annotation_op("add", "nvidia.cdi.k8s.io/pod", "nvidia.com/gpu=0")]
    answer = kube.wait_for(lambda: (a := json_patch(operator, tenant.namespace, name, ops)).status != 403 and a,
                           "the operator's RoleBinding")
    assert answer.status == 200, answer


# --- row 2 -----------------------------------------------------------------------------------------


def _pod_user_gpu_pod(**container_context: Any) -> dict[str, Any]:
    pod = kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"})
    pod["spec"]["securityContext"] = {"runAsUser": 1000, "runAsGroup": 1000}
    if container_context:
        pod["spec"]["containers"][0]["securityContext"] = container_context
    return pod


def test_no_way_to_root_beside_a_non_root_sidecar_under_baseline(
        cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path):
    tenant = make_tenant(cluster, admin, tmp_path, labels={POD_SECURITY: "baseline"})
    webhook.wait_until_known(tenant.namespace)  # else the webhook would not know the level yet

    # The row as written: stored with no_new_privs on the GPU container beside a uid-1000 sidecar.
    created = kube.create_pod(tenant.api, tenant.namespace, _with_helper(_pod_user_gpu_pod()))
    assert created.admitted, created.message
    stored = created.obj
    assert stored is not None and kube.is_mutated(stored)
    assert kube.container(stored, SIDECAR_NAME)["securityContext"]["runAsUser"] == 1000
    assert kube.container(stored, "trainer")["securityContext"]["allowPrivilegeEscalation"] is False
    assert "securityContext" not in kube.container(stored, "helper")  # no GPU: left as written

    # Asking for escalation explicitly: refused by gpufence, naming the field.
    _refused_by_the_webhook(
        kube.create_pod(tenant.api, tenant.namespace, _pod_user_gpu_pod(allowPrivilegeEscalation=True)),
        "spec.containers[0].securityContext.allowPrivilegeEscalation", 'Pod Security "baseline"')


def test_escalation_is_kept_where_the_sidecar_is_root(tenant: Tenant, webhook: WebhookProcess):
    webhook.wait_until_known(tenant.namespace)  # no Pod Security label: the sidecar is root
    created = kube.create_pod(tenant.api, tenant.namespace, _pod_user_gpu_pod(allowPrivilegeEscalation=True))
    assert created.admitted, created.message
    assert created.obj is not None
    assert kube.container(created.obj, "trainer")["securityContext"]["allowPrivilegeEscalation"] is True
    assert kube.container(created.obj, SIDECAR_NAME)["securityContext"]["runAsUser"] == 0


# --- row 3 -----------------------------------------------------------------------------------------


def mpi_worker() -> dict[str, Any]:
    """An MPI/NCCL worker: 8 GPUs, EFA interfaces, huge pages, NCCL's shared memory on the node's /dev/shm."""
    pod = kube.gpu_pod(gpus=8, annotations={"gpufence.io/memory": "8Gi"},  # the tenant's ceiling
                       limits={"vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "5120Mi", "memory": "64Gi"})
    container = pod["spec"]["containers"][0]
    container["resources"]["requests"] = {"cpu": "8", "memory": "64Gi", "hugepages-2Mi": "5120Mi",
                                          "vpc.amazonaws.com/efa": "32"}
    container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"},
                                 {"name": "hugepages", "mountPath": "/dev/hugepages"}]
    pod["spec"]["volumes"] = [{"name": "dshm", "hostPath": {"path": "/dev/shm", "type": "Directory"}},
                              {"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}}]
    return pod


def test_an_mpi_worker_with_the_nodes_dev_shm_is_admitted_and_devices_stay_refused(tenant: Tenant,
                                                                                   webhook: WebhookProcess):
    webhook.wait_until_known(tenant.namespace)
    created = kube.create_pod(tenant.api, tenant.namespace, mpi_worker())
    assert created.admitted, created.message
    stored = created.obj
    assert stored is not None and kube.is_mutated(stored)
    assert kube.container(stored, SIDECAR_NAME) is not None
    assert kube.env_of(kube.container(stored, "trainer"))["GPUFENCE_CONTAINER"] == "trainer"
    assert {"name": "dshm", "hostPath": {"path": "/dev/shm", "type": "Directory"}} in stored["spec"]["volumes"]

    for path, field in (("/dev/shm/d", "spec.volumes[0].hostPath.path"), ("/dev/char", "spec.volumes[0].hostPath.path"),
                        ("/dev", "spec.volumes[0].hostPath.path")):
        worker = mpi_worker()
        worker["spec"]["volumes"][0]["hostPath"] = {"path": path}
        _refused_by_the_webhook(kube.create_pod(tenant.api, tenant.namespace, worker), field, f'"{path}"')
    device = mpi_worker()
    device["spec"]["volumes"][0]["hostPath"] = {"path": "/dev/shm", "type": "CharDevice"}
    _refused_by_the_webhook(kube.create_pod(tenant.api, tenant.namespace, device), "spec.volumes[0].hostPath.type")
    privileged = mpi_worker()
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    _refused_by_the_webhook(kube.create_pod(tenant.api, tenant.namespace, privileged),
                            "spec.containers[0].securityContext.privileged")
    toolkit = _plain("toolkit-mount")
    toolkit["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "masked", "mountPath": "/var/run/nvidia-container-devices/all"}]
    toolkit["spec"]["volumes"] = [{"name": "masked", "hostPath": {"path": "/usr/lib/systemd/system/x.target"}}]
    _refused_by_the_webhook(kube.create_pod(tenant.api, tenant.namespace, toolkit),
                            "spec.containers[0].volumeMounts[0].mountPath")
