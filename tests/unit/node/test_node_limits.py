"""The driver's limit on every path (pure): which cgroup gets which share, and when the guardian
sets it, leaves it, or does nothing."""

from __future__ import annotations

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare, Mode
from gpufence.enforcer.facts import DriverLimit, DriverLimitState
from gpufence.node.census import placement
from gpufence.node.decide import GpuProc, NodeEngine
from gpufence.node.limits import LimitAction, LimitTarget, limit_step, limit_targets, nvml_namespace
from gpufence.node.pods import PodIndex, node_pod

GIB = 1 << 30
UID = "6f1c2b8e-9a3d-4c1e-8f7a-0123456789ab"
TRAIN = "a" * 64
HALF = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 * GIB, percent=50))})
TARGET = LimitTarget("/sys/fs/cgroup/kubepods/pod1/c1", 0, "GPU-0", 8 * GIB, "team-a", "p", UID, "train")


def idx() -> PodIndex:
    found = node_pod({
        "metadata": {"uid": UID, "namespace": "team-a", "name": "p"},
        "spec": {"initContainers": [{"name": "gpufence-enforcer",
                                     "env": [{"name": "GPUFENCE_CONFIG", "value": HALF.to_json()}]}],
                 "containers": [{"name": "train"}]},
        "status": {"containerStatuses": [{"name": "train", "containerID": f"containerd://{TRAIN}"}]},
    })
    assert found is not None
    return PodIndex.of([found], ["team-a"])


def proc(cgroup_text: str, device: int = 0) -> GpuProc:
    return GpuProc(10, 1010, device, f"GPU-{device}", GIB, 0, placement(cgroup_text))


def test_the_namespace_is_the_containers_own_v2_cgroup() -> None:
    assert nvml_namespace("/kubepods/pod1/c1") == "/sys/fs/cgroup/kubepods/pod1/c1"
    assert nvml_namespace("/") is None and nvml_namespace(None) is None
    assert nvml_namespace("/../escape") is None


def test_each_admitted_container_gets_its_share_on_each_device_in_the_units_of_its_config() -> None:
    path = f"/kubepods/burstable/pod{UID}/{TRAIN}"
    census = NodeEngine().step(100.0, [proc(f"0::{path}\n", 0), proc(f"0::{path}\n", 1)],
                               {0: 80 * GIB, 1: 10 * GIB}, idx())
    targets = limit_targets(census.census, census.configs, {0: 80 * GIB, 1: 10 * GIB})
    ns = "/sys/fs/cgroup" + path
    assert {k: t.bytes for k, t in targets.items()} == {(ns, 0): 8 * GIB, (ns, 1): 5 * GIB}  # 50 % of 10 GiB
    audit = {uid: EnforcerConfig(containers=c.containers, mode=Mode.AUDIT) for uid, c in census.configs.items()}
    assert limit_targets(census.census, audit, {0: 80 * GIB, 1: 10 * GIB}) == {}  # audit enforces nothing
    v1_only = NodeEngine().step(100.0, [proc(f"12:freezer:{path}\n0::/\n")], {0: 80 * GIB}, idx())
    assert limit_targets(v1_only.census, v1_only.configs, {0: 80 * GIB}) == {}


def test_set_where_none_is_leave_what_someone_else_set_follow_a_changed_share() -> None:
    assert limit_step(TARGET, DriverLimit(DriverLimitState.NOT_SET), None) is LimitAction.SET
    assert limit_step(TARGET, DriverLimit(DriverLimitState.UNLIMITED), None) is LimitAction.SET
    hooks = DriverLimit(DriverLimitState.SET, 6 * GIB, 8 * GIB)
    assert limit_step(TARGET, hooks, None) is LimitAction.LEAVE
    assert limit_step(TARGET, DriverLimit(DriverLimitState.SET, 8 * GIB, 8 * GIB), 8 * GIB) is None
    assert limit_step(TARGET, DriverLimit(DriverLimitState.SET, 16 * GIB, 16 * GIB), 16 * GIB) is LimitAction.SET
    assert limit_step(TARGET, DriverLimit(DriverLimitState.NO_CALL), None) is None
    assert limit_step(TARGET, DriverLimit(DriverLimitState.ERROR), 8 * GIB) is None
