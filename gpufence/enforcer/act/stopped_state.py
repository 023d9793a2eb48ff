"""The stopped-process state file: ``<state-dir>/stopped.json``.

Before the throttle executor SIGSTOPs a process it records ``(pid, start_time_ticks, container)``
here; after SIGCONT it removes the entry. Every change rewrites the whole file atomically
(``state_files.write_json``), so a reader sees the old or the new content, never a torn one.
If the enforcer dies while holding processes stopped (SIGKILL, OOM kill), the restarted enforcer
calls :func:`recover` before anything else: every recorded process whose start time still
matches is SIGCONTed (through the safe signaller). A process that is gone or whose PID was reused
(the start-time check) is dropped from the file; one whose SIGCONT failed (EPERM: a process the
enforcer may not signal) stays in the file, and the throttle executor retries it with its own
failed SIGCONTs until it runs or is gone, so no restart, however many, forgets it.

A record is written *before* the SIGSTOP, so the file may name a process that was never stopped
(the enforcer died in between): SIGCONT to a running process is harmless.

Format::

    {"version": 1, "stopped": [{"pid": 42, "start_time_ticks": 123456, "container": "train"}]}
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpufence.enforcer.act.signals import Outcome, SafeSignaller, SignalTarget
from gpufence.enforcer.act.state_files import read_json, write_json
from gpufence.enforcer.report.decision_log import DecisionLog

FILE_NAME = "stopped.json"
VERSION = 1


class StoppedState:
    def __init__(self, state_dir: str | os.PathLike[str] | None, log: DecisionLog) -> None:
        self._log = log
        self._lock = threading.Lock()
        self._entries: dict[tuple[int, int], SignalTarget] = {}
        self.path: Path | None = Path(state_dir) / FILE_NAME if state_dir else None
        self._warned = False

    # -- reading -------------------------------------------------------------------------------

    def load(self) -> list[SignalTarget]:
        """The entries of the file on disk (an unreadable or corrupt file gives [] and a log line)."""
        if self.path is None:
            return []
        try:
            doc = read_json(self.path)
        except (OSError, ValueError) as exc:
            self._log.error("stopped_state_unreadable", path=str(self.path), error=str(exc))
            return []
        targets: list[SignalTarget] = []
        for item in doc.get("stopped", []) if isinstance(doc, dict) else []:
            try:
                pid, start = int(item["pid"]), int(item["start_time_ticks"])
            except (KeyError, TypeError, ValueError):
                continue
            container = item.get("container")
            # The container is only informative here (and must be non-empty for the signaller).
            targets.append(SignalTarget(pid, start, container if isinstance(container, str) else "<unknown>"))
        return targets

    def entries(self) -> list[SignalTarget]:
        with self._lock:
            return list(self._entries.values())

    # -- writing -------------------------------------------------------------------------------

    def add(self, targets: Iterable[SignalTarget]) -> None:
        with self._lock:
            changed = False
            for t in targets:
                if t.key not in self._entries:
                    self._entries[t.key] = t
                    changed = True
            if changed:
                self._write_locked()

    def remove(self, targets: Iterable[SignalTarget]) -> None:
        with self._lock:
            changed = False
            for t in targets:
                if self._entries.pop(t.key, None) is not None:
                    changed = True
            if changed:
                self._write_locked()

    def clear(self) -> None:
        self.replace(())

    def replace(self, targets: Iterable[SignalTarget]) -> None:
        """Record exactly ``targets`` (written even when nothing changed in memory: the file on
        disk may hold a previous enforcer's entries)."""
        with self._lock:
            self._entries = {t.key: t for t in targets}
            self._write_locked()

    def _write_locked(self) -> None:
        if self.path is None:
            return
        doc = {
            "version": VERSION,
            "stopped": [
                {"pid": t.pid, "start_time_ticks": t.start_time_ticks, "container": t.container}
                for t in sorted(self._entries.values(), key=lambda t: t.key)
            ],
        }
        try:
            write_json(self.path, doc)
        except OSError as exc:
            # Without the file a crash could leave processes stopped; say so loudly, keep going
            # (the in-process release on exit still works).
            if not self._warned:
                self._warned = True
                self._log.error("stopped_state_unwritable", path=str(self.path), error=str(exc))


@dataclass(frozen=True)
class Recovery:
    recorded: int  # entries in the file
    continued: int  # SIGCONT sent
    unreleased: tuple[SignalTarget, ...]  # SIGCONT failed: still stopped, still on record


def recover(state: StoppedState, signaller: SafeSignaller, log: DecisionLog) -> Recovery:
    """SIGCONT every process a previous enforcer left recorded as stopped. The file keeps the ones
    whose SIGCONT failed (``Recovery.unreleased``: hand them to the throttle executor to retry)."""
    targets = state.load()
    continued = 0
    unreleased: list[SignalTarget] = []
    for target in targets:
        signaller.adopt_stopped(target)
        outcome = signaller.send(target, signal.SIGCONT, reason="recover_stopped_state")
        if outcome is Outcome.SENT:
            continued += 1
        elif outcome is Outcome.FAILED:
            unreleased.append(target)
        # GONE, REUSED: nothing of ours to continue. REFUSED: PID <= 1, the enforcer or one of its
        # ancestors, which are running (this process is one of them): not a record of ours.
    if targets:
        log.info(
            "stopped_state_recovered",
            path=str(state.path), recorded=len(targets), continued=continued, unreleased=len(unreleased),
        )
    state.replace(unreleased)
    return Recovery(len(targets), continued, tuple(unreleased))
