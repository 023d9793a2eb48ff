"""enforcer.decide.rules: table tests of the memory decisions and the compute duty-cycle math."""

from __future__ import annotations

import pytest

from gpufence.contract import ContainerShare, EnforcerConfig, LimitUnit, MemoryShare
from gpufence.enforcer.decide.rules import (
    ContainerDeviceUsage,
    TerminateOrder,
    container_sm_utilization,
    device_orders,
    memory_orders,
    pod_usage,
    usage_by_container,
)
from gpufence.enforcer.facts import Attribution, PodProcess

GiB = 1 << 30


def proc(
    pid: int,
    container: str | None = "train",
    used: int | None = 0,
    *,
    device: int = 0,
    sm: int | None = None,
    start: int | None = None,
) -> PodProcess:
    return PodProcess(
        pid=pid,
        nvml_pid=pid,
        start_time_ticks=start if start is not None else 1000 + pid,
        container=container,
        device_index=device,
        device_uuid=f"GPU-{device}",
        used_memory_bytes=used,
        sm_util=sm,
    )


def config(**shares: ContainerShare) -> EnforcerConfig:
    return EnforcerConfig(containers=shares)


def memory(*, bytes_: int | None = None, percent: float | None = None) -> ContainerShare:
    return ContainerShare(memory=MemoryShare(bytes=bytes_, percent=percent))


def orders_for(
    processes: list[PodProcess], cfg: EnforcerConfig, totals: dict[int, int | None] | None = None
) -> tuple[TerminateOrder, ...]:
    usages = usage_by_container(Attribution(tuple(processes), ()), cfg, totals or {0: 16 * GiB, 1: 16 * GiB})
    return memory_orders(usages)


def victim_pids(orders: tuple[TerminateOrder, ...]) -> list[list[int]]:
    return [[v.pid for v in order.victims] for order in orders]


# -- memory ----------------------------------------------------------------------------------------

TRAIN_8G = config(train=memory(bytes_=8 * GiB))


@pytest.mark.parametrize(
    ("used", "expected_victims"),
    [
        pytest.param([3, 3], [], id="under share"),
        pytest.param([5, 3], [], id="exactly at share"),
        pytest.param([5, 4, 3, 1], [[10, 11, 12, 13]], id="the whole container, largest first"),
        pytest.param([1, 3, 4, 5], [[13, 12, 11, 10]], id="order of listing does not matter"),
        pytest.param([4, 4, 4, 4], [[13, 12, 11, 10]], id="equal sizes: newest first"),
        pytest.param([9], [[10]], id="single process over"),
        pytest.param([5, 0, 0, 4], [[10, 13, 12, 11]], id="zero-byte processes go with their container"),
    ],
)
def test_memory_victims(used: list[int], expected_victims: list[list[int]]) -> None:
    processes = [proc(10 + i, used=n * GiB) for i, n in enumerate(used)]
    assert victim_pids(orders_for(processes, TRAIN_8G)) == expected_victims


def pod_orders_for(
    processes: list[PodProcess], cfg: EnforcerConfig, totals: dict[int, int | None] | None = None
) -> tuple[TerminateOrder, ...]:
    attribution = Attribution(tuple(processes), ())
    totals = totals or {0: 16 * GiB, 1: 16 * GiB}
    return memory_orders(usage_by_container(attribution, cfg, totals), pod_usage(attribution, cfg, totals))


def test_pod_budget_takes_unattributed_processes_first_largest_first_just_enough() -> None:
    cfg = config(train=memory(bytes_=4 * GiB), eval=memory(bytes_=4 * GiB))  # budget 8 GiB
    anon = [proc(1, None, 5 * GiB), proc(2, None, 4 * GiB), proc(3, None, 3 * GiB), proc(4, None, 1 * GiB)]
    # 13 + 2 = 15 GiB -> 10 -> 6: two victims; the unattributed 3 and 1 GiB stay.
    orders = pod_orders_for([*anon, proc(5, "train", 2 * GiB)], cfg)
    assert [(o.container, [v.pid for v in o.victims]) for o in orders] == [(None, [1, 2])]
    (order,) = orders
    assert (order.used_bytes, order.limit_bytes, order.device_uuid) == (15 * GiB, 8 * GiB, "GPU-0")


