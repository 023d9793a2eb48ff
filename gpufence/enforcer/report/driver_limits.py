"""Which mechanism holds each GPU container's memory share, reported (``decide/memory_mechanism``
decides it from what ``observe/driver_limits`` read).

A ``memory_enforcement`` log line whenever a container's mechanism changes (the first at the
container's first resolution), the gauge ``gpufence_container_memory_enforcement{mechanism}``, the
``/healthz`` detail and, when the container's environment asks for a driver limit that the driver
does not show, a ``GPUDriverMemoryLimitMissing`` Event (once per container cgroup); a difference
between the driver's usage and the per-process sum once per (container, device).
"""

from __future__ import annotations

from gpufence.enforcer.decide.memory_mechanism import ContainerEnforcement, Discrepancy, MemoryEnforcement
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import EventRecorder
from gpufence.enforcer.report.health import Health
from gpufence.enforcer.report.metrics import EnforcerMetrics


class DriverLimits:
    def __init__(
        self, log: DecisionLog, metrics: EnforcerMetrics, events: EventRecorder, *, health: Health | None = None,
    ) -> None:
        self._log = log
        self._health = health
        self._metrics = metrics
        self._events = events
        self._reported: dict[str, MemoryEnforcement] = {}
        self._missing_reported: set[tuple[str, str | None]] = set()
        self._discrepancies_reported: set[tuple[str, int]] = set()

    def report(self, enforcements: tuple[ContainerEnforcement, ...], discrepancies: tuple[Discrepancy, ...]) -> None:
        for found in enforcements:
            self._publish(found)
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

    def _publish(self, found: ContainerEnforcement) -> None:
        container, namespace, decision, limits = found.container, found.namespace, found.enforcement, found.limits
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
