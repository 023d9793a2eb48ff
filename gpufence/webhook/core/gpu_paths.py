"""Which containers of a pod get a GPU, and by which path (pure): the one definition the webhook
uses for the share, the sidecar, the enforcer's GPU count and ``NVIDIA_VISIBLE_DEVICES=void``, on
the way in (``/mutate``) and on the final pod (``/validate``).

Paths, from the pod alone:

* a device plugin resource whose name matches ``gpu-resource-name`` (exact names, or a prefix
  written with a trailing ``*``: the default ``nvidia.com/gpu``, ``nvidia.com/gpu.*`` for renamed
  time-sliced GPUs, ``nvidia.com/mig-*`` for MIG slices) with a positive amount: a shared GPU,
  which gets a share and the sidecar;
* a resource matching ``exclusive-gpu-resource-name`` (same syntax; none by default): a device the
  admin declares never shared between pods (e.g. a MIG profile that is not time-sliced), so no
  share and no sidecar, and never ``void``;
* a DRA claim (``resources.claims[].name``, naming one of ``spec.resourceClaims``): a shared GPU
  unless the pod claim's ``resourceClaimName`` or ``resourceClaimTemplateName`` is listed in
  ``non-gpu-resource-claims``. The pod does not show what the claim holds (that is in the
  ResourceClaim and its DeviceClass), so an unlisted claim is taken for a GPU: the safe side. A
  container with any claim, listed or not, is never voided. The webhook also resolves claims
  through their DeviceClasses (webhook.core.dra), but only to warn: a watch cache can lag behind a
  claim just created, so the admin's list, not the cache, decides what the pod gets.

* KAI-Scheduler's fraction (``webhook.core.kai``): the one container that KAI hands a GPU fraction
  through pod annotations and a ConfigMap, not a resource: a shared GPU, with KAI's
  ``gpu-fraction-num-devices`` (else 1) as its GPU count; and each container that KAI's NvFractions
  annotations (``nvidia.com/container.<name>.gpu-memory.request|limit``) name, whose GPU KAI's NRI
  plugin hands it at creation: a shared GPU too.

Why MIG defaults to shared: a MIG slice is isolated from other slices in hardware, but the device
plugin can time-slice a slice under the same resource name (replicas), and the pod spec cannot
tell the two apart. Treating it as shared costs a sidecar; treating a shared slice as exclusive
would leave its sharers unenforced.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufence.contract import SIDECAR_NAME
from gpufence.quantity import QuantityError, is_positive_quantity, parse_bytes
from gpufence.webhook.core.kai import KaiFraction, NvFraction
from gpufence.webhook.core.settings import InjectionSettings

# An extended resource name (DOMAIN/NAME) or a prefix of one ending in "*": the domain keeps a
# pattern away from cpu, memory, hugepages-* and ephemeral-storage.
_PATTERN = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?/([-A-Za-z0-9_.]*)\*?", re.ASCII)


def resource_pattern(text: str) -> str:
    """A policy value of ``gpu-resource-name`` / ``exclusive-gpu-resource-name``: an extended
    resource name, or a prefix of one ending in ``*`` (``nvidia.com/mig-*``). Raises ValueError."""
    value = text.strip()
    if not _PATTERN.fullmatch(value) or (not value.endswith("*") and value.endswith("/")):
        raise ValueError('use an extended resource name such as "nvidia.com/gpu", or a prefix of one ending '
                         'in "*" such as "nvidia.com/mig-*" (only a trailing "*", after the domain and "/")')
    return value


def claim_name(text: str) -> str:
    """A policy value of ``non-gpu-resource-claims``: a ResourceClaim or ResourceClaimTemplate name."""
    value = text.strip()
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value, re.ASCII):
        raise ValueError('use the name of a ResourceClaim or ResourceClaimTemplate, such as "nic-claim"')
    return value


@dataclass(frozen=True)
class ResourcePatterns:
    exact: frozenset[str]
    prefixes: tuple[str, ...]

    def matches(self, name: str) -> bool:
        return name in self.exact or name.startswith(self.prefixes)


@functools.lru_cache(maxsize=64)
def patterns(values: tuple[str, ...]) -> ResourcePatterns:
    return ResourcePatterns(exact=frozenset(v for v in values if not v.endswith("*")),
                            prefixes=tuple(v[:-1] for v in values if v.endswith("*")))


def advised_resource(settings: InjectionSettings) -> str:
    """The resource name a denial advises requesting: the first configured exact name."""
    return next((n for n in settings.gpu_resource_names if not n.endswith("*")), "nvidia.com/gpu")


def _amounts(container: Any, wanted: Callable[[str], bool]) -> Iterator[tuple[str, Any]]:
    """Each resource of the container that ``wanted`` names and has a positive amount (the limit
    where one is set, else the request: the API server requires them equal for extended resources).
    Tolerant of garbage. The name is checked first: a pod's cpu and memory are never GPUs, and
    parsing their quantities was most of what deciding a typical pod's GPU paths cost."""
    resources = container.get("resources") if isinstance(container, dict) else None
    if not isinstance(resources, dict):
        return
    limits, requests = resources.get("limits"), resources.get("requests")
    limits = limits if isinstance(limits, dict) else {}
    for amounts, skip in ((limits, {}), (requests, limits)):
        if isinstance(amounts, dict):
            for name, value in amounts.items():
                if isinstance(name, str) and name not in skip and wanted(name) and is_positive_quantity(value):
                    yield name, value


