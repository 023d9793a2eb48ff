"""Deciding each GPU container's share from annotations and defaults (pure, no I/O).

Precedence, per GPU container and per resource (memory, compute):

1. the pod annotation ``gpufence.io/memory.<container>`` (``gpufence.io/compute.<container>``),
2. the pod annotation ``gpufence.io/memory`` (``gpufence.io/compute``),
3. the Namespace annotation ``gpufence.io/default-memory`` (``gpufence.io/default-compute``),
4. the webhook flag (``InjectionSettings.default_memory`` / ``default_compute``).

An invalid value denies the pod with a message naming the annotation, the value and an accepted
example. A Namespace default is parsed only when it would actually apply, so an administrator's
typo never blocks a pod that sets its own share; when it does apply the pod is denied (rather
than silently admitted with less isolation than the administrator asked for) and the message
names the Namespace annotation so the user knows whom to ask, or that setting the pod's own
annotation works around it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import NamedTuple, Protocol, TypeVar

from gpufence.contract import (
    ANNOTATION_ADMIN_DEVICE_ACCESS,
    ANNOTATION_COMPUTE,
    ANNOTATION_GRACE_PERIOD,
    ANNOTATION_MEMORY,
    ANNOTATION_MODE,
    ANNOTATION_PREFIX,
    ANNOTATION_STATUS,
    MAX_GRACE_PERIOD_SECONDS,
    NAMESPACE_DEFAULT_COMPUTE,
    NAMESPACE_DEFAULT_MEMORY,
    ContainerShare,
    MemoryShare,
    Mode,
)
from gpufence.quantity import QuantityError, parse_bytes, parse_percent
from gpufence.webhook.core.denial import Denial, quote
from gpufence.webhook.core.settings import InjectionSettings

MEMORY_EXAMPLE = 'use a Kubernetes quantity such as "8Gi" or a percentage such as "25%"'
COMPUTE_EXAMPLE = 'use a percentage of the GPU\'s compute such as "50" or "50%"'
MODE_EXAMPLE = 'use "enforce" or "audit"'
GRACE_EXAMPLE = f'use a number of seconds between 0 and {MAX_GRACE_PERIOD_SECONDS:g} such as "30"'

_MEMORY_OVERRIDE_PREFIX = ANNOTATION_MEMORY + "."
_COMPUTE_OVERRIDE_PREFIX = ANNOTATION_COMPUTE + "."
_KNOWN_ANNOTATIONS = frozenset(
    {ANNOTATION_MEMORY, ANNOTATION_COMPUTE, ANNOTATION_MODE, ANNOTATION_GRACE_PERIOD, ANNOTATION_STATUS,
     ANNOTATION_ADMIN_DEVICE_ACCESS}
)
_MAX_CACHED = 128  # longest annotation value whose parse is cached
T = TypeVar("T")


class ShareBounds(Protocol):
    """What ``resolve_shares`` asks of the admin's bounds (namespace_policy.NamespacePolicy, which
    builds on this module's parsers)."""

    def mode_for(self, requested: Mode | None) -> Mode:
        """The pod's mode given the one it asked for; raises Denial when it may not."""
        ...

    def bound(self, share: ContainerShare, memory_origin: str, compute_origin: str,
              container: str = "") -> tuple[ContainerShare, list[str]]:
        """``share`` within the ceilings, and the warnings; raises Denial."""
        ...


@dataclass(frozen=True)
class SharePlan:
    """What to enforce: one entry per GPU container, in pod order."""

    containers: tuple[tuple[str, ContainerShare], ...]
    mode: Mode
    grace_period_seconds: float
    warnings: tuple[str, ...] = ()
    # KAI-Scheduler's containers (webhook.core.kai): those its NvFractions runtime limits at creation
    # (gpufence writes none of its own limit variables there), and the one of its legacy fraction,
    # whose CUDA_DEVICE_MEMORY_LIMIT from KAI's ConfigMap (HamiCore mode) is KAI's, not the author's.
    runtime_limited: frozenset[str] = frozenset()
    kai_fraction: str | None = None

    @property
    def has_any_share(self) -> bool:
        return any(s.memory is not None or s.compute_percent is not None for _, s in self.containers)


