"""What the scheduler reserved, as the guardian holds it: a ResourceClaim's allocation
(``consumedCapacity``, ``reservedFor``), the pod's and containers' claims, a share lowered to the
allocation whenever the claim was created, and one claim shared by pods held as one budget."""

from __future__ import annotations

from typing import Any

from gpufence.claims import ClaimUse, claim_allocation, container_claims, device_uuids, slice_device_uuids
from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.node.census import placement
from gpufence.node.decide import Action, GpuProc, NodeEngine
from gpufence.node.pods import PodIndex, node_pod
from gpufence.node.reserved import claim_bound, claim_capped_config, claim_overuse

GIB = 1 << 30
A_UID = "aaaaaaaa-2222-3333-4444-555555555555"
B_UID = "bbbbbbbb-2222-3333-4444-555555555555"
A_TRAIN, B_TRAIN = "a" * 64, "b" * 64
EIGHT = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 * GIB))},
                       grace_period_seconds=10, poll_interval_seconds=0.5)
FOUR = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=4 * GIB))},
                      grace_period_seconds=10, poll_interval_seconds=0.5)


def claim(name: str, *amounts: str | None, reserved: tuple[str, ...] = (), allocated: bool = True,
          request: str = "gpu") -> dict[str, Any]:
    results = []
    for i, amount in enumerate(amounts):
        result: dict[str, Any] = {"request": request, "driver": "gpu.nvidia.com", "pool": "node-1",
                                  "device": f"gpu-{i}", "shareID": f"share-{i}"}
        if amount is not None:
            result["consumedCapacity"] = {"memory": amount}
        results.append(result)
    status: dict[str, Any] = {"reservedFor": [{"resource": "pods", "name": f"p-{u[:1]}", "uid": u} for u in reserved]}
    if allocated:
        status["allocation"] = {"devices": {"results": results}}
    return {"metadata": {"namespace": "team-a", "name": name}, "status": status}


def pod(uid: str, cid: str, cfg: EnforcerConfig, *, claim_name: str | None = "shared",
        template: str | None = None, generated: str | None = None, request: str | None = None) -> dict[str, Any]:
    pod_claim: dict[str, Any] = {"name": "gpu"}
    if template is not None:
        pod_claim["resourceClaimTemplateName"] = template
    else:
        pod_claim["resourceClaimName"] = claim_name
    ref: dict[str, Any] = {"name": "gpu", **({"request": request} if request else {})}
    status: dict[str, Any] = {"containerStatuses": [{"name": "train", "containerID": f"containerd://{cid}"}]}
    if generated is not None:
        status["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": generated}]
    return {
        "metadata": {"uid": uid, "namespace": "team-a", "name": f"p-{uid[:1]}"},
        "spec": {
            "resourceClaims": [pod_claim],
            "initContainers": [{"name": "gpufence-enforcer", "env": [{"name": "GPUFENCE_CONFIG",
                                                                      "value": cfg.to_json()}]}],
            "containers": [{"name": "train", "resources": {"claims": [ref]}}, {"name": "helper"}],
        },
        "status": status,
    }


def index(pods: list[dict[str, Any]], claims: list[dict[str, Any]]) -> PodIndex:
    found = [node_pod(p) for p in pods]
    return PodIndex.of([p for p in found if p is not None], ["team-a"], [claim_allocation(c) for c in claims])


def proc(pid: int, uid: str, cid: str, used: int) -> GpuProc:
    return GpuProc(pid, 1000 + pid, 0, "GPU-0", used, 0,
                   placement(f"12:freezer:/kubepods/burstable/pod{uid}/{cid}\n0::/\n"))


# -- the claim's status ----------------------------------------------------------------------------


def test_the_allocation_is_read_from_consumed_capacity_and_reserved_for() -> None:
    found = claim_allocation(claim("shared", "4Gi", reserved=(A_UID, B_UID.upper())))
    assert found.allocated and found.reserved_for == {A_UID, B_UID}
    assert found.memory == {("gpu", "gpu.nvidia.com", "node-1", "gpu-0"): 4 * GIB}
    assert found.memory_for(None) == 4 * GIB and found.memory_for("gpu") == 4 * GIB
    assert found.memory_for("other") is None  # no device of that request


