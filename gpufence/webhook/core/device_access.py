
"""Device access without a device request (pure): privileged containers and hostPath volumes that
reach the node's GPUs outside the scheduler's count and gpufence's shares.

A GPU reaches a container through a device request (a GPU resource, a DRA claim, KAI's fraction),
which the webhook turns into a share and a sidecar. A pod can also reach the node's devices around
any request: a privileged container sees every device node of the node and no device cgroup stops
it opening one; a hostPath volume of ``/dev`` (or a ``CharDevice`` anywhere) hands it the NVIDIA
device nodes, and the node's ``/proc`` and ``/sys`` the driver's files and other containers' roots
(``/proc/<pid>/root/dev/nvidia0``). Pod Security ``baseline`` forbids all of these; a namespace
without a Pod Security label (``privileged`` to Kubernetes) does not, and the webhook used to store
such a pod with ``NVIDIA_VISIBLE_DEVICES=void`` only: no share, no sidecar, no GPU count.

So in an opted-in namespace the webhook refuses them, GPU pod or not, opted out or not, unless the
admin allows it: the namespace is in the policy's ``device-access-namespaces``, or the request comes
from a member of ``admin-groups`` (``device_access_denial``). gpufence's own hostPath volumes
(``sidecar.pod_volumes``: the host's ``/proc`` for the enforcer of a legacy driver, the preload
library) are the admin's and pass in a GPU pod, where the injection rebuilds them.

Device access means devices: the memory filesystems under /dev (``/dev/shm``, ``/dev/hugepages``,
``/dev/mqueue``) hold no device node and pass, at exactly those paths, so that MPI and NCCL workers
run in opted-in namespaces without the admin's exemption (which would also let them run privileged
containers). A mount under the toolkit's ``/var/run/nvidia-container-devices``, which the toolkit
reads as a GPU request, is refused whatever its volume.

Tolerant of garbage: the review shape-checks the pod before these rules (``podshape.check_shape``),
but each function stays total on any input of its own.
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

from gpufence.contract import ANNOTATION_ADMIN_DEVICE_ACCESS
from gpufence.webhook.core.denial import from_admin, quote

# Where a hostPath reaches a GPU or its driver without a device request. A hostPath at one of these,
# under one, or above one (``/``, ``/run``, ``/usr``) is refused:
# * /dev: the device nodes (/dev/nvidia*, /dev/nvidia-caps, /dev/dri);
# * /proc: /proc/driver/nvidia, and every process's /proc/<pid>/root, through which a root process
#   of default capabilities reaches another root container's /dev;
# * /sys: the GPUs' PCI device files (/sys/bus/pci/devices/*/resource*, config);
# * /run/nvidia, /var/run/nvidia: the GPU Operator's driver root and toolkit (its /dev and libraries);
# * the multiarch library directories: where the driver's user-space libraries (libcuda,
#   libnvidia-ml) live on the node, which the NVIDIA container toolkit mounts for a GPU container.
# Paths are compared as written: a symlink on the node that leads into one of these is resolved by
# the kubelet, not seen here. Pod Security `baseline`, which refuses every hostPath, covers that
# (docs/install.md, "Pod Security of the namespaces you opt in").
DEVICE_PATHS = (
    "/dev",
    "/proc",
    "/sys",
    "/run/nvidia",
    "/var/run/nvidia",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/lib64",
)
# hostPath types that are a device whatever the path.
DEVICE_TYPES = ("CharDevice", "BlockDevice")
# The memory filesystems under /dev that hold no device node, admitted as hostPath at exactly these
# paths: NCCL and MPI share memory through /dev/shm (tmpfs), DPDK and huge-page users map
# /dev/hugepages (hugetlbfs), POSIX message queues live in /dev/mqueue (mqueue). Exactly, not under
# them: a pod that mounts /dev/shm writable can leave a symlink there (/dev/shm/d -> /dev), and
# the kubelet and the runtime resolve a hostPath's symlinks on the node, so a second pod's hostPath
# /dev/shm/d would be the node's /dev. The mount point itself is the node's, and no pod can replace it.
MEMORY_FILESYSTEMS = ("/dev/shm", "/dev/hugepages", "/dev/mqueue")
# Where the NVIDIA container toolkit reads device requests from mounts (its
# accept-nvidia-visible-devices-as-volume-mounts): a mount whose source is /dev/null and whose
# destination starts with this path (a string prefix, as the toolkit compares it) hands the
# container the GPUs its remainder names (internal/config/image/cuda_image.go, requestsFromMounts).
# A hostPath of /dev/null is refused above, but one of a symlink the node has to /dev/null is not
# seen here, so no container of an opted-in namespace may mount anything there.
TOOLKIT_MOUNT_ROOT = "/var/run/nvidia-container-devices"
# A path that cleans to one under TOOLKIT_MOUNT_ROOT holds its last component as written: cleaning only
# drops components. Checked first, it spares cleaning every other mount of every container.
_TOOLKIT_MOUNT_NAME = TOOLKIT_MOUNT_ROOT.rsplit("/", 1)[1]


def _normal(path: str) -> str:
    """``path`` without repeated or trailing slashes and ``.`` components (the API server refuses
    ``..`` in a hostPath path)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    return "/" + "/".join(parts)


