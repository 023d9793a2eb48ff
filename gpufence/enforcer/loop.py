"""The enforcer's poll loop: observe -> decide -> act -> report.

One :class:`Enforcer` owns the adapters (NVML client, safe signaller, throttle executor, stopped
state, metrics, events, log) and runs on a thread of its own (``run``), so the HTTP server never
waits on NVML. Each poll interval ``tick`` does, in order:

1. (when ``--config FILE`` is used) reload the config if the file changed; on a change every
   throttled process is continued and the compute controller starts afresh;
2. open NVML if it is not open (backoff from one poll interval doubling to 30 s; meanwhile
   ``gpufence_nvml_up`` is 0 and ``/readyz`` says 503; ``/healthz`` fails only while a call hangs);
3. observe: ``NvmlClient.sample()`` (per-device errors are counted and logged, rate-limited, never
   fatal), ``Attributor.attribute``, the throttle's evasions, the driver's per-cgroup limits;
4. decide: ``Core.step`` (``gpufence/enforcer/decide/machine.py``, pure) decides everything for this
   poll and returns its ``Decisions``;
5. act: hand the pod's (pid, start time) pairs to the signaller, the ``Terminator`` (unattributed
   processes while the pod is over its budget, then containers over their shares as a whole; in
   audit mode only the episode lines), the throttle plan to the executor (with a lease), and
   SIGKILL the SIGTERMed processes whose grace period ran out (also checked between polls, so the
   delay is the grace period, not rounded up to a poll);
6. report: log lines, Events and metrics of what the poll saw, the poll's success.

Any exception in a tick is logged (``poll_error``, then at most once a minute per kind) and
counted (``gpufence_poll_errors_total``); the loop goes on. Compute throttling needs fresh
measurements: when NVML stops answering, a poll fails, or the config changes, every throttled
process is continued and the compute controller starts afresh. Pending SIGKILLs still fire, also
while an NVML call is slow; a call that hangs past ``--nvml-timeout`` is an error (``nvml_hung``,
see ``watchdog.py``).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from gpufence.contract import EnforcerConfig, Mode
from gpufence.enforcer.act.kill_deadlines import KillDeadlines
from gpufence.enforcer.act.signals import SafeSignaller, SignalTarget
from gpufence.enforcer.act.stopped_state import Recovery, StoppedState, recover
from gpufence.enforcer.act.terminate import Terminator
from gpufence.enforcer.act.throttle import ThrottleExecutor, ThrottlePlan
from gpufence.enforcer.decide.compute import INEFFECTIVE_SECONDS, UNATTRIBUTED
from gpufence.enforcer.decide.machine import Core, Decisions
from gpufence.enforcer.decide.rules import Evasion
from gpufence.enforcer.facts import Attribution, DriverReading
from gpufence.enforcer.observe.attribution import Attributor, PidMode
from gpufence.enforcer.observe.driver_limits import DriverLimitReader
from gpufence.enforcer.observe.nvml import NvmlClient, NvmlSample, NvmlUnavailable
from gpufence.enforcer.observe.watchdog import DeadlineRunner, NvmlHung
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.driver_limits import DriverLimits
from gpufence.enforcer.report.events import EventRecorder
from gpufence.enforcer.report.health import Health
from gpufence.enforcer.report.metrics import EnforcerMetrics
from gpufence.enforcer.report.reporter import Reporter

NVML_BACKOFF_MAX_SECONDS = 30.0
ERROR_LOG_REPEAT_SECONDS = 60.0
THROTTLE_LEASE_INTERVALS = 4


@dataclass(frozen=True)
class _Observation:
    """What one poll saw, for the core."""

    sample: NvmlSample
    attribution: Attribution
    totals: dict[int, int | None]  # device -> total memory
    mig: frozenset[int]  # devices in MIG mode
    evasions: tuple[Evasion, ...]
    driver: DriverReading


class Enforcer:
    def __init__(
        self,
        config: EnforcerConfig,
        *,
        pid_mode: PidMode,
        attributor: Attributor,
        client_factory: Callable[[], NvmlClient],
        signaller: SafeSignaller,
        throttle: ThrottleExecutor,
        stopped: StoppedState,
        log: DecisionLog,
        metrics: EnforcerMetrics,
        health: Health,
        events: EventRecorder,
        kill_deadlines: KillDeadlines | None = None,
        config_source: Callable[[], EnforcerConfig | None] | None = None,
        compute_window_seconds: float = 5.0,
        compute_period_seconds: float = 1.0,
        compute_ineffective_seconds: float = INEFFECTIVE_SECONDS,
        nvml_timeout_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.pid_mode = pid_mode
        self._attributor = attributor
        self._client_factory = client_factory
        self._client: NvmlClient | None = None
        self.driver_version: str | None = None
        self._signaller = signaller
        self._throttle = throttle
        self._stopped = stopped
        self._log = log
        self._metrics = metrics
        self._health = health
        self._events = events
        self._config_source = config_source
        self._clock = clock
        self._wall = wall_clock
        self._core = Core(
            config, compute_window_seconds=compute_window_seconds, compute_period_seconds=compute_period_seconds,
            compute_ineffective_seconds=compute_ineffective_seconds,
        )
        self._backoff = config.poll_interval_seconds
        self._next_open = 0.0
        self._report = Reporter(log, metrics, events)
        self._driver_limit_reader = DriverLimitReader()
        self._driver_limits = DriverLimits(log, metrics, events, health=health)
        self._terminator = Terminator(
            signaller, throttle, log, metrics, events, clock=clock, deadlines=kill_deadlines
        )
        self._nvml = DeadlineRunner(nvml_timeout_seconds, clock=clock)
        health.watch_nvml(self._nvml.hung_for, nvml_timeout_seconds)
        self._lost_devices: set[int] = set()
        self._throttle_planned = False  # the last plan handed to the throttle executor was not empty
        self._error_log: dict[tuple[str, str, int | None], float] = {}
        self._error_counts: dict[tuple[str, str, int | None], int] = {}
        self._publish_config()

    @property
    def config(self) -> EnforcerConfig:
        """The config in force: the core's (one place, switched by ``apply_config``)."""
        return self._core.config

    # -- lifecycle -----------------------------------------------------------------------------

    def report_paused(self, seconds: float) -> None:
        """The whole enforcer was held for ``seconds`` (its heartbeat thread saw the gap once it ran
        again): counted and recorded on the pod, since nothing was enforced meanwhile."""
        self._metrics.paused.inc(max(seconds, 0.0))
        self._events.record(
            "GPUEnforcerPaused",
            f"the gpufence enforcer did not run for {seconds:.0f}s (stopped by another process, frozen or starved): "
            "nothing was enforced meanwhile",
        )

    def recover_stopped(self) -> Recovery:
        """Continue what a previous enforcer left stopped; what cannot be continued yet (a failed
        SIGCONT) stays on record and is retried by the throttle executor with its own."""
        recovery = recover(self._stopped, self._signaller, self._log)
        self._throttle.hold_unreleased(recovery.unreleased)
        return recovery

    def recover_kill_deadlines(self) -> int:
        """Honour the SIGKILL deadlines a previous enforcer recorded (overdue ones at once): a
        restart of the sidecar does not grant a new grace period."""
        return self._terminator.restore(self.config.mode)

    def open_nvml(self) -> bool:
        """Try to open NVML now; on failure schedule the next try (exponential backoff)."""
        now = self._clock()
        client: NvmlClient | None = None
        try:
            client = self._client_factory()
            self._nvml.call("nvmlInit", client.open)
        except Exception as exc:
            error = _short_error(exc)
            self._metrics.nvml_error("nvmlInit", error)
            self._metrics.nvml_up.set(0)
            self._health.nvml(False)
            retry = self._backoff
            self._next_open = now + retry
            self._backoff = min(self._backoff * 2, NVML_BACKOFF_MAX_SECONDS)
            self._log.error(
                "nvml_unavailable", function="nvmlInit", error=f"{type(exc).__name__}: {exc}",
                retry_in_seconds=round(retry, 3),
            )
            if client is not None and not isinstance(exc, NvmlUnavailable):
                self._close_client(client)
            return False
        self._client = client
        self._backoff = self.config.poll_interval_seconds
        try:
            self.driver_version = client.driver_version
        except Exception:
            self.driver_version = None
        self._metrics.nvml_up.set(1)
        self._health.nvml(True)
        self._log.info("nvml_opened", driver_version=self.driver_version)
        return True

    def close(self) -> None:
        self._throttle.close("shutdown")
        self._events.close()
        if self._client is not None:
            self._close_client(self._client)
            self._client = None

    def _close_client(self, client: NvmlClient) -> None:
        """Close through the deadline runner: a client whose call hangs holds its own lock, and
        ``close`` would wait on it for ever (while a call hangs the runner refuses at once)."""
        with contextlib.suppress(Exception):
            self._nvml.call("nvmlShutdown", client.close)

    def run(self, stop: threading.Event) -> None:
        """The poll thread: tick every interval, SIGKILL expired grace periods in between."""
        next_tick = self._clock()
        while not stop.is_set():
            now = self._clock()
            if now >= next_tick:
                started = self._clock()
                try:
                    self.tick()
                except Exception as exc:
                    self._poll_error(exc, traceback.format_exc(limit=8))
                    # A failed poll gives no fresh plan: do not keep duty-cycling on a stale one.
                    with contextlib.suppress(Exception):
                        self._release_compute("poll error")
                finally:
                    self._metrics.poll_duration.observe(self._clock() - started)
                    self._health.tick_completed()
                # Faster while a container or the pod is close to its limit or growing fast.
                interval = self._core.poll_interval(self.config.poll_interval_seconds)
                self._metrics.poll_interval.set(interval)
                next_tick = max(next_tick + interval, self._clock() + interval / 10)
            else:
                try:
                    self._check_pending(now)
                except Exception as exc:
                    self._poll_error(exc, traceback.format_exc(limit=8))
            wake = next_tick
            deadline = self._terminator.next_deadline()
            if deadline is not None:
                wake = min(wake, deadline)
            stop.wait(max(wake - self._clock(), 0.0))

    def _poll_error(self, exc: Exception, trace: str) -> None:
        """Count every failed poll; log the first of a kind, then at most once a minute."""
        self._metrics.poll_errors.inc()
        error = f"{type(exc).__name__}: {exc}"
        key = ("poll", error, None)
        self._error_counts[key] = self._error_counts.get(key, 0) + 1
        now = self._clock()
        last = self._error_log.get(key)
        if last is None or now - last >= ERROR_LOG_REPEAT_SECONDS:
            self._error_log[key] = now
            self._log.error("poll_error", error=error, count=self._error_counts[key], traceback=trace)

    # -- one poll ------------------------------------------------------------------------------

    def tick(self) -> None:
        """One poll: observe, decide (the pure core), act, report."""
        now = self._clock()
        self._maybe_reload()
        if self._client is None and (now < self._next_open or not self.open_nvml()):
            self._check_pending(now)
            return
        seen = self._observe(now)
        if seen is None:
            return
        decisions = self._core.step(
            self._clock(), seen.attribution, seen.totals, seen.mig, seen.evasions, seen.driver
        )
        self._act(decisions)
        self._report_poll(seen.sample, decisions)

    def _observe(self, now: float) -> _Observation | None:
        """NVML's sample (with a deadline), this pod's processes in it, what the throttle saw and the
        driver's own limits; None when NVML did not answer (said, and the throttle released)."""
        client = self._client
        assert client is not None
        try:
            # While NVML answers slowly the SIGKILL timers still fire (the idle callback).
            utilisation = self._core.wants_utilisation(now)
            sample = self._nvml.call("sample", partial(client.sample, utilisation), idle=self._between_calls)
        except NvmlUnavailable as exc:
            self._nvml_lost(exc)
            self._check_pending(self._clock())
            return None
        self._record_nvml_errors(sample)
        attribution = self._attributor.attribute(sample)
        return _Observation(
            sample=sample,
            attribution=attribution,
            totals={d.index: d.total_memory_bytes for d in sample.devices if not d.lost},
            mig=frozenset(d.index for d in sample.devices if d.mig and not d.lost),
            # What the throttle saw since the last poll: processes running while held stopped.
            evasions=tuple(self._throttle.take_evasions()),
            # The driver's own per-cgroup limits and usage (NVML R615): its currentUsed is the usage.
            driver=self._driver_limit_reader.read(client, attribution, self.config, self._nvml.call),
        )

    def _act(self, decisions: Decisions) -> None:
        """Carry the decisions out: terminations, the throttle plan, SIGKILLs now due."""
        # The core's attribution: a name that is no container of the pod is screened out. Every GPU
        # process accepted as the pod's may be signalled, attributed or not (pod budget), under the
        # container the core holds it to.
        attribution = decisions.attribution
        self._signaller.authorize(SignalTarget.of(p) for p in attribution.processes)
        self._terminator.enforce(decisions, attribution, self.config.mode, self.config.grace_period_seconds)
        self._apply_compute(decisions, attribution)
        self._check_pending(self._clock())

    def _report_poll(self, sample: NvmlSample, decisions: Decisions) -> None:
        """What this poll saw and decided, after acting on it: log lines and Events first seen,
        metrics, the mechanism holding each memory share, and the poll's success."""
        attribution = decisions.attribution
        self._report.mig(sample, decisions.new_mig_devices)
        self._report.unattributed(decisions.new_unattributed, self.config)
        self._report.uninspectable(decisions.new_uninspectable)
        self._metrics.uninspectable.set(len(attribution.uninspectable))
        self._report.usage(decisions.usages, attribution)
        self._driver_limits.report(decisions.memory_enforcement, decisions.discrepancies)
        self._metrics.set_pod_usage(decisions.pods)
        self._metrics.last_successful_poll.set(self._wall())
        self._metrics.nvml_up.set(1)
        self._health.nvml(True)
        self._health.poll_succeeded()

    def _between_calls(self) -> float | None:
        """Run due SIGKILLs while waiting on NVML; seconds until the next one is due."""
        self._check_pending(self._clock())
        deadline = self._terminator.next_deadline()
        return None if deadline is None else deadline - self._clock()

    def _nvml_lost(self, exc: Exception) -> None:
        hung = isinstance(exc, NvmlHung)
        self._metrics.nvml_error("sample", "HUNG" if hung else _short_error(exc))
        self._metrics.nvml_up.set(0)
        self._health.nvml(False)
        self._log.error(
            "nvml_hung" if hung else "nvml_unavailable", function="sample", error=f"{type(exc).__name__}: {exc}",
        )
        if self._client is not None and not hung:
            self._close_client(self._client)
        # A hung client is dropped, not closed: its call holds its lock (see _close_client).
        self._client = None
        self._backoff = self.config.poll_interval_seconds
        self._next_open = self._clock() + self._backoff
        # Without measurements there is no throttling: never duty-cycle blind.
        self._release_compute("nvml unavailable")

    def _record_nvml_errors(self, sample: NvmlSample) -> None:
        now = self._clock()
        for err in sample.errors:
            self._metrics.nvml_error(err.function, err.error)
            key = (err.function, err.error, err.device_index)
            self._error_counts[key] = self._error_counts.get(key, 0) + 1
            last = self._error_log.get(key)
            if last is None or now - last >= ERROR_LOG_REPEAT_SECONDS:
                self._error_log[key] = now
                self._log.warning(
                    "nvml_error", function=err.function, error=err.error, device=err.device_index,
                    count=self._error_counts[key],
                )
        lost = {d.index for d in sample.devices if d.lost}
        for d in sample.devices:
            if d.lost and d.index not in self._lost_devices:
                self._log.error("device_lost", device=d.index, uuid=d.uuid)
            elif not d.lost and d.index in self._lost_devices:
                self._log.info("device_recovered", device=d.index, uuid=d.uuid)
        self._lost_devices = lost

    def _check_pending(self, now: float) -> None:
        self._terminator.check(now, self.config.mode)

    # -- compute -------------------------------------------------------------------------------

    def _apply_compute(self, decisions: Decisions, attribution: Attribution) -> None:
        """Log the core's throttle transitions and hand its plan to the executor (enforce mode)."""
        targets: dict[str, dict[tuple[int, int], SignalTarget]] = {}
        for p in attribution.processes:
            # The unattributed processes are one throttle group, held to the pod's budget.
            t = SignalTarget.of(p)
            targets.setdefault(p.container if p.container is not None else UNATTRIBUTED, {})[t.key] = t
        for change in decisions.throttle_changes:
            pids = sorted(t.pid for t in targets.get(change.container, {}).values())
            self._report.throttle(change, self.config.mode, pids)
        if self.config.mode is Mode.ENFORCE and (decisions.plan or self._throttle_planned):
            # The lease: if no poll renews the plans (the loop is stuck), the executor continues
            # everything by itself. With nothing planned now or before there is nothing to renew
            # or end: the executor's thread is not woken (at rest, that wake-up was a measurable
            # part of a poll's CPU).
            self._throttle_planned = bool(decisions.plan)
            self._throttle.update(
                {c: ThrottlePlan(f, tuple(targets.get(c, {}).values())) for c, f in decisions.plan.items()},
                lease_seconds=THROTTLE_LEASE_INTERVALS * self.config.poll_interval_seconds + 0.5,
            )

    def _release_compute(self, reason: str) -> None:
        """Continue everything, end every throttle, start the compute controller afresh."""
        self._throttle.release_all(reason.replace(" ", "_"))
        for change in self._core.release(reason):
            self._report.throttle(change, self.config.mode)

    # -- config --------------------------------------------------------------------------------

    def _publish_config(self) -> None:
        shares = {name: self._core.compute_share(name) for name in self.config.containers}
        self._metrics.set_compute_shares(shares)
        # Called with nothing throttled (start, config change): a 0 series per compute-limited container.
        self._metrics.throttled.clear()
        for name, share in shares.items():
            if share is not None:
                self._metrics.set_throttled(name, False)
        self._health.set_interval(self.config.poll_interval_seconds)
        self._report.two_unit_shares(self.config)

    def _maybe_reload(self) -> None:
        if self._config_source is None:
            return
        new = self._config_source()
        if new is None or new == self.config:
            return
        self.apply_config(new)

    def apply_config(self, new: EnforcerConfig) -> None:
        """Switch to a new config: continue everything throttled, start compute tracking afresh."""
        old = self.config
        self._throttle.release_all("config_changed")
        for change in self._core.reconfigure(new):
            self._report.throttle(change, self.config.mode)  # under the old config's shares and mode
        self._terminator.config_changed(old.grace_period_seconds, new.grace_period_seconds, new.mode)
        self._publish_config()
        self._log.info("config_changed", mode=new.mode, config=new.to_dict())


def _short_error(exc: BaseException) -> str:
    """A low-cardinality ``error`` label: the NVML error name in the message, else a coarse kind."""
    text = str(exc)
    match = re.search(r"NVML_ERROR_([A-Z_]+)", text)
    if match:
        return match.group(1)
    if "not found" in text or "does not exist" in text or "cannot load" in text:
        return "LIBRARY_NOT_FOUND"
    return type(exc).__name__