def test_a_whole_device_an_unparsable_amount_or_no_allocation_bounds_nothing() -> None:
    assert claim_allocation(claim("whole", None)).memory_for(None) is None
    assert claim_allocation(claim("bad", "lots")).memory_for(None) is None
    assert claim_allocation(claim("later", "4Gi", allocated=False)).memory_for(None) is None


def test_the_bound_on_one_device_is_the_largest_per_device_reservation() -> None:
    two = claim_allocation(claim("two", "2Gi", "3Gi"))
    assert two.memory_for(None) == 3 * GIB
    sub = claim_allocation(claim("sub", "1Gi", request="gpu/small"))
    assert sub.memory_for("gpu") == GIB  # a firstAvailable subrequest belongs to its request


def resource_slice(devices: dict[str, str | None], *, version: str = "v1", qualified: bool = False,
                   generation: int = 1, pool: str = "node-1") -> dict[str, Any]:
    """A ResourceSlice as NVIDIA's DRA driver publishes one: each GPU ``gpu-<minor>`` with ``uuid``."""
    listed = []
    for name, uuid in devices.items():
        attributes: dict[str, Any] = {"type": {"string": "gpu"}, "productName": {"string": "NVIDIA H200"}}
        if uuid is not None:
            attributes["gpu.nvidia.com/uuid" if qualified else "uuid"] = {"string": uuid}
        listed.append({"name": name, **({"attributes": attributes} if version == "v1"
                                        else {"basic": {"attributes": attributes}})})
    return {"metadata": {"name": f"{pool}-gpu.nvidia.com-{generation}"},
            "spec": {"driver": "gpu.nvidia.com", "nodeName": pool, "pool": {"name": pool, "generation": generation,
                                                                            "resourceSliceCount": 1},
                     "devices": listed}}


def test_a_resource_slice_names_each_devices_nvml_uuid() -> None:
    for version, qualified in (("v1", False), ("v1beta1", False), ("v1", True)):
        found = slice_device_uuids(resource_slice({"gpu-0": "GPU-aaa", "gpu-1": "GPU-bbb", "gpu-2": None},
                                                  version=version, qualified=qualified))
        assert found.uuids == {("gpu.nvidia.com", "node-1", "gpu-0"): "GPU-aaa",
                               ("gpu.nvidia.com", "node-1", "gpu-1"): "GPU-bbb"}, (version, qualified)
    # A pool republished: the newer generation's answer holds, whatever the order the slices come in.
    old, new = (slice_device_uuids(resource_slice({"gpu-0": u}, generation=g)) for u, g in (("GPU-old", 1),
                                                                                            ("GPU-new", 2)))
    assert device_uuids([new, old]) == device_uuids([old, new]) == {("gpu.nvidia.com", "node-1", "gpu-0"): "GPU-new"}
    assert slice_device_uuids({"spec": {"devices": "nonsense"}}).uuids == {}


