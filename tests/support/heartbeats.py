"""Heartbeats as the enforcer writes them, for the probe's tests (unit and integration): the file
the sidecar's exec probe reads, naming any process the test chooses."""

from __future__ import annotations

from pathlib import Path

from gpufence.enforcer import probe


def start_time(pid: int) -> int:
    """The process's start time in clock ticks (field 22 of /proc/<pid>/stat), read independently
    of the enforcer's own procfs code."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def write_heartbeat(state: Path, pid: int, *, live: bool = True, age: float = 0.0, bound: float = 5.0,
                    started: int | None = None, detail: str = "ok") -> None:
    """Write ``state``'s heartbeat naming ``pid`` (its real start time unless ``started``), ``age``
    seconds old, with the staleness ``bound`` and the liveness the enforcer would give it."""
    text = probe.heartbeat_text(live, detail, probe.clock() - age, bound, pid,
                                start_time(pid) if started is None else started)
    (state / probe.HEARTBEAT_FILE).write_text(text)
