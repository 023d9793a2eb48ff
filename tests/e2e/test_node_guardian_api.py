"""The node guardian's side of the API server: with the RBAC of k8s/components/node-guardian and a
real bound token of its ServiceAccount, its pod watch (list, then watch, with
``fieldSelector=spec.nodeName``) sees the pods of its node only, with the admitted shares of each
pod's spec and the container IDs of its status, follows their changes, and may change nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.node.kube import PodWatch, load_apis
from gpufence.node.pods import Admission
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import apply_objects, service_account_kubeconfig
from tests.e2e.test_rbac import can_i

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = ROOT / "k8s" / "components" / "node-guardian"
GUARDIAN = "system:serviceaccount:gpufence-node:gpufence-node"
NODE = "gpu-node-1"
SHARE = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 << 30))})


@pytest.fixture(scope="module")
def guardian_rbac(cluster: ControlPlane) -> None:
    # gpufence's namespace first: the guardian's Role on the policy ConfigMap lives there.
    files = [ROOT / "k8s" / "base" / "namespace.yaml", COMPONENT / "namespace.yaml", COMPONENT / "rbac.yaml",
             COMPONENT / "protect-events.yaml"]
    objects = [o for path in files for o in yaml.safe_load_all(path.read_text())]
    apply_objects(cluster, objects)


def pod(name: str, node: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,  # bound to a node that has no kubelet here: the pod stays Pending
            "initContainers": [{"name": "gpufence-enforcer", "image": "gpufence", "restartPolicy": "Always",
                                "env": [{"name": "GPUFENCE_CONFIG", "value": SHARE.to_json()}]}],
            "containers": [{"name": "train", "image": "cuda"}],
        },
    }


def set_container_id(cluster: ControlPlane, namespace: str, name: str, container_id: str) -> None:
    """What the kubelet writes once the runtime started the container."""
    status = {"status": {"containerStatuses": [{
        "name": "train", "ready": True, "restartCount": 0, "image": "cuda", "imageID": "",
        "containerID": f"containerd://{container_id}", "state": {"running": {}},
    }]}}
    cluster.kubectl("patch", "pod", name, "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))


def test_the_guardian_may_read_the_policy_configmap_and_no_other(cluster: ControlPlane, guardian_rbac: None) -> None:
    def may(verb: str, name: str) -> bool:
        result = cluster.kubectl("auth", "can-i", verb, f"configmaps/{name}", "-n", "gpufence", "--as", GUARDIAN,
                                 check=False)
        assert result.stdout.strip() in ("yes", "no"), result.stderr
        return result.stdout.strip() == "yes"

    assert may("get", "gpufence-policy") and may("watch", "gpufence-policy") and may("list", "gpufence-policy")
    assert not may("get", "other") and not may("update", "gpufence-policy")


@pytest.mark.parametrize(("verb", "resource", "allowed"), [
    ("list", "pods", True), ("watch", "pods", True), ("get", "pods", True),
    ("list", "namespaces", True), ("watch", "namespaces", True),
    ("create", "events", True),
    ("create", "pods", False), ("delete", "pods", False), ("patch", "pods", False), ("update", "pods/status", False),
    ("create", "pods/exec", False), ("get", "secrets", False), ("create", "serviceaccounts/token", False),
    ("update", "namespaces", False),
])
def test_the_guardian_may_read_and_report_and_change_nothing(
    cluster: ControlPlane, guardian_rbac: None, verb: str, resource: str, allowed: bool
) -> None:
    assert can_i(cluster, GUARDIAN, verb, resource, None if verb in ("list", "watch") else "default") is allowed


def test_the_pod_watch_sees_its_nodes_pods_with_their_shares_and_container_ids(
    cluster: ControlPlane, guardian_rbac: None, admin: client.ApiClient, tmp_path: Path
) -> None:
    namespace = kube.create_namespace(admin, "guardian", labels={"gpufence.io/injection": "enabled"})
    core = client.CoreV1Api(admin)
    mine = core.create_namespaced_pod(namespace, pod("mine", NODE))
    core.create_namespaced_pod(namespace, pod("elsewhere", "another-node"))
    first_id = "a" * 64
    set_container_id(cluster, namespace, "mine", first_id)

    token = service_account_kubeconfig(cluster, "gpufence-node", "gpufence-node", tmp_path / "guardian.kubeconfig")
    core_api, custom_api = load_apis(str(token))
    watch = PodWatch(core_api, NODE, custom_api, min_backoff=0.1, max_backoff=1.0)
    watch.start()
    try:
        kube.wait_for(watch.has_synced, "the guardian's pod list")
        kube.wait_for(lambda: mine.metadata.uid in watch.index().pods, "pod mine")
        index = watch.index()
        assert [p.name for p in index.pods.values()] == ["mine"]  # the other node's pod is not listed
        found = index.pods[mine.metadata.uid]
        assert found.admission is Admission.ADMITTED and found.config == SHARE
        assert found.containers == {first_id: "train"}
        assert namespace in index.opted_in

        # The kubelet restarts the container: a new ID arrives through the watch.
        second_id = "b" * 64
        set_container_id(cluster, namespace, "mine", second_id)
        kube.wait_for(lambda: watch.index().pods[mine.metadata.uid].containers == {second_id: "train"},
                      "the new container ID")
        core.delete_namespaced_pod("mine", namespace, grace_period_seconds=0)
        kube.wait_for(lambda: mine.metadata.uid not in watch.index().pods, "the deleted pod gone")
    finally:
        watch.stop(timeout=5)


def core_event(namespace: str, component: str) -> dict[str, Any]:
    return {
        "metadata": {"generateName": "p.gpufence."},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": namespace},
        "reason": "GPUMemoryOverShare", "message": "forged?", "type": "Warning",
        "source": {"component": component}, "reportingComponent": component, "reportingInstance": "x",
    }


def events_v1_event(namespace: str, controller: str) -> dict[str, Any]:
    return {
        "metadata": {"generateName": "p-gpufence-"}, "eventTime": "2026-12-05T10:00:00.000000Z",
        "regarding": {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": namespace},
        "reason": "GPUMemoryOverShare", "note": "forged?", "type": "Warning", "action": "Kill",
        "reportingController": controller, "reportingInstance": "x",
    }


@pytest.mark.parametrize("claimed", ["gpufence-node", "GPUfence-Node "])
def test_only_the_guardian_may_post_events_that_claim_it(
    cluster: ControlPlane, guardian_rbac: None, admin: client.ApiClient, tmp_path: Path, claimed: str
) -> None:
    # A tenant holding a token of an account that may create Events in its namespace (what `edit`
    # gets by minting its sidecar's token).
    namespace = kube.create_namespace(admin, "forger", labels={"gpufence.io/injection": "enabled"})
    client.CoreV1Api(admin).create_namespaced_service_account(namespace, {"metadata": {"name": "tenant"}})
    rbac = client.RbacAuthorizationV1Api(admin)
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "events"}, "rules": [
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]}]})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": "tenant-events"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "events"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": namespace}],
    })
    tenant = kube.api_client(service_account_kubeconfig(cluster, namespace, "tenant", tmp_path / "tenant.kubeconfig"))
    guardian = kube.api_client(service_account_kubeconfig(cluster, "gpufence-node", "gpufence-node",
                                                          tmp_path / "guardian.kubeconfig"))
    for path, body in ((f"/api/v1/namespaces/{namespace}/events", core_event(namespace, claimed)),
                       # events.k8s.io validates reportingController as a qualified name: lower case only.
                       (f"/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                        events_v1_event(namespace, claimed.lower().strip()))):
        refused = kube.create(tenant, path, body)
        assert not refused.admitted and "may only come from ServiceAccount gpufence-node/gpufence-node" in (
            refused.message), (path, refused)
    # The guardian posts core/v1 Events (the enforcer's recorder), which its ClusterRole allows.
    assert kube.create(guardian, f"/api/v1/namespaces/{namespace}/events", core_event(namespace, claimed)).admitted
    # The tenant's own component, and the sidecar's, stay the tenant's to post (documented as forgeable).
    assert kube.create(tenant, f"/api/v1/namespaces/{namespace}/events",
                       core_event(namespace, "gpufence-enforcer")).admitted
