"""enforcer.decide.rules / compute / machine: a claim is never a key, and what no container can be charged for
counts against the pod's budgets (memory, compute, GPU count); throttle evasion gives a one-shot order.

Pure: hand-built attributions, no processes (the attacks themselves run in
tests/integration/enforcer/test_tenant_attacks.py)."""

from __future__ import annotations

import pytest

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.enforcer.decide.compute import share_of, unattributed_sm_utilization
from gpufence.enforcer.decide.machine import Core, Transition
from gpufence.enforcer.decide.rules import (
    UNATTRIBUTED,
    ComputeTracker,
    Evasion,
    evasion_orders,
    pod_compute_budget,
    pod_device_orders,
    pod_gpus_requested,
    screen_claims,
)
from gpufence.enforcer.facts import Attribution, PodProcess

GiB = 1 << 30
TOTALS = {0: 80 * GiB, 1: 80 * GiB}


def proc(
    pid: int, container: str | None, used: int | None = GiB, *, device: int = 0, sm: int | None = None
) -> PodProcess:
    return PodProcess(pid, pid, 1000 + pid, container, device, f"GPU-{device}", used, sm, claim=container)


def poll(*processes: PodProcess) -> Attribution:
    return Attribution(tuple(processes), ())


def share(*, memory: int | None = None, compute: float | None = None, gpus: int | None = None) -> ContainerShare:
    return ContainerShare(
        memory=MemoryShare(bytes=memory) if memory is not None else None, compute_percent=compute, gpus=gpus
    )


# -- claims ----------------------------------------------------------------------------------------


def test_a_name_that_is_no_configured_container_is_unattributed() -> None:
    config = EnforcerConfig(containers={"train": share(memory=8 * GiB)})
    real, spoof, none = proc(1, "train"), proc(2, "not-a-container"), proc(3, None)
    screened = screen_claims(poll(real, spoof, none), config)
    assert [p.container for p in screened.processes] == ["train", None, None]
    # What it claimed stays visible (for the log), and nothing else changes.
    assert screened.processes[1].claim == "not-a-container"
    assert screened.processes[1].used_memory_bytes == GiB
    # Nothing to screen: the very same attribution.
    clean = poll(real, none)
    assert screen_claims(clean, config) is clean


def test_with_no_configured_container_every_name_is_a_stranger() -> None:
    screened = screen_claims(poll(proc(1, "train")), EnforcerConfig())
    assert screened.processes[0].container is None


def test_a_spoofed_name_over_the_pod_budget_is_terminated() -> None:
    """9 GiB on an 8 GiB share under a made-up name: before, an attribution with no limit."""
    core = Core(EnforcerConfig(containers={"train": share(memory=8 * GiB)}))
    spoof = proc(7, "sneaky", 9 * GiB)
    decisions = core.step(0.0, poll(spoof), TOTALS)
    assert decisions.attribution.processes[0].container is None
    assert decisions.new_unattributed == (decisions.attribution.processes[0],)
    [order] = decisions.orders
    assert order.container is None and [v.pid for v in order.victims] == [7]
    assert order.used_bytes == 9 * GiB and order.limit_bytes == 8 * GiB
    assert decisions.usages == ()  # "sneaky" is charged as no container


# -- compute ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shares", "budget"),
    [
        ({"a": 20.0}, 0.2),
        ({"a": 20.0, "b": 30.0}, 0.5),
        ({"a": 80.0, "b": 70.0}, 1.0),  # at most one GPU
        ({"a": 20.0, "b": None}, None),  # one container unlimited: the pod is
        ({}, None),
    ],
)
def test_pod_compute_budget_is_the_sum_of_the_shares(shares: dict[str, float | None], budget: float | None) -> None:
    config = EnforcerConfig(containers={n: share(compute=c) for n, c in shares.items()})
    found = pod_compute_budget(config)
    assert (found is None) if budget is None else found == pytest.approx(budget)
    assert share_of(config, UNATTRIBUTED) == pod_compute_budget(config)


def test_unattributed_use_is_the_pods_where_unattributed_processes_run() -> None:
    # GPU 0: an attributed 30 % and two unattributed 60 % each (capped at 100 %); GPU 1: attributed only.
    attribution = poll(
        proc(1, "a", sm=30), proc(2, None, sm=60), proc(3, None, sm=60), proc(4, "a", device=1, sm=90)
    )
    assert unattributed_sm_utilization(attribution) == 1.0
    assert unattributed_sm_utilization(poll(proc(1, "a", sm=30), proc(2, None, sm=10))) == pytest.approx(0.4)
    assert unattributed_sm_utilization(poll(proc(1, "a", sm=90))) is None


