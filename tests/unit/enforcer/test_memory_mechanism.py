"""enforcer.decide.memory_mechanism: which mechanism holds a container's memory share, and the driver's
currentUsed as its usage (pure: no NVML, no processes)."""

from __future__ import annotations

import pytest

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.enforcer.decide.machine import Core
from gpufence.enforcer.decide.memory_mechanism import (
    EnvHints,
    Mechanism,
    apply_driver_usage,
    decide,
    driver_usage,
)
from gpufence.enforcer.decide.rules import ContainerDeviceUsage
from gpufence.enforcer.facts import Attribution, DriverLimit, DriverLimitState, DriverReading, PodProcess
from gpufence.enforcer.observe.driver_limits import cgroup_namespace, container_cgroups, hidden_by_cgroup_namespace

GiB = 1 << 30
NS = "/sys/fs/cgroup/kubepods/pod1/train"
MAX = 0xFFFFFFFFFFFFFFFF
EXPECTED = EnvHints(driver_limit_expected=True)


def limit(hard: int, used: int = 0, soft: int = 0) -> DriverLimit:
    state = DriverLimitState.UNLIMITED if hard == MAX else DriverLimitState.SET
    return DriverLimit(state, soft, hard, used)


NO_CALL = DriverLimit(DriverLimitState.NO_CALL, error="FUNCTION_NOT_FOUND")
NOT_SET = DriverLimit(DriverLimitState.NOT_SET, error="NOT_SUPPORTED")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0::/kubepods/pod1/train\n", NS),
        ("0::/kubepods/pod1/train/\n", NS),
        ("12:memory:/x\n0::/kubepods/pod1/train", NS),
        ("0::/\n", None),  # a cgroup v1 host: every process shows the unified root
        ("4:memory:/kubepods/pod1/train\n", None),  # pure cgroup v1
        ("0::/../cri-containerd-abc.scope\n", None),  # outside the reader's cgroup namespace
        ("", None),
        (None, None),
    ],
)
def test_cgroup_namespace_is_the_toolkit_hooks(text: str | None, expected: str | None) -> None:
    assert cgroup_namespace(text) == expected


def test_driver_holds_the_share_when_the_hard_limit_is_at_or_below_it_on_every_device() -> None:
    got = decide(NS, {0: 4 * GiB, 1: 4 * GiB}, {0: limit(4 * GiB), 1: limit(3 * GiB)}, EXPECTED)
    assert got.mechanism is Mechanism.DRIVER and got.limit_bytes == 4 * GiB
    assert not got.driver_limit_missing
    assert "GPU 1: hard 3221225472 <= share 4294967296" in got.why


@pytest.mark.parametrize(
    ("limits", "why"),
    [
        ({0: NO_CALL}, "older than R615"),
        ({0: NOT_SET}, "no limit on " + NS),
        ({0: limit(MAX)}, "has no hard limit"),
        ({0: limit(5 * GiB)}, "hard limit 5368709120 is above the share 4294967296"),
        ({0: DriverLimit(DriverLimitState.ERROR, error="UNKNOWN")}, "failed (UNKNOWN)"),
        ({}, "not asked"),
    ],
)
def test_polling_when_the_driver_does_not_hold_it_and_the_missing_limit_is_flagged(limits, why) -> None:
    got = decide(NS, {0: 4 * GiB}, limits, EXPECTED)
    assert got.mechanism is Mechanism.POLLING and got.limit_bytes is None
    assert why in got.why and got.why.startswith("enforced by polling only")
    assert got.driver_limit_missing
    assert not decide(NS, {0: 4 * GiB}, limits, EnvHints()).driver_limit_missing  # nobody asked for one


def test_one_device_without_the_limit_is_enough_for_polling() -> None:
    got = decide(NS, {0: 4 * GiB, 1: 4 * GiB}, {0: limit(4 * GiB), 1: NOT_SET}, EnvHints())
    assert got.mechanism is Mechanism.POLLING and "GPU 1" in got.why


def test_no_cgroup_v2_path_and_no_share_in_bytes() -> None:
    assert "cgroup v1" in decide(None, {0: 4 * GiB}, {}, EXPECTED).why
    no_share = decide(NS, {0: None}, {0: limit(4 * GiB)}, EnvHints())
    assert no_share.mechanism is Mechanism.POLLING and "no memory share in bytes" in no_share.why


def test_mps_and_preload_from_the_environment_when_the_driver_does_not_hold_it() -> None:
    mps = EnvHints.from_environ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M", "NVIDIA_GPU_MEMORY_LIMIT": "4096"})
    got = decide(NS, {0: 4 * GiB}, {0: NO_CALL}, mps)
    assert got.mechanism is Mechanism.MPS and got.driver_limit_missing
    preload = EnvHints.from_environ({"LD_PRELOAD": "/usr/local/gpufence/preload/libvgpu.so",
                                     "CUDA_DEVICE_MEMORY_LIMIT": "4096m"})
    assert decide(NS, {0: 4 * GiB}, {0: NO_CALL}, preload).mechanism is Mechanism.PRELOAD
    assert not EnvHints.from_environ({"LD_PRELOAD": "/lib/libjemalloc.so"}).preload  # a preload, not a limiter
    # The driver's limit, where it holds, is named first: it acts at allocation for every process.
    assert decide(NS, {0: 4 * GiB}, {0: limit(4 * GiB)}, mps).mechanism is Mechanism.DRIVER


