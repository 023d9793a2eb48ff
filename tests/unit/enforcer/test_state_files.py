"""The state directory's files on their own: the pending-SIGKILL record (``kill_deadlines.py``) as a
restarted enforcer reads it back, including records it must not trust; what a write costs; and the
volume the webhook gives them."""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import pytest

from gpufence.contract import MAX_GRACE_PERIOD_SECONDS
from gpufence.enforcer.act.kill_deadlines import FILE_NAME, KillDeadlines, PendingKill, boot_clock, boot_id
from gpufence.enforcer.act.signals import SignalTarget
from gpufence.enforcer.act.stopped_state import StoppedState
from gpufence.enforcer.report.decision_log import DecisionLog


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


def test_a_state_file_write_pays_no_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files need to outlive the enforcer process, not the kernel (a node that crashes takes
    every recorded process with it), and the throttle rewrites stopped.json on every SIGSTOP and
    SIGCONT: a write is a temp file and a rename, never a flush to the disk."""
    synced: list[int] = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda fd, real=real: synced.append(fd) or real(fd))
    log, _ = _log()
    state = StoppedState(tmp_path, log)
    state.add([SignalTarget(42, 7, "train")])
    state.remove([SignalTarget(42, 7, "train")])
    KillDeadlines(tmp_path, log).write([PendingKill(1.0, {}, target=SignalTarget(42, 7, "train"))])
    assert synced == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kill_deadlines.json", "stopped.json"]
    assert json.loads((tmp_path / "stopped.json").read_text())["stopped"] == []


def test_the_sidecar_state_volume_is_a_small_tmpfs_the_files_fit_in(tmp_path: Path) -> None:
    """Memory-backed: it survives a restart of the sidecar within the pod (what the files are for)
    and costs no disk I/O per signal. Its pages count against the sidecar's memory, so it is small,
    yet big enough for both files at their largest plausible size, twice (a temp file before its
    rename): 10,000 processes held stopped and 10,000 pending SIGKILLs."""
    from gpufence.quantity import parse_bytes
    from gpufence.webhook.core.settings import InjectionSettings
    from gpufence.webhook.core.sidecar import STATE_VOLUME, pod_volumes

    (volume,) = [v for v in pod_volumes(InjectionSettings()) if v["name"] == STATE_VOLUME]
    assert volume["emptyDir"]["medium"] == "Memory"
    limit = parse_bytes(volume["emptyDir"]["sizeLimit"])
    assert limit <= 16 << 20

    log, _ = _log()
    many = [SignalTarget(4_000_000 + i, 10**12 + i, "c" * 63) for i in range(10_000)]
    StoppedState(tmp_path, log).add(many)
    order = {"container": "c" * 63, "device_uuid": "GPU-" + "f" * 36, "device_index": 7, "used_bytes": 2**50,
             "limit_bytes": 2**50, "gpus_requested": 8, "devices_used": list(range(8))}
    KillDeadlines(tmp_path, log).write([PendingKill(3600.0, order, target=t) for t in many])
    used = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert 2 * used < limit
