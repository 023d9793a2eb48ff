"""What the scheduler reserved, as the guardian holds it (pure): DRA claims bound the admitted shares.

Two rules, both on what the claims' status says now (``gpufence.claims``), whenever the claim was
created (before admission, after it, or replaced while the pod was gated):

* :func:`claim_capped_config`: a container's memory share never exceeds the memory its claims
  reserved on one device (``consumedCapacity.memory``). The webhook's share came from the claim's
  spec at admission, or from an annotation or a default where the claim did not exist yet; the
  guardian lowers it to the allocation (never raises it). A claim allocated whole (no consumable
  capacity), not allocated, or not known yet bounds nothing.
* :func:`claim_overuse`: the containers of every pod that shares one claim (``status.reservedFor``)
  are held together to the claim's capacity: their combined use on this node against what the claim
  reserved. Each sidecar sees only its own pod, so this breach is the guardian's alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from gpufence.contract import EnforcerConfig, MemoryShare
from gpufence.node.pods import NodePod, PodIndex

ContainerKey = tuple[str, str]  # (pod UID, container name)


def claim_bound(pod: NodePod, container: str, index: PodIndex, on: frozenset[str] | None = None) -> int | None:
    """The memory the container's claims reserved on one device, or None where they bound nothing
    (no claim, a claim unknown or not allocated, a device allocated whole). Claims add up: a
    container naming two claims may use what both reserved.

    Per device where the ResourceSlices give every allocated device's NVML UUID: the most reserved
    on a GPU in ``on`` (the UUIDs the container's processes are on now), so a 4 GiB reservation on
    one GPU bounds the container there, not the 10 GiB of another. Elsewhere (a UUID unknown, or
    the container on none of its allocated GPUs) the largest per-device reservation, as a result
    alone cannot say which GPU NVML shows."""
    uses = pod.claims.get(container) or ()
    if not uses:
        return None
    per_uuid: dict[str, int] = {}
    largest = 0
    known = True
    for use in uses:
        claim = index.claims.get((pod.namespace, use.claim)) if use.claim is not None else None
        per_device = claim.memory_by_device(use.request) if claim is not None else None
        if per_device is None:
            return None
        largest += max(per_device.values())
        for ref, amount in per_device.items():
            uuid = index.device_uuids.get(ref)
            known = known and uuid is not None
            if uuid is not None:
                per_uuid[uuid] = per_uuid.get(uuid, 0) + amount
    here = [per_uuid[u] for u in on or () if u in per_uuid]
    return max(here) if known and here else largest


def claim_capped_config(pod: NodePod, index: PodIndex, on: Mapping[str, frozenset[str]] | None = None,
                        ) -> tuple[EnforcerConfig, Mapping[str, int]]:
    """The pod's config with each GPU container's memory share lowered to its claims' bound (on the
    GPUs ``on`` names for it: container -> NVML UUIDs), and the containers it lowered (name ->
    bound in bytes). The Core holds one share per container on every GPU it uses: a container on two
    of its allocated GPUs at once is held to the larger of their reservations."""
    assert pod.config is not None
    config = pod.config
    lowered: dict[str, int] = {}
    containers = dict(config.containers)
    for name, share in config.containers.items():
        bound = claim_bound(pod, name, index, (on or {}).get(name))
        if bound is None or bound <= 0:
            continue
        memory = share.memory
        if memory is not None and memory.bytes is not None and memory.bytes <= bound:
            continue
        percent = memory.percent if memory is not None else None
        containers[name] = replace(share, memory=MemoryShare(bytes=bound, percent=percent))
        lowered[name] = bound
    if not lowered:
        return config, MappingProxyType({})
    return replace(config, containers=MappingProxyType(containers)), MappingProxyType(lowered)


@dataclass(frozen=True)
class ClaimOveruse:
    """One shared claim whose containers together use more than it reserved."""

    namespace: str
    claim: str
    capacity: int
    total: int
    fair: int  # capacity / number of containers sharing it: each one's part
    culprit: ContainerKey
    usage: Mapping[ContainerKey, int]


def claim_members(index: PodIndex) -> dict[tuple[str, str], list[ContainerKey]]:
    """The containers on this node that use each claim (by (namespace, claim name))."""
    members: dict[tuple[str, str], list[ContainerKey]] = {}
    for pod in index.pods.values():
        for name, uses in pod.claims.items():
            for use in uses:
                if use.claim is not None and (pod.namespace, use.claim) in index.claims:
                    members.setdefault((pod.namespace, use.claim), []).append((pod.uid, name))
    return members


def claim_overuse(index: PodIndex, usage: Mapping[ContainerKey, int]) -> tuple[ClaimOveruse, ...]:
    """Each claim whose containers' combined use exceeds its capacity, and the container that is
    terminated for it: the one furthest past its fair part (capacity / containers), the larger
    user on a tie, then the pod UID and name (deterministic across restarts).

    Why that one: the sum is over the capacity, so at least one container is over its fair part,
    and a container within its part has taken nobody's room; terminating the newest instead would
    let a container that grew first squeeze out every later one. The pods sharing a claim are
    those of ``reservedFor``; a container of a pod not (yet) listed there that names the claim
    counts too (it uses the device either way)."""
    found = []
    for key, members in sorted(claim_members(index).items()):
        claim = index.claims[key]
        capacity = claim.memory_for(None)
        if capacity is None or not members:
            continue
        uses = {m: usage.get(m, 0) for m in dict.fromkeys(members)}
        total = sum(uses.values())
        if total <= capacity:
            continue
        fair = capacity // len(uses)
        culprit = max(uses, key=lambda m: (uses[m] - fair, uses[m], m))
        found.append(ClaimOveruse(key[0], key[1], capacity, total, fair, culprit, MappingProxyType(uses)))
    return tuple(found)