def test_driver_usage_leaves_out_an_answer_shared_by_two_cgroups() -> None:
    """A limit on the pod's cgroup answers for both containers with the pod's total."""
    namespaces = {("a", 0): NS + "a", ("b", 0): NS + "b", ("a", 1): NS + "a", ("b", 1): NS + "b"}
    limits = {
        ("a", 0): limit(8 * GiB, used=5 * GiB),
        ("b", 0): limit(8 * GiB, used=5 * GiB),  # same as a's: the pod-level limit
        ("a", 1): limit(4 * GiB, used=1 * GiB),
        ("b", 1): limit(4 * GiB, used=2 * GiB),
    }
    assert driver_usage(namespaces, limits) == {("a", 1): 1 * GiB, ("b", 1): 2 * GiB}
    assert driver_usage({("a", 0): NS}, {("a", 0): NOT_SET}) == {}
    assert driver_usage({("a", 0): NS}, {("a", 0): limit(MAX, used=GiB)}) == {("a", 0): GiB}


def test_apply_driver_usage_replaces_the_sum_and_reports_gaps() -> None:
    rows = (
        ContainerDeviceUsage("a", 0, "GPU-0", GiB, 4 * GiB, (), unknown_usage=True),
        ContainerDeviceUsage("b", 0, "GPU-0", GiB, 4 * GiB, ()),
        ContainerDeviceUsage("c", 0, "GPU-0", GiB, 4 * GiB, ()),
    )
    usages, gaps = apply_driver_usage(rows, {("a", 0): 3 * GiB, ("b", 0): GiB + 1})
    assert [(u.used_bytes, u.process_bytes, u.unknown_usage) for u in usages] == [
        (3 * GiB, GiB, False), (GiB + 1, GiB, False), (GiB, None, False)
    ]
    assert [(g.container, g.driver_bytes, g.process_bytes) for g in gaps] == [("a", 3 * GiB, GiB)]  # b: under 1 MiB


def test_the_core_enforces_on_the_drivers_usage() -> None:
    config = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=4 * GiB))})
    seen = Attribution((PodProcess(1, 1, 1001, "train", 0, "GPU-0", 3 * GiB, 0),), ())
    core = Core(config)
    assert core.step(0.0, seen, {0: 80 * GiB}).orders == ()
    driver = DriverReading(
        namespaces={("train", 0): NS}, limits={("train", 0): limit(MAX, used=5 * GiB)}, cgroups={"train": NS}
    )
    over = core.step(0.5, seen, {0: 80 * GiB}, driver=driver)
    assert [(o.container, o.used_bytes, [v.pid for v in o.victims]) for o in over.orders] == [("train", 5 * GiB, [1])]
    assert [(d.driver_bytes, d.process_bytes) for d in over.discrepancies] == [(5 * GiB, 3 * GiB)]
    # The same reading says what holds the share: no hard limit on the cgroup, so polling.
    assert [(e.container, e.namespace, e.enforcement.mechanism) for e in over.memory_enforcement] == [
        ("train", NS, Mechanism.POLLING)
    ]


def test_a_cgroup_hidden_by_the_sidecars_cgroup_namespace_is_not_reported_missing() -> None:
    """In a pod with private cgroup namespaces the sidecar reads ``0::/../<container>``: it cannot
    ask the driver, which says nothing about whether the toolkit set a limit."""
    assert hidden_by_cgroup_namespace("0::/../cri-containerd-abc.scope\n")
    assert not hidden_by_cgroup_namespace("0::/kubepods/pod1/train\n")
    assert not hidden_by_cgroup_namespace("0::/\n") and not hidden_by_cgroup_namespace(None)
    got = decide(None, {0: 4 * GiB}, {}, EXPECTED, hidden=True)
    assert got.mechanism is Mechanism.POLLING and not got.driver_limit_missing
    assert "cgroup namespace hides" in got.why
    v1 = decide(None, {0: 4 * GiB}, {}, EXPECTED)
    assert v1.driver_limit_missing and "cgroup v1" in v1.why


def test_where_to_ask_the_driver_is_each_containers_own_cgroup() -> None:
    """observe/driver_limits.container_cgroups (pure): a container's namespace per device; a name
    held by two cgroups has none to ask about; an unconfigured name and a hidden path are noted."""
    config = EnforcerConfig(containers={
        "train": ContainerShare(memory=MemoryShare(bytes=4 * GiB)),
        "split": ContainerShare(memory=MemoryShare(bytes=4 * GiB)),
        "far": ContainerShare(memory=MemoryShare(bytes=4 * GiB)),
    })
    seen = Attribution((
        PodProcess(1, 1, 1, "train", 0, "GPU-0", GiB, 0, cgroup="0::/kubepods/pod1/train\n"),
        PodProcess(1, 1, 1, "train", 1, "GPU-1", GiB, 0, cgroup="0::/kubepods/pod1/train\n"),
        PodProcess(2, 2, 2, "split", 0, "GPU-0", GiB, 0, cgroup="0::/kubepods/pod1/a\n"),
        PodProcess(3, 3, 3, "split", 0, "GPU-0", GiB, 0, cgroup="0::/kubepods/pod1/b\n"),
        PodProcess(4, 4, 4, "far", 0, "GPU-0", GiB, 0, cgroup="0::/../cri-containerd-abc.scope\n"),
        PodProcess(5, 5, 5, "other", 0, "GPU-0", GiB, 0, cgroup="0::/kubepods/pod1/other\n"),
    ), ())
    where = container_cgroups(seen, config)
    assert where.namespaces == {("train", 0): NS, ("train", 1): NS}
    assert where.cgroups == {"train": NS, "split": None, "far": None}
    assert where.pids == {"train": 1, "split": 2, "far": 4}
    assert where.hidden == {"far"}
