"""Attacks on a running GPU pod, on the real node: what the kubelet does after admission said no (or yes).

tests/e2e/test_running_pod_attacks.py shows the API server's refusals; these show what they mean
for the pod the kubelet runs. The attack of changing the sidecar's image works at the sidecar's
next restart (kubelet 1.30 keeps the running container): the tenant's patch is refused, the sidecar
is then killed (from the host, as a workload with the sidecar's uid could), and the kubelet
restarts it with the injected image. ``kubectl debug`` by a tenant granted
``pods/ephemeralcontainers`` runs, with the ``NVIDIA_VISIBLE_DEVICES=void`` the webhook added in
its environment, so the NVIDIA toolkit hands it no GPU whatever its image says.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant
from tests.node.images import GPUFENCE_IMAGE
from tests.node.node import Node
from tests.node.workloads import container_log, get_pod, gpu_pod, host_pid, statuses, wait_running, workload_container

SHARES = {"gpufence.io/memory": "4Gi", "gpufence.io/compute": "20"}  # within the tenant's ceilings


def tenant_gpu_pod(cluster: ControlPlane, node: Node, tenant: Tenant, gpufence: WebhookProcess) -> dict[str, Any]:
    gpufence.wait_until_known(tenant.namespace)
    created = kube.create_pod(tenant.api, tenant.namespace, gpu_pod([workload_container("trainer")], SHARES))
    assert created.admitted and kube.is_mutated(created.obj), created.message
    return wait_running(cluster, node, tenant.namespace, created.obj["metadata"]["name"])


def test_a_refused_image_patch_leaves_the_restarted_sidecar_as_injected(
        cluster: ControlPlane, node: Node, sim: Node, tenant: Tenant, gpufence: WebhookProcess) -> None:
    pod = tenant_gpu_pod(cluster, node, tenant, gpufence)
    name = pod["metadata"]["name"]
    injected = next(c["image"] for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    result = tenant.kubectl(cluster, "set", "image", f"pod/{name}", f"{SIDECAR_NAME}=busybox:1.36", check=False)
    assert result.returncode != 0 and "gpufence-protect" in result.stderr, result

    os.kill(host_pid(node, pod, SIDECAR_NAME), signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        current = get_pod(cluster, tenant.namespace, name)
        status = statuses(current)[SIDECAR_NAME]
        return current if status["restartCount"] >= 1 and status.get("started") else None

    after = kube.wait_for(restarted, "the kubelet to restart the killed sidecar", 60, 0.3)
    spec_image = next(c["image"] for c in after["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)
    assert spec_image == injected
    assert statuses(after)[SIDECAR_NAME]["image"].endswith(injected.rsplit("/", 1)[-1])


def test_kubectl_debug_runs_without_the_toolkits_gpus(cluster: ControlPlane, admin: client.ApiClient, node: Node,
                                                      sim: Node, tenant: Tenant, gpufence: WebhookProcess) -> None:
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role(tenant.namespace, {"metadata": {"name": "debugger"}, "rules": [
        {"apiGroups": [""], "resources": ["pods/ephemeralcontainers"], "verbs": ["get", "patch", "update"]}]})
    rbac.create_namespaced_role_binding(tenant.namespace, {
        "metadata": {"name": "tenant-debugger"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "debugger"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": tenant.namespace}]})
    kube.wait_for(lambda: tenant.can(cluster, "patch", "pods/ephemeralcontainers"), "the debugger Role")
    name = tenant_gpu_pod(cluster, node, tenant, gpufence)["metadata"]["name"]

    tenant.kubectl(cluster, "debug", name, f"--image={GPUFENCE_IMAGE}", "--image-pull-policy=Never", "-c", "dbg",
                   "--target=trainer", "--", "sh", "-c", 'echo "visible=$NVIDIA_VISIBLE_DEVICES"; sleep 3600')

    def debugger_running() -> dict[str, Any] | None:
        current = get_pod(cluster, tenant.namespace, name)
        found = {s["name"]: s for s in current.get("status", {}).get("ephemeralContainerStatuses") or []}
        return current if "running" in (found.get("dbg", {}).get("state") or {}) else None

    running = kube.wait_for(debugger_running, "the ephemeral container running", 60, 0.3)
    kube.wait_for(lambda: "visible=" in container_log(running, "dbg"), "the debugger's output", 30, 0.2)
    assert "visible=void" in container_log(running, "dbg"), container_log(running, "dbg")
    (debugger,) = [c for c in running["spec"]["ephemeralContainers"] if c["name"] == "dbg"]
    assert kube.env_of(debugger)["NVIDIA_VISIBLE_DEVICES"] == "void", json.dumps(debugger)
