"""KAI-Scheduler's GPU fractions (pure): which container KAI hands a fraction of a GPU, and the
share that fraction means.

What KAI-Scheduler does (kai-scheduler/KAI-Scheduler, read at commit d5bc503, v0.17.0 and 9
commits: docs/gpu-sharing/README.md, pkg/common/resources/gpu_sharing.go, pkg/binder/common/gpu_access.go,
pkg/admission/webhook/v1alpha2/gpusharing/gpu_sharing.go,
pkg/binder/plugins/gpusharing/gpu-request/gpu_request_validator.go):

* A pod asks for a fraction with the annotation ``gpu-fraction`` (a number between 0 and 1: the
  part of one GPU's memory it may use) or ``gpu-memory`` (MiB), never both, with no
  ``nvidia.com/gpu`` request, and ``gpu-fraction-num-devices`` for the same fraction of several
  GPUs. Only pods whose ``spec.schedulerName`` is KAI's (``kai-scheduler`` by default) are KAI's.
* One container gets the GPU: ``spec.containers[0]``, or the (init) container that the annotation
  ``gpu-fraction-container-name`` names.
* KAI's admission webhook gives that container ``NVIDIA_VISIBLE_DEVICES`` from
  ``valueFrom.configMapKeyRef`` (a ConfigMap in the pod's namespace named after the pod); KAI's
  binder fills the ConfigMap with the reserved GPU's id before it binds the pod, and the NVIDIA
  container toolkit hands the container that GPU. No device plugin allocates it.
* KAI enforces no memory limit by default ("does not enforce memory allocation limits or perform
  memory isolation between processes"): the fraction is what gpufence enforces.

So that container is a GPU container (a share, the sidecar, never ``void``), its
``NVIDIA_VISIBLE_DEVICES`` from a ConfigMap is not a side door (``podshape.nvidia_side_door``),
and its memory share is KAI's request: ``gpu-fraction`` as a percentage, ``gpu-memory`` as bytes.
The fraction says nothing of compute (KAI time-slices), so the compute share comes from gpufence's
own annotations and defaults.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from gpufence.contract import MemoryShare
from gpufence.quantity import QuantityError, parse_bytes
from gpufence.webhook.core.denial import Denial, from_admin, quote
from gpufence.webhook.core.namespace_policy import NamespacePolicy, memory_above
from gpufence.webhook.core.settings import DEFAULT_KAI_SCHEDULER, InjectionSettings
from gpufence.webhook.core.shares import MIN_MEMORY_SHARE_BYTES

KAI_GPU_FRACTION = "gpu-fraction"
KAI_GPU_MEMORY = "gpu-memory"
KAI_NUM_DEVICES = "gpu-fraction-num-devices"
KAI_CONTAINER_NAME = "gpu-fraction-container-name"

# KAI's own rules: a fraction written as a Kubernetes decimal ("0.5", "5e-1"); whole MiB; a count.
_FRACTION = re.compile(r"[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?", re.ASCII)
_WHOLE = re.compile(r"[0-9]{1,12}", re.ASCII)
_MIB = 1 << 20

FRACTION_EXAMPLE = 'use a number between 0 and 1, the part of one GPU\'s memory, such as "0.5"'
MEMORY_EXAMPLE = 'use a whole number of MiB above 0, such as "2000"'
DEVICES_EXAMPLE = 'use a whole number of GPUs above 0, such as "2"'


def scheduler_name(text: str) -> str:
    """A policy value of ``kai-scheduler-name``: a scheduler name (a DNS subdomain). Raises ValueError."""
    value = text.strip()
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", value, re.ASCII):
        raise ValueError(f'use the name KAI-Scheduler runs under, such as "{DEFAULT_KAI_SCHEDULER}"')
    return value


@dataclass(frozen=True)
class KaiFraction:
    """The pod's KAI fraction request: the container it is for, and the annotations as written."""

    container: str
    annotations: dict[str, Any]

    @property
    def devices(self) -> int:
        """How many GPUs the container gets (``gpu-fraction-num-devices``, else 1): the enforcer's
        ``gpus``. An invalid count reads as 1 here; ``memory_share`` denies it."""
        raw = self.annotations.get(KAI_NUM_DEVICES)
        if isinstance(raw, str) and _WHOLE.fullmatch(raw) and int(raw) > 0:
            return int(raw)
        return 1

    def origin(self) -> str:
        """The annotation the share comes from, as messages name it."""
        key = KAI_GPU_FRACTION if KAI_GPU_FRACTION in self.annotations else KAI_GPU_MEMORY
        return f"annotation {key}={quote(self.annotations[key])}"

    def memory_share(self) -> MemoryShare:
        """The container's memory share on each of its GPUs; raises Denial, naming the
        annotation, its value, KAI's rule and an accepted example."""
        fraction, memory = self.annotations.get(KAI_GPU_FRACTION), self.annotations.get(KAI_GPU_MEMORY)
        if fraction is not None and memory is not None:
            raise Denial(
                f"annotations {KAI_GPU_FRACTION}={quote(fraction)} and {KAI_GPU_MEMORY}={quote(memory)} are both "
                "set: KAI-Scheduler takes a fraction of a GPU or an amount of its memory, not both; remove one"
            )
        if KAI_NUM_DEVICES in self.annotations:
            raw = self.annotations[KAI_NUM_DEVICES]
            if not (isinstance(raw, str) and _WHOLE.fullmatch(raw) and int(raw) > 0):
                raise Denial(f"annotation {KAI_NUM_DEVICES}={quote(raw)} is not a number of GPUs: "
                                 f"{DEVICES_EXAMPLE}")
        if fraction is not None:
            value = _fraction(fraction)
            if value is None:
                raise Denial(f"annotation {KAI_GPU_FRACTION}={quote(fraction)} is not a KAI-Scheduler GPU "
                                 f"fraction: {FRACTION_EXAMPLE}")
            # Exact in decimal, so "0.29" is 29.0%, not 28.999999999999996%.
            return MemoryShare(percent=float(value * 100))
        if not (isinstance(memory, str) and _WHOLE.fullmatch(memory) and int(memory) > 0):
            raise Denial(f"annotation {KAI_GPU_MEMORY}={quote(memory)} is not a KAI-Scheduler GPU memory "
                             f"request: {MEMORY_EXAMPLE}")
        return MemoryShare(bytes=int(memory) * _MIB)

    def ceiling_denial(self, share: MemoryShare, policy: NamespacePolicy) -> str | None:
        """The denial where ``share`` lies above the namespace's memory ceiling in the same unit
        (in the other unit both apply, as for gpufence.io/memory: ``NamespacePolicy.bound``), with
        the largest request in KAI's own annotation that the ceiling accepts."""
        ceiling = policy.max_memory
        if ceiling is None or (share.bytes is None) != (ceiling.share.bytes is None):
            return None
        if not memory_above(share, ceiling.share):
            return None
        if ceiling.share.bytes is not None:
            accepted = f'{KAI_GPU_MEMORY}: "{ceiling.share.bytes // _MIB}"'
        else:
            assert ceiling.share.percent is not None
            accepted = f'{KAI_GPU_FRACTION}: "{format((Decimal(str(ceiling.share.percent)) / 100).normalize(), "f")}"'
        return (f"{self.origin()} is above the memory ceiling of namespace {quote(policy.namespace)} "
                f"({ceiling.origin}): ask KAI-Scheduler for at most that, e.g. {accepted}")


