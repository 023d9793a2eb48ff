"""What the scheduler reserved, held by the real ``gpufence-node`` on real processes in real cgroups
(v1 and v2), the claims given as the API server serves them through ``--pods-file``: a claim
allocated after admission lowers the admitted share to its ``consumedCapacity``, and two pods on one
claim are held together to its capacity (the container furthest past its fair part is terminated),
and a claim reserving different amounts on two GPUs holds each container to the amount on the GPU
it is on, as the node's ResourceSlice names the GPUs' NVML UUIDs."""

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


def claim(name: str, memory: str, *pod_uids: str, devices: tuple[tuple[str, str], ...] | None = None,
          ) -> dict[str, Any]:
    """A ResourceClaim as kube-scheduler leaves it: one device result with its consumedCapacity (or
    one per ``devices``: (device, memory))."""
    results = [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": device,
                "shareID": f"share-{name}-{device}", "consumedCapacity": {"memory": amount}}
               for device, amount in devices or (("gpu-0", memory),)]
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"namespace": "team-a", "name": name, "uid": f"claim-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu.nvidia.com", "capacity": {"requests": {"memory": memory}}}}]}},
        "status": {
            "allocation": {"devices": {"results": results}},
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


def resource_slice(uuids: dict[str, str]) -> dict[str, Any]:
    """The node's ResourceSlice as NVIDIA's DRA driver publishes it: ``gpu-<minor>`` with ``uuid``."""
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "node-1-gpu.nvidia.com-abcde"},
        "spec": {"driver": "gpu.nvidia.com", "nodeName": "node-1",
                 "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
                 "devices": [{"name": name, "attributes": {"type": {"string": "gpu"}, "uuid": {"string": uuid}},
                              "allowMultipleAllocations": True, "capacity": {"memory": {"value": "80Gi"}}}
                             for name, uuid in uuids.items()]},
    }


def test_a_reservation_bounds_the_container_on_its_own_gpu_not_the_largest(gpu: GpuSandbox, bed: CgroupBed) -> None:
    """Two pods, each with a claim of 4 GiB on gpu-0 and 10 GiB on gpu-1, each admitted at 12 GiB and
    using 6 GiB: the one on gpu-0 (NVML's GPU-0) is over what was reserved there and is terminated at
    4 GiB; the one on gpu-1 is within its 10 GiB and left alone. Without the slice both would be held
    to 10 GiB (the largest reservation), and neither terminated."""
    on_a, on_b = bed.pod("p-a"), bed.pod("p-b")
    a, b = on_a.container("train"), on_b.container("train")
    on_a.claims["train"], on_b.claims["train"] = "pair-a", "pair-b"
    layout = (("gpu-0", "4Gi"), ("gpu-1", "10Gi"))
    bed.claims += [claim("pair-a", "", on_a.uid, devices=layout), claim("pair-b", "", on_b.uid, devices=layout)]
    bed.slices.append(resource_slice({"gpu-0": "GPU-0", "gpu-1": "GPU-1"}))
    bed.publish({"p-a": share(12), "p-b": share(12)})
    first, second = a.start(gpu), b.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(first, 6 * GIB), uuid="GPU-0"),
              gpu.device_with(gpu.proc(second, 6 * GIB), uuid="GPU-1"))
    g = start_guardian(gpu, bed)
    termed = g.wait_event("guardian_sigterm", 20, reason="memory_over_share")
    assert termed["pod"] == "p-a" and termed["uuid"] == "GPU-0"
    assert termed["claim_bound_bytes"] == 4 * GIB and termed["limit_bytes"] == 4 * GIB
    assert first.proc.wait(10) == 0
    wait_polls(g, 5)
    assert second.alive() and not g.events("guardian_episode_started", pod="p-b")
