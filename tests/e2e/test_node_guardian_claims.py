"""What the scheduler reserved, as the node guardian reads it: kube-apiserver and kube-scheduler 1.37
allocate consumable-capacity claims (the ResourceSlice of tests/e2e/test_dra_capacity.py: shareable
GPUs on a Node object with no kubelet), and the guardian's own watch (its ServiceAccount's bound
token, the RBAC of k8s/components/node-guardian) reads the allocations: a claim created after its
pod lowers the pod's admitted share to what was reserved, the allocated device is mapped to the NVML
UUID the node's ResourceSlice publishes for it, and two pods on one claim are one budget.
The node side (planted processes in real cgroups, the real gpufence-node) is
tests/integration/node/test_guardian_claims.py, fed allocations of the same shape; a kubelet that
joins a 1.37 control plane is not part of the node bed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.node.kube import PodWatch, load_apis
from gpufence.node.reserved import claim_capped_config, claim_overuse
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import service_account_kubeconfig
from tests.e2e.test_dra import API
from tests.e2e.test_dra_capacity import capacity_cluster, gpu_node  # noqa: F401  (fixtures)
from tests.e2e.test_node_guardian_api import guardian_rbac  # noqa: F401  (fixture)

GIB = 1 << 30


def share(gib: int) -> EnforcerConfig:
    return EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=gib * GIB))})


def claim(name: str, device_class_name: str, memory: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": device_class_name, "capacity": {"requests": {"memory": memory}}}}]}}}


def pod(name: str, claim_name: str, config: EnforcerConfig) -> dict[str, Any]:
    """A pod as the webhook admitted it (its sidecar's config in the spec), using one claim."""
    return {
        "metadata": {"name": name},
        "spec": {
            "initContainers": [{"name": "gpufence-enforcer", "image": "gpufence", "restartPolicy": "Always",
                                "env": [{"name": "GPUFENCE_CONFIG", "value": config.to_json()}]}],
            "containers": [{"name": "train", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            "tolerations": [{"operator": "Exists"}],  # no kubelet heartbeats the Node
        },
    }


def test_the_guardians_claim_watch_holds_shares_to_what_the_scheduler_reserved(
    gpu_node: tuple[str, str], guardian_rbac: None,  # noqa: F811  (the fixtures imported above)
    cluster: ControlPlane, admin: client.ApiClient, tmp_path: Path,
) -> None:
    node, device_class_name = gpu_node
    ns = kube.create_namespace(admin, "guardian-dra", labels={"gpufence.io/injection": "enabled"})
    core = client.CoreV1Api(admin)
    token = service_account_kubeconfig(cluster, "gpufence-node", "gpufence-node",
                                       tmp_path / "guardian.kubeconfig")
    core_api, custom_api = load_apis(str(token))
    watch = PodWatch(core_api, node, custom_api, min_backoff=0.1, max_backoff=1.0)

    def create(name: str, claim_name: str, config: EnforcerConfig) -> str:
        made = kube.create_pod(admin, ns, pod(name, claim_name, config))
        assert made.admitted and made.obj is not None, made.message
        return str(made.obj["metadata"]["uid"])

    watch.start()
    try:
        kube.wait_for(watch.has_synced, "the guardian's pod list")
        # Admitted at 8 GiB before its claim existed; the claim is created after, asking 1 GiB.
        late = create("late", "late", share(8))
        assert kube.create(admin, f"{API}/namespaces/{ns}/resourceclaims",
                           claim("late", device_class_name, "1Gi")).admitted

        def lowered() -> bool:
            index = watch.index()
            found = index.pods.get(late)
            return found is not None and claim_capped_config(found, index)[1] == {"train": GIB}
        kube.wait_for(lowered, "the guardian to hold pod late to its 1 GiB allocation", timeout=90)
        allocation = watch.index().claims[(ns, "late")]
        assert allocation.reserved_for == {late}

        # The driver publishes each GPU's NVML UUID (NVIDIA's: the attribute ``uuid``): the guardian
        # reads the node's ResourceSlice with its own token and maps the allocated device to it.
        custom = client.CustomObjectsApi(admin)
        published: Any = custom.get_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", f"{node}-gpus")
        uuids = {d["name"]: f"GPU-{node}-{d['name']}" for d in published["spec"]["devices"]}
        for device in published["spec"]["devices"]:
            device["attributes"] = {"uuid": {"string": uuids[device["name"]]}}
        custom.replace_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", f"{node}-gpus", published)
        expected = {("gpu.nvidia.com", node, name): uuid for name, uuid in uuids.items()}
        kube.wait_for(lambda: dict(watch.index().device_uuids) == expected, "the guardian to read the slice's UUIDs")
        index = watch.index()
        ((_, _, _, device),) = index.claims[(ns, "late")].memory
        own, other = uuids[device], next(u for name, u in uuids.items() if name != device)
        late_pod = index.pods[late]
        assert claim_capped_config(late_pod, index, {"train": frozenset({own})})[1] == {"train": GIB}
        # On a GPU it was not allocated it is still held (to the largest reservation it has).
        assert claim_capped_config(late_pod, index, {"train": frozenset({other})})[1] == {"train": GIB}

        # One 4 GiB claim for two pods, each admitted at 4 GiB: one budget of 4 GiB.
        assert kube.create(admin, f"{API}/namespaces/{ns}/resourceclaims",
                           claim("shared", device_class_name, "4Gi")).admitted
        first = create("first", "shared", share(4))
        second = create("second", "shared", share(4))
        both = {first, second}

        def shared() -> bool:
            index = watch.index()
            found = index.claims.get((ns, "shared"))
            return found is not None and found.reserved_for == both and both <= set(index.pods)
        kube.wait_for(shared, "both pods scheduled on the shared claim", timeout=90)
        index = watch.index()
        assert index.claims[(ns, "shared")].memory_for(None) == 4 * GIB
        within = {(first, "train"): 2 * GIB, (second, "train"): 2 * GIB}
        assert not claim_overuse(index, within)
        over = {(first, "train"): GIB, (second, "train"): 3 * GIB + 1}
        (found,) = claim_overuse(index, over)
        assert found.claim == "shared" and found.culprit == (second, "train")
    finally:
        watch.stop(timeout=5)
        for name in ("late", "first", "second"):  # bound to a node without a kubelet: delete them
            try:
                core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