def _fraction(text: Any) -> Decimal | None:
    """KAI's fraction: a decimal strictly between 0 and 1, else None."""
    if not isinstance(text, str) or len(text) > 32 or not _FRACTION.fullmatch(text):
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if 0 < value < 1 else None


def kai_fraction(pod: Any, settings: InjectionSettings) -> KaiFraction | None:
    """The pod's KAI fraction request, or None where KAI hands it no fraction: another scheduler,
    neither fraction annotation, a ``spec.nodeName`` set at creation (no scheduler, so no binder,
    ever places such a pod: only a ConfigMap of the tenant's own would fill its variable), or a
    ``gpu-fraction-container-name`` naming no container (KAI refuses that pod). Tolerant of garbage."""
    if not isinstance(pod, dict):
        return None
    metadata, spec = pod.get("metadata"), pod.get("spec")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict) or not isinstance(spec, dict):
        return None
    if KAI_GPU_FRACTION not in annotations and KAI_GPU_MEMORY not in annotations:
        return None
    if spec.get("schedulerName") not in settings.kai_scheduler_names or spec.get("nodeName"):
        return None
    containers = spec.get("containers")
    if KAI_CONTAINER_NAME in annotations:
        wanted = annotations[KAI_CONTAINER_NAME]
        for key in ("initContainers", "containers"):
            listed = spec.get(key)
            for container in listed if isinstance(listed, list) else ():
                if isinstance(container, dict) and container.get("name") == wanted and isinstance(wanted, str):
                    return KaiFraction(container=wanted, annotations=annotations)
        return None
    if isinstance(containers, list) and containers and isinstance(containers[0], dict):
        name = containers[0].get("name")
        if isinstance(name, str) and name:
            return KaiFraction(container=name, annotations=annotations)
    return None