def test_the_bound_is_per_gpu_where_the_slices_name_the_uuids() -> None:
    """4 GiB reserved on gpu-0 and 10 GiB on gpu-1 (two requests of one claim): on GPU-aaa the
    container is held to 4 GiB, on GPU-bbb to 10 GiB; without the slice, to 10 GiB wherever it is."""
    claims = [claim("shared", "4Gi", "10Gi")]
    slices = [slice_device_uuids(resource_slice({"gpu-0": "GPU-aaa", "gpu-1": "GPU-bbb"}))]
    found = [node_pod(pod(A_UID, A_TRAIN, EIGHT))]
    idx = PodIndex.of([p for p in found if p is not None], ["team-a"], [claim_allocation(c) for c in claims],
                      device_uuids=device_uuids(slices))
    p = idx.pods[A_UID]
    assert claim_bound(p, "train", idx, frozenset({"GPU-aaa"})) == 4 * GIB
    assert claim_bound(p, "train", idx, frozenset({"GPU-bbb"})) == 10 * GIB
    assert claim_bound(p, "train", idx, frozenset({"GPU-aaa", "GPU-bbb"})) == 10 * GIB  # one share for both
    assert claim_bound(p, "train", idx, frozenset({"GPU-zzz"})) == 10 * GIB  # on none it was allocated
    no_slice = index([pod(A_UID, A_TRAIN, EIGHT)], claims)
    assert claim_bound(no_slice.pods[A_UID], "train", no_slice, frozenset({"GPU-aaa"})) == 10 * GIB
    config, lowered = claim_capped_config(p, idx, {"train": frozenset({"GPU-aaa"})})
    memory = config.containers["train"].memory
    assert memory is not None and memory.bytes == 4 * GIB and lowered == {"train": 4 * GIB}
    # The engine gives the Core the bound of the GPU the container's processes are on.
    engine = NodeEngine(poll_interval=0.5)
    on_a = GpuProc(10, 1010, 0, "GPU-aaa", 5 * GIB, 0, placement(f"0::/kubepods/burstable/pod{A_UID}/{A_TRAIN}\n"))
    decisions = engine.step(100.0, [on_a], {0: 80 * GIB}, idx)
    assert decisions.configs[A_UID].containers["train"].memory == MemoryShare(bytes=4 * GIB)
    assert [b.record.get("claim_bound_bytes") for b in decisions.step.started] == [4 * GIB]
    on_b = GpuProc(10, 1010, 1, "GPU-bbb", 5 * GIB, 0, on_a.placement)
    decisions = NodeEngine(poll_interval=0.5).step(100.0, [on_b], {1: 80 * GIB}, idx)
    assert decisions.configs[A_UID].containers["train"].memory == MemoryShare(bytes=8 * GIB)  # 10 GiB: not lowered
    assert not decisions.step.started


def test_a_containers_claims_follow_the_pods_status_for_a_template() -> None:
    direct = container_claims(pod(A_UID, A_TRAIN, EIGHT, request="gpu"))
    assert direct == {"train": (ClaimUse("gpu", "shared", "gpu"),)}
    waiting = container_claims(pod(A_UID, A_TRAIN, EIGHT, template="t"))
    assert waiting == {"train": (ClaimUse("gpu", None, None),)}
    generated = container_claims(pod(A_UID, A_TRAIN, EIGHT, template="t", generated="p-a-gpu-x1"))
    assert generated == {"train": (ClaimUse("gpu", "p-a-gpu-x1", None),)}


# -- a share never above what was reserved ----------------------------------------------------------


def test_a_share_is_lowered_to_a_claim_allocated_after_admission_never_raised() -> None:
    idx = index([pod(A_UID, A_TRAIN, EIGHT)], [claim("shared", "1Gi")])
    p = idx.pods[A_UID]
    assert claim_bound(p, "train", idx) == GIB and claim_bound(p, "helper", idx) is None
    config, lowered = claim_capped_config(p, idx)
    memory = config.containers["train"].memory
    assert memory is not None and memory.bytes == GIB and lowered == {"train": GIB}
    raised = index([pod(A_UID, A_TRAIN, EIGHT)], [claim("shared", "16Gi")])
    assert claim_capped_config(raised.pods[A_UID], raised) == (EIGHT, {})


def test_an_unknown_or_unallocated_claim_leaves_the_admitted_share() -> None:
    idx = index([pod(A_UID, A_TRAIN, EIGHT)], [])
    assert claim_capped_config(idx.pods[A_UID], idx)[0] == EIGHT
    waiting = index([pod(A_UID, A_TRAIN, EIGHT, template="t")], [claim("shared", "1Gi")])
    assert claim_capped_config(waiting.pods[A_UID], waiting)[0] == EIGHT


