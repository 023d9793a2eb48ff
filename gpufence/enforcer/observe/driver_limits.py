"""The driver's per-cgroup memory limits, read for each GPU container every poll.

Each poll, for every configured container with GPU processes, the container's cgroup (from the
attribution: the cgroup is the container's identity) is turned into NVML's namespace and
``nvmlDeviceGetMemoryLimits_v1`` is asked on each device where the container runs: one call per
(container, device), none on a driver without the call. The container's environment variables
that say which limits were asked for (``facts.HINT_VARIABLES``) are read once per container
cgroup: a container's environment is fixed when it starts. What it found is a
``facts.DriverReading``; ``decide/memory_mechanism`` decides what holds each share, and
``report/driver_limits`` reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpufence.contract import EnforcerConfig
from gpufence.enforcer.facts import (
    HINT_VARIABLES,
    Attribution,
    DriverLimit,
    DriverLimitState,
    DriverReading,
    NvmlUnavailable,
)
from gpufence.enforcer.observe.nvml import NvmlClient
from gpufence.enforcer.observe.procfs import read_environ

CGROUP_ROOT = "/sys/fs/cgroup"
_ENVIRON_MAX = 1024
_NO_CALL = DriverLimit(DriverLimitState.NO_CALL, error="FUNCTION_NOT_FOUND")

Call = Callable[[str, Callable[[], dict[tuple[str, int], DriverLimit]]], dict[tuple[str, int], DriverLimit]]


def cgroup_namespace(proc_cgroup_text: str | None) -> str | None:
    """The NVML namespace of a process from its /proc/<pid>/cgroup text: ``/sys/fs/cgroup/<path>``
    from the unified hierarchy's ``0::/<path>`` line, as the toolkit's hook builds it. None without
    such a line, or for the root (a cgroup v1 host shows ``0::/`` for every process): no cgroup the
    driver could limit for this container alone. None too for a path with ``..`` components: the
    kernel writes a process outside the reader's cgroup namespace that way (cgroup_namespaces(7)),
    so a sidecar with a private cgroup namespace cannot tell the host path the driver keys on."""
    for line in (proc_cgroup_text or "").splitlines():
        if line.startswith("0::/"):
            path = line[3:].rstrip("/")
            if not path or ".." in path.split("/"):
                return None
            return CGROUP_ROOT + path
    return None


def hidden_by_cgroup_namespace(proc_cgroup_text: str | None) -> bool:
    """Whether the unified-hierarchy path is written relative to the reader's cgroup namespace with
    ``..`` (the container's cgroup is outside the sidecar's): its host path, and so the driver's
    answer, cannot be known from here; that says nothing about whether a limit is set."""
    for line in (proc_cgroup_text or "").splitlines():
        if line.startswith("0::/"):
            return ".." in line[3:].split("/")
    return False


@dataclass(frozen=True)
class ContainerCgroups:
    """Where to ask the driver: each configured container's cgroup, from its GPU processes."""

    namespaces: Mapping[tuple[str, int], str]  # (container, device) -> its own namespace
    cgroups: Mapping[str, str | None]  # container -> namespace (None: none usable, or several)
    pids: Mapping[str, int]  # container -> one of its processes (for its environment)
    hidden: frozenset[str]  # containers whose host cgroup path our cgroup namespace hides


def container_cgroups(attribution: Attribution, config: EnforcerConfig) -> ContainerCgroups:
    """The configured containers' cgroups as NVML's namespaces (pure). A name held by several
    cgroups has no single cgroup to ask about: its namespace is None and it is asked nothing."""
    namespaces: dict[tuple[str, int], str] = {}
    cgroups: dict[str, str | None] = {}
    pids: dict[str, int] = {}
    hidden: set[str] = set()
    many: set[str] = set()
    for p in attribution.processes:
        if p.container is None or p.container not in config.containers:
            continue
        namespace = cgroup_namespace(p.cgroup)
        if hidden_by_cgroup_namespace(p.cgroup):
            hidden.add(p.container)
        pids.setdefault(p.container, p.pid)
        if p.container in cgroups and cgroups[p.container] != namespace:
            many.add(p.container)
        cgroups.setdefault(p.container, namespace)
        if namespace is not None:
            namespaces[(p.container, p.device_index)] = namespace
    return ContainerCgroups(
        namespaces={k: v for k, v in namespaces.items() if k[0] not in many},
        cgroups={c: None if c in many else ns for c, ns in cgroups.items()},
        pids=pids,
        hidden=frozenset(hidden),
    )


class DriverLimitReader:
    """Asks the driver about each container's cgroup every poll; reads each container's
    environment once per cgroup (bounded)."""

    def __init__(self, *, proc_root: str = "/proc") -> None:
        self._proc_root = proc_root
        self._environ: dict[tuple[str, str | None], Mapping[str, str]] = {}

    def read(
        self, client: NvmlClient, attribution: Attribution, config: EnforcerConfig, call: Call
    ) -> DriverReading:
        """The driver's answers (through ``call``, the loop's deadline runner) for this poll."""
        where = container_cgroups(attribution, config)
        environ = {c: self._environ_of(c, where.cgroups[c], pid) for c, pid in where.pids.items()}
        try:
            limits = self._limits(client, where.namespaces, call)
        except NvmlUnavailable:
            # The next poll's sample finds NVML gone (or the call still hung) and says so.
            return DriverReading(where.namespaces, {}, where.cgroups, environ, failed=True, hidden=where.hidden)
        return DriverReading(where.namespaces, limits, where.cgroups, environ, hidden=where.hidden)

    @staticmethod
    def _limits(
        client: NvmlClient, wanted: Mapping[tuple[str, int], str], call: Call
    ) -> Mapping[tuple[str, int], DriverLimit]:
        if not wanted:
            return {}
        if not client.has_memory_limits:
            # An older driver: every answer is known without a call (nor the worker-thread handoff).
            return {key: _NO_CALL for key in wanted}
        return call(
            "nvmlDeviceGetMemoryLimits", lambda: {key: client.memory_limit(key[1], ns) for key, ns in wanted.items()}
        )

    def _environ_of(self, container: str, namespace: str | None, pid: int) -> Mapping[str, str]:
        """Read once per container cgroup: a container's environment is fixed when it starts."""
        key = (container, namespace)
        found = self._environ.get(key)
        if found is None:
            if len(self._environ) >= _ENVIRON_MAX:
                self._environ.clear()
            found = self._environ[key] = read_environ(pid, HINT_VARIABLES, self._proc_root)
        return found
