"""The compute throttle executor: SIGSTOP/SIGCONT duty cycles, on a thread of its own.

For each throttled container the poll loop hands over a :class:`ThrottlePlan`: the run fraction
``f`` from ``rules.ComputeTracker.plan`` and the container's GPU processes. The executor runs the
container for ``f * period`` seconds, then stops it for ``(1 - f) * period``, and so on; a new
container starts with a run phase. The thread sleeps on a condition variable until the next phase
switch (or an update), so it keeps time independently of NVML calls in the poll loop.

Each cycle's length is drawn anew within ``PERIOD_JITTER`` of the period (the mean stays the
period). A real driver samples per-process utilisation on a fixed clock (every 0.2 s on an H200,
driver 580) and a 1 s cycle kept to the period would hold its run phase at the same instants of
that clock: the controller would see the run fraction in steps of a fifth, not as it is. In a
simulation of that sampling (``bench/compute_sampling.py``) the container ended 14-19 % under its
share with a fixed period and within 4 % of it with the jitter.

Invariants (a stopped process is never left behind):

* every SIGSTOP is preceded by a record in the stopped-state file, every SIGCONT followed by the
  removal of the record;
* a container dropped from the plan is continued at once (``update``); ``release_all`` continues
  everything (config change, audit mode); ``close`` does the same and ends the thread — the CLI
  calls it on SIGTERM/SIGINT, on exceptions and from ``atexit``;
* a process that leaves the plan's target list while stopped is continued;
* ``exempt`` continues a process and never stops it again (the memory enforcer SIGTERMs a process
  it may hold stopped: a stopped process would not act on SIGTERM until continued);
* a SIGCONT that fails (EPERM, ...) leaves the process recorded, in memory and in the state file,
  and is retried every ``RETRY_SECONDS`` until the process runs or is gone (also by ``close``);
  so are the processes a previous enforcer left stopped whose SIGCONT failed at recovery
  (``hold_unreleased``);
* a plan carries a lease (``update(..., lease_seconds=...)``): when no fresh poll renews it in time
  (the poll loop is stuck), everything is continued (``lease_expired``);
* an unexpected exception in the thread continues everything, is logged, and the thread goes on.

A SIGSTOP is only as good as nobody else's SIGCONT: any process of the workload's user may continue
a stopped process (a helper sending SIGCONT every millisecond made the time stopped fall from 95 %
to 0 % while the container was reported throttled). So during each stopped phase the executor
reads the state of every process it holds stopped (``/proc/<pid>/stat``, one small read, every
``EVASION_CHECK_SECONDS`` once ``EVASION_SETTLE_SECONDS`` have passed since its SIGSTOP); one seen
running is stopped again at once, and one seen running in ``EVASION_PHASES`` stopped phases within
``EVASION_WINDOW_SECONDS`` (not only in a row: a helper that continues it in every other stopped
phase doubled its running time while a streak never formed, issue 32 row 5) is reported
(``take_evasions``): the poll loop hands the reports to the core, which orders the container
terminated (``rules.evasion_orders``). Evidence, not chance: a process in ``D`` (uninterruptible: it
acts on the SIGSTOP when it leaves the kernel) is not counted, nor one whose SIGSTOP is still pending
(``SafeSignaller.stop_pending``: delivered late on a loaded node, it has not acted on it yet, while a
SIGCONT from elsewhere discards a pending SIGSTOP), nor a phase in which it was seen stopped at every
check. So a process is counted only when something else continued it, and what it can take before
it is terminated is less than ``EVASION_PHASES`` stopped phases per window.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpufence.enforcer.act.signals import Outcome, SafeSignaller, SignalTarget
from gpufence.enforcer.act.stopped_state import StoppedState
from gpufence.enforcer.decide.rules import Evasion
from gpufence.enforcer.report.decision_log import DecisionLog

# Each cycle lasts the period times a factor drawn from [1 - PERIOD_JITTER, 1 + PERIOD_JITTER].
PERIOD_JITTER = 0.1
# How often a failed SIGCONT is retried.
RETRY_SECONDS = 0.2
# Throttle evasion: how often a stopped phase is checked, how long after its SIGSTOP a process is
# first checked, and in how many stopped phases within how many seconds it must be seen running to
# be reported (in any order: every other phase counts as much as two in a row). At most one stopped
# phase a minute can go to a helper's SIGCONTs before the container is terminated.
EVASION_CHECK_SECONDS = 0.05
EVASION_SETTLE_SECONDS = 0.02
EVASION_PHASES = 2
EVASION_WINDOW_SECONDS = 60.0
# States that say nothing about evasion: stopped (T, t), signal not yet acted on (D), gone (Z, X).
_NOT_RUNNING = frozenset("TtDZX")


def cycle_length(period: float, jitter: float, rng: random.Random) -> float:
    """One duty cycle's length: ``period`` times a factor drawn evenly from [1 - jitter, 1 + jitter]."""
    return period * (1 + jitter * (2 * rng.random() - 1))


