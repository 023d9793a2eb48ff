"""The sidecar and the guardian on one breach: one termination. The real enforcer (as the sidecar,
a host process here) and the real guardian watch the same container in its real cgroup through the
same simulated driver: while the sidecar works, its SIGTERM ends the breach and the guardian does
nothing; when a root workload has stopped the sidecar, the guardian kills the container at the
grace period plus its handover, with no second grace period."""

from __future__ import annotations

import os
import signal

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from tests.integration.node.conftest import CgroupBed, start_guardian, wait_polls
from tests.support.enforcer_harness import GpuSandbox, wait_state

GIB = 1 << 30
SHARE = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 * GIB))},
                       grace_period_seconds=1.0, poll_interval_seconds=0.1)


def test_a_working_sidecar_terminates_and_the_guardian_only_watches(gpu: GpuSandbox, bed: CgroupBed) -> None:
    pod = bed.pod()
    train = pod.container("train")
    bed.publish({"p": SHARE})
    hog = train.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(hog, GIB)))
    g = start_guardian(gpu, bed)
    sidecar = gpu.enforcer(SHARE.to_dict())
    g.wait_event("nvml_opened", 20)
    gpu.write(gpu.device_with(gpu.proc(hog, 9 * GIB)))
    sidecar.wait_event("sigterm", 20, container="train")
    assert hog.proc.wait(10) == 0  # its own SIGTERM handler: the graceful exit the sidecar gives
    wait_polls(g, 20)  # past the pod's grace period and the handover (1.3 s at 0.1 s polls)
    assert not g.events("guardian_sigkill") and not g.events("guardian_sigterm")
    # If the guardian saw the breach before the sidecar ended it, it let the episode go.
    assert len(g.events("guardian_episode_started")) == len(g.events("guardian_episode_ended"))


def test_a_stopped_sidecar_is_replaced_by_the_guardian_without_a_second_grace(
    gpu: GpuSandbox, bed: CgroupBed
) -> None:
    pod = bed.pod()
    train = pod.container("train")
    bed.publish({"p": SHARE})
    hog = train.start(gpu, ignore_term=True)
    gpu.write(gpu.device_with(gpu.proc(hog, GIB)))
    g = start_guardian(gpu, bed)
    sidecar = gpu.enforcer(SHARE.to_dict())
    g.wait_event("nvml_opened", 20)
    os.kill(sidecar.proc.pid, signal.SIGSTOP)  # what a root workload does the moment the sidecar appears
    wait_state(sidecar.proc.pid, lambda s: s == "T", 10)
    try:
        gpu.write(gpu.device_with(gpu.proc(hog, 9 * GIB)))
        g.wait_event("guardian_episode_started", 20, reason="memory_over_share")
        killed = g.wait_event("guardian_sigkill", 20, reason="memory_over_share")
        assert hog.proc.wait(10) == -signal.SIGKILL
        assert killed["grace_seconds"] == 1.0 + 0.1 + 2 * 0.1 and killed["held_seconds"] >= killed["grace_seconds"]
        assert not hog.said("got SIGTERM")  # the stopped sidecar sent nothing, the guardian no SIGTERM
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
