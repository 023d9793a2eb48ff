"""Which pod and container each GPU process of the node is, by its host cgroup (pure).

A process cannot leave its cgroup, and the kubelet names a container's cgroup after its pod's UID
and the runtime after the container's ID, so ``/proc/<pid>/cgroup`` read on the host (world-readable,
no ptrace right needed) is a process's pod and container whatever the process says or drops. The
forms the kubelet and the runtimes write, under either cgroup version:

* cgroupfs driver: ``/kubepods[/burstable|/besteffort]/pod<uid>/<container id>``;
* systemd driver: ``/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid with _>.slice/
  <runtime>-<container id>.scope`` (``cri-containerd-``, ``crio-``, ``docker-``), where systemd
  writes the UID's dashes as underscores;
* either under a prefix, and a systemd slice name with the kubelet's cgroup root in front (kind's
  ``/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable-pod<uid>.slice/...``).

cgroup v1 lists one line per hierarchy (``<id>:<controllers>:<path>``); cgroup v2 has the one line
``0::<path>``; a hybrid host has both (the v2 line then says ``/`` for every process). A process in
no pod (the host's, a system daemon's) has no ``pod<uid>`` segment; one in the pod's own cgroup (no
container segment) or in the sandbox has a pod and no container ID the pod's status names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# The v1 hierarchies a container's cgroup is read from, best first: the freezer's is the one the
# guardian acts on; every kubelet-managed hierarchy has the same path below the root.
V1_PREFERENCE = ("freezer", "pids", "cpu", "cpu,cpuacct", "memory", "name=systemd")

_POD_CGROUPFS = re.compile(r"^pod([0-9a-fA-F-]{8,64})$")
# A kubelet with a cgroup root of its own (kind's "/kubelet") prefixes every slice with it.
_POD_SYSTEMD = re.compile(r"^(?:[a-z0-9.]+-)*kubepods(?:-[a-z]+)?-pod([0-9a-fA-F_]{8,64})\.slice$")
_CONTAINER_SCOPE = re.compile(r"^(?:cri-containerd|crio|docker|containerd)-([0-9a-f]{12,128})\.scope$")
_CONTAINER_PLAIN = re.compile(r"^([0-9a-f]{12,128})$")


@dataclass(frozen=True)
class CgroupFile:
    """``/proc/<pid>/cgroup`` parsed: the v2 path (None: no ``0::`` line) and each v1 hierarchy's."""

    unified: str | None
    v1: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def path(self) -> str | None:
        """The path that names the container: the v2 one unless it is the root (a hybrid host, where
        the controllers are v1's), else the first v1 hierarchy in ``V1_PREFERENCE`` that names one,
        else any v1 path below the root."""
        if self.unified not in (None, "/"):
            return self.unified
        for name in V1_PREFERENCE:
            found = self.v1.get(name)
            if found and found != "/":
                return found
        for _, found in sorted(self.v1.items()):
            if found != "/":
                return found
        return self.unified


@dataclass(frozen=True)
class Placement:
    """Where a process is: its pod's UID and its container's ID (each None when the path names none),
    and the cgroup paths the guardian acts on."""

    pod_uid: str | None
    container_id: str | None
    path: str | None  # the path that named them (v2, or the preferred v1 hierarchy's)
    unified: str | None = None  # the v2 path (cgroup.freeze, cgroup.procs under the v2 mount)
    freezer: str | None = None  # the v1 freezer hierarchy's path (freezer.state)

    @property
    def in_pod(self) -> bool:
        return self.pod_uid is not None


HOST = Placement(None, None, None)


def parse_cgroup_file(text: str) -> CgroupFile:
    """The content of ``/proc/<pid>/cgroup``; malformed lines are skipped."""
    unified = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified = path
        elif controllers:
            v1[controllers] = path
            for controller in controllers.split(","):
                v1.setdefault(controller, path)
    return CgroupFile(unified, MappingProxyType(v1))


def pod_and_container(path: str) -> tuple[str | None, str | None]:
    """(pod UID, container ID) named by a cgroup path; (None, None) outside every pod.

    The pod segment is the last one that names a pod (a node nested in another's container has
    its host's pod above); the container is the segment right below it, if that names one."""
    segments = [s for s in path.split("/") if s]
    for index in range(len(segments) - 1, -1, -1):
        uid = _pod_uid(segments[index])
        if uid is None:
            continue
        below = segments[index + 1] if index + 1 < len(segments) else None
        return uid, (_container_id(below) if below is not None else None)
    return None, None


def placement(text: str | None) -> Placement:
    """Where the process whose ``/proc/<pid>/cgroup`` reads ``text`` is (``HOST`` when unreadable)."""
    if text is None:
        return HOST
    parsed = parse_cgroup_file(text)
    path = parsed.path()
    if path is None:
        return HOST
    uid, container = pod_and_container(path)
    freezer = parsed.v1.get("freezer")
    if container is not None:
        # A cgroup the container made below its own is still the container: act on all of it.
        path, unified, freezer = (container_root(p) for p in (path, parsed.unified, freezer))
        return Placement(uid, container, path, unified, freezer)
    return Placement(uid, container, path, parsed.unified, freezer)


def container_root(path: str | None) -> str | None:
    """``path`` cut after the segment that names its pod's container (unchanged when none does)."""
    if path is None:
        return None
    segments = path.split("/")
    for index in range(len(segments) - 1, 0, -1):
        if _pod_uid(segments[index - 1]) is not None and _container_id(segments[index]) is not None:
            return "/".join(segments[: index + 1])
    return path


def _pod_uid(segment: str) -> str | None:
    match = _POD_CGROUPFS.match(segment)
    if match:
        return match.group(1).lower()
    match = _POD_SYSTEMD.match(segment)
    if match:
        return match.group(1).replace("_", "-").lower()
    return None


def _container_id(segment: str) -> str | None:
    match = _CONTAINER_SCOPE.match(segment) or _CONTAINER_PLAIN.match(segment)
    return match.group(1) if match else None
