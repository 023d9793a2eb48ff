"""The admin-owned bounds on what a pod may ask for (pure): the namespace's mode and ceilings.

Who decides what: the cluster admin sets webhook flags; the namespace admin annotates
the Namespace (which tenants normally cannot edit; read from the watch cache); the pod's author
asks, within those bounds. A namespace annotation wins over the flag of the same meaning; the
flags' defaults are the safe ones (no audit by the pod's choice, no opt-out).

* ``gpufence.io/mode`` on the Namespace (else ``--default-mode``): the mode of its pods. A pod may
  ask for a stricter mode, never a weaker one, unless ``gpufence.io/allow-audit: "true"`` (else
  ``--allow-audit``).
* ``gpufence.io/max-memory`` / ``gpufence.io/max-compute`` (else ``--max-memory`` /
  ``--max-compute``): ceilings on each GPU container's share. A share above the ceiling is denied;
  a container without a share gets the ceiling as its share, so nothing runs above it. A memory
  share and a ceiling in different units (bytes vs percent) cannot be compared at admission (the
  device's memory is unknown there): the config carries both and the enforcer applies the smaller
  on each device (``MemoryShare.limit_on``), which the admission warning, the enforcer's log and
  its metric ``gpufence_container_gpu_memory_limit_from_percent`` say.
* ``gpufence.io/allow-opt-out: "true"`` (else ``--allow-opt-out``): only then does the pod label
  ``gpufence.io/inject: "false"`` exempt a GPU pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpufence.contract import (
    ANNOTATION_MODE,
    NAMESPACE_ALLOW_AUDIT,
    NAMESPACE_ALLOW_OPT_OUT,
    NAMESPACE_MAX_COMPUTE,
    NAMESPACE_MAX_MEMORY,
    POD_OPT_OUT_LABEL,
    ContainerShare,
    MemoryShare,
    Mode,
)
from gpufence.webhook.core.denial import Denial, quote
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import MODE_EXAMPLE, compute_from, memory_from, parse_mode


@dataclass(frozen=True)
class Ceiling:
    origin: str  # e.g. 'Namespace annotation gpufence.io/max-memory="25%"', for messages
    text: str  # the ceiling as written, offered back as an accepted value


@dataclass(frozen=True)
class MemoryCeiling(Ceiling):
    share: MemoryShare


@dataclass(frozen=True)
class ComputeCeiling(Ceiling):
    percent: float


@dataclass(frozen=True)
class NamespacePolicy:
    namespace: str
    mode: Mode = Mode.ENFORCE
    mode_origin: str = "webhook flag --default-mode"
    allow_audit: bool = False
    allow_opt_out: bool = False
    max_memory: MemoryCeiling | None = None
    max_compute: ComputeCeiling | None = None

    def mode_for(self, requested: Mode | None) -> Mode:
        """The pod's mode: the one it asked for if that is not weaker than the namespace's."""
        if requested is None:
            return self.mode
        if requested is Mode.AUDIT and self.mode is Mode.ENFORCE and not self.allow_audit:
            raise Denial(
                f"annotation {ANNOTATION_MODE}={quote(requested.value)} asks for audit mode (measured, never "
                f"limited), but namespace {quote(self.namespace)} runs in enforce mode ({self.mode_origin}) and "
                f'does not allow audit by the pod\'s choice (Namespace annotation {NAMESPACE_ALLOW_AUDIT}: "true" '
                f'would): remove the annotation or set it to "enforce"'
            )
        return requested

    def bound(self, share: ContainerShare, memory_origin: str, compute_origin: str,
              container: str = "") -> tuple[ContainerShare, list[str]]:
        """``share`` within the ceilings (a missing share becomes the ceiling) and the warnings; raises
        Denial. A memory share in the other unit than the ceiling keeps both (the smaller applies on
        each device), with a warning for ``container``."""
        memory, warnings = self._bound_memory(share.memory, memory_origin, container)
        compute = self._bound_compute(share.compute_percent, compute_origin)
        if memory is share.memory and compute == share.compute_percent:
            return share, warnings
        return ContainerShare(memory=memory, compute_percent=compute), warnings

    def _bound_memory(self, memory: MemoryShare | None, origin: str,
                      container: str) -> tuple[MemoryShare | None, list[str]]:
        ceiling = self.max_memory
        if ceiling is None:
            return memory, []
        if memory is None:
            return ceiling.share, []
        if (memory.bytes is None) != (ceiling.share.bytes is None):
            both = MemoryShare(bytes=memory.bytes if memory.bytes is not None else ceiling.share.bytes,
                               percent=memory.percent if memory.percent is not None else ceiling.share.percent)
            return both, [
                f"container {quote(container)}: {origin} and the memory ceiling of namespace "
                f"{quote(self.namespace)} ({ceiling.origin}) are in different units, so both apply: on "
                f"each GPU the smaller is the limit"
            ]
        if memory_above(memory, ceiling.share):
            raise Denial(
                f"{origin} is above the memory ceiling of namespace {quote(self.namespace)} "
                f"({ceiling.origin}): use at most {quote(ceiling.text)}"
            )
        return memory, []

    def _bound_compute(self, compute: float | None, origin: str) -> float | None:
        ceiling = self.max_compute
        if ceiling is None:
            return compute
        if compute is None:
            return ceiling.percent
        if compute > ceiling.percent:
            raise Denial(
                f"{origin} is above the compute ceiling of namespace {quote(self.namespace)} "
                f"({ceiling.origin}): use at most {quote(ceiling.text)}"
            )
        return compute


def memory_above(share: MemoryShare, ceiling: MemoryShare) -> bool:
    """Whether ``share`` is above ``ceiling``, both in the same unit (bytes where both have bytes):
    the one comparison of a memory share with a ceiling (the namespace's, KAI's, a claim's)."""
    if share.bytes is not None and ceiling.bytes is not None:
        return share.bytes > ceiling.bytes
    assert share.percent is not None and ceiling.percent is not None
    return share.percent > ceiling.percent


def _flag_or_namespace(
    annotations: Mapping[str, object], key: str, flag_value: object, flag_name: str
) -> tuple[object, str, str] | None:
    if key in annotations:
        return annotations[key], "namespace", key
    if flag_value is not None:
        return flag_value, "flag", flag_name
    return None


def _origin(value: object, source: str, key: str) -> str:
    what = "Namespace annotation" if source == "namespace" else "webhook flag"
    return f"{what} {key}={quote(value)}"


def opt_out_allowed(annotations: Mapping[str, object], settings: InjectionSettings) -> bool:
    """Whether the pod label gpufence.io/inject=false exempts a GPU pod in this namespace."""
    if NAMESPACE_ALLOW_OPT_OUT in annotations:
        return annotations[NAMESPACE_ALLOW_OPT_OUT] == "true"
    return settings.allow_opt_out


def opt_out_denial(namespace: str) -> str:
    return (
        f'the pod label {POD_OPT_OUT_LABEL}="false" asks to run this GPU pod without gpufence, which namespace '
        f"{quote(namespace)} does not allow (its admin can, with the Namespace annotation "
        f'{NAMESPACE_ALLOW_OPT_OUT}: "true"): remove the label, or run the pod in a namespace that allows opt-out'
    )


def namespace_policy(
    namespace: str, annotations: Mapping[str, object], settings: InjectionSettings
) -> NamespacePolicy:
    """The policy of ``namespace`` from its annotations and the flags; raises Denial on an
    admin's typo (the message names the Namespace annotation, so the user knows whom to ask)."""
    mode, mode_origin = Mode(settings.default_mode), f"webhook flag --default-mode={quote(settings.default_mode)}"
    if ANNOTATION_MODE in annotations:
        raw = annotations[ANNOTATION_MODE]
        try:
            mode = parse_mode(raw)
        except ValueError:
            raise Denial(
                f"Namespace annotation {ANNOTATION_MODE}={quote(raw)} is not a valid mode: {MODE_EXAMPLE}"
            ) from None
        mode_origin = f"Namespace annotation {ANNOTATION_MODE}={quote(raw)}"
    allow_audit = settings.allow_audit
    if NAMESPACE_ALLOW_AUDIT in annotations:
        allow_audit = annotations[NAMESPACE_ALLOW_AUDIT] == "true"
    allow_opt_out = opt_out_allowed(annotations, settings)
    max_memory = max_compute = None
    found = _flag_or_namespace(annotations, NAMESPACE_MAX_MEMORY, settings.max_memory, "--max-memory")
    if found is not None:
        max_memory = MemoryCeiling(origin=_origin(*found), text=str(found[0]).strip(), share=memory_from(*found))
    found = _flag_or_namespace(annotations, NAMESPACE_MAX_COMPUTE, settings.max_compute, "--max-compute")
    if found is not None:
        max_compute = ComputeCeiling(origin=_origin(*found), text=str(found[0]).strip(), percent=compute_from(*found))
    return NamespacePolicy(namespace=namespace, mode=mode, mode_origin=mode_origin, allow_audit=allow_audit,
                           allow_opt_out=allow_opt_out, max_memory=max_memory, max_compute=max_compute)
