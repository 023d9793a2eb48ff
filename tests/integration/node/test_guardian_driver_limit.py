"""The driver's limit on every path: the real ``gpufence-node`` against the simulated driver's R615
calls (``nvmlDeviceSetMemoryLimits_v1`` / ``GetMemoryLimits_v1``, the ledger every process of the
simulated driver shares) on real cgroups. Where no limit is on a GPU container's cgroup the guardian
sets its share and reads it back (and lowers it when a DRA allocation lowers the share); where the
toolkit's hook set one, it leaves it. On cgroup v1 a container has no v2 cgroup of its own: nothing
is set."""

from __future__ import annotations

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.simnvml.limits import CGROUP_ROOT, SimLimit, preset_limits, read_limits
from tests.integration.node.conftest import CgroupBed, start_guardian, wait_polls
from tests.integration.node.test_guardian_claims import claim
from tests.support.enforcer_harness import GpuSandbox

GIB = 1 << 30


def share(memory_gib: int) -> EnforcerConfig:
    return EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=memory_gib * GIB))},
                          grace_period_seconds=1.0, poll_interval_seconds=0.1)


def test_the_guardian_sets_the_share_where_no_limit_is_and_lowers_it_to_a_later_claim(
    gpu: GpuSandbox, bed: CgroupBed
) -> None:
    pod = bed.pod()
    train = pod.container("train")
    pod.claims["train"] = "late"
    bed.publish({"p": share(8)})
    hog = train.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(hog, GIB // 2)))
    g = start_guardian(gpu, bed)
    if bed.version == "v1":
        wait_polls(g, 5)
        assert g.events("nvml_opened")[0]["driver_limits"] is True
        assert not g.events("guardian_driver_limit") and read_limits(gpu.state_path) == ()
        return
    namespace = CGROUP_ROOT + train.path
    first = g.wait_event("guardian_driver_limit", 20, action="set")
    assert first["ok"] and first["by"] == "gpufence-node" and first["cgroup"] == namespace
    assert first["read_back_hard_bytes"] == first["read_back_soft_bytes"] == 8 * GIB
    assert read_limits(gpu.state_path) == (SimLimit("GPU-0", namespace, 8 * GIB, 8 * GIB),)
    # The scheduler allocates the claim at 1 GiB: the limit the guardian set follows the share.
    bed.claims.append(claim("late", "1Gi", pod.uid))
    bed.publish({"p": share(8)})
    lowered = g.wait_event("guardian_driver_limit", 20, action="set", share_bytes=GIB)
    assert lowered["ok"] and lowered["read_back_hard_bytes"] == GIB
    assert read_limits(gpu.state_path) == (SimLimit("GPU-0", namespace, GIB, GIB),)
    assert hog.alive()  # half a GiB used: within both


def test_a_limit_the_toolkits_hook_set_is_left_as_it_is(gpu: GpuSandbox, bed: CgroupBed) -> None:
    pod = bed.pod()
    train = pod.container("train")
    bed.publish({"p": share(8)})
    namespace = CGROUP_ROOT + train.path
    hooks = SimLimit("GPU-0", namespace, 6 * GIB, 8 * GIB)  # the hook's REQUEST and LIMIT
    preset_limits(gpu.state_path, hooks)
    hog = train.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(hog, GIB)))
    g = start_guardian(gpu, bed)
    if bed.version == "v2":
        left = g.wait_event("guardian_driver_limit", 20, action="left")
        assert left["ok"] and left["soft_bytes"] == 6 * GIB and left["hard_bytes"] == 8 * GIB
    wait_polls(g, 5)
    assert not g.events("guardian_driver_limit", action="set")  # no second writer
    assert read_limits(gpu.state_path) == (hooks,)
