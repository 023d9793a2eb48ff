"""What the API server says about the pods on this node: each pod's admitted shares and the IDs of
its containers (pure: pod objects in, frozen values out).

The admitted shares are the sidecar's ``GPUFENCE_CONFIG``, which the webhook wrote into the pod spec
at creation. A pod's spec env is immutable after creation and only the API server serves it, so no
tenant can change what the guardian reads; nothing a workload can write (its process environment,
its files, its labels) is ever read for a share. A container is matched to its pod by the container
ID the pod's status records (``containerd://<id>``), the same ID the runtime puts in its cgroup.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from gpufence.claims import ClaimAllocation, ClaimUse, DeviceRef, container_claims
from gpufence.contract import (
    ANNOTATION_ADMIN_DEVICE_ACCESS,
    ENV_CONFIG,
    NAMESPACE_ALLOW_OPT_OUT,
    POD_OPT_OUT_LABEL,
    SIDECAR_NAME,
    ConfigError,
    EnforcerConfig,
    GpuSharing,
)

_STATUS_LISTS = ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses")


class Admission(StrEnum):
    """How gpufence admitted a pod, as the guardian sees it."""

    ADMITTED = "admitted"  # a sidecar with a valid GPUFENCE_CONFIG: its containers have shares
    NOT_ADMITTED = "not_admitted"  # no config (admitted without a GPU, or before gpufence)
    INVALID = "invalid"  # a sidecar whose config does not parse: no share can be trusted
    OPTED_OUT = "opted_out"  # gpufence.io/inject=false in a namespace whose admin allows opting out


@dataclass(frozen=True)
class NodePod:
    uid: str
    namespace: str
    name: str
    admission: Admission
    config: EnforcerConfig | None  # the admitted shares (ADMITTED only)
    containers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # container ID -> name
    problem: str | None = None  # why INVALID
    claims: Mapping[str, tuple[ClaimUse, ...]] = field(default_factory=lambda: MappingProxyType({}))  # by container
    # Who created the pod with device access only admin-groups may grant (ANNOTATION_ADMIN_DEVICE_ACCESS).
    admin_creator: str | None = None

    def share_of(self, container: str) -> bool:
        """Whether ``container`` holds an admitted GPU share (a GPU container of the config)."""
        return self.config is not None and container in self.config.containers


def container_id(raw: object) -> str | None:
    """``containerd://<id>`` (or ``cri-o://``, ``docker://``) -> ``<id>``; None when absent."""
    if not isinstance(raw, str) or "://" not in raw:
        return None
    found = raw.split("://", 1)[1].strip()
    return found or None


def sidecar_config(spec: Mapping[str, Any]) -> tuple[str | None, bool]:
    """The sidecar's ``GPUFENCE_CONFIG`` value and whether the pod has a sidecar at all."""
    for key in ("initContainers", "containers"):
        for container in spec.get(key) or ():
            if not isinstance(container, Mapping) or container.get("name") != SIDECAR_NAME:
                continue
            for env in container.get("env") or ():
                if isinstance(env, Mapping) and env.get("name") == ENV_CONFIG and isinstance(env.get("value"), str):
                    return env["value"], True
            return None, True
    return None, False


def node_pod(obj: Mapping[str, Any], namespace_annotations: Mapping[str, str] | None = None) -> NodePod | None:
    """The pod as the guardian needs it; None for an object without a UID (not a pod)."""
    meta = obj.get("metadata") or {}
    uid = meta.get("uid")
    if not isinstance(uid, str) or not uid:
        return None
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    containers: dict[str, str] = {}
    for key in _STATUS_LISTS:
        for entry in status.get(key) or ():
            if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
                cid = container_id(entry.get("containerID"))
                if cid is not None:
                    containers[cid] = entry["name"]
    text, has_sidecar = sidecar_config(spec)
    config = None
    problem = None
    if text is not None:
        try:
            config = EnforcerConfig.from_json(text)
            admission = Admission.ADMITTED
        except ConfigError as exc:
            admission, problem = Admission.INVALID, f"{ENV_CONFIG} of {SIDECAR_NAME}: {exc}"
    elif has_sidecar:
        admission, problem = Admission.INVALID, f"{SIDECAR_NAME} has no {ENV_CONFIG}"
    elif _opted_out(meta, namespace_annotations or {}):
        admission = Admission.OPTED_OUT
    else:
        admission = Admission.NOT_ADMITTED
    return NodePod(
        uid=uid.lower(), namespace=str(meta.get("namespace") or ""), name=str(meta.get("name") or ""),
        admission=admission, config=config, containers=MappingProxyType(containers), problem=problem,
        claims=MappingProxyType(container_claims(obj)),
        admin_creator=_admin_creator(meta),
    )


def _admin_creator(meta: Mapping[str, Any]) -> str | None:
    # The webhook writes it for a creator in admin-groups whose pod has device access only they may
    # grant, and denies it to anyone else at creation;
    # the protect policy refuses adding, changing or removing it afterwards (gpufence.io/*).
    annotations = meta.get("annotations") or {}
    value = annotations.get(ANNOTATION_ADMIN_DEVICE_ACCESS) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) and value else None


def _opted_out(meta: Mapping[str, Any], namespace_annotations: Mapping[str, str]) -> bool:
    # The label is the tenant's to set at any time, so it counts only where the namespace's admin
    # allows opting out (an annotation only the admin writes); where the annotation is absent the
    # webhook's flag decides, which the guardian does not read: it takes the stricter answer.
    labels = meta.get("labels") or {}
    return labels.get(POD_OPT_OUT_LABEL) == "false" and namespace_annotations.get(NAMESPACE_ALLOW_OPT_OUT) == "true"


@dataclass(frozen=True)
class PodIndex:
    """The pods on the node by UID, which namespaces are opted in, the ResourceClaims by
    (namespace, name) with what the scheduler allocated, the NVML UUID of each DRA device the
    ResourceSlices name (driver, pool, device), and the namespaces the cluster policy's
    ``device-access-namespaces`` lists (the admin's ConfigMap, read as the webhook reads it), and
    the same ConfigMap's ``other-namespace-gpu-processes`` and ``host-gpu-processes``."""

    pods: Mapping[str, NodePod]
    opted_in: frozenset[str]
    claims: Mapping[tuple[str, str], ClaimAllocation] = field(default_factory=lambda: MappingProxyType({}))
    device_uuids: Mapping[DeviceRef, str] = field(default_factory=lambda: MappingProxyType({}))
    device_access: frozenset[str] = frozenset()
    other_namespaces: GpuSharing = GpuSharing.ALLOW
    host: GpuSharing = GpuSharing.ALLOW

    @classmethod
    def of(cls, pods: Iterable[NodePod], opted_in: Iterable[str], claims: Iterable[ClaimAllocation] = (), *,
           device_uuids: Mapping[DeviceRef, str] | None = None, device_access: Iterable[str] = (),
           other_namespaces: GpuSharing = GpuSharing.ALLOW, host: GpuSharing = GpuSharing.ALLOW) -> PodIndex:
        return cls(MappingProxyType({p.uid: p for p in pods}), frozenset(opted_in),
                   MappingProxyType({(c.namespace, c.name): c for c in claims}),
                   MappingProxyType(dict(device_uuids or {})), frozenset(device_access), other_namespaces, host)

    def get(self, uid: str | None) -> NodePod | None:
        return None if uid is None else self.pods.get(uid)
