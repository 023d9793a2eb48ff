"""Prometheus metrics of the enforcer, on a registry of its own (docs/internals/architecture.md, "Metrics").

Label names are joinable with DCGM-exporter: ``namespace``, ``pod``, ``container``, ``UUID``,
``gpu`` (the device index as a string). Per-container gauges are replaced wholesale each poll
(``set_container_usage``) so a container or device that disappears does not leave a stale series.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpufence import metric_names as names

if TYPE_CHECKING:
    from gpufence.enforcer.decide.rules import PodDeviceUsage

# The (action, resource) pairs the loop can count for a container. Created at zero per configured
# container so that the first kill is an increase from 0 to 1: a counter series that appears at 1
# has no earlier sample, and ``increase()`` over it is 0, so the kill alert would never fire.
ACTION_KINDS = (
    ("sigterm", "memory"), ("sigkill", "memory"), ("audit", "memory"),
    ("throttle_start", "compute"), ("throttle_stop", "compute"), ("audit", "compute"),
    ("sigterm", "gpus"), ("sigkill", "gpus"), ("audit", "gpus"),
    # A throttled process seen running while held stopped: terminated with its container.
    ("throttle_evaded", "compute"), ("sigterm", "compute"), ("sigkill", "compute"),
    # A throttle that cannot hold the share (work running while the process is stopped): terminated too.
    ("throttle_ineffective", "compute"),
)


@dataclass(frozen=True)
class UsageSample:
    """One (container, device) row for the per-device gauges."""

    container: str
    uuid: str
    gpu: int
    used_bytes: int
    limit_bytes: int | None
    sm_utilization: float | None  # 0-1, None when the driver does not report it
    limit_from_percent: bool = False  # the limit is the percentage part of the share


# Each metric's help text, as /metrics exports it (docs/monitoring.md's reference is generated from it).
_HELP = {
    names.CONTAINER_MEMORY_USED: "GPU memory used by the container's processes on the device",
    names.CONTAINER_MEMORY_LIMIT: "The container's GPU memory share on the device",
    names.CONTAINER_LIMIT_FROM_PERCENT: (
        "1 when the memory limit on the device is the percentage part of the share, 0 when it is "
        "the bytes (a share in two units, a pod's share and a namespace ceiling: the smaller applies)"
    ),
    names.CONTAINER_SM_UTILIZATION: "SM utilisation of the container's processes on the device (0-1)",
    names.CONTAINER_COMPUTE_SHARE: "The container's compute share (0-1)",
    names.CONTAINER_THROTTLED: "1 while the container is duty-cycled with SIGSTOP/SIGCONT",
    names.CONTAINER_MEMORY_ENFORCEMENT: (
        "1 for the mechanism that holds the container's GPU memory share: driver (NVML's per-cgroup hard "
        "limit), mps, preload, or polling (the enforcer alone); polling is the backstop in every case"
    ),
    names.ENFORCEMENT_ACTIONS: "Enforcement actions taken (or, in audit mode, that would have been taken)",
    names.POD_MEMORY_USED: "GPU memory used by all the pod's GPU processes on the device, attributed or not",
    names.POD_MEMORY_UNATTRIBUTED: "GPU memory used by the pod's processes no container can be charged for",
    names.POD_MEMORY_BUDGET: "The pod's budget on the device: the sum of its GPU containers' memory shares",
    names.POD_UNATTRIBUTED_PROCESSES: "The pod's GPU processes on the device that no container can be charged for",
    names.DEVICE_MIG_UNENFORCED: (
        "1 for a device in MIG mode: left to MIG's hardware isolation, not enforced by gpufence"
    ),
    names.UNINSPECTABLE_PROCESSES: (
        "GPU processes NVML lists whose /proc/<pid>/fd the enforcer may not read: charged to the pod's budget"
    ),
    names.ENFORCER_PAUSED: (
        "Seconds the enforcer did not run at all (held from outside: SIGSTOP, a freezer), as its "
        "heartbeat thread saw once it ran again"
    ),
    names.POLL_DURATION: "Duration of one poll: NVML sample, attribution, policy and actions",
    names.POLL_INTERVAL: "The interval to the next poll: the configured one, or shorter while close to a limit",
    names.LAST_SUCCESSFUL_POLL: "Unix time of the last poll that sampled NVML successfully",
    names.NVML_UP: "1 while NVML is initialised and answering",
    names.NVML_ERRORS: "NVML calls that failed",
    names.POLL_ERRORS: "Polls that failed with an unexpected exception",
}
_POLL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class EnforcerMetrics:
    def __init__(self, namespace: str, pod: str) -> None:
        self.namespace = namespace
        self.pod = pod
        self.registry = r = CollectorRegistry(auto_describe=True)
        device, container, pod_device = names.DEVICE_LABELS, names.CONTAINER_LABELS, names.POD_DEVICE_LABELS
        # Per container and device.
        self.memory_used = _gauge(r, names.CONTAINER_MEMORY_USED, device)
        self.memory_limit = _gauge(r, names.CONTAINER_MEMORY_LIMIT, device)
        self.limit_from_percent = _gauge(r, names.CONTAINER_LIMIT_FROM_PERCENT, device)
        self.sm_utilization = _gauge(r, names.CONTAINER_SM_UTILIZATION, device)
        # Per container.
        self.compute_share = _gauge(r, names.CONTAINER_COMPUTE_SHARE, container)
        self.throttled = _gauge(r, names.CONTAINER_THROTTLED, container)
        self.memory_enforcement = _gauge(r, names.CONTAINER_MEMORY_ENFORCEMENT, (*container, "mechanism"))
        self.actions = _counter(r, names.ENFORCEMENT_ACTIONS, (*container, "action", "resource"))
        # Per pod and device.
        self.pod_memory_used = _gauge(r, names.POD_MEMORY_USED, pod_device)
        self.pod_memory_unattributed = _gauge(r, names.POD_MEMORY_UNATTRIBUTED, pod_device)
        self.pod_memory_budget = _gauge(r, names.POD_MEMORY_BUDGET, pod_device)
        self.unattributed_processes = _gauge(r, names.POD_UNATTRIBUTED_PROCESSES, pod_device)
        self.mig_unenforced = _gauge(r, names.DEVICE_MIG_UNENFORCED, pod_device)
        # The enforcer itself.
        self.uninspectable = _gauge(r, names.UNINSPECTABLE_PROCESSES)
        self.paused = _counter(r, names.ENFORCER_PAUSED)
        self.poll_duration = Histogram(
            names.POLL_DURATION, _HELP[names.POLL_DURATION], buckets=_POLL_BUCKETS, registry=r
        )
        self.poll_interval = _gauge(r, names.POLL_INTERVAL)
        self.last_successful_poll = _gauge(r, names.LAST_SUCCESSFUL_POLL)
        self.nvml_up = _gauge(r, names.NVML_UP)
        self.nvml_errors = _counter(r, names.NVML_ERRORS, ("function", "error"))
        self.poll_errors = _counter(r, names.POLL_ERRORS)
        self.nvml_up.set(0)
        self._device_series: set[tuple[str, str, str]] = set()
        self._pod_series: set[tuple[str, str]] = set()
        # The rows last written: at rest every poll brings the same ones, and rewriting each series
        # was most of a quiet poll's metric work.
        self._container_rows: tuple[UsageSample, ...] = ()
        self._pod_rows: tuple[PodDeviceUsage, ...] = ()
        self._enforcement_series: dict[str, tuple[tuple[str, ...], ...]] = {}

    # -- helpers -----------------------------------------------------------------------------

    def declare_containers(self, containers: Iterable[str]) -> None:
        """Export every action counter of these containers at zero (see ACTION_KINDS).

        All pairs for every container, not only those its current shares allow: a config reload
        may add a share, and a zero series costs nothing.
        """
        for container in containers:
            for action, resource in ACTION_KINDS:
                self.actions.labels(self.namespace, self.pod, container, action, resource)

    def action(self, container: str, action: str, resource: str) -> None:
        self.actions.labels(self.namespace, self.pod, container, action, resource).inc()

    def nvml_error(self, function: str, error: str) -> None:
        self.nvml_errors.labels(function, error).inc()

    def set_compute_shares(self, shares: dict[str, float | None]) -> None:
        self.compute_share.clear()
        for container, share in shares.items():
            if share is not None:
                self.compute_share.labels(self.namespace, self.pod, container).set(share)

    def set_throttled(self, container: str, on: bool) -> None:
        self.throttled.labels(self.namespace, self.pod, container).set(1 if on else 0)

    def set_container_usage(self, rows: Iterable[UsageSample]) -> None:
        rows = tuple(rows)
        if rows == self._container_rows:
            return
        self._container_rows = rows
        seen: set[tuple[str, str, str]] = set()
        for row in rows:
            key = (row.container, row.uuid, str(row.gpu))
            seen.add(key)
            labels = (self.namespace, self.pod, *key)
            self.memory_used.labels(*labels).set(row.used_bytes)
            if row.limit_bytes is not None:
                self.memory_limit.labels(*labels).set(row.limit_bytes)
                self.limit_from_percent.labels(*labels).set(1 if row.limit_from_percent else 0)
            else:
                _remove(self.memory_limit, labels)
                _remove(self.limit_from_percent, labels)
            if row.sm_utilization is not None:
                self.sm_utilization.labels(*labels).set(row.sm_utilization)
            else:
                _remove(self.sm_utilization, labels)
        for key in self._device_series - seen:
            labels = (self.namespace, self.pod, *key)
            for gauge in (self.memory_used, self.memory_limit, self.limit_from_percent, self.sm_utilization):
                _remove(gauge, labels)
        self._device_series = seen

    def set_memory_enforcement(self, container: str, mechanism: str) -> None:
        """One series per container: the mechanism in force (the previous one's series is removed)."""
        for labels in list(self._enforcement_series.get(container, ())):
            _remove(self.memory_enforcement, labels)
        labels = (self.namespace, self.pod, container, mechanism)
        self.memory_enforcement.labels(*labels).set(1)
        self._enforcement_series[container] = (labels,)

    def set_mig_unenforced(self, uuid: str, gpu: int) -> None:
        self.mig_unenforced.labels(self.namespace, self.pod, uuid, str(gpu)).set(1)

    def set_pod_usage(self, rows: Iterable[PodDeviceUsage]) -> None:
        """Per device: the pod's total, unattributed and budget (replaced wholesale, as above)."""
        rows = tuple(rows)
        if rows == self._pod_rows:
            return
        self._pod_rows = rows
        seen: set[tuple[str, str]] = set()
        for row in rows:
            key = (row.device_uuid, str(row.device_index))
            seen.add(key)
            labels = (self.namespace, self.pod, *key)
            self.pod_memory_used.labels(*labels).set(row.used_bytes)
            self.pod_memory_unattributed.labels(*labels).set(row.unattributed_bytes)
            self.unattributed_processes.labels(*labels).set(len(row.unattributed))
            if row.budget_bytes is not None:
                self.pod_memory_budget.labels(*labels).set(row.budget_bytes)
            else:
                _remove(self.pod_memory_budget, labels)
        for key in self._pod_series - seen:
            labels = (self.namespace, self.pod, *key)
            for gauge in (
                self.pod_memory_used, self.pod_memory_unattributed, self.pod_memory_budget, self.unattributed_processes
            ):
                _remove(gauge, labels)
        self._pod_series = seen

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _remove(gauge: Gauge, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):
        gauge.remove(*labels)


def _gauge(registry: CollectorRegistry, name: str, labels: tuple[str, ...] = ()) -> Gauge:
    return Gauge(name, _HELP[name], labels, registry=registry)


def _counter(registry: CollectorRegistry, name: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(name, _HELP[name], labels, registry=registry)
