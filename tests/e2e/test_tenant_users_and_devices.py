"""Issue 32 rows 3 and 4, performed as a tenant would: through the API server (1.30, 1.37) as the
``edit`` ServiceAccount of tests/e2e/tenant.py, in opted-in namespaces.

Row 3: a pod-level ``runAsUser: 1000`` with the GPU container ``runAsUser: 0``. The sidecar used to
inherit uid 1000 and could neither read nor signal the root process. Now its user is its own: in a
namespace without a Pod Security label it is stored as uid 0 (with SYS_PTRACE and KILL, which reach
every user); under ``restricted``, where it may hold no capability, a GPU container it could not act
on is refused by gpufence, naming the field, and the control (one user for the pod) is admitted.
(That the root sidecar then terminates the root process on a node is
tests/e2e/node/test_node_security.py.)

Row 4: a pod that requests no GPU but runs privileged, or mounts /dev/nvidia* and the driver's
libraries from the node, in an opted-in namespace without a Pod Security label (the install docs'
default): it used to be stored with NVIDIA_VISIBLE_DEVICES=void only. Now gpufence refuses it,
naming the field, unless the admin lists the namespace in ``device-access-namespaces``; the control
(the same pod without the device access) is admitted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant, make_tenant

POD_SECURITY = "pod-security.kubernetes.io/enforce"


def _refused_by_gpufence(created: kube.Created, field: str) -> None:
    assert not created.admitted, f"admitted: {created.obj and created.obj['spec']}"
    # The webhook's denial (400), not Pod Security's (403): gpufence names the field itself.
    assert created.status == 400 and field in created.message, (created.status, created.message)


def _plain(name: str, **container: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": kube.unique(name)},
            "spec": {"containers": [{"name": "helper", "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
                                     "command": ["nvidia-smi"], **container}]}}


# --- row 3 -----------------------------------------------------------------------------------------


def _root_gpu_container_under_pod_user(restricted: bool = False) -> dict[str, Any]:
    pod = kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"}, restricted=restricted)
    pod["spec"]["securityContext"] = {**pod["spec"].get("securityContext", {}), "runAsUser": 1000,
                                      "runAsGroup": 1000}
    container = pod["spec"]["containers"][0]
    container["securityContext"] = {**container.get("securityContext", {}), "runAsUser": 0}
    return pod


def test_the_sidecar_does_not_follow_the_pods_user_where_pod_security_is_unset(tenant: Tenant,
                                                                                webhook: WebhookProcess):
    webhook.wait_until_known(tenant.namespace)
    created = kube.create_pod(tenant.api, tenant.namespace, _root_gpu_container_under_pod_user())
    assert created.admitted, created.message
    stored = created.obj
    assert stored is not None and kube.is_mutated(stored)
    context = kube.container(stored, SIDECAR_NAME)["securityContext"]
    # uid 0 of its own, not the pod's 1000, with the capabilities that reach every user.
    assert context["runAsUser"] == 0, context
    assert {"KILL", "SYS_PTRACE"} <= set(context["capabilities"]["add"]), context
    assert stored["spec"]["securityContext"]["runAsUser"] == 1000  # the tenant's pod is left as written


def test_a_gpu_container_the_sidecar_cannot_act_on_is_refused_under_restricted(
        cluster: ControlPlane, admin: client.ApiClient, webhook: WebhookProcess, tmp_path: Path):
    tenant = make_tenant(cluster, admin, tmp_path, labels={POD_SECURITY: "restricted"})
    webhook.wait_until_known(tenant.namespace)  # else the webhook would not know the level yet

    # The row as written: the GPU container as root under a pod-level non-root user.
    _refused_by_gpufence(kube.create_pod(tenant.api, tenant.namespace, _root_gpu_container_under_pod_user(True)),
                         "spec.containers[0].securityContext.runAsUser")
    # Two GPU containers of two users: no one capability-less user reaches both.
    two = kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"}, restricted=True)
    other = {**two["spec"]["containers"][0], "name": "eval"}
    other["securityContext"] = {**other["securityContext"], "runAsUser": 2000}
    two["spec"]["containers"].append(other)
    _refused_by_gpufence(kube.create_pod(tenant.api, tenant.namespace, two),
                         "spec.containers[1].securityContext.runAsUser")
    # No runAsUser at all: the image's user, which the webhook cannot give the sidecar.
    image_user = kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"}, restricted=True)
    del image_user["spec"]["securityContext"]["runAsUser"]
    _refused_by_gpufence(kube.create_pod(tenant.api, tenant.namespace, image_user),
                         "spec.securityContext.runAsUser")

    # The control: one non-root user for the pod; admitted, and Pod Security restricted passes the sidecar.
    control = kube.create_pod(tenant.api, tenant.namespace,
                              kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"}, restricted=True))
    assert control.admitted, control.message
    assert control.obj is not None
    assert kube.container(control.obj, SIDECAR_NAME)["securityContext"]["runAsUser"] == 1000


# --- row 4 -----------------------------------------------------------------------------------------


def _privileged() -> dict[str, Any]:
    return _plain("privileged", securityContext={"privileged": True})


def _host_devices() -> dict[str, Any]:
    pod = _plain("host-devices", volumeMounts=[
        {"name": "nvidia0", "mountPath": "/dev/nvidia0"}, {"name": "nvidiactl", "mountPath": "/dev/nvidiactl"},
        {"name": "libs", "mountPath": "/host/lib", "readOnly": True}])
    pod["spec"]["volumes"] = [
        {"name": "nvidia0", "hostPath": {"path": "/dev/nvidia0"}},
        {"name": "nvidiactl", "hostPath": {"path": "/dev/nvidiactl"}},
        {"name": "libs", "hostPath": {"path": "/usr/lib/x86_64-linux-gnu"}}]
    return pod


def test_device_access_without_a_device_request_is_refused_to_the_tenant(tenant: Tenant):
    # The tenant's namespace enforces no Pod Security level (tests/e2e/tenant.py): where `baseline`
    # would refuse these pods itself, and the webhook used to store them with the void only.
    _refused_by_gpufence(kube.create_pod(tenant.api, tenant.namespace, _privileged()),
                         "spec.containers[0].securityContext.privileged")
    _refused_by_gpufence(kube.create_pod(tenant.api, tenant.namespace, _host_devices()),
                         "spec.volumes[0].hostPath.path")
    # A GPU pod whose container also runs privileged would see every GPU of the node: refused too.
    gpu = kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"})
    gpu["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    _refused_by_gpufence(kube.create_pod(tenant.api, tenant.namespace, gpu),
                         "spec.containers[0].securityContext.privileged")

    # The control: the same pod without the device access is admitted, with the void.
    control = kube.create_pod(tenant.api, tenant.namespace, _plain("control"))
    assert control.admitted, control.message
    assert control.obj is not None
    assert kube.env_of(kube.container(control.obj, "helper"))["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_the_admin_may_allow_device_access_in_a_listed_namespace(
        tenant: Tenant, set_policy: Callable[[dict[str, str]], None]):
    set_policy({"device-access-namespaces": tenant.namespace})
    # The webhook applies the ConfigMap from its watch: the refusal stops once it has.
    kube.wait_for(lambda: kube.create_pod(tenant.api, tenant.namespace, _privileged(), dry_run=True).admitted,
                  "the webhook to apply device-access-namespaces", timeout=30, interval=0.2)
    for pod in (_privileged(), _host_devices()):
        created = kube.create_pod(tenant.api, tenant.namespace, pod)
        assert created.admitted, created.message
