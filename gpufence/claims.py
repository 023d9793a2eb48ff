"""What the scheduler reserved for a pod's containers through DRA claims (pure: API objects in, frozen
values out), for the node guardian (and anything else that holds a container to its allocation).

The webhook reads a claim's *spec* at admission (``webhook.core.dra``: the memory a request asks);
the claim may not exist then (created after the pod, or replaced while the pod is gated), so what
binds is the claim's *status*, written by the scheduler (``resource.k8s.io/v1``):

* ``status.allocation.devices.results[]``: one result per allocated device, with ``request``,
  ``driver``, ``pool``, ``device`` and, for a device published with ``allowMultipleAllocations``
  (consumable capacity, KEP-5075), ``consumedCapacity.memory``: the amount reserved on that device
  (the device's ``requestPolicy`` may have rounded the ask up);
* ``status.reservedFor[]``: the consumers (``resource: pods``, ``uid``) that share the claim;
* the pod's ``status.resourceClaimStatuses[]``: the ResourceClaim generated for a pod claim that
  names a template (``resourceClaimName``); a pod claim naming a claim directly needs none;
* a container's ``resources.claims[]``: the pod claims it uses, optionally one ``request`` of each.

A result names its device by driver, pool and name (``gpu.nvidia.com``, the node, ``gpu-0``), not
by the UUID NVML shows. The driver's ResourceSlices say which is which: NVIDIA's DRA driver
publishes each GPU as a device named ``gpu-<minor>`` with the attribute ``uuid`` (its NVML UUID; a
MIG device ``gpu-<minor>-mig-...`` with its own ``uuid`` and ``parentUUID``), in the pool of its
node (k8s-dra-driver-gpu, ``cmd/gpu-kubelet-plugin/deviceinfo.go``). :func:`slice_device_uuids`
reads that map; with it a reservation bounds the container on that GPU only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpufence.quantity import QuantityError, parse_bytes

MEMORY_CAPACITY = "memory"  # the capacity NVIDIA's DRA driver publishes for a shareable GPU
UUID_ATTRIBUTE = "uuid"  # the attribute NVIDIA's DRA driver gives each device: its NVML UUID

DeviceRef = tuple[str, str, str]  # (driver, pool, device) as an allocation result and a ResourceSlice name it


@dataclass(frozen=True)
class ClaimUse:
    """One pod claim a container names: the ResourceClaim (None until the pod's status names the one
    generated from a template) and the request it is limited to (None: every request)."""

    pod_claim: str
    claim: str | None
    request: str | None


@dataclass(frozen=True)
class ClaimAllocation:
    """What the scheduler recorded in one ResourceClaim's status."""

    namespace: str
    name: str
    allocated: bool
    # (request, driver, pool, device) -> consumedCapacity.memory in bytes; None for a whole device
    # (no consumable capacity: nothing smaller than the device was reserved)
    memory: Mapping[tuple[str, str, str, str], int | None]
    reserved_for: frozenset[str]  # the UIDs of the pods that share the claim

    def memory_by_device(self, request: str | None) -> dict[DeviceRef, int] | None:
        """The memory reserved for ``request`` (every request: None) on each device, or None where
        some device of it was allocated whole or nothing is allocated."""
        if not self.allocated:
            return None
        per_device: dict[DeviceRef, int] = {}
        for (req, driver, pool, device), amount in self.memory.items():
            if request is not None and req != request and not req.startswith(f"{request}/"):
                continue
            if amount is None:
                return None
            per_device[(driver, pool, device)] = per_device.get((driver, pool, device), 0) + amount
        return per_device or None

    def memory_for(self, request: str | None) -> int | None:
        """The most memory reserved on any one device for ``request``: the bound where the devices'
        NVML UUIDs are not known (no ResourceSlice names them)."""
        per_device = self.memory_by_device(request)
        return max(per_device.values()) if per_device else None


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def claim_allocation(obj: Mapping[str, Any]) -> ClaimAllocation:
    """A ResourceClaim's allocation; amounts that do not parse count as a whole device."""
    meta = _mapping(obj.get("metadata"))
    status = _mapping(obj.get("status"))
    allocation = status.get("allocation")
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    memory: dict[tuple[str, str, str, str], int | None] = {}
    for result in results if isinstance(results, list) else ():
        if not isinstance(result, Mapping):
            continue
        key = (_text(result.get("request")), _text(result.get("driver")), _text(result.get("pool")),
               _text(result.get("device")))
        consumed = result.get("consumedCapacity")
        amount = consumed.get(MEMORY_CAPACITY) if isinstance(consumed, Mapping) else None
        try:
            memory[key] = parse_bytes(str(amount)) if isinstance(amount, (str, int)) and amount is not True else None
        except QuantityError:
            memory[key] = None
    reserved = status.get("reservedFor")
    uids = frozenset(
        _text(r.get("uid")).lower() for r in (reserved if isinstance(reserved, list) else ())
        if isinstance(r, Mapping) and r.get("resource") == "pods" and _text(r.get("uid"))
    )
    return ClaimAllocation(_text(meta.get("namespace")), _text(meta.get("name")), isinstance(allocation, Mapping),
                           memory, uids)


