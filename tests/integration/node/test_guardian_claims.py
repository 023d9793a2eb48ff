"""What the scheduler reserved, held by the real ``gpufence-node`` on real processes in real cgroups
(v1 and v2), the claims given as the API server serves them through ``--pods-file``: a claim
allocated after admission lowers the admitted share to its ``consumedCapacity``, and two pods on one
claim are held together to its capacity (the container furthest past its fair part is terminated)."""

from __future__ import annotations

import signal
from typing import Any

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from tests.integration.node.conftest import CgroupBed, start_guardian, wait_polls
from tests.support.enforcer_harness import GpuSandbox

GIB = 1 << 30


def share(memory_gib: int, grace: float = 1.0) -> EnforcerConfig:
    return EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=memory_gib * GIB))},
                          grace_period_seconds=grace, poll_interval_seconds=0.1)


def claim(name: str, memory: str, *pod_uids: str) -> dict[str, Any]:
    """A ResourceClaim as kube-scheduler leaves it: one device result with its consumedCapacity."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": "team-a", "name": name, "uid": f"claim-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nvidia.com", "capacity": {"requests": {"memory": memory}}}}]}},
        "status": {
            "allocation": {"devices": {"results": [{
                "request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0",
                "shareID": f"share-{name}", "consumedCapacity": {"memory": memory}}]}},
            "reservedFor": [{"resource": "pods", "name": f"p-{uid[:4]}", "uid": uid} for uid in pod_uids],
        },
    }


def test_a_claim_allocated_after_admission_holds_the_container_to_what_was_reserved(
    gpu: GpuSandbox, bed: CgroupBed
) -> None:
    pod = bed.pod()
    train = pod.container("train")
    pod.claims["train"] = "late"
    bed.publish({"p": share(8)})  # admitted at 8 GiB: the claim did not exist at admission
    hog = train.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(hog, 2 * GIB)))
    g = start_guardian(gpu, bed)
    wait_polls(g, 5)
    assert not g.events("guardian_episode_started")  # 2 GiB of an admitted 8 GiB: nothing to do yet
    bed.claims.append(claim("late", "1Gi", pod.uid))  # the scheduler's allocation: 1 GiB
    bed.publish({"p": share(8)})
    termed = g.wait_event("guardian_sigterm", 20, reason="memory_over_share")
    # The sidecar holds 8 GiB and would never act: the guardian's SIGTERM goes out at once.
    assert termed["limit_bytes"] == GIB and termed["claim_bound_bytes"] == GIB and termed["used_bytes"] == 2 * GIB
    assert termed["container"] == "train" and hog.pid in termed["sent"]
    assert hog.proc.wait(10) == 0 and hog.said("got SIGTERM")
    assert g.metric("gpufence_node_actions_total", action="sigterm", reason="memory_over_share") == 1


def test_two_pods_on_one_claim_are_held_together_to_its_capacity(gpu: GpuSandbox, bed: CgroupBed) -> None:
    first, second = bed.pod("p-a"), bed.pod("p-b")
    a, b = first.container("train"), second.container("train")
    first.claims["train"] = second.claims["train"] = "shared"
    bed.claims.append(claim("shared", "4Gi", first.uid, second.uid))
    bed.publish({"p-a": share(4), "p-b": share(4)})  # each admitted at the claim's 4 GiB: 8 GiB in all
    modest = a.start(gpu)
    greedy = b.start(gpu, ignore_term=True)
    # Each within its own 4 GiB share; together 4.5 GiB of a 4 GiB claim.
    gpu.write(gpu.device_with(gpu.proc(modest, GIB), gpu.proc(greedy, 3 * GIB + GIB // 2)))
    g = start_guardian(gpu, bed)
    termed = g.wait_event("guardian_sigterm", 20, reason="claim_over_capacity")
    assert termed["pod"] == "p-b" and termed["claim"] == "shared" and termed["claim_capacity_bytes"] == 4 * GIB
    assert termed["fair_part_bytes"] == 2 * GIB and termed["claim_used_bytes"] == 4 * GIB + GIB // 2
    assert termed["sharing"] == {"p-a/train": GIB, "p-b/train": 3 * GIB + GIB // 2}
    killed = g.wait_event("guardian_sigkill", 20, reason="claim_over_capacity")
    assert killed["grace_seconds"] == 1.0 and greedy.pid in killed["sent"]
    assert greedy.proc.wait(10) == -signal.SIGKILL
    assert modest.alive() and not modest.said("got SIGTERM")
    assert not g.events("guardian_sigterm", pod="p-a") and not g.events("guardian_sigkill", pod="p-a")
