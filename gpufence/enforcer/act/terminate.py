"""Memory enforcement's executor: terminate whole containers, and unattributed processes when the
pod is over its budget (the orders and episodes come from ``machine.Core``; this module only acts, and
keeps the SIGKILL timers, which depend on signal outcomes and process exits).

* A container over its share is terminated as a whole: SIGTERM to every process of it that the
  enforcer knows (its GPU processes on every device, and every process of its cgroup: launchers
  such as torchrun or a shell hold no CUDA context but would restart the worker), SIGKILL after the
  grace period to all that remain, the cgroup swept once more so a worker a launcher restarted in
  the meantime goes too. The kubelet then sees the container exit and applies its restartPolicy
  (a kill loop shows as restarts and CrashLoopBackOff, not as an invisible churn of processes).
* An unattributed process chosen by the pod budget is terminated on its own (it belongs to no
  container the enforcer can name; its cgroup, if any, is unattributed because of conflicting
  claims, and terminating that cgroup could hit an innocent container). So are the unattributed
  processes while the pod runs on more GPUs than it requested.
* A throttled process seen running during its stopped phase (something sends it SIGCONT: the
  throttle executor reports it, ``rules.evasion_orders`` decides) is terminated with its container,
  like a container over its memory share (``throttle_evaded``); an unattributed one on its own.

An MPS client (the webhook set MPS limits) is first ended through its control daemon
(``terminate_client``, ``act/mps.py``), within a bounded wait, so that the other clients of its GPU
keep running; the signals follow in any case.

Every signal goes through the ``SafeSignaller`` (start time checked, never outside the pod); a
process held stopped by the throttle is exempted (continued) before its SIGTERM, and every process
gets a SIGCONT right after its SIGTERM, so one stopped by anything else handles it too.

The SIGKILL deadlines are recorded (``kill_deadlines.py``) before the SIGTERMs that start them and
taken over by a restarted enforcer (``restore``), so a restart of the sidecar never grants a new
grace period.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpufence.contract import Mode
from gpufence.enforcer.act.kill_deadlines import KillDeadlines, PendingKill
from gpufence.enforcer.act.mps import MpsDrain
from gpufence.enforcer.act.signals import Outcome, SafeSignaller, SignalTarget
from gpufence.enforcer.act.throttle import ThrottleExecutor
from gpufence.enforcer.decide.compute import UNATTRIBUTED as COMPUTE_UNATTRIBUTED
from gpufence.enforcer.decide.machine import Decisions
from gpufence.enforcer.decide.rules import TerminateOrder
from gpufence.enforcer.observe.attribution import Attribution, PodProcess
from gpufence.enforcer.observe.procfs import processes_in_cgroup
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import EventRecorder
from gpufence.enforcer.report.metrics import EnforcerMetrics

# The container label of actions taken against unattributed processes (pod budget).
UNATTRIBUTED = COMPUTE_UNATTRIBUTED


# Why a process is terminated: the order behind each SIGTERM and SIGKILL, what its log lines and
# Events say, and how it is written to (and read back from) the pending-SIGKILL file so that a
# restarted enforcer says the same.
@dataclass(frozen=True)
class Why:
    """The order a signal is sent for (what the log lines and Events say)."""

    container: str | None
    device_uuid: str
    device_index: int
    used_bytes: int
    limit_bytes: int
    gpus_requested: int | None = None  # set: the container runs on more GPUs than it requested
    devices_used: tuple[int, ...] = ()
    evaded_pids: tuple[int, ...] = ()  # set: seen running while the throttle held them stopped
    evaded_phases: int = 0
    # set: SM use (0-1) that stayed over the compute share while the throttle held the processes
    ineffective_use: float | None = None
    compute_share: float | None = None
    held_seconds: float = 0.0

    @classmethod
    def of(cls, order: TerminateOrder) -> Why:
        return cls(order.container, order.device_uuid, order.device_index, order.used_bytes, order.limit_bytes,
                   order.gpus_requested, order.devices_used, order.evaded_pids, order.evaded_phases,
                   order.ineffective_use, order.compute_share, order.held_seconds)

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "devices_used": list(self.devices_used), "evaded_pids": list(self.evaded_pids)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], container: str | None) -> Why:
        """From ``record`` (a previous enforcer's); what is missing or malformed gets a neutral value
        (only the log lines and Events say it: the deadline is what matters)."""

        def get(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
            value = record.get(key)
            return value if isinstance(value, kind) and not isinstance(value, bool) else default

        def ints(key: str) -> tuple[int, ...]:
            value = record.get(key)
            return tuple(d for d in value if isinstance(d, int)) if isinstance(value, list) else ()

        requested = get("gpus_requested", int, None)
        return cls(get("container", str, container), get("device_uuid", str, ""), get("device_index", int, -1),
                   get("used_bytes", int, 0), get("limit_bytes", int, 0), requested, ints("devices_used"),
                   ints("evaded_pids"), get("evaded_phases", int, 0), get("ineffective_use", (int, float), None),
                   get("compute_share", (int, float), None), get("held_seconds", (int, float), 0.0))

    @property
    def resource(self) -> str:
        if self.evaded_pids or self.ineffective_use is not None:
            return "compute"
        return "gpus" if self.gpus_requested is not None else "memory"

    @property
    def log_reason(self) -> str:
        if self.evaded_pids:
            return "throttle_evaded"
        if self.ineffective_use is not None:
            return "throttle_ineffective"
        if self.gpus_requested is not None:
            return "gpus_over_request"
        return "memory_over_share" if self.container is not None else "pod_over_budget"

    @property
    def event_reason(self) -> str:
        if self.evaded_pids:
            return "GPUThrottleEvaded"
        if self.ineffective_use is not None:
            return "GPUThrottleIneffective"
        if self.gpus_requested is not None:
            return "GPUDevicesOverRequest"
        return "GPUMemoryOverShare" if self.container is not None else "GPUPodOverBudget"

    def evasion(self) -> str:
        return (f"pids {list(self.evaded_pids)} ran during their stopped phase in {self.evaded_phases} duty cycles "
                "within a minute (something else sends them SIGCONT)")

    def ineffective(self) -> str:
        return (f"SM use stayed at {self.ineffective_use or 0:.0%} over its compute share of "
                f"{self.compute_share or 0:.0%} for {self.held_seconds:.0f}s while the throttle held it stopped "
                "most of the time (its GPU work runs while it is stopped: SIGSTOP cannot hold it)")

    def unattributed(self, pid: int, process_used: int | None, grace: float) -> str:
        """The Event message for an unattributed victim."""
        if self.evaded_pids:
            what = f"unattributed {self.evasion()}"
        elif self.ineffective_use is not None:
            what = f"the pod's unattributed processes: {self.ineffective()}"
        elif self.gpus_requested is not None:
            what = (f"the pod runs on GPUs {list(self.devices_used)}, more than the {self.gpus_requested} it "
                    "requested, and has processes no container can be charged for")
        else:
            what = (f"the pod uses {self.used_bytes} bytes of GPU memory on {self.device_uuid}, over its budget of "
                    f"{self.limit_bytes}")
        return (f"{what}: SIGTERM to unattributed pid {pid} ({process_used} bytes), SIGKILL after {grace:g}s")


@dataclass
class _Pending:
    target: SignalTarget
    deadline: float
    why: Why


@dataclass
class _Sweep:
    cgroup: str
    deadline: float
    why: Why


class Terminator:
    def __init__(
        self,
        signaller: SafeSignaller,
        throttle: ThrottleExecutor,
        log: DecisionLog,
        metrics: EnforcerMetrics,
        events: EventRecorder,
        *,
        clock: Callable[[], float] = time.monotonic,
        proc_root: str = "/proc",
        deadlines: KillDeadlines | None = None,
        mps: MpsDrain | None = None,
    ) -> None:
        self._signaller = signaller
        self._mps = mps if mps is not None else MpsDrain(log, proc_root=proc_root, clock=clock)
        self._deadlines = deadlines
        self._throttle = throttle
        self._log = log
        self._metrics = metrics
        self._events = events
        self._clock = clock
        self._proc_root = proc_root
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._sweeps: dict[str, _Sweep] = {}  # cgroup -> the SIGKILL sweep due at the grace's end
        # Processes already terminated (or found gone) that NVML may still list for a while (a
        # zombie, a driver slow to drop the context): never re-signalled, not re-logged each poll.
        self._finished: set[tuple[int, int]] = set()

    # -- the poll's orders -----------------------------------------------------------------------

    def enforce(self, decisions: Decisions, attribution: Attribution, mode: Mode, grace: float) -> None:
        """Act on this poll's decisions (``machine.Core.step``): log each over-share episode once (the
        core says which start and end), and in enforce mode terminate what the orders name."""
        self._finished &= {(p.pid, p.start_time_ticks) for p in attribution.processes}
        for order in decisions.episodes_started:
            self._log_episode(order, mode, attribution)
        for container, index in decisions.episodes_ended:
            if container is None:
                self._log.info("pod_under_budget", gpu=index)
            else:
                self._log.info("memory_under_share", container=container, gpu=index)
        if mode is Mode.AUDIT:
            return
        for order in decisions.orders:
            why = Why.of(order)
            if order.container is None:
                self._drain_mps(order.victims)
                self._sigterm([(SignalTarget.of(v), v.used_memory_bytes) for v in order.victims], why, grace)
            else:
                self._terminate_container(order.container, why, attribution, grace)

    def _log_episode(self, order: TerminateOrder, mode: Mode, attribution: Attribution) -> None:
        common = _episode_fields(order, mode)
        if order.evaded_pids:
            victims = [v.pid for v in order.victims] if order.container is None else sorted(
                {p.pid for p in attribution.processes if p.container == order.container})
            self._log.warning(
                "throttle_evaded", container=order.container, evaded_pids=list(order.evaded_pids),
                phases=order.evaded_phases, victims=victims,
                reason="seen running while the throttle held it stopped, in several duty cycles within a minute: "
                "something else sends it SIGCONT; terminated with its container (an unattributed process on its own)",
                **common,
            )
            self._metrics.action(order.container or UNATTRIBUTED, "throttle_evaded", "compute")
        elif order.ineffective_use is not None:
            victims = [v.pid for v in order.victims]
            self._log.warning(
                "throttle_ineffective", container=order.container, unattributed=order.container is None,
                sm_utilization=round(order.ineffective_use, 3), compute_share=order.compute_share,
                held_seconds=round(order.held_seconds, 1), victims=victims,
                reason="SM use stayed over the compute share while the throttle held the processes stopped at its "
                "minimum run fraction: the GPU work runs while they are stopped (long or persistent kernels), so "
                "SIGSTOP cannot hold it; terminated with its container (unattributed processes on their own)",
                **common,
            )
            self._metrics.action(order.container or UNATTRIBUTED, "throttle_ineffective", "compute")
        elif order.container is None and order.gpus_requested is not None:
            self._log.warning(
                "gpus_over_request", container=None, unattributed=True, gpus_requested=order.gpus_requested,
                gpus_used=list(order.devices_used), victims=[v.pid for v in order.victims],
                reason="the pod's processes run on more GPUs than its containers requested, and some of them no "
                "container can be charged for: those are terminated", **common,
            )
        elif order.container is None:
            unattributed = sum(
                p.used_memory_bytes or 0
                for p in attribution.processes
                if p.container is None and p.device_index == order.device_index
            )
            self._log.warning(
                "pod_over_budget", unattributed_bytes=unattributed, victims=[v.pid for v in order.victims],
                reason="the pod's GPU processes use more than the sum of its containers' shares: "
                "unattributed processes go first, largest first", **common,
            )
        elif order.gpus_requested is not None:
            self._log.warning(
                "gpus_over_request", container=order.container, gpus_requested=order.gpus_requested,
                gpus_used=list(order.devices_used),
                victims=sorted({p.pid for p in attribution.processes if p.container == order.container}),
                reason="the container's processes run on more GPUs than it requested (NVIDIA_VISIBLE_DEVICES "
                "from envFrom?): it is terminated as a whole", **common,
            )
        else:
            self._log.warning(
                "memory_over_share", container=order.container,
                victims=sorted({p.pid for p in attribution.processes if p.container == order.container}),
                **common,
            )
        if mode is Mode.AUDIT:
            self._metrics.action(order.container or UNATTRIBUTED, "audit", Why.of(order).resource)

    def _terminate_container(self, container: str, why: Why, attribution: Attribution, grace: float) -> None:
        """SIGTERM every process of the container the enforcer can find (GPU processes on every
        device, and everything in its cgroup); its cgroup is swept with SIGKILL when grace ends."""
        mine = [p for p in attribution.processes if p.container == container]
        targets = {(p.pid, p.start_time_ticks): SignalTarget.of(p) for p in mine}
        cgroups = {p.cgroup for p in mine if p.cgroup is not None}
        members = [
            SignalTarget(pid, start, container)
            for cgroup in sorted(cgroups)
            for pid, start in processes_in_cgroup(cgroup, self._proc_root)
            if (pid, start) not in targets
        ]
        self._signaller.admit_members(members)
        targets.update((t.key, t) for t in members)
        fresh = [t for t in targets.values() if t.key not in self._pending and t.key not in self._finished]
        if not fresh:
            return  # its grace period is running, or it is already gone
        used = {(p.pid, p.start_time_ticks): p.used_memory_bytes for p in mine if p.device_index == why.device_index}
        victims = [(t, used.get(t.key)) for t in sorted(fresh, key=lambda t: t.pid)]
        self._drain_mps(mine)
        sent = self._sigterm(victims, why, grace, cgroups=sorted(cgroups))
        if sent:
            if why.evaded_pids:
                what = f"container {container}: {why.evasion()}"
            elif why.ineffective_use is not None:
                what = f"container {container}: {why.ineffective()}"
            elif why.gpus_requested is not None:
                what = (f"container {container} runs on GPUs {list(why.devices_used)}, more than the "
                        f"{why.gpus_requested} it requested")
            else:
                what = (f"container {container} uses {why.used_bytes} bytes of GPU memory on {why.device_uuid}, "
                        f"over its share of {why.limit_bytes}")
            self._events.record(
                why.event_reason,
                f"{what}: container terminated (SIGTERM to pids {sent}, SIGKILL after {grace:g}s)",
                action="Terminate",
            )

    def _drain_mps(self, processes: Sequence[PodProcess]) -> None:
        """MPS clients (where the webhook set MPS limits) are ended through their control daemon
        before their SIGTERM (``act/mps.py``: killing one with work in flight can fail its GPU's
        other clients); bounded, and the signals follow whatever it answers. Once per process."""
        seen: set[tuple[int, int]] = set()
        for p in processes:
            key = (p.pid, p.start_time_ticks)
            if key in seen or key in self._pending or key in self._finished:
                continue
            seen.add(key)
            client = self._mps.client(p.pid, p.nvml_pid)
            if client is not None:
                self._mps.drain(client, p.container)

    def _sigterm(
        self, victims: list[tuple[SignalTarget, int | None]], why: Why, grace: float, *, cgroups: Sequence[str] = ()
    ) -> list[int]:
        """SIGTERM ``victims`` ((target, its used bytes)); returns the PIDs signalled. Their SIGKILL
        deadline, and the sweep of ``cgroups``, are on record before the first SIGTERM: a workload
        that traps it and kills its sidecar at once must not win a new grace period."""
        victims = [(t, used) for t, used in victims if t.key not in self._pending and t.key not in self._finished]
        if not victims:
            return []
        # One deadline for the lot, from just before the SIGTERMs (signalling them takes microseconds).
        deadline = self._clock() + grace
        for target, _ in victims:
            self._pending[target.key] = _Pending(target, deadline, why)
        for cgroup in cgroups:
            self._sweeps.setdefault(cgroup, _Sweep(cgroup, deadline, why))
        self._persist()
        sent: list[int] = []
        for target, process_used in victims:
            # A process we hold stopped would not act on SIGTERM: continue it, never stop it again.
            self._throttle.exempt(target)
            outcome = self._signaller.send(
                target, signal.SIGTERM, reason=why.log_reason, uuid=why.device_uuid, gpu=why.device_index,
                used_bytes=why.used_bytes, limit_bytes=why.limit_bytes, process_used_bytes=process_used,
                action="sigterm", grace_period_seconds=grace,
            )
            if outcome is not Outcome.SENT:
                del self._pending[target.key]
                if outcome in (Outcome.GONE, Outcome.REUSED, Outcome.REFUSED):
                    self._finished.add(target.key)
                continue
            sent.append(target.pid)
            # And SIGCONT after it (as systemd does): a process stopped by anything but our throttle
            # (its own pod, job control, a debugger), or stopped again between the exemption's
            # SIGCONT and the SIGTERM, would keep the SIGTERM pending and never handle it before
            # the SIGKILL. SIGCONT stops nothing, so a running process loses nothing by it.
            self._signaller.send(target, signal.SIGCONT, reason="after_sigterm")
            self._metrics.action(target.container or UNATTRIBUTED, "sigterm", why.resource)
            if why.container is None:
                self._events.record(why.event_reason, why.unattributed(target.pid, process_used, grace),
                                    action="Terminate")
        if len(sent) < len(victims):
            self._persist()
        return sent

    # -- across restarts -------------------------------------------------------------------------

    def restore(self, mode: Mode) -> int:
        """Take over the SIGKILL deadlines a previous enforcer left on record (before the first
        poll); SIGKILL at once what is overdue. Returns how many were taken over."""
        if self._deadlines is None:
            return 0
        recorded = self._deadlines.load()
        if not recorded:
            return 0
        now = self._clock()
        processes = [k for k in recorded if k.target is not None]
        cgroups = [k for k in recorded if k.cgroup is not None]
        self._log.info(
            "kill_deadlines_recovered", path=str(self._deadlines.path), processes=len(processes),
            cgroups=len(cgroups), overdue=sum(1 for k in recorded if k.remaining <= 0), mode=mode,
        )
        if mode is Mode.AUDIT:  # audit mode kills nothing: what was pending is dropped
            self._persist()
            return 0
        for kill in processes:
            target = kill.target
            assert target is not None
            why = Why.from_record(kill.order, target.container)
            # Our SIGTERM, a previous incarnation's: its SIGKILL is a follow-up this enforcer may send.
            self._signaller.adopt_terminated(target)
            self._throttle.exempt(target)
            self._pending[target.key] = _Pending(target, now + kill.remaining, why)
        for kill in cgroups:
            assert kill.cgroup is not None
            why = Why.from_record(kill.order, None)
            self._sweeps[kill.cgroup] = _Sweep(kill.cgroup, now + kill.remaining, why)
        self.check(now, mode)
        self._persist()
        return len(recorded)

    def _persist(self) -> None:
        if self._deadlines is None:
            return
        now = self._clock()
        self._deadlines.write(
            [PendingKill(p.deadline - now, p.why.record(), target=p.target) for p in self._pending.values()]
            + [PendingKill(s.deadline - now, s.why.record(), cgroup=s.cgroup) for s in self._sweeps.values()]
        )

    # -- between polls ---------------------------------------------------------------------------

    def check(self, now: float, mode: Mode) -> None:
        """Log exits, SIGKILL what outlived its grace period, sweep the cgroups of terminated containers."""
        before = (len(self._pending), len(self._sweeps))
        self._check(now, mode)
        if (len(self._pending), len(self._sweeps)) != before:  # only ever removes: a count says it all
            self._persist()

    def _check(self, now: float, mode: Mode) -> None:
        for key, pending in list(self._pending.items()):
            target = pending.target
            if not self._signaller.alive(target):
                del self._pending[key]
                self._finished.add(key)
                self._log.info("terminated", pid=target.pid, container=target.container, reason="exited after SIGTERM")
                continue
            if now < pending.deadline:
                continue
            del self._pending[key]
            self._finished.add(key)
            if mode is Mode.ENFORCE:
                self._sigkill(target, pending.why)
        for cgroup, sweep in list(self._sweeps.items()):
            if now < sweep.deadline:
                continue
            del self._sweeps[cgroup]
            if mode is not Mode.ENFORCE or sweep.why.container is None:
                continue
            # Whatever is still in the container's cgroup (a worker its launcher restarted during
            # the grace period included) is killed: the container must exit.
            found = processes_in_cgroup(cgroup, self._proc_root)
            left = [SignalTarget(pid, start, sweep.why.container) for pid, start in found]
            self._signaller.admit_members(left)
            for target in left:
                self._pending.pop(target.key, None)
                self._finished.add(target.key)
                self._sigkill(target, sweep.why)

    def _sigkill(self, target: SignalTarget, why: Why) -> None:
        outcome = self._signaller.send(
            target, signal.SIGKILL, reason="grace_period_expired", uuid=why.device_uuid, gpu=why.device_index,
            limit_bytes=why.limit_bytes, action="sigkill",
        )
        if outcome is Outcome.SENT:
            self._metrics.action(target.container or UNATTRIBUTED, "sigkill", why.resource)
            self._events.record(
                why.event_reason,
                f"container {target.container}: pid {target.pid} still alive after the grace period: SIGKILL"
                if why.container is not None
                else f"unattributed pid {target.pid} still alive after the grace period: SIGKILL",
                action="Kill",
            )

    def next_deadline(self) -> float | None:
        deadlines = [p.deadline for p in self._pending.values()] + [s.deadline for s in self._sweeps.values()]
        return min(deadlines) if deadlines else None

    def config_changed(self, old_grace: float, new_grace: float, mode: Mode) -> None:
        """Audit mode drops what is pending; a shorter grace period shortens running ones."""
        if mode is Mode.AUDIT:
            self._pending.clear()
            self._sweeps.clear()
        else:
            items: list[_Pending | _Sweep] = [*self._pending.values(), *self._sweeps.values()]
            for item in items:
                item.deadline = min(item.deadline, item.deadline - old_grace + new_grace)
        self._persist()


def _episode_fields(order: TerminateOrder, mode: Mode) -> dict[str, object]:
    """The fields every episode's log line carries: the device, the figures, what is done."""
    return dict(
        uuid=order.device_uuid, gpu=order.device_index, used_bytes=order.used_bytes,
        limit_bytes=order.limit_bytes, mode=mode, action="audit" if mode is Mode.AUDIT else "sigterm",
    )
