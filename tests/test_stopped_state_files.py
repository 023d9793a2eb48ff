"""The state directory's files on their own: the pending-SIGKILL record (``kill_deadlines.py``) as a
restarted enforcer reads it back, including records it must not trust."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from gpufence.enforcer.config import MAX_GRACE_PERIOD_SECONDS
from gpufence.enforcer.kill_deadlines import FILE_NAME, KillDeadlines, PendingKill, boot_clock, boot_id
from gpufence.enforcer.logs import DecisionLog
from gpufence.enforcer.signals import SignalTarget


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _log() -> tuple[DecisionLog, io.StringIO]:
    stream = io.StringIO()
    return DecisionLog(level="debug", stream=stream), stream


def test_deadlines_survive_as_time_left_on_a_clock_shared_by_both_enforcers(tmp_path: Path) -> None:
    log, _ = _log()
    clock = Clock(1000.0)
    order = {"container": "train", "device_uuid": "GPU-0", "limit_bytes": 5}
    KillDeadlines(tmp_path, log, clock=clock, boot="b1").write([
        PendingKill(2.5, order, target=SignalTarget(42, 7, "train")),
        PendingKill(-1.0, {}, target=SignalTarget(43, 8, None)),  # overdue, unattributed
        PendingKill(2.5, order, cgroup="/kubepods/pod1/train"),
    ])
    assert [p.name for p in tmp_path.iterdir()] == [FILE_NAME]  # no temp file left behind
    clock.now = 1001.0  # the next enforcer reads it one second later
    loaded = KillDeadlines(tmp_path, log, clock=clock, boot="b1").load()
    assert loaded == [
        PendingKill(1.5, order, target=SignalTarget(42, 7, "train")),
        PendingKill(-2.0, {}, target=SignalTarget(43, 8, None)),
        PendingKill(1.5, order, cgroup="/kubepods/pod1/train"),
    ]


def test_records_from_before_a_reboot_are_dropped(tmp_path: Path) -> None:
    log, stream = _log()
    KillDeadlines(tmp_path, log, clock=Clock(5.0), boot="before").write(
        [PendingKill(1.0, {}, target=SignalTarget(42, 7, "train"))]
    )
    assert KillDeadlines(tmp_path, log, clock=Clock(1.0), boot="after").load() == []
    assert '"event":"kill_deadlines_stale"' in stream.getvalue()


def test_malformed_records_are_skipped_and_a_far_deadline_is_bounded(tmp_path: Path) -> None:
    log, stream = _log()
    good = {"pid": 42, "start_time_ticks": 7, "container": "train", "deadline": 1e300, "order": {}}
    doc = {
        "version": 1, "boot_id": "b",
        "processes": [
            good,
            {**good, "pid": 1},  # PID 1 is never ours
            {**good, "pid": True},
            {**good, "start_time_ticks": "7"},
            {**good, "container": 3},
            {**good, "deadline": math.nan},
            {**good, "deadline": "soon"},
            "not a record",
        ],
        "cgroups": [{"cgroup": "", "deadline": 1.0}, {"deadline": 1.0}],
    }
    (tmp_path / FILE_NAME).write_text(json.dumps(doc))
    loaded = KillDeadlines(tmp_path, log, clock=Clock(0.0), boot="b").load()
    # A record cannot hold a SIGKILL back longer than the longest grace period.
    assert loaded == [PendingKill(MAX_GRACE_PERIOD_SECONDS, {}, target=SignalTarget(42, 7, "train"))]

    (tmp_path / FILE_NAME).write_text("{torn")
    assert KillDeadlines(tmp_path, log, clock=Clock(0.0), boot="b").load() == []
    assert '"event":"kill_deadlines_unreadable"' in stream.getvalue()


def test_the_real_clock_and_boot_id() -> None:
    first = boot_clock()
    assert boot_clock() >= first > 0
    assert boot_id() == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