def _shared_gpu(gpu: ResourcePatterns, exclusive: ResourcePatterns) -> Callable[[str], bool]:
    """Whether a resource name is a shared GPU: matches gpu-resource-name, not exclusive-gpu-resource-name."""
    return lambda name: gpu.matches(name) and not exclusive.matches(name)


def shared_gpu_resource(container: Any, settings: InjectionSettings) -> str | None:
    """The first resource of the container that is a shared GPU (for the GPU's memory), or None."""
    shared = _shared_gpu(patterns(settings.gpu_resource_names), patterns(settings.exclusive_gpu_resource_names))
    return next((name for name, _ in _amounts(container, shared)), None)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _claims(container: Any) -> list[Any]:
    """The pod claim names the container uses (``resources.claims[].name``)."""
    resources = container.get("resources") if isinstance(container, dict) else None
    claims = resources.get("claims") if isinstance(resources, dict) else None
    if not isinstance(claims, list):
        return []
    return [c.get("name") if isinstance(c, dict) else None for c in claims]


def _count(value: Any) -> int:
    try:
        return value if isinstance(value, int) else parse_bytes(str(value))
    except QuantityError:  # is_positive_quantity parsed it already
        return 0


class PodGpuPaths:
    """The paths by which the (init) containers of one pod get devices, under one policy."""

    def __init__(self, spec: Any, settings: InjectionSettings, kai: KaiFraction | None = None,
                 nv: Sequence[NvFraction] = ()) -> None:
        self.spec: Mapping[str, Any] = spec if isinstance(spec, dict) else {}
        # KAI-Scheduler's paths (webhook.core.kai): the containers it hands a GPU fraction (its legacy
        # annotations; its NvFractions annotations), and how many GPUs each.
        self.kai_devices_by_name: dict[str, int] = {f.container: f.devices for f in nv}
        if kai is not None:
            self.kai_devices_by_name[kai.container] = kai.devices
        self.gpu = patterns(settings.gpu_resource_names)
        self.exclusive = patterns(settings.exclusive_gpu_resource_names)
        self._shared = _shared_gpu(self.gpu, self.exclusive)
        listed = frozenset(settings.non_gpu_resource_claims)
        pod_claims = self.spec.get("resourceClaims")
        self.pod_claims: list[str] = []  # in pod order
        self.non_gpu_claims: set[str] = set()
        for claim in pod_claims if isinstance(pod_claims, list) else ():
            if not isinstance(claim, dict) or not isinstance(claim.get("name"), str):
                continue
            self.pod_claims.append(claim["name"])
            if claim.get("resourceClaimName") in listed or claim.get("resourceClaimTemplateName") in listed:
                self.non_gpu_claims.add(claim["name"])
        # _gpu_by_resource per ``resources`` object, by identity: a review asks it of each container
        # several times (GPU names, counts, the sidecar's claims, the void), and the webhook's
        # copy-on-write copies of a container share its resources. The object is kept with its
        # answer, so its id cannot be reused by another object while this instance lives.
        self._by_resource: dict[int, tuple[Any, bool]] = {}
        self._containers = [c for key in ("initContainers", "containers") for c in _list(self.spec.get(key))]
        # The sidecar holds the GPU claims of the pod it enforces: they make it a GPU container only
        # where no other container is one (a workload named like the sidecar), never in its own pod.
        self._others_gpu = any(self._gpu_by_resource(c) or self._gpu_claims(c) or self._by_kai(c)
                               for c in self._containers if not _is_sidecar(c))

    def _by_kai(self, container: Any) -> bool:
        name = container.get("name") if isinstance(container, dict) else None
        return isinstance(name, str) and name in self.kai_devices_by_name

    def _any_gpu(self, name: str) -> bool:
        """A GPU resource, shared or exclusive."""
        return self.gpu.matches(name) or self.exclusive.matches(name)

    def _gpu_by_resource(self, container: Any) -> bool:
        resources = container.get("resources") if isinstance(container, dict) else None
        if not isinstance(resources, dict):
            return False
        known = self._by_resource.get(id(resources))
        if known is not None and known[0] is resources:
            return known[1]
        answer = next(_amounts(container, self._shared), None) is not None
        self._by_resource[id(resources)] = (resources, answer)
        return answer

    def _gpu_claims(self, container: Any) -> list[Any]:
        return [n for n in _claims(container) if n not in self.non_gpu_claims]

    def is_gpu_container(self, container: Any) -> bool:
        """Gets a shared GPU: a matching resource, or a claim not listed as non-GPU (share + sidecar)."""
        if self._gpu_by_resource(container) or self._by_kai(container):
            return True
        if not self._gpu_claims(container):
            return False
        return not (_is_sidecar(container) and self._others_gpu)

    def gets_device(self, container: Any) -> bool:
        """Gets a device by any path, so ``NVIDIA_VISIBLE_DEVICES=void`` would take it away."""
        return bool(_claims(container)) or self._by_kai(container) or \
            next(_amounts(container, self._any_gpu), None) is not None

    def gpu_count(self, container: Any) -> int | None:
        """The devices the container requested through resources (the enforcer's ``gpus``), or None
        where it requested none that way. A MIG slice counts as one: it lies on one GPU, so N slices
        never span more than N GPUs. A DRA claim adds nothing: its device count is in the
        ResourceClaim, not the pod, so a claim-only container gets no count check. A container with
        both is held to its resources' count, because an API server with DRA off drops the claims
        after the mutating webhook and before validation, which then sees only the resources."""
        kai = self.kai_devices_by_name[container["name"]] if self._by_kai(container) else 0
        return kai + sum(_count(v) for _, v in _amounts(container, self._any_gpu)) or None

    def gpu_container_names(self) -> list[Any]:
        """The names of the GPU containers, in pod order (init containers first)."""
        return [c.get("name") for c in self._containers if self.is_gpu_container(c)]

    def gpu_counts(self) -> dict[str, int]:
        """``gpu_count`` of every GPU container that has one, by name."""
        counts: dict[str, int] = {}
        for c in self._containers:
            if isinstance(c, dict) and isinstance(c.get("name"), str) and self.is_gpu_container(c):
                count = self.gpu_count(c)
                if count is not None:
                    counts[c["name"]] = count
        return counts

    def gpu_claims_by_container(self) -> dict[str, list[str]]:
        """The GPU claims (pod claim names, not listed as non-GPU) of each GPU container other than
        the sidecar, by name: where a claim's consumable capacity becomes the share (webhook.core.dra)."""
        found: dict[str, list[str]] = {}
        for c in self._containers:
            if isinstance(c, dict) and isinstance(c.get("name"), str) and not _is_sidecar(c) \
                    and self.is_gpu_container(c):
                names = [n for n in self._gpu_claims(c) if isinstance(n, str)]
                if names:
                    found[c["name"]] = names
        return found

    def sidecar_claims(self, gpu_names: Sequence[str]) -> list[str]:
        """The pod claims that the GPU containers ``gpu_names`` use as GPUs, in pod order: the
        sidecar gets them too, so that the runtime hands it the devices (CDI) and NVML sees them."""
        used = {n for c in self._containers
                if isinstance(c, dict) and c.get("name") in gpu_names and not _is_sidecar(c)
                for n in self._gpu_claims(c)}
        return [n for n in self.pod_claims if n in used]


def _is_sidecar(container: Any) -> bool:
    return isinstance(container, dict) and container.get("name") == SIDECAR_NAME