def test_the_guardian_terminates_at_the_allocation_the_sidecar_cannot_see() -> None:
    engine = NodeEngine(poll_interval=0.5)
    idx = index([pod(A_UID, A_TRAIN, EIGHT)], [claim("shared", "1Gi")])
    first = engine.step(100.0, [proc(10, A_UID, A_TRAIN, 2 * GIB)], {0: 80 * GIB}, idx)
    ((action, episode),) = first.step.actions
    # The sidecar holds 8 GiB and never acts, so the guardian's SIGTERM goes out at once.
    assert action is Action.SIGTERM and episode.reason == "memory_over_share"
    assert episode.record["limit_bytes"] == GIB and episode.record["claim_bound_bytes"] == GIB
    ((action, _),) = engine.step(110.0, [proc(10, A_UID, A_TRAIN, 2 * GIB)], {0: 80 * GIB}, idx).step.actions
    assert action is Action.SIGKILL


def test_a_claim_replaced_while_running_changes_the_share_at_the_next_poll() -> None:
    engine = NodeEngine(poll_interval=0.5)
    big = index([pod(A_UID, A_TRAIN, EIGHT)], [claim("shared", "4Gi")])
    assert not engine.step(100.0, [proc(10, A_UID, A_TRAIN, 2 * GIB)], {0: 80 * GIB}, big).step.started
    small = index([pod(A_UID, A_TRAIN, EIGHT)], [claim("shared", "1Gi")])
    assert engine.step(100.5, [proc(10, A_UID, A_TRAIN, 2 * GIB)], {0: 80 * GIB}, small).step.started


# -- one claim, one budget --------------------------------------------------------------------------


def test_two_pods_on_one_claim_are_held_together_to_its_capacity() -> None:
    pods = [pod(A_UID, A_TRAIN, FOUR), pod(B_UID, B_TRAIN, FOUR)]
    idx = index(pods, [claim("shared", "4Gi", reserved=(A_UID, B_UID))])
    assert not claim_overuse(idx, {(A_UID, "train"): 2 * GIB, (B_UID, "train"): 2 * GIB})
    (over,) = claim_overuse(idx, {(A_UID, "train"): GIB, (B_UID, "train"): 3 * GIB + 1})
    assert over.culprit == (B_UID, "train") and over.fair == 2 * GIB and over.total == 4 * GIB + 1
    # Each is within its own 4 GiB share: only the claim's budget is breached.
    engine = NodeEngine()
    result = engine.step(100.0, [proc(10, A_UID, A_TRAIN, GIB), proc(11, B_UID, B_TRAIN, 3 * GIB + 1)],
                         {0: 80 * GIB}, idx)
    ((action, episode),) = result.step.actions
    assert action is Action.SIGTERM and episode.reason == "claim_over_capacity"
    assert episode.placement.container_id == B_TRAIN and episode.record["claim"] == "shared"
    assert episode.record["sharing"] == {"p-a/train": GIB, "p-b/train": 3 * GIB + 1}


def test_the_culprit_is_the_one_furthest_past_its_fair_part_not_the_newest() -> None:
    idx = index([pod(A_UID, A_TRAIN, FOUR), pod(B_UID, B_TRAIN, FOUR)], [claim("shared", "4Gi")])
    (over,) = claim_overuse(idx, {(A_UID, "train"): 3 * GIB, (B_UID, "train"): 2 * GIB})
    assert over.culprit == (A_UID, "train")
    (tie,) = claim_overuse(idx, {(A_UID, "train"): 3 * GIB, (B_UID, "train"): 3 * GIB})
    assert tie.culprit == (B_UID, "train")  # a tie: the larger key, the same on every guardian


def test_one_termination_at_a_time_per_shared_claim() -> None:
    engine = NodeEngine()
    idx = index([pod(A_UID, A_TRAIN, FOUR), pod(B_UID, B_TRAIN, FOUR)], [claim("shared", "4Gi")])
    procs = [proc(10, A_UID, A_TRAIN, 3 * GIB), proc(11, B_UID, B_TRAIN, 2 * GIB)]
    assert len(engine.step(100.0, procs, {0: 80 * GIB}, idx).step.actions) == 1
    # The culprit holds its memory until it exits: nobody else is chosen meanwhile.
    assert not engine.step(101.0, procs, {0: 80 * GIB}, idx).step.started
