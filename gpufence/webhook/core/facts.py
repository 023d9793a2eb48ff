"""What one review is about, decided once (pure): the pod's typed facts that every rule reads.

``pod_facts`` checks the pod's shape (``podshape.check_shape``: a field of the wrong JSON type is a
denial naming it, never an exception in a rule that trusted the type) and reads, once, what the
rules and the injection ask of it: its namespace and that namespace's policy inputs, its labels and
annotations, who sent it, its containers, KAI-Scheduler's fractions and the GPU paths
(``gpu_paths.PodGpuPaths``). The facts are immutable; the raw pod stays in them only for the rules
that read fields of their own and for the desired pod and its patch, which are computed on it.

The shape check stays hand-written rather than a typed decoder's (msgspec structs were weighed): the
rules and the patch read the decoded JSON objects, so a typed decode would be a second pass beside
the server's ``json.loads``, not instead of it, and its errors name JSON types where a denial here
names the field and what it must be.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from gpufence.webhook.core.gpu_paths import PodGpuPaths
from gpufence.webhook.core.kai import KaiFraction, NvFraction, kai_fraction, nv_fractions
from gpufence.webhook.core.podshape import check_shape
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo

# The label of the namespace's enforced Pod Security level, which decides the sidecar's user and
# capabilities (``sidecar.sidecar_user``, ``sidecar.sidecar_security_context``).
POD_SECURITY_LABEL = "pod-security.kubernetes.io/enforce"
_EMPTY: Mapping[str, Any] = MappingProxyType({})


class PodFacts(NamedTuple):
    """One pod under review, as every rule reads it (after ``check_shape``). A NamedTuple, as the
    core's other per-review records: made on every review, where a frozen dataclass's ``__init__``
    costs several times as much."""

    pod: dict[str, Any]  # the raw object, never modified: the desired pod and the patch start from it
    spec: dict[str, Any]
    namespace: str  # "" where neither the request nor the pod names one
    namespace_annotations: Mapping[str, object]  # empty where the cache has none (the flags' policy)
    pod_security: str | None  # the namespace's enforced Pod Security level
    labels: Mapping[str, Any]
    annotations: Mapping[str, Any]
    groups: object  # the request's userInfo.groups, as sent (the admin's exemptions read it)
    container_names: tuple[str, ...]  # init containers first
    kai: KaiFraction | None
    nv: tuple[NvFraction, ...]
    paths: PodGpuPaths
    gpu_names: tuple[str, ...]  # the GPU containers (a share and the sidecar), in pod order

    @property
    def kai_container(self) -> str | None:
        return self.kai.container if self.kai is not None else None


def pod_facts(request: Mapping[str, Any], pod: dict[str, Any], namespace: str, info: NamespaceInfo | None,
              settings: InjectionSettings) -> PodFacts:
    """The facts of ``pod`` (``request.object``) in ``namespace`` (``info``: the cache's, None where it
    has none); raises ``Denial`` where the pod's shape is wrong or a KAI annotation is invalid."""
    names = check_shape(pod)
    metadata = pod.get("metadata") or {}
    kai = kai_fraction(pod, settings)
    nv = tuple(nv_fractions(pod))
    paths = PodGpuPaths(pod["spec"], settings, kai, nv)
    user = request.get("userInfo")
    return PodFacts(
        pod=pod, spec=pod["spec"], namespace=namespace,
        namespace_annotations=MappingProxyType(dict(info.annotations)) if info is not None else _EMPTY,
        pod_security=info.labels.get(POD_SECURITY_LABEL) if info is not None else None,
        labels=MappingProxyType(metadata.get("labels") or {}),
        annotations=MappingProxyType(metadata.get("annotations") or {}),
        groups=user.get("groups") if isinstance(user, dict) else None,
        container_names=tuple(names), kai=kai, nv=nv, paths=paths,
        gpu_names=tuple(paths.gpu_container_names()),
    )
