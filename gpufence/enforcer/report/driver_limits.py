"""The driver's per-cgroup memory limits, read for each GPU container every poll (the I/O around
``memory_mechanism``, which decides).

Each poll, for every configured container with GPU processes, the container's cgroup (from the
attribution: the cgroup is the container's identity) is turned into NVML's namespace and
``nvmlDeviceGetMemoryLimits_v1`` is asked on each device where the container runs: one call per
(container, device), none on a driver without the call. The answers give the core the driver's
``currentUsed`` as usage, and the reporter the mechanism that holds each share: a
``memory_enforcement`` log line whenever it changes (the first at the container's first resolution),
the gauge ``gpufence_container_memory_enforcement{mechanism}``, the ``/healthz`` detail and, when
the container's environment asks for a driver limit that the driver does not show, a
``GPUDriverMemoryLimitMissing`` Event (once per container cgroup).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpufence.contract import EnforcerConfig
from gpufence.enforcer.decide.memory_mechanism import (
    HINT_VARIABLES,
    Discrepancy,
    EnvHints,
    MemoryEnforcement,
    cgroup_namespace,
    decide,
    driver_usage,
    hidden_by_cgroup_namespace,
)
from gpufence.enforcer.decide.rules import ContainerDeviceUsage
from gpufence.enforcer.observe.attribution import Attribution
from gpufence.enforcer.observe.nvml import DriverLimit, DriverLimitState, NvmlClient, NvmlUnavailable
from gpufence.enforcer.observe.procfs import read_environ
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import EventRecorder
from gpufence.enforcer.report.health import Health
from gpufence.enforcer.report.metrics import EnforcerMetrics

_HINTS_MAX = 1024
_NO_CALL = DriverLimit(DriverLimitState.NO_CALL, error="FUNCTION_NOT_FOUND")


@dataclass
class DriverReading:
    """One poll's answers: (container, device) -> namespace and the driver's limit there."""

    namespaces: dict[tuple[str, int], str] = field(default_factory=dict)
    limits: dict[tuple[str, int], DriverLimit] = field(default_factory=dict)
    cgroups: dict[str, str | None] = field(default_factory=dict)  # container -> namespace (None: none usable)
    pids: dict[str, int] = field(default_factory=dict)  # container -> one of its processes (for its environment)
    failed: bool = False  # NVML did not answer (hung, closed): nothing to report this poll
    hidden: set[str] = field(default_factory=set)  # containers whose host cgroup path our cgroup namespace hides

    def usage(self) -> dict[tuple[str, int], int]:
        return driver_usage(self.namespaces, self.limits)


class DriverLimits:
    def __init__(
        self, log: DecisionLog, metrics: EnforcerMetrics, events: EventRecorder, *, proc_root: str = "/proc",
        health: Health | None = None,
    ) -> None:
        self._log = log
        self._health = health
        self._metrics = metrics
        self._events = events
        self._proc_root = proc_root
        self._reported: dict[str, MemoryEnforcement] = {}
        self._hints: dict[tuple[str, str | None], EnvHints] = {}
        self._missing_reported: set[tuple[str, str | None]] = set()
        self._discrepancies_reported: set[tuple[str, int]] = set()

    def read(
        self, client: NvmlClient, attribution: Attribution, config: EnforcerConfig,
        call: Callable[[str, Callable[[], dict[tuple[str, int], DriverLimit]]], dict[tuple[str, int], DriverLimit]],
    ) -> DriverReading:
        """Ask the driver (through ``call``, the loop's deadline runner) about each container's cgroup."""
        reading = DriverReading()
        many: set[str] = set()
        for p in attribution.processes:
            if p.container is None or p.container not in config.containers:
                continue
            namespace = cgroup_namespace(p.cgroup)
            if hidden_by_cgroup_namespace(p.cgroup):
                reading.hidden.add(p.container)
            reading.pids.setdefault(p.container, p.pid)
            if p.container in reading.cgroups and reading.cgroups[p.container] != namespace:
                many.add(p.container)  # several cgroups under one name: no single cgroup to ask about
            reading.cgroups.setdefault(p.container, namespace)
            if namespace is not None:
                reading.namespaces[(p.container, p.device_index)] = namespace
        for container in many:
            reading.cgroups[container] = None
        reading.namespaces = {k: v for k, v in reading.namespaces.items() if k[0] not in many}
        wanted = dict(reading.namespaces)
        if wanted and not client.has_memory_limits:
            # An older driver: every answer is known without a call (nor the worker-thread handoff).
            reading.limits = {key: _NO_CALL for key in wanted}
        elif wanted:
            try:
                reading.limits = call(
                    "nvmlDeviceGetMemoryLimits",
                    lambda: {key: client.memory_limit(key[1], ns) for key, ns in wanted.items()},
                )
            except NvmlUnavailable:
                # The next poll's sample finds NVML gone (or the call still hung) and says so.
                reading.failed = True
        return reading

    def report(
        self, reading: DriverReading, usages: tuple[ContainerDeviceUsage, ...], discrepancies: tuple[Discrepancy, ...]
    ) -> None:
        shares: dict[str, dict[int, int | None]] = {}
        for u in usages if not reading.failed else ():
            if u.container in reading.cgroups:
                shares.setdefault(u.container, {})[u.device_index] = u.limit_bytes
        for container, devices in shares.items():
            namespace = reading.cgroups[container]
            limits = {d: reading.limits[(container, d)] for d in devices if (container, d) in reading.limits}
            hints = self._env_hints(container, namespace, reading.pids[container])
            decision = decide(namespace, devices, limits, hints, hidden=container in reading.hidden)
            self._publish(container, namespace, decision, limits)
        for d in discrepancies:
            key = (d.container, d.device_index)
            if key in self._discrepancies_reported:
                continue
            self._discrepancies_reported.add(key)
            self._log.warning(
                "driver_usage_discrepancy", container=d.container, gpu=d.device_index,
                driver_used_bytes=d.driver_bytes, process_sum_bytes=d.process_bytes,
                reason="the driver's currentUsed for the container's cgroup (now its usage) differs from the sum "
                "over the processes the enforcer attributes to it: processes it cannot see, or memory not "
                "charged to a process",
            )

    def _publish(
        self, container: str, namespace: str | None, decision: MemoryEnforcement, limits: Mapping[int, DriverLimit]
    ) -> None:
        if self._reported.get(container) != decision:
            self._reported[container] = decision
            self._metrics.set_memory_enforcement(container, decision.mechanism.value)
            if self._health is not None:
                self._health.memory_enforcement(container, decision.mechanism.value)
            self._log.info(
                "memory_enforcement", container=container, mechanism=decision.mechanism.value,
                limit_bytes=decision.limit_bytes, why=decision.why, cgroup=namespace,
                driver={str(d): {"state": x.state.value, "hard_bytes": x.hard_bytes, "soft_bytes": x.soft_bytes,
                                 "current_used_bytes": x.current_used_bytes, "error": x.error}
                        for d, x in sorted(limits.items())},
                backstop="polling",
            )
        key = (container, namespace)
        if decision.driver_limit_missing and key not in self._missing_reported:
            self._missing_reported.add(key)
            message = (
                f"container {container}: the pod asks for a driver memory limit (NVIDIA_GPU_MEMORY_LIMIT) but the "
                f"driver shows none on its cgroup; {decision.why}"
            )
            self._log.warning("driver_memory_limit_missing", container=container, cgroup=namespace, why=decision.why)
            self._events.record("GPUDriverMemoryLimitMissing", message, action="Polling")

    def _env_hints(self, container: str, namespace: str | None, pid: int) -> EnvHints:
        """Read once per container cgroup: a container's environment is fixed when it starts."""
        key = (container, namespace)
        hints = self._hints.get(key)
        if hints is None:
            if len(self._hints) >= _HINTS_MAX:
                self._hints.clear()
            hints = self._hints[key] = EnvHints.from_environ(read_environ(pid, HINT_VARIABLES, self._proc_root))
        return hints
