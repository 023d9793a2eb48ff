"""What the guardian says: JSON log lines (the enforcer's ``DecisionLog``, gpufence/logs.py's format),
Prometheus metrics on a registry of its own (names in gpufence/metric_names.py), and Events on the
pods it acts on, posted as its own ServiceAccount (the enforcer's ``EventRecorder`` with the
component ``gpufence-node``, so an Event from the guardian is told apart from one a tenant can mint
for the sidecar's ServiceAccount by who posted it, which the API server records).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter as Tally
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpufence import metric_names as names
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import EventRecorder, PodRef
from gpufence.enforcer.report.kube_events_api import CredentialsUnavailable, EventsApi
from gpufence.node.decide import CensusEntry, Standing, ThrottleTarget

COMPONENT = "gpufence-node"
ACTION_REASONS = (
    ("sigterm", "unaccounted"), ("sigkill", "unaccounted"),
    ("sigkill", "memory_over_share"), ("sigkill", "gpus_over_request"),
    ("sigterm", "throttle_ineffective"), ("sigkill", "throttle_ineffective"),
    # DRA (gpufence.node.reserved): a share lowered to the claim's allocation, a shared claim's budget
    ("sigterm", "memory_over_share"), ("sigterm", "claim_over_capacity"), ("sigkill", "claim_over_capacity"),
    # a pod of a namespace gpufence does not govern, where other-namespace-gpu-processes is terminate
    ("sigterm", "other_namespace"), ("sigkill", "other_namespace"),
)
_MAX_RECORDERS = 256


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.processes = Gauge(names.NODE_GPU_PROCESSES, "GPU processes on the node's GPUs, by standing",
                               ["standing"], registry=r)
        self.unaccounted = Gauge(names.NODE_UNACCOUNTED_PROCESSES,
                                 "GPU processes of opted-in namespaces that hold no admitted GPU share",
                                 ["namespace", "pod", "container"], registry=r)
        self.unaccounted_memory = Gauge(names.NODE_UNACCOUNTED_MEMORY,
                                        "GPU memory held by those processes (what NVML reports for them)",
                                        ["namespace", "pod", "container"], registry=r)
        self.admin_allowed = Gauge(names.NODE_ADMIN_ALLOWED_PROCESSES,
                                   "GPU processes of opted-in namespaces that hold no admitted GPU share where the "
                                   "admin's policy allowed the pod device access (reported, not acted on)",
                                   ["namespace", "pod", "container"], registry=r)
        self.admin_allowed_memory = Gauge(names.NODE_ADMIN_ALLOWED_MEMORY,
                                          "GPU memory held by the GPU processes without a share that the admin's "
                                          "policy allowed (what NVML reports for them)",
                                          ["namespace", "pod", "container"], registry=r)
        # Its help (docs/monitoring.md is generated from it) predates the actions without a signal:
        # audit, report (other-namespace-gpu-processes, host-gpu-processes) and allow (admin_allowed).
        self.actions = Counter(names.NODE_ACTIONS, "Signals the guardian sent to containers, by reason",
                               ["action", "reason"], registry=r)
        self.throttled = Gauge(names.NODE_THROTTLED, "Run fraction the guardian's freezer holds a container to",
                               list(names.CONTAINER_LABELS), registry=r)
        self.poll_duration = Histogram(names.NODE_POLL_DURATION, "Duration of one guardian poll", registry=r,
                                       buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.last_poll = Gauge(names.NODE_LAST_SUCCESSFUL_POLL, "Unix time of the last completed poll", registry=r)
        self.nvml_up = Gauge(names.NODE_NVML_UP, "1 when NVML answers", registry=r)
        self.pods_synced = Gauge(names.NODE_PODS_SYNCED, "1 when the pods of the node are listed", registry=r)
        self.poll_errors = Counter(names.NODE_POLL_ERRORS, "Polls that failed", registry=r)
        for standing in Standing:
            self.processes.labels(standing.value)
        for action, reason in ACTION_REASONS:
            self.actions.labels(action, reason)

    def census(self, census: Iterable[CensusEntry]) -> None:
        entries = list(census)
        counts = Tally(e.standing for e in entries)
        for standing in Standing:
            self.processes.labels(standing.value).set(counts.get(standing, 0))
        _per_container(entries, Standing.UNACCOUNTED, self.unaccounted, self.unaccounted_memory)
        _per_container(entries, Standing.ADMIN_ALLOWED, self.admin_allowed, self.admin_allowed_memory)

    def throttle(self, targets: Iterable[ThrottleTarget]) -> None:
        self.throttled.clear()
        for t in targets:
            self.throttled.labels(t.pod.namespace, t.pod.name, t.container).set(t.fraction)


class _GuardianRecorder(EventRecorder):
    def event_body(self, reason: str, message: str, event_type: str, action: str, when: datetime) -> dict[str, Any]:
        body = super().event_body(reason, message, event_type, action, when)
        body["source"] = {"component": COMPONENT, "host": body["source"]["host"]}
        body["reportingComponent"] = COMPONENT
        return body


class NodeEvents:
    """Events on the pods the guardian acts on: one recorder (a queue and a thread) per such pod."""

    def __init__(self, log: DecisionLog, api: EventsApi | None) -> None:
        self._log = log
        self._api = api
        self._recorders: dict[str, EventRecorder] = {}

    @classmethod
    def from_environment(cls, log: DecisionLog) -> NodeEvents:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            log.info("events_disabled", reason="not running in a Kubernetes cluster")
            return cls(log, None)
        try:
            api = EventsApi.in_cluster(host, os.environ.get("KUBERNETES_SERVICE_PORT") or "443")
        except (CredentialsUnavailable, ValueError) as exc:
            log.info("events_disabled", reason=f"no in-cluster credentials: {exc}")
            return cls(log, None)
        log.info("events_enabled", api=api.base_url, component=COMPONENT)
        return cls(log, api)

    def record(self, namespace: str | None, pod: str | None, uid: str | None, reason: str, message: str,
               event_type: str = "Warning") -> None:
        if self._api is None or not namespace or not pod:
            return
        key = uid or f"{namespace}/{pod}"
        recorder = self._recorders.get(key)
        if recorder is None:
            if len(self._recorders) >= _MAX_RECORDERS:
                oldest = next(iter(self._recorders))
                self._recorders.pop(oldest).close(timeout=0.5)
            recorder = _GuardianRecorder(self._log, PodRef(namespace, pod, uid), self._api)
            self._recorders[key] = recorder
        recorder.record(reason, message, event_type=event_type)

    def close(self) -> None:
        for recorder in self._recorders.values():
            with contextlib.suppress(Exception):
                recorder.close(timeout=1.0)
        self._recorders.clear()


def _per_container(census: Iterable[CensusEntry], standing: Standing, processes: Gauge, memory: Gauge) -> None:
    """The processes and memory of each container of ``standing``; the series of a container gone are dropped."""
    counted: Tally[tuple[str, str, str]] = Tally()
    used: Tally[tuple[str, str, str]] = Tally()
    for e in census:
        if e.standing is standing:
            key = (e.pod.namespace if e.pod else "", e.pod.name if e.pod else "", e.container or "")
            counted[key] += 1
            used[key] += e.process.used_memory_bytes or 0
    processes.clear()
    memory.clear()
    for labels, count in counted.items():
        processes.labels(*labels).set(count)
        memory.labels(*labels).set(used[labels])
