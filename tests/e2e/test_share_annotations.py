"""Issue 32 row 7: the annotations a pod's GPU share was admitted with stay as they were admitted.

The webhook turns KAI-Scheduler's ``gpu-fraction`` / ``gpu-memory``, its NvFractions per-container
requests and gpufence's own ``gpufence.io/*`` annotations into the enforcer's share when the pod
is created; the enforcer keeps that share. A tenant (``edit``, tests/e2e/tenant.py) who lowered or
removed them afterwards would have the scheduler set aside less than the enforcer allows. Each
attack passes only when the API server refuses it with the gpufence-protect policy's message
(k8s/base/protect-policy.yaml), against the real API servers (1.30, 1.37); the other side too:
other annotations and labels still change, KAI's binder's ``gpus.devices`` stays writable, and a
member of ``admin-groups`` may change a share annotation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant
from tests.e2e.test_kai import kai_pod
from tests.e2e.test_running_pod_attacks import POLICY, cert_user, json_patch, read_pod

NV_LIMIT = "nvidia.com/container.trainer.gpu-memory.limit"
NV_DEVICES = "nvidia.com/container.trainer.gpus.devices"


def created(tenant: Tenant, gpufence: WebhookProcess, pod: dict[str, Any]) -> str:
    gpufence.wait_until_known(tenant.namespace)
    answer = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert answer.admitted, answer.message
    assert kube.is_mutated(answer.obj)
    return str(answer.obj["metadata"]["name"])


def nv_pod() -> dict[str, Any]:
    """A pod that asks KAI's NvFractions for 4Gi with the per-container annotation, no GPU resource."""
    pod = kube.gpu_pod(annotations={NV_LIMIT: "4Gi"})
    del pod["spec"]["containers"][0]["resources"]["limits"]
    return pod


def escaped(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def annotation_op(op: str, key: str, value: str | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"op": op, "path": f"/metadata/annotations/{escaped(key)}"}
    if value is not None:
        found["value"] = value
    return found


@pytest.mark.parametrize(("pod", "op", "key", "value", "verb"), [
    ("kai-fraction", "replace", "gpu-fraction", "0.1", "changes"),
    ("kai-fraction", "remove", "gpu-fraction", None, "removes"),
    ("kai-fraction", "add", "gpu-fraction-num-devices", "1", "adds"),
    ("kai-memory", "remove", "gpu-memory", None, "removes"),
    ("kai-memory", "replace", "gpu-memory", "1000", "changes"),
    ("nv-fractions", "replace", NV_LIMIT, "1Gi", "changes"),
    ("gpufence", "replace", "gpufence.io/memory", "1Gi", "changes"),
    ("gpufence", "add", "gpufence.io/memory.trainer", "1Gi", "adds"),
    ("gpufence", "remove", "gpufence.io/compute", None, "removes"),
])
def test_changing_a_share_annotation_is_refused(tenant: Tenant, gpufence: WebhookProcess, pod: str, op: str,
                                                key: str, value: str | None, verb: str) -> None:
    made = {"kai-fraction": lambda: kai_pod({"gpu-fraction": "0.25"}, after_kai=False),
            "kai-memory": lambda: kai_pod({"gpu-memory": "4000"}, after_kai=False),
            "nv-fractions": nv_pod,
            "gpufence": lambda: kube.gpu_pod(annotations={"gpufence.io/memory": "4Gi", "gpufence.io/compute": "20"}),
            }[pod]()
    name = created(tenant, gpufence, made)
    before = read_pod(tenant.api, tenant.namespace, name)["metadata"]["annotations"]
    answer = json_patch(tenant.api, tenant.namespace, name, [annotation_op(op, key, value)])
    assert answer.refused_by_gpufence, answer
    assert f"{verb} the annotation {key}," in answer.message, answer
    assert "admin-groups" in answer.message and "example.com/note" in answer.message
    assert read_pod(tenant.api, tenant.namespace, name)["metadata"]["annotations"] == before


def test_kubectl_annotate_lowering_kais_fraction_is_refused(cluster: ControlPlane, tenant: Tenant,
                                                            gpufence: WebhookProcess) -> None:
    """As a tenant types it (a merge patch through kubectl)."""
    name = created(tenant, gpufence, kai_pod({"gpu-fraction": "0.25"}, after_kai=False))
    result = tenant.kubectl(cluster, "annotate", f"pod/{name}", "gpu-fraction=0.05", "--overwrite", check=False)
    assert result.returncode != 0 and POLICY in result.stderr, result
    assert "changes the annotation gpu-fraction," in result.stderr
    assert read_pod(tenant.api, tenant.namespace, name)["metadata"]["annotations"]["gpu-fraction"] == "0.25"


def test_other_annotations_labels_and_kais_devices_still_change(cluster: ControlPlane, tenant: Tenant,
                                                                gpufence: WebhookProcess) -> None:
    name = created(tenant, gpufence, nv_pod())
    tenant.kubectl(cluster, "label", f"pod/{name}", "release=2")
    tenant.kubectl(cluster, "annotate", f"pod/{name}", "example.com/note=checked")
    # KAI's binder writes the device it chose on the bound pod; gpufence leaves that write alone
    # (KAI's own admission decides who may: its binder).
    answer = json_patch(tenant.api, tenant.namespace, name, [annotation_op("add", NV_DEVICES, "GPU-0")])
    assert answer.status == 200, answer
    annotations = read_pod(tenant.api, tenant.namespace, name)["metadata"]["annotations"]
    assert annotations["example.com/note"] == "checked" and annotations[NV_LIMIT] == "4Gi"


def test_the_admin_group_may_change_a_share_annotation(cluster: ControlPlane, admin: client.ApiClient,
                                                       tenant: Tenant, gpufence: WebhookProcess,
                                                       tmp_path: Path) -> None:
    name = created(tenant, gpufence, kai_pod({"gpu-fraction": "0.25"}, after_kai=False))
    client.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(tenant.namespace, {
        "metadata": {"name": "gpufence-admins-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "Group", "name": "gpufence:admins", "apiGroup": "rbac.authorization.k8s.io"}],
    })
    operator = cert_user(cluster, tmp_path, "oncall", ("gpufence:admins",))
    ops = [annotation_op("replace", "gpu-fraction", "0.5")]
    answer = kube.wait_for(lambda: (a := json_patch(operator, tenant.namespace, name, ops)).status != 403 and a,
                           "the operator's RoleBinding")
    assert answer.status == 200, answer
    assert read_pod(tenant.api, tenant.namespace, name)["metadata"]["annotations"]["gpu-fraction"] == "0.5"
