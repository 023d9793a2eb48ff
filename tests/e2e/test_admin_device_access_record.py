"""The webhook's record of a pod a member of admin-groups created with device access only they may
grant (``gpufence.io/admin-device-access``), which the node guardian reads to report, and not end,
such a pod's GPU processes without a share: performed as a tenant would, through the API server
(1.30, 1.37) as the ``edit`` ServiceAccount of tests/e2e/tenant.py, in an opted-in namespace.

The tenant cannot set it at creation (the webhook refuses, naming it), nor add, change or remove it
on a running pod (gpufence-protect); a member of admin-groups who creates a pod with an annotation
that hands out devices gets it with the user name the API server authenticated, whatever the pod
said, and one whose pod needed no exemption gets none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client

from gpufence.contract import ANNOTATION_ADMIN_DEVICE_ACCESS
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant
from tests.e2e.test_running_pod_attacks import POLICY, cert_user, json_patch, read_pod
from tests.e2e.test_share_annotations import annotation_op


def _plain(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": kube.unique(name), "annotations": annotations or {}},
            "spec": {"containers": [{"name": "app", "image": "busybox:1.36", "command": ["sleep", "1d"]}]}}


def _annotations(api: client.ApiClient, namespace: str, name: str) -> dict[str, str]:
    return read_pod(api, namespace, name)["metadata"].get("annotations") or {}


def test_only_the_webhook_writes_the_admin_device_access_record(
        cluster: ControlPlane, admin: client.ApiClient, tenant: Tenant, gpufence: WebhookProcess,
        tmp_path: Path) -> None:
    gpufence.wait_until_known(tenant.namespace)
    # At creation, a GPU pod or not.
    for pod in (_plain("forged", {ANNOTATION_ADMIN_DEVICE_ACCESS: "alice"}),
                kube.gpu_pod(annotations={ANNOTATION_ADMIN_DEVICE_ACCESS: "alice"})):
        refused = kube.create_pod(tenant.api, tenant.namespace, pod)
        assert not refused.admitted and refused.status == 400, (refused.status, refused.message)
        assert f'annotation {ANNOTATION_ADMIN_DEVICE_ACCESS}="alice" (metadata.annotations)' in refused.message
        assert "admin-groups" in refused.message

    # On a running pod: not added, as a JSON patch or as a tenant types it.
    created = kube.create_pod(tenant.api, tenant.namespace, _plain("plain"))
    assert created.admitted and created.obj is not None, created.message
    name = str(created.obj["metadata"]["name"])
    assert ANNOTATION_ADMIN_DEVICE_ACCESS not in _annotations(tenant.api, tenant.namespace, name)
    answer = json_patch(tenant.api, tenant.namespace, name, [
        {"op": "add", "path": "/metadata/annotations", "value": {ANNOTATION_ADMIN_DEVICE_ACCESS: "alice"}}])
    assert answer.refused_by_gpufence, answer
    assert f"adds the annotation {ANNOTATION_ADMIN_DEVICE_ACCESS}, which the gpufence webhook writes" in answer.message
    result = tenant.kubectl(cluster, "annotate", f"pod/{name}", f"{ANNOTATION_ADMIN_DEVICE_ACCESS}=alice", check=False)
    assert result.returncode != 0 and POLICY in result.stderr, result
    assert ANNOTATION_ADMIN_DEVICE_ACCESS not in _annotations(tenant.api, tenant.namespace, name)

    # A member of admin-groups creates a pod: recorded with the name the API server authenticated.
    client.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(tenant.namespace, {
        "metadata": {"name": "gpufence-admins-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "Group", "name": "gpufence:admins", "apiGroup": "rbac.authorization.k8s.io"}],
    })
    operator = cert_user(cluster, tmp_path, "oncall", ("gpufence:admins",))
    pod = _plain("by-admin", {ANNOTATION_ADMIN_DEVICE_ACCESS: "someone-else",
                              "nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=0"})
    made = kube.wait_for(
        lambda: (c := kube.create_pod(operator, tenant.namespace, pod)).status != 403 and c,
        "the operator's RoleBinding")
    assert made.admitted and made.obj is not None, (made.status, made.message)
    ours = str(made.obj["metadata"]["name"])
    assert _annotations(tenant.api, tenant.namespace, ours)[ANNOTATION_ADMIN_DEVICE_ACCESS] == "oncall"
    # The operator's pod that needs no exemption: no record (the admin allowed it no device).
    ordinary = kube.create_pod(operator, tenant.namespace, _plain("ordinary"))
    assert ordinary.admitted and ordinary.obj is not None, ordinary.message
    assert ANNOTATION_ADMIN_DEVICE_ACCESS not in _annotations(tenant.api, tenant.namespace,
                                                             str(ordinary.obj["metadata"]["name"]))

    # The tenant can neither change nor remove it.
    for op in (annotation_op("replace", ANNOTATION_ADMIN_DEVICE_ACCESS, "mallory"),
               annotation_op("remove", ANNOTATION_ADMIN_DEVICE_ACCESS)):
        answer = json_patch(tenant.api, tenant.namespace, ours, [op])
        assert answer.refused_by_gpufence, answer
        verb = "changes" if op["op"] == "replace" else "removes"
        assert f"{verb} the annotation {ANNOTATION_ADMIN_DEVICE_ACCESS}," in answer.message
    assert _annotations(tenant.api, tenant.namespace, ours)[ANNOTATION_ADMIN_DEVICE_ACCESS] == "oncall"
    # Other annotations still change.
    tenant.kubectl(cluster, "annotate", f"pod/{ours}", "example.com/note=checked")