def test_pod_budget_then_containers_over_their_own_share() -> None:
    cfg = config(train=memory(bytes_=4 * GiB), eval=memory(bytes_=4 * GiB))
    processes = [proc(1, None, 1 * GiB), proc(2, "train", 6 * GiB), proc(3, "eval", 1 * GiB), proc(4, "train", 1)]
    orders = pod_orders_for(processes, cfg)
    assert [(o.container, [v.pid for v in o.victims]) for o in orders] == [(None, [1]), ("train", [2, 4])]


@pytest.mark.parametrize(
    ("processes", "shares"),
    [
        pytest.param([proc(1, None, 1 * GiB), proc(2, "train", 7 * GiB)], {"train": 8}, id="at the budget"),
        pytest.param([proc(1, None, 50 * GiB)], {"train": 8, "eval": None}, id="a container without a share"),
        pytest.param([proc(1, None, None), proc(2, "train", 9 * GiB)], {"train": 8}, id="unknown usage is no victim"),
        pytest.param([proc(1, None, 50 * GiB)], {}, id="no container configured"),
    ],
)
def test_no_pod_budget_order(processes: list[PodProcess], shares: dict[str, int | None]) -> None:
    cfg = config(**{n: memory(bytes_=g * GiB) if g else ContainerShare() for n, g in shares.items()})
    assert [o for o in pod_orders_for(processes, cfg) if o.container is None] == []


def test_pod_usage_counts_every_process_and_a_percent_budget_needs_the_total() -> None:
    cfg = config(train=memory(bytes_=4 * GiB), eval=memory(percent=25))
    processes = [proc(1, None, 3 * GiB), proc(2, "train", 2 * GiB), proc(3, None, None, device=1)]
    pods = pod_usage(Attribution(tuple(processes), ()), cfg, {0: 16 * GiB, 1: None})
    summary = [(p.device_index, p.used_bytes, p.unattributed_bytes, p.budget_bytes, len(p.unattributed)) for p in pods]
    assert summary == [(0, 5 * GiB, 3 * GiB, 8 * GiB, 1), (1, 0, 0, None, 1)]


def test_usage_sums_per_container_and_device() -> None:
    processes = [
        proc(1, "train", 2 * GiB),
        proc(2, "eval", 1 * GiB),
        proc(3, "train", 3 * GiB),
        proc(1, "train", 7 * GiB, device=1),
    ]
    usages = usage_by_container(Attribution(tuple(processes), ()), TRAIN_8G, {0: 16 * GiB, 1: 16 * GiB})
    summary = [(u.device_index, u.container, u.used_bytes, u.limit_bytes, [p.pid for p in u.processes]) for u in usages]
    assert summary == [
        (0, "eval", 1 * GiB, None, [2]),  # not in the config: nothing to enforce
        (0, "train", 5 * GiB, 8 * GiB, [1, 3]),
        (1, "train", 7 * GiB, 8 * GiB, [1]),
    ]


def test_percent_share_uses_each_devices_total() -> None:
    cfg = config(eval=memory(percent=25))
    processes = [proc(1, "eval", 5 * GiB), proc(2, "eval", 5 * GiB, device=1)]
    usages = usage_by_container(Attribution(tuple(processes), ()), cfg, {0: 16 * GiB, 1: 40 * GiB})
    assert [u.limit_bytes for u in usages] == [4 * GiB, 10 * GiB]
    # Over on the 16 GiB device only.
    assert [(o.device_index, [v.pid for v in o.victims]) for o in memory_orders(usages)] == [(0, [1])]