def _clean(path: str) -> str:
    """``path`` as Go's ``filepath.Clean`` leaves it (``..`` resolved lexically), which is how the
    toolkit compares a mount's destination."""
    return "/" + posixpath.normpath(path).lstrip("/") if path.startswith("/") else posixpath.normpath(path)


def reaches_devices(path: str) -> bool:
    """Whether a hostPath of ``path`` is, is under or contains one of ``DEVICE_PATHS`` (and is not
    exactly one of ``MEMORY_FILESYSTEMS``)."""
    if not path.startswith("/"):
        return False  # the API server refuses a relative hostPath
    normal = _normal(path)
    if normal in MEMORY_FILESYSTEMS:
        return False
    for device in DEVICE_PATHS:
        if normal == device or normal.startswith(device + "/") or device.startswith(normal.rstrip("/") + "/"):
            return True
    return False


def device_access_denial(spec: Any, namespace: str, groups: Any, admin_groups: Collection[str],
                         allowed_namespaces: Collection[str], own_volumes: Iterable[Mapping[str, Any]] = (),
                         gpu_resource: str = "nvidia.com/gpu") -> str | None:
    """The denial for the first privileged container or device-reaching hostPath volume of ``spec``,
    else None (and None for the admin's exemptions: ``namespace`` in ``allowed_namespaces``, or one of
    the request's ``groups`` in ``admin_groups``).

    ``own_volumes``: gpufence's own volumes in a GPU pod (``sidecar.pod_volumes``), which pass where
    the pod holds them exactly as gpufence makes them. ``gpu_resource``: advised in the denial.
    """
    if not isinstance(spec, dict) or namespace in allowed_namespaces:
        return None
    if from_admin(groups, admin_groups):
        return None
    allowed = ", ".join(quote(n) for n in allowed_namespaces) or "none"
    how = (f"only the cluster admin allows it, by listing the namespace in device-access-namespaces of "
           f"ConfigMap gpufence/gpufence-policy (now: {allowed}) or by creating the pod as a member of admin-groups")
    advice = f'request a GPU with resources.limits["{gpu_resource}"]'
    return (_privileged_denial(spec, namespace, how, advice)
            or _toolkit_mount_denial(spec, namespace, how, advice)
            or _host_path_denial(spec, namespace, how, advice, [dict(v) for v in own_volumes]))


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(key, index, container) of every init and app container of ``spec`` that is an object."""
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        for i, container in enumerate(containers if isinstance(containers, list) else ()):
            if isinstance(container, dict):
                yield key, i, container


def _privileged_denial(spec: dict[str, Any], namespace: str, how: str, advice: str) -> str | None:
    for key, i, container in _containers(spec):
        context = container.get("securityContext")
        if isinstance(context, dict) and context.get("privileged") is True:
            return (
                f"container {quote(container.get('name'))} sets privileged: true "
                f"(spec.{key}[{i}].securityContext.privileged): a privileged container opens every device "
                "of the node, every GPU among them, outside the scheduler's count and gpufence's shares; "
                f"in namespace {quote(namespace)} {how}; remove it, and {advice}"
            )
    return None


def _toolkit_mount_denial(spec: dict[str, Any], namespace: str, how: str, advice: str) -> str | None:
    for key, i, container in _containers(spec):
        mounts = container.get("volumeMounts")
        for j, mount in enumerate(mounts if isinstance(mounts, list) else ()):
            target = mount.get("mountPath") if isinstance(mount, dict) else None
            if isinstance(target, str) and _TOOLKIT_MOUNT_NAME in target \
                    and _clean(target).startswith(TOOLKIT_MOUNT_ROOT):
                return (
                    f"container {quote(container.get('name'))} mounts volume {quote(mount.get('name'))} at "
                    f"{quote(target)} (spec.{key}[{i}].volumeMounts[{j}].mountPath): the NVIDIA container "
                    f"toolkit reads a mount under {TOOLKIT_MOUNT_ROOT} as a request for the GPUs its path "
                    "names, outside the scheduler's count and gpufence's shares; "
                    f"in namespace {quote(namespace)} {how}; mount the volume elsewhere, and {advice}"
                )
    return None


def _host_path_denial(spec: dict[str, Any], namespace: str, how: str, advice: str,
                      ours: list[dict[str, Any]]) -> str | None:
    volumes = spec.get("volumes")
    for i, volume in enumerate(volumes if isinstance(volumes, list) else ()):
        host = volume.get("hostPath") if isinstance(volume, dict) else None
        if not isinstance(host, dict) or volume in ours:
            continue
        path = host.get("path")
        kind = host.get("type")
        device_type = kind in DEVICE_TYPES
        if device_type or (isinstance(path, str) and reaches_devices(path)):
            field = f"spec.volumes[{i}].hostPath.{'type' if device_type else 'path'}"
            shown = f"type {kind}" if device_type else quote(path if isinstance(path, str) else "")
            return (
                f"volume {quote(volume.get('name'))} is hostPath {shown} ({field}): a hostPath "
                "of a device, or at, under or above /dev, /proc, /sys, NVIDIA's driver root (/run/nvidia) or the "
                "driver's library directories, reaches the node's GPUs outside the scheduler's count and "
                f"gpufence's shares; in namespace {quote(namespace)} {how}; use another volume, e.g. an "
                "emptyDir (for shared memory, an emptyDir with medium: Memory, or hostPath /dev/shm, "
                f"/dev/hugepages or /dev/mqueue exactly), and {advice}"
            )
    return None


# Annotations that a component of a GPU node turns into device access, with what reads them: a pod
# that carries one gets devices without a device request, outside the scheduler's count and
# gpufence's shares. A key is refused where it is one of these or starts with one and "/".
# (KAI-Scheduler's nvidia.com/container.<name>.gpus.devices is refused at creation by
# ``kai.nv_devices_denial``: KAI's binder writes it after creation, so an update may.)
DEVICE_ANNOTATIONS: tuple[tuple[str, str], ...] = (
    # cmd/nvidia-ctk-installer/container/runtime/nri/plugin.go (toolkit 1.19.0+, nriCDIAnnotationDomain),
    # keys <domain>/container.<name>, <domain>/pod and <domain> (containerd/nri GetEffectiveAnnotation).
    ("nvidia.cdi.k8s.io", "the NVIDIA container toolkit's NRI plugin injects the CDI devices it names "
                          "(nvidia.com/gpu=all is every GPU of the node)"),
    # container-device-interface pkg/cdi/producer/annotations (Prefix "cdi.k8s.io/"): the runtimes
    # inject the CDI devices named in such container annotations, which a device plugin sets.
    ("cdi.k8s.io", "container runtimes (containerd, CRI-O) inject the CDI devices named by cdi.k8s.io/ "
                   "annotations, which only a device plugin should set"),
    # containerd/nri plugins/device-injector: device nodes, CDI devices and mounts from pod annotations.
    ("devices.noderesource.dev", "the NRI device-injector plugin adds the device nodes it names"),
    ("devices.nri.io", "the NRI device-injector plugin adds the device nodes it names"),
    ("cdi-devices.noderesource.dev", "the NRI device-injector plugin injects the CDI devices it names"),
    ("cdi-devices.nri.io", "the NRI device-injector plugin injects the CDI devices it names"),
    ("mounts.noderesource.dev", "the NRI device-injector plugin adds the host mounts it names"),
    ("mounts.nri.io", "the NRI device-injector plugin adds the host mounts it names"),
    # cri-o pkg/annotations DevicesAnnotation: host devices, where the runtime handler allows it.
    ("io.kubernetes.cri-o.Devices", "CRI-O adds the host devices it names where the runtime handler's "
                                    "allowed_annotations lists it"),
)


_DEVICE_DOMAINS = frozenset(domain for domain, _ in DEVICE_ANNOTATIONS)
_DEVICE_PREFIXES = tuple(domain + "/" for domain, _ in DEVICE_ANNOTATIONS)


def device_annotation(key: str) -> str | None:
    """What turns annotation ``key`` into device access (``DEVICE_ANNOTATIONS``), or None."""
    if key not in _DEVICE_DOMAINS and not key.startswith(_DEVICE_PREFIXES):
        return None  # every annotation of nearly every pod: one lookup and one C call
    for domain, reader in DEVICE_ANNOTATIONS:
        if key == domain or key.startswith(domain + "/"):
            return reader
    return None


def device_annotation_denial(pod: Any, groups: Any, admin_groups: Collection[str],
                             gpu_resource: str = "nvidia.com/gpu") -> str | None:
    """The denial for the first annotation of ``pod`` that a node component turns into device access
    (``DEVICE_ANNOTATIONS``), unless one of the request's ``groups`` is in ``admin_groups``; else None.

    GPU pod or not, opted out or not: NVIDIA's NRI plugin injects nvidia.com/gpu=all into a
    container that requested nothing, with no sidecar and no share. ``gpu_resource``: advised.
    """
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict):
        return None
    if from_admin(groups, admin_groups):
        return None
    for key, value in annotations.items():
        reader = device_annotation(key) if isinstance(key, str) else None
        if reader is not None:
            return (
                f"annotation {key}={quote(value)} (metadata.annotations): {reader}, outside the scheduler's "
                "count and gpufence's shares; in namespaces that use gpufence only members of admin-groups "
                "(ConfigMap gpufence/gpufence-policy) may set it; remove it and request GPUs with "
                f'resources.limits["{gpu_resource}"]'
            )
    return None


# --- the record of an admin's pod -------------------------------------------------------------------
# The node guardian reports, and does not end, GPU processes without a share in a pod that a member of
# admin-groups created with what only they may have (the exemptions above, and KAI's gpus.devices).
# It cannot tell the creator from the pod, so the webhook records it at creation in
# ANNOTATION_ADMIN_DEVICE_ACCESS: written where the exemption was used, denied to anyone else (a
# controller's pod too: its template is the tenant's), and kept from every update by the
# gpufence-protect policy (k8s/base/protect-policy.yaml, with gpufence.io/status). An admin's pod that
# needed no exemption gets no record: the admin allowed it no device.


def admin_record_denial(pod: Any, groups: Any, admin_groups: Collection[str]) -> str | None:
    """The denial for a pod that carries ``ANNOTATION_ADMIN_DEVICE_ACCESS`` at creation by a request
    whose ``groups`` are not in ``admin_groups``; else None."""
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict) or ANNOTATION_ADMIN_DEVICE_ACCESS not in annotations:
        return None
    if from_admin(groups, admin_groups):
        return None
    return (
        f"annotation {ANNOTATION_ADMIN_DEVICE_ACCESS}={quote(annotations[ANNOTATION_ADMIN_DEVICE_ACCESS])} "
        "(metadata.annotations): the gpufence webhook writes it when a member of admin-groups (ConfigMap "
        "gpufence/gpufence-policy) creates a pod with device access only they may grant, and the node guardian "
        "leaves the GPU processes of such a pod alone; no one else may set it (in a controller's pod template "
        f"neither); remove it, e.g. metadata.annotations without {ANNOTATION_ADMIN_DEVICE_ACCESS}"
    )


def with_admin_record(pod: dict[str, Any], user: Any) -> dict[str, Any]:
    """``pod`` with ``ANNOTATION_ADMIN_DEVICE_ACCESS`` set to ``user`` (the request's
    ``userInfo.username``; copy-on-write, ``pod`` itself when it already says so). For a member of
    admin-groups whose pod used an exemption; the pod must have passed ``podshape.check_shape``."""
    name = user if isinstance(user, str) and user else "(no user name)"
    found = pod.get("metadata")
    metadata: dict[str, Any] = found if isinstance(found, dict) else {}
    found = metadata.get("annotations")
    annotations: dict[str, Any] = found if isinstance(found, dict) else {}
    if annotations.get(ANNOTATION_ADMIN_DEVICE_ACCESS) == name:
        return pod
    return {**pod, "metadata": {**metadata, "annotations": {**annotations, ANNOTATION_ADMIN_DEVICE_ACCESS: name}}}