def kai_memory(kai: KaiFraction | None, policy: NamespacePolicy) -> dict[str, tuple[MemoryShare, str]]:
    """``shares.resolve_shares``'s ``scheduler_memory`` for the pod's KAI fraction (empty without
    one); raises Denial for an invalid request or one above the namespace's memory ceiling."""
    if kai is None:
        return {}
    share = kai.memory_share()
    denial = kai.ceiling_denial(share, policy)
    if denial is not None:
        raise Denial(denial)
    return {kai.container: (share, kai.origin())}


# --- KAI-Scheduler v0.18's NvFractions mode (kai-gpu-fractioning) ----------------------------------
#
# Read in kai-scheduler/KAI-Scheduler docs/gpu-sharing/README.md and docs/gpu-sharing/nv-fraction/README.md
# (v0.18), and kai-scheduler/kai-gpu-fractioning README.md,
# fractioning-manager/fractiond/internal/annotations/annotations.go and
# fractioning-manager/fractiond/internal/injection/injection.go (commit 0ee10b4):
#
# * a container asks with the pod annotations ``nvidia.com/container.<name>.gpu-memory.request`` and
#   ``...gpu-memory.limit`` (Kubernetes memory quantities; one defaults to the other; the request
#   may not exceed the limit), and ``...gpu-compute.mode`` (``time-slicing`` or ``sm-sharing``). It
#   requests no GPU resource; KAI schedules the request, and its binder writes the GPU it chose into
#   ``nvidia.com/container.<name>.gpus.devices`` after allocation;
# * fractiond, an NRI plugin on the node, sets that container's ``NVIDIA_VISIBLE_DEVICES`` from the
#   ``gpus.devices`` annotation, ``NVIDIA_GPU_MEMORY_REQUESTS`` / ``NVIDIA_GPU_MEMORY_LIMITS`` and an MPS
#   pipe mount when the container is created (after admission): the limit is held by KAI's MPS
#   daemon, under names the toolkit's apply-cuda-memory-limits hook does not read (it reads
#   NVIDIA_GPU_MEMORY_REQUEST / _LIMIT, docs/driver-limits-node.md).
#
# So that container is a GPU container (the sidecar, a share, never void), its memory share is the
# limit (else the request): what KAI's runtime caps it at; gpufence writes none of its own limit
# variables there (driver, MPS, preload): KAI's runtime holds the limit with its own request/limit
# semantics, which gpufence's REQUEST = LIMIT or MPS client limit would contradict. The enforcer
# polls as everywhere (the backstop). ``gpus.devices`` written by the pod's author at CREATE is a
# side door (fractiond would hand that GPU to a pod that requested none): denied unless the author
# is in ``admin-groups``.

NV_PREFIX = "nvidia.com/container."
NV_REQUEST, NV_LIMIT, NV_DEVICES = "gpu-memory.request", "gpu-memory.limit", "gpus.devices"
_NV_KEY = re.compile(r"nvidia\.com/container\.([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)\."
                     r"(gpu-memory\.request|gpu-memory\.limit|gpu-compute\.mode|gpus\.devices)", re.ASCII)
NV_MEMORY_EXAMPLE = 'use a Kubernetes memory quantity of at least 1Mi, such as "8Gi" or "7680Mi"'


def nv_key(container: str, suffix: str) -> str:
    return f"{NV_PREFIX}{container}.{suffix}"


