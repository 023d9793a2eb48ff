"""The guardian's poll: observe every GPU process of the node, decide with the enforcer's rules, act
through cgroups, report.

One poll (``Guardian.poll``)::

    NvmlClient.sample()  (through the enforcer's DeadlineRunner: a hung driver call never hangs the loop)
      -> each listed PID's start time and /proc/<pid>/cgroup, read once (liveness.py) -> census.placement
      -> NodeEngine.step(now, processes, device totals, pods.index())     (pure: gpufence/node/decide.py)
      -> state file (episodes, before any signal) -> SIGTERM / SIGKILL through the cgroup (cgroupfs)
      -> the freezer's plan (throttle.FreezerThrottle) -> log lines, metrics, Events

Times are ``CLOCK_BOOTTIME`` (the state file's clock). The loop wakes every ``poll_interval`` and
at each episode's due time, so a SIGKILL is never a poll late.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from gpufence.contract import Mode
from gpufence.enforcer.act.kill_deadlines import boot_clock
from gpufence.enforcer.facts import DriverLimitState
from gpufence.enforcer.observe.nvml import NvmlClient, NvmlSample, NvmlUnavailable
from gpufence.enforcer.observe.procfs import read_cgroup
from gpufence.enforcer.observe.watchdog import DeadlineRunner
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.node.census import Placement, placement
from gpufence.node.cgroupfs import CgroupFs
from gpufence.node.decide import (
    Action,
    Breach,
    CensusEntry,
    Episode,
    GpuProc,
    NodeDecisions,
    NodeEngine,
    Standing,
)
from gpufence.node.kube import PodSource
from gpufence.node.limits import Key, LimitAction, LimitTarget, limit_step, limit_targets
from gpufence.node.liveness import LiveProcesses
from gpufence.node.pods import PodIndex
from gpufence.node.report import NodeEvents, NodeMetrics
from gpufence.node.state import GuardianState
from gpufence.node.throttle import FreezerThrottle

NVML_RETRY_SECONDS = 5.0
# The freezer's plan expires after this many poll intervals without a renewing poll (plus half a second).
LEASE_POLLS = 4
_PLACEMENT_CACHE_MAX = 8192

EVENT_REASONS = {
    "unaccounted": "GPUProcessUnaccounted",
    "memory_over_share": "GPUMemoryOverShare",
    "gpus_over_request": "GPUDevicesOverRequest",
    "throttle_ineffective": "GPUThrottleIneffective",
    "throttle_evaded": "GPUThrottleEvaded",
    "claim_over_capacity": "GPUClaimOverCapacity",
    "other_namespace": "GPUSharedWithOtherNamespace",  # on the foreign pod
    "host": "GPUSharedWithHostProcess",  # on each opted-in pod sharing the GPU
}
ADMIN_ALLOWED_EVENT = "GPUAccessAdminAllowed"


@dataclass
class Guardian:
    nvml: NvmlClient
    runner: DeadlineRunner
    fs: CgroupFs
    pods: PodSource
    engine: NodeEngine
    state: GuardianState
    throttle: FreezerThrottle
    log: DecisionLog
    metrics: NodeMetrics
    events: NodeEvents
    proc_root: str = "/proc"
    clock: Callable[[], float] = boot_clock
    _nvml_open: bool = False
    _nvml_retry_at: float = 0.0
    _placements: dict[tuple[int, int], Placement] = field(default_factory=dict)
    _live: LiveProcesses = field(init=False)
    _procs: dict[tuple[tuple[int, int], int], GpuProc] = field(default_factory=dict)
    _reported: set[tuple[str, str]] = field(default_factory=set)
    _limits_set: dict[Key, int] = field(default_factory=dict)  # the driver limits this guardian set
    _limits_seen: dict[Key, int] = field(default_factory=dict)  # the share last handled per key
    _limits_stamp: tuple[object, ...] | None = None
    _policy: tuple[object, ...] | None = None  # the policy keys last said (guardian_policy)

    def __post_init__(self) -> None:
        self._live = LiveProcesses(self.proc_root)

    # -- lifecycle ----------------------------------------------------------------------------

    def recover(self) -> None:
        """Before the first poll: thaw what a previous guardian left frozen, take over its episodes."""
        now = self.clock()
        recovered = self.state.load(now)
        if recovered.problem:
            self.log.warning("guardian_state_ignored", path=str(self.state.path), reason=recovered.problem)
        thawed = self.throttle.thaw_recorded(recovered.frozen)
        self.engine.backstop.restore(recovered.episodes)
        self.log.info(
            "guardian_state_recovered", path=str(self.state.path), episodes=len(recovered.episodes),
            termed=sum(e.termed for e in recovered.episodes), overdue=sum(e.kill_at <= now for e in recovered.episodes),
            thawed=thawed,
        )

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.poll()
            except Exception as exc:  # one bad poll must not end enforcement
                self.metrics.poll_errors.inc()
                self.log.error("poll_error", error=f"{type(exc).__name__}: {exc}")
            self.metrics.poll_duration.observe(time.monotonic() - started)
            now = self.clock()
            wake = now + self.engine.poll_interval
            due = self.engine.next_due()
            if due is not None:
                wake = min(wake, due)
            stop.wait(max(0.0, wake - now))

    # -- one poll -------------------------------------------------------------------------------

    def poll(self) -> NodeDecisions | None:
        now = self.clock()
        self.metrics.pods_synced.set(1 if self.pods.has_synced() else 0)
        sample = self._sample(now)
        if sample is None:
            return None
        processes, totals, mig = self._observe(sample)
        index = self.pods.index()
        self._policy_line(index)
        decisions = self.engine.step(now, processes, totals, index, mig)
        # The record first: a guardian killed right after a SIGTERM must not SIGTERM again.
        try:
            self.state.save_episodes(self.engine.backstop.episodes.values())
        except OSError as exc:
            self.log.error("guardian_state_unwritable", path=str(self.state.path), error=str(exc))
        self._report(decisions)
        for action, episode in decisions.step.actions:
            try:
                self._act(action, episode)
            except Exception as exc:  # one container's failure must not hold back the others' signals
                self.metrics.poll_errors.inc()
                self.log.error("guardian_action_failed", action=action.value, cgroup=episode.cgroup,
                               error=f"{type(exc).__name__}: {exc}")
        self._driver_limits(decisions, totals)
        self.throttle.set_plan(decisions.throttle, LEASE_POLLS * self.engine.poll_interval + 0.5)
        self.metrics.throttle(decisions.throttle.values())
        self.metrics.census(decisions.census)
        self.metrics.last_poll.set(time.time())
        return decisions

    def _policy_line(self, index: PodIndex) -> None:
        """The policy keys the guardian holds, said when they change (the first poll included): what
        it reads of the ConfigMap, where the webhook's own policy_loaded line is not in its log."""
        held = (tuple(sorted(index.device_access)), index.other_namespaces.value, index.host.value)
        if held != self._policy:
            self._policy = held
            self.log.info("guardian_policy", device_access_namespaces=list(held[0]),
                          other_namespace_gpu_processes=held[1], host_gpu_processes=held[2])

    def _sample(self, now: float) -> NvmlSample | None:
        if not self._nvml_open:
            if now < self._nvml_retry_at:
                return None
            try:
                self.runner.call("init", self.nvml.open)
            except NvmlUnavailable as exc:
                self._nvml_retry_at = now + NVML_RETRY_SECONDS
                self.metrics.nvml_up.set(0)
                self.log.error("nvml_unavailable", error=str(exc), retry_in_seconds=NVML_RETRY_SECONDS)
                self.throttle.set_plan({}, 0.0)
                return None
            self._nvml_open = True
            self.log.info("nvml_opened", driver_version=self.nvml.driver_version,
                          driver_limits=self.nvml.has_memory_limits)
        utilisation = self.engine.wants_utilisation(now)
        try:
            sample = self.runner.call("sample", lambda: self.nvml.sample(utilisation=utilisation))
        except NvmlUnavailable as exc:
            self._nvml_open = False
            self._nvml_retry_at = now + NVML_RETRY_SECONDS
            self.metrics.nvml_up.set(0)
            self.log.error("nvml_lost", error=str(exc))
            self.throttle.set_plan({}, 0.0)  # nothing measured: nothing held
            return None
        self.metrics.nvml_up.set(1)
        return sample

    def _observe(self, sample: NvmlSample) -> tuple[list[GpuProc], dict[int, int | None], frozenset[int]]:
        processes = []
        totals: dict[int, int | None] = {}
        mig = set()
        live: set[tuple[int, int]] = set()
        devices = [d for d in sample.devices if not d.lost]
        started = self._live.start_times(p.pid for d in devices for p in d.processes)
        for device in devices:
            totals[device.index] = device.total_memory_bytes
            if device.mig:
                mig.add(device.index)
            for p in device.processes:
                start = started.get(p.pid)
                if start is None:
                    continue  # exited, or a zombie
                key = (p.pid, start)
                live.add(key)
                where = self._placements.get(key)
                if where is None:
                    # A process never leaves its cgroup: read once per (pid, start time).
                    where = placement(read_cgroup(p.pid, self.proc_root))
                    self._placements[key] = where
                sm = device.sm_util_by_pid.get(p.pid)
                # The same record as last poll where nothing changed (most processes, most polls).
                proc = self._procs.get((key, device.index))
                if proc is None or proc.used_memory_bytes != p.used_memory_bytes or proc.sm_util != sm \
                        or proc.device_uuid != device.uuid or proc.placement is not where:
                    proc = GpuProc(p.pid, start, device.index, device.uuid, p.used_memory_bytes, sm, where)
                processes.append(proc)
        self._procs = {((p.pid, p.start_time_ticks), p.device_index): p for p in processes}
        if len(self._placements) > _PLACEMENT_CACHE_MAX or len(self._placements) > 2 * len(live) + 64:
            self._placements = {k: v for k, v in self._placements.items() if k in live}
        return processes, totals, frozenset(mig)

    # -- acting ---------------------------------------------------------------------------------

    def _act(self, action: Action, episode: Episode) -> None:
        self.throttle.release(episode.cgroup)  # a frozen process would hold a SIGTERM until thawed
        where = episode.placement
        result = self.fs.signal(where, 15) if action is Action.SIGTERM else self.fs.kill(where)
        record = dict(episode.record)
        self.metrics.actions.labels(action.value, episode.reason).inc()  # before the line that says so
        self.log.emit(
            f"guardian_{action.value}", level="warning", reason=episode.reason, cgroup=episode.cgroup,
            sent=list(result.sent), gone=list(result.gone),
            failed=[f"{pid}: {error}" for pid, error in result.failed] or None,
            grace_seconds=round(episode.kill_at - episode.started, 3),
            held_seconds=round(self.clock() - episode.started, 3), episode_started=episode.started, **record,
        )
        what = "SIGTERM, then SIGKILL after the grace period" if action is Action.SIGTERM else "SIGKILL"
        self.events.record(
            record.get("namespace"), record.get("pod"), record.get("pod_uid"),
            EVENT_REASONS.get(episode.reason, "GPUGuardianAction"),
            f"gpufence-node: {what} to container {record.get('container') or episode.placement.container_id} "
            f"({episode.reason}: {record.get('why') or _usage(record)}); {len(result.sent)} processes signalled",
        )

    def _driver_limits(self, decisions: NodeDecisions, totals: Mapping[int, int | None]) -> None:
        """Each admitted GPU container's share as the driver's limit on its cgroup (``limits.py``),
        handled when a container or its share is new: set where nobody set one and read back,
        left where one is there."""
        if not self.nvml.has_memory_limits or self.engine.mode is not Mode.ENFORCE:
            return  # audit: a hard limit fails allocations, which is enforcing
        # The targets follow the census, the configs and the devices' sizes: nothing to do while
        # none of them changed since a pass that left nothing undone.
        stamp = (self.engine.generation, tuple(sorted(totals.items())))
        if stamp == self._limits_stamp:
            return
        targets = limit_targets(decisions.census, decisions.configs, totals)
        for key in set(self._limits_seen) - set(targets):
            del self._limits_seen[key]  # the container is gone (or has no GPU process left)
            self._limits_set.pop(key, None)
        todo = [t for k, t in targets.items() if self._limits_seen.get(k) != t.bytes]
        if todo:
            try:
                done = self.runner.call("nvmlDeviceSetMemoryLimits", lambda: [self._limit_one(t) for t in todo])
            except NvmlUnavailable as exc:
                self.log.error("guardian_driver_limit_failed", error=str(exc))  # the next sample says more
                return
            for line in done:
                if line is not None:
                    self.log.emit("guardian_driver_limit", level="info" if line["ok"] else "warning", **line)
        # A reading that failed is asked again next poll: no stamp while one is left.
        if all(self._limits_seen.get(k) == t.bytes for k, t in targets.items()):
            self._limits_stamp = stamp

    def _limit_one(self, target: LimitTarget) -> dict[str, object] | None:
        key = (target.namespace, target.device_index)
        reading = self.nvml.memory_limit(target.device_index, target.namespace)
        action = limit_step(target, reading, self._limits_set.get(key))
        line: dict[str, object] = {
            "namespace": target.namespace_of_pod, "pod": target.pod, "pod_uid": target.pod_uid,
            "container": target.container, "uuid": target.device_uuid, "gpu": target.device_index,
            "cgroup": target.namespace, "share_bytes": target.bytes,
        }
        if action is None:
            if reading.state is DriverLimitState.ERROR:
                return None  # asked again next poll
            self._limits_seen[key] = target.bytes
            return None
        self._limits_seen[key] = target.bytes
        if action is LimitAction.LEAVE:
            return {**line, "action": "left", "by": "the toolkit's hook (or an earlier guardian)",
                    "soft_bytes": reading.soft_bytes, "hard_bytes": reading.hard_bytes,
                    "ok": reading.hard_bytes is not None and reading.hard_bytes <= target.bytes}
        error = self.nvml.set_memory_limit(target.device_index, target.namespace, target.bytes, target.bytes)
        back = self.nvml.memory_limit(target.device_index, target.namespace)
        ok = error is None and back.state is DriverLimitState.SET and back.hard_bytes == target.bytes
        if ok:
            self._limits_set[key] = target.bytes
        # A refusal (the cgroup already holds more than the share: the driver refuses a limit below
        # its use) is said once and tried again when the share or the container changes; the
        # guardian's memory rule holds the share meanwhile.
        return {**line, "action": "set", "by": "gpufence-node", "error": error,
                "read_back_state": back.state.value, "read_back_soft_bytes": back.soft_bytes,
                "read_back_hard_bytes": back.hard_bytes, "ok": ok}

    # -- reporting ------------------------------------------------------------------------------

    def _report(self, decisions: NodeDecisions) -> None:
        for entry in decisions.new_census:
            p = entry.process
            self.log.emit(
                "gpu_process", level="warning" if entry.standing is Standing.UNACCOUNTED else "info",
                standing=entry.standing.value, why=entry.why, pid=p.pid, uuid=p.device_uuid, gpu=p.device_index,
                used_bytes=p.used_memory_bytes, namespace=entry.pod.namespace if entry.pod else None,
                pod=entry.pod.name if entry.pod else None, pod_uid=p.placement.pod_uid, container=entry.container,
                container_id=p.placement.container_id, cgroup=p.placement.path,
            )
        for episode in decisions.step.started:
            term_in = None if episode.term_at is None else round(episode.term_at - episode.started, 3)
            self.log.warning("guardian_episode_started", reason=episode.reason, cgroup=episode.cgroup,
                             sigterm_in=term_in,
                             sigkill_in=round(episode.kill_at - episode.started, 3), **dict(episode.record))
        for episode in decisions.step.ended:
            self.log.info("guardian_episode_ended", reason=episode.reason, cgroup=episode.cgroup,
                          why="the breach ended before the guardian acted (the sidecar did, or the use fell)",
                          **dict(episode.record))
        current = {(b.cgroup, b.reason) for b in decisions.report_only}
        for breach in decisions.report_only:
            if (breach.cgroup, breach.reason) not in self._reported:
                self._audit(breach)
        self._reported = current
        for breach in decisions.reported:
            self._report_foreign(breach)
        for entry in decisions.allowed:
            self._allowed(entry)
        for uid, result in decisions.pods.items():
            for change in result.throttle_changes:
                self.log.info(f"guardian_throttle_{change.transition.value}", pod_uid=uid, container=change.container,
                              fraction=change.fraction, compute_share=change.share, demand=change.demand,
                              sm_utilization=change.sm_utilization, reason=change.reason or None)

    def _audit(self, breach: Breach) -> None:
        self.metrics.actions.labels("audit", breach.reason).inc()
        self.log.warning("guardian_audit", reason=breach.reason, cgroup=breach.cgroup, action="none (audit)",
                         **dict(breach.record))
        record = breach.record
        self.events.record(record.get("namespace"), record.get("pod"), record.get("pod_uid"),
                           EVENT_REASONS.get(breach.reason, "GPUGuardianAction"),
                           f"gpufence-node (audit, nothing done): {breach.reason}: "
                           f"{record.get('why') or _usage(record)}")

    def _report_foreign(self, breach: Breach) -> None:
        """A foreign process the policy says to report (once per episode): the log line names
        everything; the Event goes to the foreign pod, or, for a host process, to each opted-in pod
        sharing its GPU, without the host's PID or cgroup (a tenant reads its pod's Events)."""
        self.metrics.actions.labels("report", breach.reason).inc()
        self.log.warning("guardian_report", reason=breach.reason, cgroup=breach.cgroup or None,
                         action="none (report)", **dict(breach.record))
        record = breach.record
        reason = EVENT_REASONS.get(breach.reason, "GPUGuardianAction")
        if breach.reason != "host":
            self.events.record(record.get("namespace"), record.get("pod"), record.get("pod_uid"), reason,
                               f"gpufence-node (report, nothing done): {record.get('why')}")
            return
        sharing = record.get("sharing_pods")
        for pod in sharing if isinstance(sharing, list) else ():
            self.events.record(
                pod.get("namespace"), pod.get("pod"), pod.get("pod_uid"), reason,
                f"gpufence-node (report, nothing done): a process of the host, in no pod, holds "
                f"{record.get('used_bytes')} bytes on GPU {record.get('uuid')}, which this pod's share is on; "
                f"the policy's {record.get('policy_key')} is report")

    def _allowed(self, entry: CensusEntry) -> None:
        """A container without a share that the admin's policy allowed device access: said once per
        episode, so the admin sees that gpufence saw it and left it alone."""
        p = entry.process
        pod = entry.pod
        # No gpufence_node_actions_total: nothing was done (GpufenceNodeGuardianActed fires on any
        # action value); gpufence_node_admin_allowed_* count these containers.
        self.log.info("guardian_admin_allowed", action="none (admin-allowed)", why=entry.why, pid=p.pid,
                      uuid=p.device_uuid, gpu=p.device_index, used_bytes=p.used_memory_bytes,
                      namespace=pod.namespace if pod else None, pod=pod.name if pod else None,
                      pod_uid=p.placement.pod_uid, container=entry.container, container_id=p.placement.container_id,
                      cgroup=p.placement.path)
        if pod is not None:
            self.events.record(pod.namespace, pod.name, pod.uid, ADMIN_ALLOWED_EVENT,
                               f"gpufence-node saw container {entry.container or p.placement.container_id} use GPU "
                               f"{p.device_uuid} without a gpufence share and left it alone: {entry.why}",
                               event_type="Normal")


def _usage(record: Mapping[str, object]) -> str:
    return f"{record.get('used_bytes')} bytes used, {record.get('limit_bytes')} allowed"
