"""The guardian's state file (``<state-dir>/guardian.json``, a host path only the guardian writes):
what one guardian process hands to the next, so that a restart or an upgrade mid-termination
neither grants a new grace period nor signals twice, and leaves no container frozen.

Format::

    {"version": 1, "boot_id": "...",
     "episodes": [{"cgroup": "/kubepods/...", "reason": "unaccounted", "started": 5000.5,
                   "term_at": 5000.5, "kill_at": 5010.5, "termed": true,
                   "placement": {"pod_uid": ..., "container_id": ..., "path": ..., "unified": ..., "freezer": ...},
                   "record": {...}}],
     "frozen": [{"pod_uid": ..., ...}]}

Times are ``CLOCK_BOOTTIME`` seconds (one clock for every process of the node, never set by NTP);
after a reboot (another boot id) nothing recorded holds. ``frozen`` lists every cgroup the freezer
may hold, written before each freeze: a guardian that dies (SIGKILL, OOM) mid-cycle leaves it
frozen, and the next one thaws it before anything else. Rewritten whole, atomically
(``enforcer.act.state_files``: a temp file, then a rename).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gpufence.contract import MAX_GRACE_PERIOD_SECONDS
from gpufence.enforcer.act.kill_deadlines import boot_id
from gpufence.enforcer.act.state_files import read_json, write_json
from gpufence.node.census import Placement
from gpufence.node.decide import Episode

FILE_NAME = "guardian.json"
VERSION = 1


@dataclass(frozen=True)
class Recovered:
    episodes: tuple[Episode, ...]
    frozen: tuple[Placement, ...]
    problem: str | None = None  # why nothing was recovered from a file that is there


class GuardianState:
    def __init__(self, state_dir: str | os.PathLike[str], *, boot: str | None = None) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self._boot = boot if boot is not None else boot_id()
        self._episodes: tuple[Episode, ...] = ()
        self._frozen: dict[str, Placement] = {}
        self._lock = threading.Lock()  # the poll thread records episodes, the throttle thread freezes

    def load(self, now: float) -> Recovered:
        """What the last guardian recorded; a deadline is never further than the longest grace."""
        try:
            doc = read_json(self.path)
        except (OSError, ValueError) as exc:
            return Recovered((), (), f"unreadable: {exc}")
        if doc is None:
            return Recovered((), ())
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            return Recovered((), (), "not a version 1 state document")
        if doc.get("boot_id") != self._boot:
            return Recovered((), (), "recorded before the last boot")
        episodes = tuple(e for e in map(lambda item: _episode(item, now), _list(doc, "episodes")) if e is not None)
        frozen = tuple(p for p in map(_placement, _list(doc, "frozen")) if p is not None)
        self._episodes = episodes
        self._frozen = {p.path: p for p in frozen if p.path is not None}
        return Recovered(episodes, frozen)

    def save_episodes(self, episodes: Iterable[Episode]) -> None:
        episodes = tuple(episodes)
        with self._lock:
            if episodes != self._episodes:
                self._episodes = episodes
                self._write()

    def mark_frozen(self, where: Placement) -> None:
        """Record before the freeze (raises OSError: then the caller does not freeze)."""
        with self._lock:
            if where.path is not None and where.path not in self._frozen:
                self._frozen[where.path] = where
                self._write()

    def mark_thawed(self, where: Placement) -> None:
        with self._lock:
            if where.path is not None and self._frozen.pop(where.path, None) is not None:
                self._write()

    def _write(self) -> None:
        write_json(self.path, {
            "version": VERSION, "boot_id": self._boot,
            "episodes": [_episode_doc(e) for e in self._episodes],
            "frozen": [_placement_doc(p) for p in self._frozen.values()],
        })


def _list(doc: Mapping[str, Any], key: str) -> list[Any]:
    items = doc.get(key)
    return items if isinstance(items, list) else []


def _placement_doc(p: Placement) -> dict[str, Any]:
    return {"pod_uid": p.pod_uid, "container_id": p.container_id, "path": p.path, "unified": p.unified,
            "freezer": p.freezer}


def _placement(item: Any) -> Placement | None:
    if not isinstance(item, dict) or not isinstance(item.get("path"), str):
        return None
    values = [item.get(k) for k in ("pod_uid", "container_id", "path", "unified", "freezer")]
    if not all(v is None or isinstance(v, str) for v in values):
        return None
    return Placement(*values)


def _episode_doc(e: Episode) -> dict[str, Any]:
    return {"cgroup": e.cgroup, "reason": e.reason, "started": e.started, "term_at": e.term_at,
            "kill_at": e.kill_at, "termed": e.termed, "placement": _placement_doc(e.placement),
            "record": dict(e.record)}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _episode(item: Any, now: float) -> Episode | None:
    if not isinstance(item, dict):
        return None
    where = _placement(item.get("placement"))
    started, kill_at = _number(item.get("started")), _number(item.get("kill_at"))
    term_at = _number(item.get("term_at"))
    cgroup, reason = item.get("cgroup"), item.get("reason")
    if where is None or started is None or kill_at is None or not (isinstance(cgroup, str) and isinstance(reason, str)):
        return None
    if item.get("term_at") is not None and term_at is None:
        return None
    record = item.get("record")
    # A record cannot hold a SIGKILL back longer than any grace period can be.
    kill_at = min(kill_at, now + MAX_GRACE_PERIOD_SECONDS)
    return Episode(cgroup, where, reason, started, term_at, kill_at, termed=item.get("termed") is True,
                   record=MappingProxyType(dict(record) if isinstance(record, dict) else {}))
