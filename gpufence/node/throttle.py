"""The compute duty cycle with the cgroup freezer: each throttled container runs its run fraction of
every period and is frozen for the rest.

The plan (cgroup -> run fraction) is the enforcer core's (``NodeDecisions.throttle``); this thread
only carries it out. Each period starts with every planned container thawed; each is frozen once its
fraction of the period has passed. The period's length is drawn within 10 % of the configured one,
as the sidecar's executor does, so the phases do not stay in step with the driver's sampling clock.

Never left frozen: a container leaving the plan, a plan not renewed within its lease (the poll loop
stuck or dead), ``release`` before a termination, ``stop`` (SIGTERM, exit) and any error thaw it;
every cgroup is recorded in the state file before it is frozen, so a guardian that dies mid-cycle
is followed by one that thaws it first (``gpufence.node.state``).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping

from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.node.census import Placement
from gpufence.node.cgroupfs import CgroupError, CgroupFs
from gpufence.node.decide import ThrottleTarget
from gpufence.node.state import GuardianState

PERIOD_JITTER = 0.1


class FreezerThrottle:
    def __init__(self, fs: CgroupFs, state: GuardianState, log: DecisionLog, *, period: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fs = fs
        self._state = state
        self._log = log
        self._period = period
        self._clock = clock
        self._cond = threading.Condition()
        self._plan: dict[str, ThrottleTarget] = {}
        self._lease_until = 0.0
        self._frozen: dict[str, Placement] = {}
        # Thawed within the cycle but still in the state file (frozen again within the period).
        self._recorded: dict[str, Placement] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._failed: set[str] = set()

    # -- the poll loop's side ---------------------------------------------------------------------

    def set_plan(self, plan: Mapping[str, ThrottleTarget], lease_seconds: float) -> None:
        with self._cond:
            self._plan = dict(plan)
            self._lease_until = self._clock() + lease_seconds
            for cgroup in list(self._frozen) + list(self._recorded):
                if cgroup not in self._plan:
                    self._thaw(cgroup)
            self._cond.notify_all()

    def release(self, cgroup: str) -> None:
        """Thaw ``cgroup`` and drop it from the plan (before it is terminated)."""
        with self._cond:
            self._plan.pop(cgroup, None)
            self._thaw(cgroup)

    def thaw_recorded(self, frozen: tuple[Placement, ...]) -> list[str]:
        """Thaw what a previous guardian recorded as frozen; the paths thawed."""
        thawed = []
        for where in frozen:
            try:
                self._fs.thaw(where)
                thawed.append(where.path or "")
            except CgroupError as exc:
                self._log.error("thaw_failed", cgroup=where.path, error=str(exc))
                continue
            self._state.mark_thawed(where)
        return thawed

    @property
    def frozen(self) -> tuple[str, ...]:
        with self._cond:
            return tuple(self._frozen)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="freezer-throttle", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            self._thaw_all()

    # -- the cycle ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        return
                    if not self._plan or self._clock() > self._lease_until:
                        if self._plan:
                            self._log.warning("throttle_lease_expired", frozen=sorted(self._frozen))
                            self._plan = {}
                        self._thaw_all()
                        self._cond.wait(self._period)
                        continue
                    self._cycle()
        except BaseException as exc:  # never leave a container frozen behind a dead thread
            with self._cond:
                self._thaw_all()
            self._log.error("throttle_thread_died", error=repr(exc))
            raise

    def _cycle(self) -> None:
        """One period (called and returning with the lock held; waits release it)."""
        start = self._clock()
        period = self._period * (1 + random.uniform(-PERIOD_JITTER, PERIOD_JITTER))
        for cgroup in list(self._frozen):
            self._thaw(cgroup, forget=False)  # still recorded: it is frozen again within this period
        pending = sorted(self._plan.items(), key=lambda item: item[1].fraction)
        for cgroup, target in pending:
            if not self._wait_until(start + target.fraction * period):
                return
            current = self._plan.get(cgroup)
            if current is not None and current.fraction < 1.0:
                self._freeze(cgroup, current.placement)
        self._wait_until(start + period)

    def _wait_until(self, when: float) -> bool:
        while not self._stopping:
            remaining = when - self._clock()
            if remaining <= 0:
                return True
            self._cond.wait(remaining)
        return False

    def _freeze(self, cgroup: str, where: Placement) -> None:
        try:
            self._state.mark_frozen(where)
        except OSError as exc:
            self._log_once(cgroup, "throttle_unrecorded", error=str(exc))
            return  # unrecorded, a freeze could outlive a crash of this process: not frozen
        try:
            self._fs.freeze(where)
        except CgroupError as exc:
            self._log_once(cgroup, "freeze_failed", error=str(exc))
            self._state.mark_thawed(where)
            return
        self._frozen[cgroup] = where

    def _thaw(self, cgroup: str, *, forget: bool = True) -> None:
        """Thaw; ``forget`` also drops it from the state file (it leaves the plan)."""
        where = self._frozen.pop(cgroup, None)
        if where is None and forget:
            where = self._recorded.pop(cgroup, None)
            if where is not None:
                self._forget(cgroup, where)
            return
        if where is None:
            return
        try:
            self._fs.thaw(where)
        except CgroupError as exc:
            self._frozen[cgroup] = where  # retried at the next period
            self._log_once(cgroup, "thaw_failed", error=str(exc))
            return
        if forget:
            self._recorded.pop(cgroup, None)
            self._forget(cgroup, where)
        else:
            self._recorded[cgroup] = where

    def _forget(self, cgroup: str, where: Placement) -> None:
        try:
            self._state.mark_thawed(where)
        except OSError as exc:
            self._log_once(cgroup, "throttle_unrecorded", error=str(exc))

    def _thaw_all(self) -> None:
        for cgroup in list(self._frozen) + list(self._recorded):
            self._thaw(cgroup)

    def _log_once(self, cgroup: str, event: str, **fields: object) -> None:
        key = f"{event}:{cgroup}"
        if key not in self._failed:
            self._failed.add(key)
            self._log.error(event, cgroup=cgroup, **fields)
