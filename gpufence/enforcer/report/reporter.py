"""How the loop reports the core's decisions: log lines, metrics and Kubernetes Events (no decisions
here, and no signals: those are the core's and the executors')."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpufence.contract import EnforcerConfig, LimitUnit, Mode
from gpufence.enforcer.decide.compute import UNATTRIBUTED
from gpufence.enforcer.decide.machine import ThrottleChange, Transition
from gpufence.enforcer.facts import Attribution, PodProcess
from gpufence.enforcer.observe.nvml import NvmlSample
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import EventRecorder
from gpufence.enforcer.report.metrics import EnforcerMetrics, UsageSample


class Reporter:
    def __init__(self, log: DecisionLog, metrics: EnforcerMetrics, events: EventRecorder) -> None:
        self.log = log
        self.metrics = metrics
        self.events = events

    def unattributed(self, processes: Iterable[PodProcess], config: EnforcerConfig) -> None:
        for p in processes:
            self.log.warning(
                "unattributed_process", pid=p.pid, nvml_pid=p.nvml_pid, uuid=p.device_uuid,
                gpu=p.device_index, used_bytes=p.used_memory_bytes,
                cgroup=p.cgroup, claim=p.claim, why=unattributed_why(p, config),
                reason="no certain container: counts against the pod budget, first to go when the pod is over it",
            )

    def two_unit_shares(self, config: EnforcerConfig) -> None:
        """Say, once per config, which containers have a memory share in two units and what that means
        (the per-device outcome is the metric gpufence_container_gpu_memory_limit_from_percent)."""
        for name, share in config.containers.items():
            if share.memory is not None and share.memory.two_units:
                self.log.info(
                    "memory_share_two_units", container=name, share_bytes=share.memory.bytes,
                    share_percent=share.memory.percent,
                    reason="the pod's share and the namespace's ceiling are in different units (bytes and percent); "
                    "on each device the smaller of the two is the limit",
                )

    def mig(self, sample: NvmlSample, indexes: Iterable[int]) -> None:
        """Say once per device, in the log, a metric and an Event, that MIG is left to MIG."""
        uuids = {d.index: d.uuid for d in sample.devices}
        for index in indexes:
            why = "MIG mode is enabled: its hardware isolation applies, the enforcer does not act on this device"
            self.log.warning("mig_device_not_enforced", gpu=index, uuid=uuids.get(index), reason=why)
            self.metrics.set_mig_unenforced(uuids.get(index, ""), index)
            self.events.record(
                "GPUMIGNotEnforced", f"GPU {uuids.get(index)}: {why}", event_type="Normal", action="None"
            )

    def uninspectable(self, nvml_pids: Iterable[int]) -> None:
        for pid in nvml_pids:
            why = ("NVML lists it but /proc/<pid>/fd is not readable (no ptrace access): the sidecar has fewer "
                   "capabilities than the workload or another user; it counts against the pod's budget and is "
                   "terminated as the pod's when the pod is over it")
            self.log.error("process_uninspectable", nvml_pid=pid, reason=why,
                           remedy="run the workload with the runtime's default capabilities (docs/install.md)")
            self.events.record("GPUProcessUninspectable", f"GPU process {pid}: {why}", event_type="Warning",
                               action="Charged")

    def usage(self, usages: Iterable[Any], attribution: Attribution) -> None:
        sm: dict[tuple[str, int], int] = {}
        for p in attribution.processes:
            if p.container is not None and p.sm_util is not None:
                key = (p.container, p.device_index)
                sm[key] = sm.get(key, 0) + p.sm_util
        rows = [
            UsageSample(
                container=u.container, uuid=u.device_uuid, gpu=u.device_index, used_bytes=u.used_bytes,
                limit_bytes=u.limit_bytes, limit_from_percent=u.limit_unit is LimitUnit.PERCENT,
                sm_utilization=(min(sm[(u.container, u.device_index)], 100) / 100)
                if (u.container, u.device_index) in sm else None,
            )
            for u in usages
        ]
        self.metrics.set_container_usage(rows)

    def throttle(self, change: ThrottleChange, mode: Mode, pids: list[int] | None = None) -> None:
        container = change.container
        pod = container == UNATTRIBUTED
        # The unattributed processes' throttle is the pod's: say so instead of naming a container.
        who: dict[str, Any] = (
            {"container": None, "unattributed": True, "pod_compute_budget": change.share} if pod
            else {"container": container, "compute_share": change.share}
        )
        if change.transition is Transition.UPDATE:
            self.log.debug("throttle_update", **who, run_fraction=_round(change.fraction))
            return
        if change.transition is Transition.STOP:
            self.log.info(
                "throttle_stop", **who, mode=mode,
                action="audit" if mode is Mode.AUDIT else "throttle_stop", reason=change.reason,
            )
            if mode is Mode.ENFORCE:
                self.metrics.action(container, "throttle_stop", "compute")
            self.metrics.set_throttled(container, False)
            return
        self.log.warning(
            "throttle_start", **who, sm_utilization=change.sm_utilization,
            demand=_round(change.demand), run_fraction=_round(change.fraction), mode=mode,
            action="audit" if mode is Mode.AUDIT else "throttle_start", pids=pids or [],
            **({"reason": "the pod's SM use, where it has unattributed processes, is over its budget (the sum of "
                "its containers' compute shares): the unattributed processes are duty-cycled"} if pod else {}),
        )
        if mode is Mode.AUDIT:
            self.metrics.action(container, "audit", "compute")
            return
        self.metrics.action(container, "throttle_start", "compute")
        self.metrics.set_throttled(container, True)
        if pod:
            self.events.record(
                "GPUPodComputeOverBudget",
                f"the pod uses {change.sm_utilization:.0%} SM where it has unattributed GPU processes (pids "
                f"{pids or []}), over its compute budget {change.share or 0:.0%} (the sum of its containers' "
                f"shares): they are duty-cycled at {change.fraction or 0:.0%} run time",
                action="Throttle",
            )
            return
        self.events.record(
            "GPUComputeOverShare",
            f"container {container} uses more SM time than its compute share {change.share or 0:.0%}: "
            f"duty-cycled at {change.fraction or 0:.0%} run time",
            action="Throttle",
        )


def unattributed_why(p: PodProcess, config: EnforcerConfig) -> str:
    """Why a process has no container, from what it claims (for the log and the Event)."""
    if p.claim is not None and p.claim not in config.containers:
        return f"it claims {p.claim!r}, which is no container of this pod: a claim is not a key"
    if p.claim is not None:
        return "its cgroup's processes claim different names, or another cgroup holds its name"
    return "it claims no container and no name is bound to its cgroup"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