@dataclass(frozen=True)
class SliceDevices:
    """What one ResourceSlice says of its devices: each one's NVML UUID, where its driver publishes one."""

    name: str
    pool_generation: int
    uuids: Mapping[DeviceRef, str]


def slice_device_uuids(obj: Mapping[str, Any]) -> SliceDevices:
    """A ResourceSlice's devices by (driver, pool, device) -> the string attribute ``uuid``, written
    unqualified (the driver's own domain, as NVIDIA's driver writes it) or qualified by the driver's
    name (``gpu.nvidia.com/uuid``). ``resource.k8s.io/v1`` holds a device's attributes on the device,
    v1beta1 under ``basic``; both are read. A device without one is left out (its bound stays the
    largest reservation)."""
    meta = _mapping(obj.get("metadata"))
    spec = _mapping(obj.get("spec"))
    driver = _text(spec.get("driver"))
    pool = _mapping(spec.get("pool"))
    generation = pool.get("generation")
    uuids: dict[DeviceRef, str] = {}
    devices = spec.get("devices")
    for device in devices if isinstance(devices, list) else ():
        if not isinstance(device, Mapping) or not _text(device.get("name")):
            continue
        attributes = device.get("attributes")
        if not isinstance(attributes, Mapping):
            attributes = _mapping(_mapping(device.get("basic")).get("attributes"))
        value = attributes.get(UUID_ATTRIBUTE) or attributes.get(f"{driver}/{UUID_ATTRIBUTE}")
        uuid = _mapping(value).get("string")
        if isinstance(uuid, str) and uuid:
            uuids[(driver, _text(pool.get("name")), device["name"])] = uuid
    return SliceDevices(_text(meta.get("name")), generation if isinstance(generation, int) else 0, uuids)


def device_uuids(slices: Iterable[SliceDevices]) -> dict[DeviceRef, str]:
    """Every device's UUID over the slices; where slices of two generations of a pool disagree (a
    driver republishing), the newer generation's."""
    found: dict[DeviceRef, tuple[int, str]] = {}
    for piece in slices:
        for ref, uuid in piece.uuids.items():
            if ref not in found or piece.pool_generation >= found[ref][0]:
                found[ref] = (piece.pool_generation, uuid)
    return {ref: uuid for ref, (_, uuid) in found.items()}


def container_claims(pod: Mapping[str, Any]) -> dict[str, tuple[ClaimUse, ...]]:
    """Each container's claims (by container name; only containers that name one)."""
    spec = _mapping(pod.get("spec"))
    status = _mapping(pod.get("status"))
    names: dict[str, str | None] = {}
    for entry in spec.get("resourceClaims") or ():
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            direct = entry.get("resourceClaimName")
            names[entry["name"]] = direct if isinstance(direct, str) else None
    for entry in status.get("resourceClaimStatuses") or ():
        if isinstance(entry, Mapping) and entry.get("name") in names and names[entry["name"]] is None:
            generated = entry.get("resourceClaimName")
            names[entry["name"]] = generated if isinstance(generated, str) else None
    found: dict[str, tuple[ClaimUse, ...]] = {}
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or ():
            if not isinstance(container, Mapping) or not isinstance(container.get("name"), str):
                continue
            resources = container.get("resources")
            claims = resources.get("claims") if isinstance(resources, Mapping) else None
            uses = tuple(
                ClaimUse(c["name"], names[c["name"]], c.get("request") if isinstance(c.get("request"), str) else None)
                for c in (claims if isinstance(claims, list) else ())
                if isinstance(c, Mapping) and c.get("name") in names
            )
            if uses:
                found[container["name"]] = uses
    return found
