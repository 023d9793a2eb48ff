"""Properties of enforcer.decide.rules over arbitrary mixes of processes, shares and NVML gaps.

The invariant under test is the enforcer's hard one, as far as the pure core decides it: a victim
is always a process of this pod, either of a container strictly over its share on that device (the
whole container goes), or unattributed while the pod is strictly over its budget there (no more of
those than needed).
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare, Mode
from gpufence.enforcer.decide.rules import (
    UNATTRIBUTED,
    ComputeTracker,
    memory_orders,
    pod_budget_bytes,
    pod_compute_budget,
    pod_usage,
    usage_by_container,
)
from gpufence.enforcer.facts import Attribution, PodProcess
from tests.support.examples import examples

CONTAINERS = ("a", "b", "c")
DEVICES = (0, 1, 2)

memory_shares = st.one_of(
    st.none(),
    st.builds(MemoryShare, bytes=st.integers(1, 300)),
    st.builds(MemoryShare, percent=st.floats(0.5, 100)),
)
configs = st.dictionaries(
    st.sampled_from(CONTAINERS),
    st.builds(ContainerShare, memory=memory_shares, compute_percent=st.none() | st.floats(1, 100)),
).map(lambda shares: EnforcerConfig(containers=shares))
# Device totals: known, None (NVML could not tell), or absent from the mapping.
totals = st.dictionaries(st.sampled_from(DEVICES), st.none() | st.integers(1, 400))


_process_specs = st.lists(
    st.tuples(
        st.integers(1, 60),  # pid (unique)
        st.sampled_from((*CONTAINERS, "unconfigured", None)),
        st.lists(  # the devices it runs on, with its memory there (None: NVML could not tell)
            st.tuples(st.sampled_from(DEVICES), st.none() | st.integers(0, 200)),
            min_size=1,
            max_size=3,
            unique_by=lambda d: d[0],
        ),
        st.integers(0, 5),  # start time (ties are allowed: tie-breaking must still be deterministic)
    ),
    max_size=10,
    unique_by=lambda spec: spec[0],
)


@st.composite
def attributions(draw: st.DrawFn) -> Attribution:
    """Pod processes (attributed to configured names, to an unknown name, or unattributed) on
    several devices, some with unknown memory; plus foreign NVML PIDs that are not ours."""
    processes = [
        PodProcess(pid, pid + 10_000, start, container, device, f"GPU-{device}", used, None)
        for pid, container, placements, start in draw(_process_specs)
        for device, used in placements
    ]
    foreign = draw(st.lists(st.integers(100, 200), unique=True, max_size=5))
    return Attribution(processes=tuple(processes), foreign_pids=tuple(foreign))


def expected_limit(config: EnforcerConfig, container: str, total: int | None) -> int | None:
    """The limit, computed here independently of rules.py."""
    share = config.containers.get(container)
    if share is None or share.memory is None:
        return None
    if share.memory.bytes is not None:
        return share.memory.bytes
    return None if total is None else int(total * share.memory.percent / 100)


@settings(max_examples=examples(150), deadline=None)
@given(attribution=attributions(), config=configs, device_totals=totals)
def test_memory_victims_are_only_ever_the_right_ones(
    attribution: Attribution, config: EnforcerConfig, device_totals: dict[int, int | None]
) -> None:
    pods = pod_usage(attribution, config, device_totals)
    orders = memory_orders(usage_by_container(attribution, config, device_totals), pods)
    container_orders = [o for o in orders if o.container is not None]

    groups: dict[tuple[str, int], list[PodProcess]] = defaultdict(list)
    for p in attribution.processes:
        if p.container is not None:
            groups[(p.container, p.device_index)].append(p)
    used = {key: sum(p.used_memory_bytes or 0 for p in procs) for key, procs in groups.items()}
    limit = {key: expected_limit(config, key[0], device_totals.get(key[1])) for key in groups}
    over = {key for key in groups if limit[key] is not None and used[key] > limit[key]}

    # Exactly the containers strictly over their share get an order, one per device.
    assert sorted((o.container, o.device_index) for o in container_orders) == sorted(over)
    pod_processes = set(attribution.processes)
    for order in container_orders:
        key = (order.container, order.device_index)
        assert (order.used_bytes, order.limit_bytes) == (used[key], limit[key])
        victims = order.victims
        assert victims, "an order without victims would be a no-op"
        assert len(set(victims)) == len(victims)
        for v in victims:
            assert v in pod_processes  # never a stranger: only what attribution said is ours
            assert v.container is not None and v.container == order.container
            assert v.device_index == order.device_index
            assert v.pid not in attribution.foreign_pids
        # The whole container on that device, largest first.
        assert set(victims) == set(groups[key])
        sizes = [v.used_memory_bytes or 0 for v in victims]
        assert sizes == sorted(sizes, reverse=True)

    # The pod budget: unattributed victims only while the pod is strictly over it, just enough.
    pod_orders = [o for o in orders if o.container is None]
    for order in pod_orders:
        budget = pod_budget_bytes(config, device_totals.get(order.device_index))
        mine = [p for p in attribution.processes if p.device_index == order.device_index]
        pod_used = sum(p.used_memory_bytes or 0 for p in mine)
        assert budget is not None and pod_used > budget
        assert (order.used_bytes, order.limit_bytes) == (pod_used, budget)
        sizes = [v.used_memory_bytes or 0 for v in order.victims]
        assert all(v in pod_processes and v.container is None and v.used_memory_bytes for v in order.victims)
        assert all(v.device_index == order.device_index for v in order.victims)
        assert sizes == sorted(sizes, reverse=True)
        assert pod_used - sum(sizes[:-1]) > budget  # without the last victim the pod is still over
    assert len({o.device_index for o in pod_orders}) == len(pod_orders)


@st.composite
def compute_runs(draw: st.DrawFn) -> tuple[ComputeTracker, list[tuple[float, EnforcerConfig, Attribution]], set[str]]:
    """A tracker and a sequence of (time, config, attribution) polls. Containers in ``under`` are
    given a compute share and never use more than it on any device."""
    tracker = ComputeTracker(
        window_seconds=draw(st.floats(0.1, 10)),
        period_seconds=draw(st.floats(0.05, 5)),
        min_run_fraction=draw(st.floats(0.001, 0.999)),
    )
    under = draw(st.sets(st.sampled_from(CONTAINERS)))
    under_share = {name: draw(st.integers(1, 100)) for name in under}
    base = draw(configs).containers
    base = {**base, **{name: ContainerShare(compute_percent=share) for name, share in under_share.items()}}
    alternative = {name: share for name, share in base.items() if draw(st.booleans()) or name in under}
    steps = []
    now = draw(st.floats(-1e3, 1e3))
    for _ in range(draw(st.integers(1, 25))):
        now += draw(st.floats(0.001, 3))
        mode = draw(st.sampled_from(Mode))
        shares = draw(st.sampled_from((base, alternative)))  # the config may change between polls
        processes = []
        for pid in range(draw(st.integers(0, 6))):
            container = draw(st.sampled_from((*CONTAINERS, None)))
            device = draw(st.sampled_from(DEVICES))
            if container in under:
                # One process per device at most, within the share: the container is under its share.
                if any(p.container == container and p.device_index == device for p in processes):
                    continue
                sm: int | None = draw(st.none() | st.integers(0, under_share[container]))
            else:
                sm = draw(st.none() | st.integers(0, 100))
            processes.append(PodProcess(pid + 1, pid + 1, 0, container, device, f"GPU-{device}", None, sm))
        steps.append((now, EnforcerConfig(containers=shares, mode=mode), Attribution(tuple(processes), ())))
    return tracker, steps, under


@settings(max_examples=examples(80), deadline=None)
@given(run=compute_runs())
def test_compute_plans_are_proper_fractions_for_limited_containers_over_their_share(
    run: tuple[ComputeTracker, list[tuple[float, EnforcerConfig, Attribution]], set[str]],
) -> None:
    tracker, steps, under = run
    for now, config, attribution in steps:
        tracker.observe(now, attribution, config)
        plan = tracker.plan(now, config)
        for container, fraction in plan.items():
            assert 0 < fraction < 1
            assert fraction >= tracker.min_run_fraction
            if container == UNATTRIBUTED:
                # The unattributed processes are held to the pod's budget, which is below a GPU.
                budget = pod_compute_budget(config)
                assert budget is not None and budget < 1
                continue
            share = config.containers[container].compute_percent
            assert share is not None and share < 100  # a full share can never be exceeded
        assert not under & set(plan), "a container at or under its compute share was throttled"
