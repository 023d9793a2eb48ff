"""enforcer.decide.machine: the decision state machine, poll by poll, without processes or signals."""

from __future__ import annotations

import itertools

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare, Mode
from gpufence.enforcer.decide.machine import UTILISATION_REFRESH_SECONDS, Core, Transition
from gpufence.enforcer.facts import Attribution, PodProcess

GiB = 1 << 30
CONFIG = EnforcerConfig(
    containers={
        "train": ContainerShare(memory=MemoryShare(bytes=4 * GiB), compute_percent=50),
        "eval": ContainerShare(memory=MemoryShare(bytes=4 * GiB)),
    }
)
TOTALS = {0: 80 * GiB}


def proc(pid: int, container: str | None, used: int, sm: int = 0) -> PodProcess:
    return PodProcess(pid, pid, 1000 + pid, container, 0, "GPU-0", used, sm)


def poll(*processes: PodProcess) -> Attribution:
    return Attribution(tuple(processes), ())


def test_memory_episodes_start_once_and_end_once() -> None:
    core = Core(CONFIG)
    under = core.step(0.0, poll(proc(1, "train", GiB)), TOTALS)
    assert under.orders == () and under.episodes_started == () and under.episodes_ended == ()
    over = poll(proc(1, "train", 5 * GiB), proc(2, None, 5 * GiB))
    first = core.step(0.5, over, TOTALS)
    assert [(o.container, [v.pid for v in o.victims]) for o in first.orders] == [(None, [2]), ("train", [1])]
    assert [o.container for o in first.episodes_started] == [None, "train"]
    again = core.step(1.0, over, TOTALS)
    assert len(again.orders) == 2 and again.episodes_started == ()  # same episodes: no new lines
    back = core.step(1.5, poll(proc(3, "train", GiB)), TOTALS)
    assert back.episodes_ended == ((None, 0), ("train", 0))


def test_unattributed_processes_are_reported_new_once() -> None:
    core = Core(CONFIG)
    anon = proc(7, None, GiB)
    assert core.step(0.0, poll(anon), TOTALS).new_unattributed == (anon,)
    assert core.step(0.5, poll(anon), TOTALS).new_unattributed == ()
    assert core.step(1.0, poll(anon), TOTALS).pods[0].unattributed_bytes == GiB


def test_throttle_transitions_have_one_owner() -> None:
    core = Core(CONFIG, compute_window_seconds=2.0, compute_period_seconds=0.5)
    changes = []
    now = 0.0
    for _ in range(4):  # 100 % against a 50 % share, instant plant
        fraction = core.throttled.get("train", 1.0)
        decisions = core.step(now, poll(proc(1, "train", 0, sm=round(100 * fraction))), TOTALS)
        changes += decisions.throttle_changes
        now += 0.5
    assert [c.transition for c in changes][:1] == [Transition.START]
    assert changes[0].share == 0.5 and changes[0].fraction == core.throttled["train"]
    assert dict(decisions.plan) == dict(core.throttled)
    # NVML lost: every throttle ends, reported as STOP with the reason; the controller starts afresh.
    (stop,) = core.release("nvml unavailable")
    assert (stop.container, stop.transition, stop.reason) == ("train", Transition.STOP, "nvml unavailable")
    assert core.throttled == {}
    assert core.step(now, poll(proc(1, "train", 0, sm=100)), TOTALS).plan == {}  # needs a full period again


def test_reconfigure_ends_throttles_and_episodes() -> None:
    core = Core(CONFIG, compute_window_seconds=1.0, compute_period_seconds=0.5)
    for i in range(3):
        core.step(i * 0.5, poll(proc(1, "train", 5 * GiB, sm=100)), TOTALS)
    assert core.throttled
    changes = core.reconfigure(EnforcerConfig(containers={"train": ContainerShare()}))
    assert [(c.container, c.transition) for c in changes] == [("train", Transition.STOP)]
    assert core.config.containers["train"] == ContainerShare()
    after = core.step(2.0, poll(proc(1, "train", 5 * GiB, sm=100)), TOTALS)
    assert after.orders == () and after.plan == {}