@dataclass(frozen=True)
class ClaimMemory:
    """The memory a container's DRA claim reserved on a shareable GPU (``webhook.core.dra.claim_memory``):
    its share, where the claim asks it, for messages, and the amount as a value a message offers."""

    share: MemoryShare
    origin: str  # 'claim "gpu" (ResourceClaimTemplate "gpu-30g") request "gpu" capacity.requests.memory="30Gi"'
    accepted: str  # "30Gi"


def with_gpu_counts(plan: SharePlan, counts: Mapping[str, int]) -> SharePlan:
    """``plan`` with each GPU container's requested GPU count (``ContainerShare.gpus``), which the
    enforcer holds its processes to; a count of 0 (garbage the API server would refuse) is left out."""
    containers = tuple(
        (name, dataclasses.replace(share, gpus=counts[name]) if counts.get(name, 0) > 0 else share)
        for name, share in plan.containers
    )
    return dataclasses.replace(plan, containers=containers)


def parse_mode(raw: object) -> Mode:
    """A mode annotation's value (surrounding blanks ignored); ValueError when it is none."""
    if not isinstance(raw, str):
        raise ValueError(raw)
    return Mode(raw.strip())


def _memoized(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` with its results for short texts cached: pods repeat a handful of share values.

    Only results are cached (a ``ValueError`` is raised anew), and only for texts of up to
    ``_MAX_CACHED`` characters, so the cache stays small whatever the requests hold.
    """
    cached = functools.lru_cache(maxsize=256)(parse)

    @functools.wraps(parse)
    def wrapper(text: str) -> T:
        return cached(text) if len(text) <= _MAX_CACHED else parse(text)

    return wrapper


# The smallest absolute memory share. Below it a value is a typo, never a real GPU share: "500m"
# is half a byte in Kubernetes quantity syntax (m = thousandths), "100k" a hundred kilobytes; as a
# share it would get every process of the container killed. Denied with a suggestion instead.
MIN_MEMORY_SHARE_BYTES = 1024 * 1024


class MemoryShareTooSmall(QuantityError):
    """A valid quantity below ``MIN_MEMORY_SHARE_BYTES``."""

    def __init__(self, num_bytes: int) -> None:
        super().__init__(f"{num_bytes} byte{'' if num_bytes == 1 else 's'}, below the smallest GPU memory share (1Mi)")
        self.num_bytes = num_bytes


@_memoized
def parse_memory_share(text: str) -> MemoryShare:
    text = text.strip()
    if text.endswith("%"):
        return MemoryShare(percent=parse_percent(text, require_sign=True))
    num_bytes = parse_bytes(text)
    if num_bytes < MIN_MEMORY_SHARE_BYTES:
        raise MemoryShareTooSmall(num_bytes)
    return MemoryShare(bytes=num_bytes)


def _too_small_example(text: str) -> str:
    """What the user probably meant: "500m" -> "500M" or "500Mi"; else a generic example."""
    text = text.strip()
    if text.endswith("m") and text[:-1].isdigit() and len(text) <= 16:
        return f'use "{text[:-1]}M" or "{text[:-1]}Mi" (in Kubernetes quantities "m" means thousandths)'
    return 'use a quantity such as "500M", "500Mi" or "8Gi"'


@_memoized
def parse_compute_share(text: str) -> float:
    return parse_percent(text.strip(), require_sign=False)


@_memoized
def parse_grace_period(text: str) -> float:
    """Seconds as a plain non-negative number (``"30"``, ``"2.5"``; a trailing ``s`` is tolerated)."""
    text = text.strip()
    if text.endswith("s"):
        text = text[:-1]
    if not text or len(text) > 16 or not all(c in "0123456789." for c in text):
        raise ValueError("not a number")
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError("not a number") from None
    if not (0 <= value <= Decimal(str(MAX_GRACE_PERIOD_SECONDS))):
        raise ValueError("out of range")
    return float(value)


def _describe_source(source: str, key: str) -> str:
    if source == "namespace":
        return f"Namespace annotation {key}"
    if source == "flag":
        return f"webhook flag {key}"
    return f"annotation {key}"


def memory_from(value: object, source: str, key: str) -> MemoryShare:
    """``value`` from ``source`` ("pod", "namespace" or "flag") at ``key`` as a memory share; Denial."""
    if isinstance(value, str):
        try:
            return parse_memory_share(value)
        except MemoryShareTooSmall as exc:
            raise Denial(
                f"{_describe_source(source, key)}={quote(value)} is {exc}, so it is taken for a typo: "
                f"{_too_small_example(value)}"
            ) from None
        except QuantityError:
            pass
    raise Denial(f"{_describe_source(source, key)}={quote(value)} is not a valid memory share: {MEMORY_EXAMPLE}")


def compute_from(value: object, source: str, key: str) -> float:
    """``value`` from ``source`` at ``key`` as a compute share (percent); raises Denial."""
    if isinstance(value, str):
        try:
            return parse_compute_share(value)
        except QuantityError:
            pass
    raise Denial(f"{_describe_source(source, key)}={quote(value)} is not a valid compute share: {COMPUTE_EXAMPLE}")


def resolve_shares(
    annotations: Mapping[str, object],
    namespace_annotations: Mapping[str, object],
    settings: InjectionSettings,
    gpu_containers: Sequence[str],
    all_containers: Sequence[str],
    policy: ShareBounds | None = None,
    scheduler_memory: Mapping[str, tuple[MemoryShare, str]] | None = None,
    claim_memory: Mapping[str, ClaimMemory] | None = None,
) -> SharePlan:
    """The share of every GPU container, the mode and the grace period; raises ``Denial``.

    ``policy`` (``namespace_policy``): the admin's mode and ceilings; None: no bounds (unit tests).
    ``scheduler_memory``: by container, a memory share and its origin that the scheduler fixed
    (KAI-Scheduler's fraction, ``webhook.core.kai``). It wins over gpufence's memory annotations and
    defaults: the scheduler placed the pod on a GPU by that amount and promised the rest of the
    GPU to other pods, so more would take their memory and less would break what the pod asked the
    scheduler for. A gpufence memory annotation that would have applied is reported, not used.
    ``claim_memory``: by container, the memory its DRA claims reserved on a shareable GPU
    (consumable capacity, ``webhook.core.dra.claim_memory``; its ceiling is checked by the caller). It is
    the share, over the namespace's and the flag's defaults (they are no request of the pod's); the
    pod's memory annotation may lower it, never raise it (the scheduler promised the rest of the
    GPU to other claims): a higher byte share is denied, a percentage applies beside it (the smaller
    on each GPU).
    """
    memory_overrides, compute_overrides, warnings = _overrides(annotations, gpu_containers, all_containers)
    sources = _sources(annotations, namespace_annotations, settings, set(gpu_containers), memory_overrides,
                       compute_overrides, scheduler_memory or {}, claim_memory or {})
    shares = []
    for name in gpu_containers:
        share, said = _container_share(name, sources, policy)
        warnings += said
        shares.append((name, share))
    containers = tuple(shares)
    mode = _mode(annotations, policy)
    grace = _grace_period(annotations, settings)
    if not SharePlan(containers=containers, mode=mode, grace_period_seconds=grace).has_any_share:
        mode = Mode.AUDIT
        warnings.append(
            f"gpufence: no GPU memory or compute share is set for this pod, so it is admitted in audit mode "
            f"(measured, never limited); set {ANNOTATION_MEMORY} and/or {ANNOTATION_COMPUTE} to enforce a share"
        )
    return SharePlan(containers=containers, mode=mode, grace_period_seconds=grace, warnings=tuple(warnings))


def _overrides(annotations: Mapping[str, object], gpu_containers: Sequence[str],
               all_containers: Sequence[str]) -> tuple[dict[str, object], dict[str, object], list[str]]:
    """The pod's per-container memory and compute annotations (unparsed, by container) and the
    warnings for gpufence annotations it does not know; Denial for one naming no GPU container."""
    warnings: list[str] = []
    gpu_set = set(gpu_containers)
    memory_overrides: dict[str, object] = {}
    compute_overrides: dict[str, object] = {}
    for key, value in annotations.items():
        if not key.startswith(ANNOTATION_PREFIX):
            continue
        if key.startswith(_MEMORY_OVERRIDE_PREFIX):
            target, overrides = key[len(_MEMORY_OVERRIDE_PREFIX) :], memory_overrides
        elif key.startswith(_COMPUTE_OVERRIDE_PREFIX):
            target, overrides = key[len(_COMPUTE_OVERRIDE_PREFIX) :], compute_overrides
        else:
            if key not in _KNOWN_ANNOTATIONS:
                warnings.append(f"unknown annotation {quote(key)} is ignored")
            continue
        if target not in gpu_set:
            what = "is not a GPU container" if target in all_containers else "does not exist in this pod"
            gpu_list = ", ".join(gpu_containers)
            raise Denial(
                f"annotation {quote(key)} names container {quote(target)}, which {what}: "
                f"per-container shares apply to the containers that request a GPU ({gpu_list})"
            )
        overrides[target] = value
    return memory_overrides, compute_overrides, warnings


class _Sources(NamedTuple):
    """Where a pod's shares come from, parsed: the per-container annotations, the pod-wide value (else
    the namespace default, else the flag) as written and parsed, the scheduler's and the claims' memory."""

    memory_overrides: Mapping[str, object]
    compute_overrides: Mapping[str, object]
    memory_default: tuple[object, str, str] | None
    compute_default: tuple[object, str, str] | None
    parsed_memory_default: MemoryShare | None
    parsed_compute_default: float | None
    memory_by_name: Mapping[str, MemoryShare]
    compute_by_name: Mapping[str, float]
    fixed: Mapping[str, tuple[MemoryShare, str]]
    claimed: Mapping[str, ClaimMemory]


def _sources(annotations: Mapping[str, object], namespace_annotations: Mapping[str, object],
             settings: InjectionSettings, gpu_set: set[str], memory_overrides: dict[str, object],
             compute_overrides: dict[str, object], fixed: Mapping[str, tuple[MemoryShare, str]],
             claimed: Mapping[str, ClaimMemory]) -> _Sources:
    """Every value that may apply parsed (Denial for an invalid one); a default only where some
    container uses it, so an administrator's typo never blocks a pod that sets its own share."""
    memory_default = _fallback(annotations, ANNOTATION_MEMORY, namespace_annotations, NAMESPACE_DEFAULT_MEMORY,
                               settings.default_memory, "--default-memory")
    compute_default = _fallback(annotations, ANNOTATION_COMPUTE, namespace_annotations, NAMESPACE_DEFAULT_COMPUTE,
                                settings.default_compute, "--default-compute")
    parsed_memory_default: MemoryShare | None = None
    parsed_compute_default: float | None = None
    # A claimed container uses a default only where it is the pod's own annotation (to lower the claim).
    covered = memory_overrides.keys() | fixed.keys() | (set() if _from_pod(memory_default) else claimed.keys())
    if memory_default is not None and len(covered & gpu_set) < len(gpu_set):
        parsed_memory_default = memory_from(*memory_default)
    if compute_default is not None and len(compute_overrides) < len(gpu_set):
        parsed_compute_default = compute_from(*compute_default)
    # Overrides are validated even where they shadow nothing, so a typo is never silently ignored.
    memory_by_name = {n: memory_from(v, "pod", _MEMORY_OVERRIDE_PREFIX + n) for n, v in memory_overrides.items()}
    compute_by_name = {n: compute_from(v, "pod", _COMPUTE_OVERRIDE_PREFIX + n) for n, v in compute_overrides.items()}
    return _Sources(memory_overrides, compute_overrides, memory_default, compute_default, parsed_memory_default,
                    parsed_compute_default, memory_by_name, compute_by_name, fixed, claimed)


def _container_share(name: str, sources: _Sources, policy: ShareBounds | None) -> tuple[ContainerShare, list[str]]:
    """One GPU container's share (the scheduler's memory, else its claim's, else the annotations'
    and defaults', within the policy's ceilings) and its warnings; raises Denial."""
    warnings: list[str] = []
    memory = sources.memory_by_name.get(name, sources.parsed_memory_default)
    memory_origin = _origin(sources.memory_overrides, name, _MEMORY_OVERRIDE_PREFIX, sources.memory_default)
    by_pod = name in sources.memory_overrides or _from_pod(sources.memory_default)
    fixed = sources.fixed.get(name)
    if fixed is not None:
        if by_pod:
            warnings.append(
                f"container {quote(name)}: {fixed[1]} sets its memory share, so {memory_origin} "
                "is not used for it (the scheduler placed the pod by its own annotation)"
            )
        memory, memory_origin = fixed
    claim_bytes: int | None = None  # the claim's amount beside a percentage of the pod's
    if fixed is None and name in sources.claimed:
        memory, memory_origin, claim_bytes, said = _within_claim(name, sources.claimed[name], memory, memory_origin,
                                                                 by_pod)
        warnings += said
    share = ContainerShare(memory=memory, compute_percent=sources.compute_by_name.get(name,
                                                                                      sources.parsed_compute_default))
    if policy is not None:
        share, said = policy.bound(share, memory_origin, _origin(sources.compute_overrides, name,
                                                                 _COMPUTE_OVERRIDE_PREFIX, sources.compute_default),
                                   name)
        warnings += said
    if claim_bytes is not None and share.memory is not None:
        # After the ceilings, which bound the percentage as written (both units then apply).
        held = claim_bytes if share.memory.bytes is None else min(claim_bytes, share.memory.bytes)
        share = dataclasses.replace(share, memory=MemoryShare(bytes=held, percent=share.memory.percent))
    return share, warnings


def _mode(annotations: Mapping[str, object], policy: ShareBounds | None) -> Mode:
    """The pod's mode: its annotation's, as the policy allows it; Denial for an invalid one."""
    requested: Mode | None = None
    if ANNOTATION_MODE in annotations:
        raw = annotations[ANNOTATION_MODE]
        try:
            requested = parse_mode(raw)
        except ValueError:
            raise Denial(f"annotation {ANNOTATION_MODE}={quote(raw)} is not a valid mode: {MODE_EXAMPLE}") from None
    return policy.mode_for(requested) if policy is not None else (requested or Mode.ENFORCE)


def _grace_period(annotations: Mapping[str, object], settings: InjectionSettings) -> float:
    """The pod's grace period: its annotation's, else the flag's; Denial for an invalid one."""
    if ANNOTATION_GRACE_PERIOD not in annotations:
        return settings.default_grace_period_seconds
    raw = annotations[ANNOTATION_GRACE_PERIOD]
    try:
        if not isinstance(raw, str):
            raise ValueError("not a string")
        return parse_grace_period(raw)
    except ValueError:
        raise Denial(
            f"annotation {ANNOTATION_GRACE_PERIOD}={quote(raw)} is not a valid grace period: {GRACE_EXAMPLE}"
        ) from None


def _from_pod(default: tuple[object, str, str] | None) -> bool:
    return default is not None and default[1] == "pod"


def _within_claim(name: str, claim: ClaimMemory, asked: MemoryShare | None, asked_origin: str,
                  by_pod: bool) -> tuple[MemoryShare, str, int | None, list[str]]:
    """A container's memory share where its claim reserved ``claim``: the claim's amount, or the
    pod's own memory annotation (``by_pod``) where that is lower (Denial where it is higher); a
    percentage of the pod's is returned with the claim's bytes to hold beside it (both apply), and
    the warning that says so."""
    if not by_pod or asked is None:
        return claim.share, claim.origin, None, []
    assert claim.share.bytes is not None
    if asked.bytes is None:
        return asked, asked_origin, claim.share.bytes, [
            f"container {quote(name)}: {asked_origin} and its {claim.origin} are in different units, "
            "so both apply: on each GPU the smaller is the limit"]
    if asked.bytes > claim.share.bytes:
        raise Denial(
            f"{asked_origin} is above what container {quote(name)}'s {claim.origin} reserved: the scheduler "
            f"promised the rest of that GPU to other claims; use at most {quote(claim.accepted)}, or ask the "
            "claim for more"
        )
    return asked, asked_origin, None, []


def _origin(
    overrides: Mapping[str, object], name: str, prefix: str, default: tuple[object, str, str] | None
) -> str:
    """Where a container's share came from, as a message names it (empty when it has none)."""
    if name in overrides:
        return f"annotation {prefix}{name}={quote(overrides[name])}"
    if default is not None:
        value, source, key = default
        return f"{_describe_source(source, key)}={quote(value)}"
    return ""


def _fallback(
    annotations: Mapping[str, object],
    pod_key: str,
    namespace_annotations: Mapping[str, object],
    namespace_key: str,
    flag_value: str | None,
    flag_name: str,
) -> tuple[object, str, str] | None:
    if pod_key in annotations:
        return annotations[pod_key], "pod", pod_key
    if namespace_key in namespace_annotations:
        return namespace_annotations[namespace_key], "namespace", namespace_key
    if flag_value is not None:
        return flag_value, "flag", flag_name
    return None