@pytest.mark.parametrize("totals", [{0: None}, {}, {0: 0}], ids=["total None", "total missing", "total 0"])
def test_percent_share_with_unknown_total_is_no_limit(totals: dict[int, int | None]) -> None:
    processes = [proc(1, "eval", 100 * GiB)]
    usages = usage_by_container(Attribution(tuple(processes), ()), config(eval=memory(percent=10)), totals)
    assert [u.limit_bytes for u in usages] == [None]
    assert memory_orders(usages) == ()


def test_a_share_in_two_units_is_the_smaller_on_each_device() -> None:
    """A pod's 10Gi under a namespace ceiling of 25% (or the other way round): the config carries
    both and each device's limit is the smaller, with its unit, which the metrics report."""
    cfg = config(eval=memory(bytes_=10 * GiB, percent=25))
    processes = [proc(1, "eval", 5 * GiB), proc(2, "eval", 11 * GiB, device=1), proc(3, "eval", 9 * GiB, device=2)]
    totals = {0: 16 * GiB, 1: 80 * GiB, 2: None}
    usages = usage_by_container(Attribution(tuple(processes), ()), cfg, totals)
    assert [(u.limit_bytes, u.limit_unit) for u in usages] == [
        (4 * GiB, LimitUnit.PERCENT),  # 25% of 16 GiB < 10 GiB
        (10 * GiB, LimitUnit.BYTES),  # 10 GiB < 25% of 80 GiB
        (10 * GiB, LimitUnit.BYTES),  # total unknown: the bytes still bound it, never the guess
    ]
    assert [(o.device_index, o.limit_bytes) for o in memory_orders(usages)] == [(0, 4 * GiB), (1, 10 * GiB)]


def test_a_share_in_two_units_round_trips_through_the_wire_format() -> None:
    cfg = config(eval=memory(bytes_=10 * GiB, percent=25))
    doc = cfg.to_dict()
    assert doc["containers"]["eval"] == {"memoryBytes": 10 * GiB, "memoryPercent": 25}
    assert EnforcerConfig.from_json(cfg.to_json()) == cfg
    assert MemoryShare(bytes=10 * GiB, percent=25).describe() == f"min({10 * GiB},25%)"


@pytest.mark.parametrize(
    ("gpus", "devices", "expected"),
    [
        pytest.param(1, [0], None, id="one GPU requested, one used"),
        pytest.param(2, [0, 1], None, id="two requested, two used"),
        pytest.param(None, [0, 1, 2], None, id="no count in the config: no check"),
        pytest.param(1, [0, 1], (1, (0, 1)), id="one requested, two used: the second is the extra"),
        pytest.param(2, [3, 0, 5], (5, (0, 3, 5)), id="the devices beyond the count, by index"),
    ],
)
def test_a_container_on_more_gpus_than_it_requested_is_terminated_as_a_whole(
    gpus: int | None, devices: list[int], expected: tuple[int, tuple[int, ...]] | None
) -> None:
    cfg = config(train=ContainerShare(memory=MemoryShare(bytes=8 * GiB), gpus=gpus), eval=ContainerShare(gpus=1))
    processes = [proc(10 + i, used=1 * GiB, device=d) for i, d in enumerate(devices)] + [proc(99, "eval", 1 * GiB)]
    usages = usage_by_container(Attribution(tuple(processes), ()), cfg, dict.fromkeys(range(6), 16 * GiB))
    orders = device_orders(usages, cfg)
    if expected is None:
        assert orders == ()
        return
    (order,) = orders
    assert (order.device_index, order.devices_used) == expected
    assert order.container == "train" and order.gpus_requested == gpus and order.limit_bytes == 0
    assert sorted(v.pid for v in order.victims) == [10 + i for i in range(len(devices))]  # never eval's


def test_byte_share_does_not_need_the_total() -> None:
    assert victim_pids(orders_for([proc(1, used=9 * GiB)], TRAIN_8G, {0: None})) == [[1]]