def test_polling_speeds_up_near_a_limit_or_on_fast_growth_and_settles_back() -> None:
    core = Core(CONFIG)
    core.step(0.0, poll(proc(1, "train", GiB)), TOTALS)
    assert core.poll_interval(0.5) == 0.5  # a quarter of its share: at rest
    core.step(0.5, poll(proc(1, "train", 3 * GiB // 2)), TOTALS)  # +0.5 GiB of a 4 GiB share: fast growth
    assert core.poll_interval(0.5) == 0.05
    core = Core(CONFIG)
    core.step(0.0, poll(proc(1, "train", 37 * GiB // 10)), TOTALS)  # 92 % of its share: close
    assert core.poll_interval(0.5) == 0.05
    assert core.poll_interval(0.06) == 0.05  # never under the minimum interval, never slower than base
    for i in range(25):  # steady, well under: back to the configured interval after the hold
        core.step(1.0 + i, poll(proc(1, "train", GiB)), TOTALS)
    assert core.poll_interval(0.5) == 0.5


def test_utilisation_is_read_once_per_duty_cycle_period_with_a_compute_share() -> None:
    # A compute share: once per period (1 s), whether the polls come every 0.5 s, 0.2 s or, near a
    # memory limit, every 0.05 s; a poll interval longer than the period reads at every poll.
    for interval, expected in ((0.5, 4), (0.2, 4), (0.05, 5), (2.0, 2)):
        core = Core(CONFIG)
        polls = [round(i * interval, 3) for i in range(int(3.9 / interval) + 1)]
        reads = [t for t in polls if core.wants_utilisation(t)]
        assert len(reads) == expected, (interval, reads)
        assert all(b - a >= 0.9 for a, b in itertools.pairwise(reads))
    core = Core(CONFIG, compute_period_seconds=2.0)
    assert [t / 2 for t in range(10) if core.wants_utilisation(t / 2)] == [0.0, 2.0, 4.0]
    # Memory shares only: the reading feeds the gauge, refreshed every UTILISATION_REFRESH_SECONDS.
    core = Core(EnforcerConfig(containers={"a": ContainerShare(memory=MemoryShare(bytes=GiB))}))
    reads = [t / 2 for t in range(24) if core.wants_utilisation(100 + t / 2)]
    assert reads == [0.0, UTILISATION_REFRESH_SECONDS, 2 * UTILISATION_REFRESH_SECONDS]


def test_a_throttle_that_cannot_hold_the_share_terminates_the_container_once_per_stretch() -> None:
    """Issue 32 row 6: the use stays at 100 % whatever the run fraction (kernels that run while the
    process is stopped). Pinned at the minimum and still over the share for the stated time, the
    container is ordered terminated (one order, not one per poll); a plant that follows the fraction
    converges instead and is never judged ineffective."""
    config = EnforcerConfig(containers={"train": ContainerShare(compute_percent=20)})
    core = Core(config, compute_window_seconds=1.0, compute_period_seconds=0.5, compute_ineffective_seconds=3.0)
    now, orders, pinned_at = 0.0, [], None
    while now < 8.0:
        decisions = core.step(now, poll(proc(1, "train", GiB, sm=100)), TOTALS)
        if pinned_at is None and core.throttled.get("train") == 0.05:
            pinned_at = now
        orders += [(now, o) for o in decisions.orders]
        assert decisions.orders == tuple(o for o in decisions.episodes_started if o.ineffective_use is not None)
        now += 0.1
    assert pinned_at is not None and pinned_at < 2.0
    assert len(orders) == 2, [t for t, _ in orders]  # at 3 s pinned, then 3 s later again (still running)
    (first_at, first), (second_at, _) = orders
    assert 3.0 <= first_at - pinned_at < 3.2 and 2.9 < second_at - first_at < 3.2
    assert first.container == "train" and [v.pid for v in first.victims] == [1]
    assert first.ineffective_use == 1.0 and first.compute_share == 0.2 and first.held_seconds >= 3.0

    # The control: use that follows the run fraction (an instant plant) is held, never ineffective.
    core = Core(config, compute_window_seconds=1.0, compute_period_seconds=0.5, compute_ineffective_seconds=3.0)
    now = 0.0
    while now < 8.0:
        fraction = core.throttled.get("train", 1.0)
        decisions = core.step(now, poll(proc(1, "train", GiB, sm=round(100 * fraction))), TOTALS)
        assert decisions.orders == (), now
        now += 0.1
    assert "train" in core.throttled


def test_an_ineffective_throttle_is_not_judged_in_audit_mode() -> None:
    config = EnforcerConfig(containers={"train": ContainerShare(compute_percent=20)}, mode=Mode.AUDIT)
    core = Core(config, compute_window_seconds=1.0, compute_period_seconds=0.5, compute_ineffective_seconds=1.0)
    now = 0.0
    while now < 5.0:
        assert core.step(now, poll(proc(1, "train", GiB, sm=100)), TOTALS).orders == ()
        now += 0.1
