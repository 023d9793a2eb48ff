"""The driver's limit on every path (pure): where the driver has R615's per-cgroup memory limit
(``nvmlDeviceSetMemoryLimits_v1``), the guardian sets each admitted GPU container's share on the
container's cgroup itself, unless a limit is already there (the toolkit's hook set it from the
container's ``NVIDIA_GPU_MEMORY_LIMIT``: one writer per cgroup), and reads it back.

Whatever path gave the container its GPU (device plugin, DRA, KAI), the share is the one the guardian
holds (``decide.NodeEngine``: the admitted share, lowered to a DRA allocation), the namespace is the
container's cgroup v2 path as NVML names it (``/sys/fs/cgroup/<path>``, the hook's naming); a
container with no v2 cgroup of its own (a cgroup v1 host) has none, and nothing is set.

:func:`limit_step` decides, per (namespace, device): ``SET`` where no limit is there, or where the
limit is the guardian's own and the share changed (a claim allocated later); ``LEAVE`` where a
limit is there that the guardian did not set (the hook's, or one set by an earlier guardian: the
two cannot be told apart after a restart, and either holds the admitted share); nothing where the
driver lacks the call or the guardian's own limit is in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from gpufence.contract import EnforcerConfig, Mode
from gpufence.enforcer.facts import DriverLimit, DriverLimitState
from gpufence.node.decide import CensusEntry, Standing

CGROUP_ROOT = "/sys/fs/cgroup"

Key = tuple[str, int]  # (NVML namespace, device index)


@dataclass(frozen=True)
class LimitTarget:
    namespace: str
    device_index: int
    device_uuid: str
    bytes: int  # the share on this device: both the soft and the hard limit the guardian sets
    namespace_of_pod: str
    pod: str
    pod_uid: str
    container: str


def nvml_namespace(unified: str | None) -> str | None:
    """The container's v2 cgroup as NVML names it, or None (no v2 cgroup of its own)."""
    if unified is None or unified.rstrip("/") == "" or ".." in unified.split("/"):
        return None
    return CGROUP_ROOT + unified.rstrip("/")


def limit_targets(census: tuple[CensusEntry, ...], configs: Mapping[str, EnforcerConfig],
                  device_totals: Mapping[int, int | None]) -> dict[Key, LimitTarget]:
    """Each admitted GPU container's share per device it runs on, keyed by its NVML namespace; a pod
    in ``audit`` gets none (a hard limit fails its allocations: that is enforcing)."""
    targets: dict[Key, LimitTarget] = {}
    for entry in census:
        pod, name = entry.pod, entry.container
        if entry.standing is not Standing.ADMITTED or pod is None or name is None:
            continue
        config = configs.get(pod.uid)
        share = config.containers.get(name) if config is not None and config.mode is Mode.ENFORCE else None
        memory = share.memory if share is not None else None
        namespace = nvml_namespace(entry.process.placement.unified)
        found = memory.limit_on(device_totals.get(entry.process.device_index)) if memory is not None else None
        if namespace is None or found is None:
            continue
        key = (namespace, entry.process.device_index)
        targets[key] = LimitTarget(namespace, entry.process.device_index, entry.process.device_uuid, found[0],
                                   pod.namespace, pod.name, pod.uid, name)
    return targets


class LimitAction(StrEnum):
    SET = "set"
    LEAVE = "leave"


def limit_step(target: LimitTarget, reading: DriverLimit, ours: int | None) -> LimitAction | None:
    """What to do with one container's cgroup on one device, given the driver's reading and the
    hard limit this guardian set there (None: it set none)."""
    if reading.state in (DriverLimitState.NO_CALL, DriverLimitState.ERROR):
        return None  # no call: nothing to set; an error: asked again next poll
    if reading.state is DriverLimitState.SET:
        if ours is None:
            return LimitAction.LEAVE
        return None if reading.hard_bytes == target.bytes else LimitAction.SET
    return LimitAction.SET  # NOT_SET, or registered with no limit: nobody holds the share there