def test_unattributed_processes_are_throttled_against_the_pod_budget_and_released_when_gone() -> None:
    """Two processes of one cgroup claiming different names at 120 % SM on a 20 % share: before, never
    throttled (compute was enforced for attributed containers only)."""
    config = EnforcerConfig(containers={"train": share(compute=20)})
    tracker = ComputeTracker(window_seconds=2.0, period_seconds=0.5)
    conflicted = poll(proc(1, None, sm=60), proc(2, None, sm=60))
    plans = []
    for step in range(12):
        tracker.observe(step * 0.1, conflicted, config)
        plans.append(dict(tracker.plan(step * 0.1, config)))
    started = [plan for plan in plans if plan]
    assert started[0] == {UNATTRIBUTED: pytest.approx(0.2)}  # share / mean use at the start
    # A plant that does not respond (static utilisation here) drives the fraction down, never up.
    assert set(plans[-1]) == {UNATTRIBUTED} and plans[-1][UNATTRIBUTED] < 0.2
    # They exit: the use is 0, the loop's output reaches 1 and the throttle ends.
    now = 1.2
    for _ in range(60):
        now += 0.1
        tracker.observe(now, poll(), config)
        plan = dict(tracker.plan(now, config))
    assert plan == {}


def test_unattributed_processes_within_the_pod_budget_are_not_throttled() -> None:
    config = EnforcerConfig(containers={"a": share(compute=20), "b": share(compute=30)})
    tracker = ComputeTracker(window_seconds=2.0, period_seconds=0.5)
    for step in range(30):
        tracker.observe(step * 0.1, poll(proc(1, "a", sm=20), proc(2, None, sm=25)), config)
        assert dict(tracker.plan(step * 0.1, config)) == {}


def test_the_core_reports_the_unattributed_throttle_with_the_pod_budget() -> None:
    core = Core(EnforcerConfig(containers={"train": share(compute=20)}), compute_window_seconds=1.0,
                compute_period_seconds=0.3)
    starts = []
    for step in range(10):
        decisions = core.step(step * 0.1, poll(proc(1, "stranger", sm=100)), TOTALS)
        starts += [c for c in decisions.throttle_changes if c.transition is Transition.START]
    [start] = starts
    assert start.container == UNATTRIBUTED and start.share == pytest.approx(0.2)
    assert start.sm_utilization == 1.0
    assert core.throttled.keys() == {UNATTRIBUTED}


# -- GPU count -------------------------------------------------------------------------------------


def test_unattributed_processes_on_more_gpus_than_the_pod_requested_are_terminated() -> None:
    """envFrom NVIDIA_VISIBLE_DEVICES=all: unattributed processes on two GPUs, one requested."""
    config = EnforcerConfig(containers={"train": share(gpus=1)})
    both = poll(proc(1, "train"), proc(2, None, 2 * GiB), proc(2, None, GiB, device=1))
    [order] = pod_device_orders(both, config)
    assert order.container is None and order.gpus_requested == 1 and order.devices_used == (0, 1)
    assert order.device_index == 1
    assert [v.pid for v in order.victims] == [2]  # one process on two devices is one victim
    # The attributed container is within its own count: never a victim here.
    assert all(v.container is None for v in order.victims)


@pytest.mark.parametrize(
    ("processes", "gpus"),
    [
        pytest.param([proc(1, None), proc(2, None)], {"train": 1}, id="one device"),
        pytest.param([proc(1, None), proc(2, None, device=1)], {"train": 1, "eval": 1}, id="within the sum"),
        pytest.param([proc(1, "train"), proc(2, "train", device=1)], {"train": 1}, id="nothing unattributed"),
        pytest.param([proc(1, None), proc(2, None, device=1)], {"train": 1, "eval": None}, id="a count unknown"),
    ],
)
def test_no_pod_gpu_order(processes: list[PodProcess], gpus: dict[str, int | None]) -> None:
    config = EnforcerConfig(containers={n: share(gpus=g) for n, g in gpus.items()})
    assert pod_device_orders(poll(*processes), config) == ()


def test_pod_gpus_requested() -> None:
    assert pod_gpus_requested(EnforcerConfig(containers={"a": share(gpus=1), "b": share(gpus=2)})) == 3
    assert pod_gpus_requested(EnforcerConfig()) is None


# -- throttle evasion ------------------------------------------------------------------------------


def evasion(pid: int, container: str | None) -> Evasion:
    return Evasion(container, pid, 1000 + pid, "R", 2)


def test_an_evader_is_terminated_with_its_container() -> None:
    attribution = poll(proc(1, "train"), proc(2, "train", device=1), proc(3, "calm"), proc(4, None))
    [order] = evasion_orders([evasion(1, "train")], attribution)
    assert order.container == "train" and order.evaded_pids == (1,) and order.evaded_phases == 2
    assert sorted(v.pid for v in order.victims) == [1, 2]


def test_an_unattributed_evader_goes_alone_and_a_gone_one_gives_no_order() -> None:
    attribution = poll(proc(1, "train"), proc(4, None), proc(5, None))
    [order] = evasion_orders([evasion(4, None), evasion(9, "train")], attribution)
    assert order.container is None and [v.pid for v in order.victims] == [4]
    # A PID reused by another process (other start time) is not the evader.
    stale = Evasion("train", 1, 1, "R", 2)
    assert evasion_orders([stale], attribution) == ()


def test_evasion_orders_are_one_shot_episodes() -> None:
    core = Core(EnforcerConfig(containers={"train": share(compute=10)}))
    attribution = poll(proc(1, "train", sm=100))
    first = core.step(0.0, attribution, TOTALS, evasions=[evasion(1, "train")])
    assert [o.evaded_pids for o in first.orders] == [(1,)]
    assert first.episodes_started == first.orders
    second = core.step(0.1, attribution, TOTALS)
    assert second.orders == () and second.episodes_ended == ()
