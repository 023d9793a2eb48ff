"""The pending-SIGKILL file: ``<state-dir>/kill_deadlines.json``.

Between the SIGTERM of a container over its memory share (or of an unattributed process the pod
budget chose) and the SIGKILL, the ``Terminator`` waits the grace period. Those deadlines are
recorded here *before* the SIGTERMs, so that a restarted sidecar (the kubelet restarting it after
a failed liveness probe or an OOM kill, or a workload that traps SIGTERM and kills its sidecar at
once) honours them: one grace period per episode, however often the sidecar restarts in it. The
restarted enforcer takes them over before its first poll and SIGKILLs at once what is overdue,
through the safe signaller (which re-checks that each PID still names the same process).

Deadlines are on ``CLOCK_BOOTTIME``: monotonic, never set by NTP or by hand, and one clock for
every process of the node, so for every incarnation of the sidecar in its pod. The boot id goes
with them: after a reboot no record holds (no recorded process survived it).

Format::

    {"version": 1, "boot_id": "...",
     "processes": [{"pid": 42, "start_time_ticks": 123456, "container": "train",
                    "deadline": 5012.25, "order": {...}}],
     "cgroups": [{"cgroup": "/kubepods/.../cri-containerd-...", "deadline": 5012.25, "order": {...}}]}

``container`` is null for an unattributed process; ``order`` is what the terminator's log lines
and Events say about the termination (opaque here). A cgroup record is the sweep of a container's
cgroup when its grace period ends (a worker its launcher restarted meanwhile included).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from gpufence.contract import MAX_GRACE_PERIOD_SECONDS
from gpufence.enforcer.act.signals import SignalTarget
from gpufence.enforcer.act.state_files import read_json, write_json
from gpufence.enforcer.report.decision_log import DecisionLog

FILE_NAME = "kill_deadlines.json"
VERSION = 1
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def boot_id(path: str = BOOT_ID_PATH) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class PendingKill:
    """A SIGKILL due ``remaining`` seconds from now (<= 0: overdue) for a process or a cgroup."""

    remaining: float
    order: Mapping[str, Any]
    target: SignalTarget | None = None  # a process ...
    cgroup: str | None = None  # ... or the sweep of a container's cgroup


class KillDeadlines:
    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None,
        log: DecisionLog,
        *,
        clock: Callable[[], float] = boot_clock,
        boot: str | None = None,
    ) -> None:
        self._log = log
        self._clock = clock
        self._boot = boot if boot is not None else boot_id()
        self.path: Path | None = Path(state_dir) / FILE_NAME if state_dir else None
        self._warned = False

    def load(self) -> list[PendingKill]:
        """The recorded deadlines, as seconds from now; [] (and a log line) for an unreadable file."""
        if self.path is None:
            return []
        try:
            doc = read_json(self.path)
        except (OSError, ValueError) as exc:
            self._log.error("kill_deadlines_unreadable", path=str(self.path), error=str(exc))
            return []
        if not isinstance(doc, dict):
            return []
        if doc.get("boot_id") != self._boot:
            self._log.info("kill_deadlines_stale", path=str(self.path), reason="recorded before the last boot")
            return []
        now = self._clock()
        pending: list[PendingKill] = []
        for kind in ("processes", "cgroups"):
            items = doc.get(kind)
            for item in items if isinstance(items, list) else ():
                kill = _parse(item, kind, now)
                if kill is not None:
                    pending.append(kill)
        return pending

    def write(self, pending: Iterable[PendingKill]) -> None:
        """Record exactly ``pending`` (``remaining`` from now)."""
        if self.path is None:
            return
        now = self._clock()
        processes, cgroups = [], []
        for kill in pending:
            common = {"deadline": now + kill.remaining, "order": dict(kill.order)}
            if kill.target is not None:
                t = kill.target
                processes.append({"pid": t.pid, "start_time_ticks": t.start_time_ticks, "container": t.container,
                                  **common})
            elif kill.cgroup is not None:
                cgroups.append({"cgroup": kill.cgroup, **common})
        doc = {"version": VERSION, "boot_id": self._boot, "processes": processes, "cgroups": cgroups}
        try:
            write_json(self.path, doc)
        except OSError as exc:
            # Without the file a restarted sidecar gives a new grace period; the SIGKILLs of this
            # process still fire.
            if not self._warned:
                self._warned = True
                self._log.error("kill_deadlines_unwritable", path=str(self.path), error=str(exc))


def _parse(item: Any, kind: str, now: float) -> PendingKill | None:
    if not isinstance(item, dict):
        return None
    deadline, order = item.get("deadline"), item.get("order")
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not math.isfinite(deadline):
        return None
    # Never wait longer than any grace period can be (a record cannot hold a SIGKILL back for ever).
    remaining = min(deadline - now, MAX_GRACE_PERIOD_SECONDS)
    order = order if isinstance(order, dict) else {}
    if kind == "cgroups":
        cgroup = item.get("cgroup")
        return PendingKill(remaining, order, cgroup=cgroup) if isinstance(cgroup, str) and cgroup else None
    pid, start, container = item.get("pid"), item.get("start_time_ticks"), item.get("container")
    if not (_is_int(pid) and pid > 1 and _is_int(start) and start >= 0):
        return None
    if container is not None and not isinstance(container, str):
        return None
    return PendingKill(remaining, order, target=SignalTarget(pid, start, container))


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