@dataclass(frozen=True)
class NvFraction:
    """One container's NvFractions request: its name and the pod's annotations."""

    container: str
    annotations: dict[str, Any]

    def _value(self, suffix: str) -> Any:
        return self.annotations.get(nv_key(self.container, suffix))

    def origin(self) -> str:
        """The annotation the share comes from (the limit, else the request), as messages name it."""
        suffix = NV_LIMIT if self._value(NV_LIMIT) is not None else NV_REQUEST
        return f"annotation {nv_key(self.container, suffix)}={quote(self._value(suffix))}"

    @property
    def devices(self) -> int:
        """The GPUs it gets: ``gpu-fraction-num-devices`` (KAI applies it to NvFractions too), else 1."""
        raw = self.annotations.get(KAI_NUM_DEVICES)
        return int(raw) if isinstance(raw, str) and _WHOLE.fullmatch(raw) and int(raw) > 0 else 1

    def memory_share(self) -> MemoryShare:
        """The limit (else the request) in bytes on each of its GPUs; raises Denial for a value
        that is not a quantity of at least 1Mi or a request above the limit (KAI's rules)."""
        parsed: dict[str, int] = {}
        for suffix in (NV_REQUEST, NV_LIMIT):
            raw = self._value(suffix)
            if raw is None:
                continue
            try:
                value = parse_bytes(raw) if isinstance(raw, str) and not raw.strip().endswith("%") else 0
            except QuantityError:
                value = 0
            if value < MIN_MEMORY_SHARE_BYTES:
                raise Denial(f"annotation {nv_key(self.container, suffix)}={quote(raw)} is not a KAI-Scheduler "
                                 f"GPU memory request: {NV_MEMORY_EXAMPLE}")
            parsed[suffix] = value
        if NV_REQUEST in parsed and NV_LIMIT in parsed and parsed[NV_REQUEST] > parsed[NV_LIMIT]:
            raise Denial(
                f"annotation {nv_key(self.container, NV_REQUEST)}={quote(self._value(NV_REQUEST))} is above "
                f"{nv_key(self.container, NV_LIMIT)}={quote(self._value(NV_LIMIT))}: KAI-Scheduler requires the "
                "request to be at most the limit")
        return MemoryShare(bytes=parsed.get(NV_LIMIT, parsed.get(NV_REQUEST)))

    def ceiling_denial(self, share: MemoryShare, policy: NamespacePolicy) -> str | None:
        """The denial where ``share`` lies above the namespace's memory ceiling in bytes (a percentage
        ceiling applies beside it, ``NamespacePolicy.bound``)."""
        ceiling = policy.max_memory
        if ceiling is None or ceiling.share.bytes is None or not memory_above(share, ceiling.share):
            return None
        suffix = NV_LIMIT if self._value(NV_LIMIT) is not None else NV_REQUEST
        return (f"{self.origin()} is above the memory ceiling of namespace {quote(policy.namespace)} "
                f"({ceiling.origin}): ask KAI-Scheduler for at most that, e.g. "
                f"{nv_key(self.container, suffix)}: {quote(ceiling.text)}")


def _container_names(spec: Any) -> list[str]:
    names = []
    for key in ("initContainers", "containers"):
        listed = spec.get(key) if isinstance(spec, dict) else None
        for container in listed if isinstance(listed, list) else ():
            if isinstance(container, dict) and isinstance(container.get("name"), str):
                names.append(container["name"])
    return names


def nv_fractions(pod: Any) -> list[NvFraction]:
    """The containers that ask KAI's NvFractions for GPU memory (a ``gpu-memory.request`` or
    ``.limit`` annotation naming a container of the pod), in pod order, whatever the scheduler name
    (kai-gpu-fractioning's README shows such a pod without one); an annotation naming no container
    asks for nothing (KAI refuses that pod). Tolerant of garbage."""
    if not isinstance(pod, dict):
        return []
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict):
        return []
    asked = {m.group(1) for key in annotations if isinstance(key, str) and key.startswith(NV_PREFIX)
             and (m := _NV_KEY.fullmatch(key)) is not None and m.group(2) in (NV_REQUEST, NV_LIMIT)}
    if not asked:
        return []
    return [NvFraction(name, annotations) for name in dict.fromkeys(_container_names(pod.get("spec")))
            if name in asked]


def nv_devices_denial(pod: Any, groups: Any, admin_groups: tuple[str, ...]) -> str | None:
    """The denial for a pod created with a ``nvidia.com/container.<name>.gpus.devices`` annotation by
    anyone outside ``admin_groups``: KAI's binder writes it after allocation, never at creation, and
    fractiond hands the GPUs it names to the container, which requested none. None otherwise."""
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict):
        return None
    if from_admin(groups, admin_groups):
        return None
    for key in annotations:
        if isinstance(key, str) and key.startswith(NV_PREFIX) and (m := _NV_KEY.fullmatch(key)) is not None \
                and m.group(2) == NV_DEVICES:
            return (f"annotation {key} is written by KAI-Scheduler's binder after it allocates a GPU, never by the "
                    "pod's author: on a node running kai-gpu-fractioning it would hand the container that GPU "
                    f"without any request; remove it and ask with {nv_key(m.group(1), NV_REQUEST)}")
    return None


def nv_memory(fractions: list[NvFraction], policy: NamespacePolicy) -> dict[str, tuple[MemoryShare, str]]:
    """``shares.resolve_shares``'s ``scheduler_memory`` for the pod's NvFractions containers; raises
    Denial for an invalid request or one above the namespace's memory ceiling."""
    found: dict[str, tuple[MemoryShare, str]] = {}
    for fraction in fractions:
        share = fraction.memory_share()
        denial = fraction.ceiling_denial(share, policy)
        if denial is not None:
            raise Denial(denial)
        found[fraction.container] = (share, fraction.origin())
    return found