def test_multi_device_usage_is_per_device() -> None:
    # 6 GiB on each of two devices: 12 GiB in all, but under the 8 GiB share on each device.
    processes = [proc(1, used=6 * GiB), proc(2, used=6 * GiB, device=1)]
    assert orders_for(processes, TRAIN_8G) == ()
    processes.append(proc(3, used=3 * GiB, device=1))
    (order,) = orders_for(processes, TRAIN_8G)
    assert (order.device_index, order.device_uuid, [v.pid for v in order.victims]) == (1, "GPU-1", [2, 3])


def test_unknown_used_memory_counts_zero_is_flagged_and_goes_with_its_container() -> None:
    processes = [proc(1, used=None), proc(2, used=6 * GiB), proc(3, used=3 * GiB)]
    usages = usage_by_container(Attribution(tuple(processes), ()), TRAIN_8G, {0: 16 * GiB})
    (usage,) = usages
    assert (usage.used_bytes, usage.unknown_usage) == (9 * GiB, True)
    assert victim_pids(memory_orders(usages)) == [[2, 3, 1]]
    # Only unknowns: nothing counted, nothing to kill.
    (only_unknown,) = usage_by_container(Attribution((proc(1, used=None),), ()), TRAIN_8G, {0: 16 * GiB})
    assert (only_unknown.used_bytes, only_unknown.unknown_usage) == (0, True)
    assert memory_orders([only_unknown]) == ()


def test_unattributed_processes_are_never_counted_or_victims() -> None:
    processes = [proc(1, None, 50 * GiB), proc(2, "train", 9 * GiB)]
    usages = usage_by_container(Attribution(tuple(processes), ()), TRAIN_8G, {0: 16 * GiB})
    assert [(u.container, u.used_bytes) for u in usages] == [("train", 9 * GiB)]
    assert victim_pids(memory_orders(usages)) == [[2]]


def test_a_hand_built_usage_cannot_make_strangers_victims() -> None:
    # memory_orders re-checks every process: unattributed, another container's, another device's.
    strangers = (proc(1, None, 10 * GiB), proc(2, "eval", 10 * GiB), proc(3, "train", 10 * GiB, device=1))
    usage = ContainerDeviceUsage(
        container="train",
        device_index=0,
        device_uuid="GPU-0",
        used_bytes=35 * GiB,
        limit_bytes=8 * GiB,
        processes=(*strangers, proc(4, "train", 5 * GiB)),
    )
    assert victim_pids(memory_orders([usage])) == [[4]]


def test_containers_without_a_memory_share_are_never_killed() -> None:
    cfg = config(train=ContainerShare(compute_percent=50))
    assert orders_for([proc(1, used=15 * GiB)], cfg) == ()


def test_orders_for_several_containers_at_once() -> None:
    cfg = config(train=memory(bytes_=8 * GiB), eval=memory(bytes_=2 * GiB), idle=memory(bytes_=1 * GiB))
    processes = [proc(1, "train", 9 * GiB), proc(2, "eval", 1 * GiB), proc(3, "eval", 2 * GiB), proc(4, "idle", GiB)]
    assert [(o.container, [v.pid for v in o.victims]) for o in orders_for(processes, cfg)] == [
        ("eval", [3, 2]),
        ("train", [1]),
    ]


# -- compute (the controller is tested in tests/unit/enforcer/test_compute.py) ----------------------


def at(*processes: PodProcess) -> Attribution:
    return Attribution(tuple(processes), ())


def test_container_sm_utilization_aggregation() -> None:
    attribution = at(
        proc(1, "train", sm=30),
        proc(2, "train", sm=50),
        proc(3, "train", sm=20, device=1),
        proc(4, "eval", sm=80),
        proc(5, "eval", sm=70),  # 150 % on one device is impossible: capped
        proc(6, "other", sm=None),  # no sample since NVML's last one: it did not run
        proc(7, None, sm=100),  # unattributed: nobody's
    )
    assert container_sm_utilization(attribution) == {"train": 0.8, "eval": 1.0, "other": 0.0}