@dataclass(frozen=True)
class ThrottlePlan:
    fraction: float                       # run fraction of each period, in (0, 1)
    targets: tuple[SignalTarget, ...]


@dataclass
class _Cycle:
    fraction: float
    targets: dict[tuple[int, int], SignalTarget]
    period: float  # this cycle's length: the executor's period with its jitter
    running: bool = True
    phase_start: float = 0.0
    stopped: dict[tuple[int, int], SignalTarget] = field(default_factory=dict)
    stopped_at: dict[tuple[int, int], float] = field(default_factory=dict)  # when we sent its SIGSTOP
    seen_now: set[tuple[int, int]] = field(default_factory=set)  # seen running in this stopped phase
    reported: set[tuple[int, int]] = field(default_factory=set)

    def pause_seconds(self) -> float:
        """How long this cycle's processes stay stopped (0 at a run fraction of 1)."""
        return self.period - self.fraction * self.period

    def phase_seconds(self) -> float:
        """The length of the phase the cycle is in: its run phase, or its stopped phase."""
        return self.fraction * self.period if self.running else self.pause_seconds()


class ThrottleExecutor:
    def __init__(
        self,
        signaller: SafeSignaller,
        state: StoppedState,
        log: DecisionLog,
        *,
        period_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        jitter: float = PERIOD_JITTER,
        rng: random.Random | None = None,
    ) -> None:
        if period_seconds <= 0:
            raise ValueError("period_seconds must be positive")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
        self._signaller = signaller
        self._state = state
        self._log = log
        self._period = period_seconds
        self._clock = clock
        self._jitter = jitter
        self._rng = rng or random.Random()
        self._cond = threading.Condition()
        self._cycles: dict[str, _Cycle] = {}
        self._exempt: set[tuple[int, int]] = set()
        # Processes we stopped whose SIGCONT failed: still ours to continue (and still on record).
        self._unreleased: dict[tuple[int, int], SignalTarget] = {}
        self._lease_until: float | None = None
        self._evasions: list[Evasion] = []
        # process -> when it was seen running in a stopped phase (one entry a phase), within the window
        self._evaded_at: dict[tuple[int, int], deque[float]] = {}
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpufence-throttle", daemon=True)
            self._thread.start()

    def close(self, reason: str = "shutdown") -> None:
        """Continue everything and end the thread. Idempotent; safe from atexit and signal paths."""
        with self._cond:
            self._closing = True
            self._release_all_locked(reason)
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    # -- commands from the poll loop -----------------------------------------------------------

    def update(self, plans: Mapping[str, ThrottlePlan], *, lease_seconds: float | None = None) -> None:
        """Replace the plans. With ``lease_seconds``, everything is continued unless another update
        comes within that time (a throttle never runs on a plan no fresh measurement renews)."""
        with self._cond:
            if self._closing:
                return
            now = self._clock()
            self._lease_until = now + lease_seconds if lease_seconds is not None and plans else None
            for name in list(self._cycles):
                if name not in plans:
                    ended = self._cycles.pop(name)
                    self._continue_locked(ended, list(ended.stopped.values()), "throttle_stop")
            for name, plan in plans.items():
                fraction = min(max(plan.fraction, 0.0), 1.0)
                targets = {t.key: t for t in plan.targets if t.key not in self._exempt}
                cycle = self._cycles.get(name)
                if cycle is None:
                    self._cycles[name] = _Cycle(fraction, targets, self._cycle_length(), running=True, phase_start=now)
                    continue
                cycle.fraction = fraction
                cycle.targets = targets
                gone = [t for k, t in cycle.stopped.items() if k not in targets]
                if gone:
                    self._continue_locked(cycle, gone, "left_throttle_plan")
                if not cycle.running:
                    new = [t for k, t in targets.items() if k not in cycle.stopped]
                    if new:
                        self._stop_locked(cycle, new)
            # An exemption lasts as long as the process (its NVML entry may come back next poll).
            self._exempt = {k for k in self._exempt if self._signaller.alive(SignalTarget(k[0], k[1], "-"))}
            self._cond.notify_all()

    def exempt(self, target: SignalTarget) -> None:
        """Continue ``target`` if we hold it stopped and never stop it again."""
        with self._cond:
            self._exempt.add(target.key)
            for cycle in self._cycles.values():
                cycle.targets.pop(target.key, None)
                if target.key in cycle.stopped:
                    self._continue_locked(cycle, [cycle.stopped[target.key]], "exempt")

    def hold_unreleased(self, targets: Iterable[SignalTarget]) -> None:
        """Take over stopped processes whose SIGCONT failed (a previous enforcer's, from
        ``stopped_state.recover``): kept on record and retried like this executor's own."""
        held = list(targets)
        if not held:
            return
        with self._cond:
            self._state.add(held)
            self._unreleased.update((t.key, t) for t in held)
            self._cond.notify_all()

    def release_all(self, reason: str) -> None:
        with self._cond:
            self._release_all_locked(reason)
            self._cond.notify_all()

    def take_evasions(self) -> list[Evasion]:
        """The evasions seen since the last call (each process reported once per throttle)."""
        with self._cond:
            found, self._evasions = self._evasions, []
            return found

    def throttled(self) -> set[str]:
        with self._cond:
            return set(self._cycles)

    def stopped_targets(self) -> list[SignalTarget]:
        """Every process this executor holds stopped (failed SIGCONTs included)."""
        with self._cond:
            held = {t.key: t for c in self._cycles.values() for t in c.stopped.values()}
            held.update(self._unreleased)
            return list(held.values())

    # -- internals (called with the lock held) -------------------------------------------------

    def _release_all_locked(self, reason: str) -> None:
        for cycle in self._cycles.values():
            self._continue_locked(cycle, list(cycle.stopped.values()), reason)
        self._cycles.clear()
        self._lease_until = None
        self._retry_locked()

    def _stop_locked(self, cycle: _Cycle, targets: Iterable[SignalTarget]) -> None:
        targets = [t for t in targets if t.key not in cycle.stopped and t.key not in self._exempt]
        if not targets:
            return
        self._state.add(targets)  # recorded before the SIGSTOP
        not_stopped = []
        for t in targets:
            outcome = self._signaller.send(t, signal.SIGSTOP, reason="compute_over_share")
            if outcome is Outcome.SENT:
                cycle.stopped[t.key] = t
                cycle.stopped_at[t.key] = self._clock()
            else:
                not_stopped.append(t)
        if not_stopped:
            self._state.remove(not_stopped)

    def _continue_locked(self, cycle: _Cycle, targets: Iterable[SignalTarget], reason: str) -> None:
        released = []
        for t in targets:
            cycle.stopped.pop(t.key, None)
            cycle.stopped_at.pop(t.key, None)
            if self._sigcont(t, reason):
                released.append(t)
        self._state.remove(released)

    def _sigcont(self, target: SignalTarget, reason: str) -> bool:
        """SIGCONT; False (and kept for a retry, still on record) unless it ran or is gone."""
        outcome = self._signaller.send(target, signal.SIGCONT, reason=reason)
        if outcome in (Outcome.SENT, Outcome.GONE, Outcome.REUSED, Outcome.DRY_RUN):
            self._unreleased.pop(target.key, None)
            return True
        self._unreleased[target.key] = target
        return False

    def _retry_locked(self) -> None:
        retry = list(self._unreleased.values())
        if retry:
            self._state.remove([t for t in retry if self._sigcont(t, "retry_sigcont")])

    def _check_evasion_locked(self, cycle: _Cycle, now: float) -> None:
        """In a stopped phase: is every process we stopped still stopped? One seen running is
        stopped again (until something continues it again) and counted once per phase; at
        ``EVASION_PHASES`` phases within ``EVASION_WINDOW_SECONDS`` it is reported."""
        for key, t in list(cycle.stopped.items()):
            if now - cycle.stopped_at.get(key, now) < EVASION_SETTLE_SECONDS:
                continue
            state = self._signaller.state(t)
            if state is None or state in _NOT_RUNNING:
                continue
            if self._signaller.stop_pending(t):
                continue  # our SIGSTOP is on its way (a loaded node): nobody continued it
            if key not in cycle.seen_now:
                cycle.seen_now.add(key)
                seen = self._evaded_at.setdefault(key, deque())
                seen.append(now)
                while seen and seen[0] <= now - EVASION_WINDOW_SECONDS:
                    seen.popleft()
                self._log.debug("throttle_found_running", container=t.container, pid=t.pid, state=state,
                                phases=len(seen))
                if len(seen) >= EVASION_PHASES and key not in cycle.reported:
                    cycle.reported.add(key)
                    self._evasions.append(Evasion(t.container, t.pid, t.start_time_ticks, state, len(seen)))
                    self._cond.notify_all()
            self._signaller.send(t, signal.SIGSTOP, reason="compute_over_share_found_running")
            cycle.stopped_at[key] = now

    def _end_stopped_phase_locked(self, cycle: _Cycle) -> None:
        """A stopped phase ends: what was seen in it outside the window is forgotten."""
        cycle.seen_now.clear()
        oldest = self._clock() - EVASION_WINDOW_SECONDS
        for key in list(self._evaded_at):
            seen = self._evaded_at[key]
            while seen and seen[0] <= oldest:
                seen.popleft()
            if not seen:
                del self._evaded_at[key]

    # -- the thread ----------------------------------------------------------------------------

    def _cycle_length(self) -> float:
        return cycle_length(self._period, self._jitter, self._rng)

    def _run(self) -> None:
        with self._cond:
            while not self._closing:
                try:
                    timeout = self._step_locked()
                except Exception as exc:  # never leave anything stopped on a bug
                    self._log.error("throttle_error", error=f"{type(exc).__name__}: {exc}")
                    try:
                        self._release_all_locked("throttle_error")
                    except Exception as exc2:
                        self._log.error("throttle_error", error=f"release failed: {exc2}")
                    timeout = self._period
                self._cond.wait(timeout=timeout)

    def _step_locked(self) -> float | None:
        """Do the phase switches that are due; return seconds until the next one (None: idle)."""
        now = self._clock()
        if self._lease_until is not None and now >= self._lease_until:
            self._log.warning("throttle_lease_expired", reason="no fresh poll renewed the throttle plans")
            self._release_all_locked("lease_expired")
        self._retry_locked()
        next_switch: float | None = now + RETRY_SECONDS if self._unreleased else None
        if self._lease_until is not None:
            next_switch = self._lease_until if next_switch is None else min(next_switch, self._lease_until)
        for cycle in self._cycles.values():
            due = cycle.phase_start + cycle.phase_seconds()
            if not cycle.running:
                self._check_evasion_locked(cycle, now)
            if now >= due:
                # Keep the cadence (next phase starts at the scheduled time) unless far behind.
                start = due if now - due < self._period else now
                if cycle.running and cycle.pause_seconds() > 0:
                    self._stop_locked(cycle, list(cycle.targets.values()))
                    cycle.running = False
                else:
                    self._end_stopped_phase_locked(cycle)
                    self._continue_locked(cycle, list(cycle.stopped.values()), "duty_cycle")
                    cycle.running = True
                    cycle.period = self._cycle_length()
                cycle.phase_start = start
                due = start + cycle.phase_seconds()
                if cycle.running and cycle.pause_seconds() <= 0:
                    due = start + cycle.period
            if not cycle.running and cycle.stopped:
                due = min(due, now + EVASION_CHECK_SECONDS)  # the next look at the stopped processes
            next_switch = due if next_switch is None else min(next_switch, due)
        if next_switch is None:
            return None
        return max(next_switch - self._clock(), 0.0)
