"""GPU processes of other namespaces and of the host on a GPU with an opted-in pod's share, against the
real guardian, real processes in real cgroups (v1 and v2) and the simulated driver: the policy's
other-namespace-gpu-processes and host-gpu-processes (read from the policy ConfigMap in the pods
file) decide. ``terminate`` ends the foreign container in enforce and reports it in audit, only on
a GPU that holds an opted-in share; the host's ``report`` reports and never signals; with neither
key set, nothing changes from before the keys."""

from __future__ import annotations

import signal

import pytest

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from tests.integration.node.conftest import CgroupBed, Guardian, start_guardian, wait_polls
from tests.support.enforcer_harness import GpuSandbox, Workload

GIB = 1 << 30
SHARE = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 * GIB))},
                       grace_period_seconds=1.0, poll_interval_seconds=0.1)


def node(gpu: GpuSandbox, bed: CgroupBed, policy: dict[str, str] | None, *args: str,
         ) -> tuple[Guardian, dict[str, Workload]]:
    """An opted-in pod within its share on GPU-0; beside it on GPU-0 a pod of a namespace that is
    not opted in (ignoring SIGTERM) and a host process; on GPU-1, with no opted-in share, another
    pod of that namespace."""
    bed.policy = policy
    ours = bed.pod("ours").container("train")
    theirs = bed.pod("theirs", namespace="other").container("app")
    far = bed.pod("far", namespace="other").container("app")
    bed.publish({"ours": SHARE})
    w = {"ours": ours.start(gpu), "theirs": theirs.start(gpu, ignore_term=True), "far": far.start(gpu),
         "host": gpu.workload(None)}
    gpu.write(gpu.device_with(gpu.proc(w["ours"], 2 * GIB), gpu.proc(w["theirs"], 6 * GIB),
                              gpu.proc(w["host"], GIB), uuid="GPU-0"),
              gpu.device_with(gpu.proc(w["far"], 6 * GIB), uuid="GPU-1"))
    g = start_guardian(gpu, bed, "--unaccounted-grace", "1", *args)
    held = g.wait_event("guardian_policy", 20)
    assert (held["other_namespace_gpu_processes"], held["host_gpu_processes"]) == (
        (policy or {}).get("other-namespace-gpu-processes", "allow"), (policy or {}).get("host-gpu-processes", "allow"))
    # Every process has been placed and decided on at least once.
    for name, standing in (("ours", "admitted"), ("theirs", "other_namespace"), ("far", "other_namespace"),
                           ("host", "host")):
        g.wait_event("gpu_process", 20, standing=standing, pid=w[name].pid)
    return g, w


def test_terminate_ends_the_foreign_container_on_an_opted_in_gpu_and_report_reports_the_host(
    gpu: GpuSandbox, bed: CgroupBed
) -> None:
    g, w = node(gpu, bed, {"other-namespace-gpu-processes": "terminate", "host-gpu-processes": "report"})
    term = g.wait_event("guardian_sigterm", 20, reason="other_namespace")
    assert term["pod"] == "theirs" and term["namespace"] == "other" and term["sent"] == [w["theirs"].pid]
    assert term["sharing_pods"] == [{"namespace": "team-a", "pod": "ours", "pod_uid": bed.pods[0].uid}]
    assert "other-namespace-gpu-processes is terminate" in term["why"]
    w["theirs"].wait_line("ignored SIGTERM", 10)
    kill = g.wait_event("guardian_sigkill", 20, reason="other_namespace")
    assert kill["pod"] == "theirs" and kill["held_seconds"] >= 1.0
    assert w["theirs"].proc.wait(10) == -signal.SIGKILL
    report = g.wait_event("guardian_report", 20, reason="host")
    assert report["pid"] == w["host"].pid and report["action"] == "none (report)"
    assert report["sharing_pods"] == [{"namespace": "team-a", "pod": "ours", "pod_uid": bed.pods[0].uid}]
    wait_polls(g, 10)
    # The host process, the opted-in pod, and the foreign pod on a GPU without an opted-in share run on.
    for name in ("ours", "far", "host"):
        assert w[name].alive() and not w[name].said("got SIGTERM"), name
    assert [e["pod"] for e in g.events("guardian_sigterm") + g.events("guardian_sigkill")] == ["theirs", "theirs"]
    assert len(g.events("guardian_report")) == 1  # once per episode, not per poll
    assert g.metric("gpufence_node_actions_total", action="sigterm", reason="other_namespace") == 1
    assert g.metric("gpufence_node_actions_total", action="sigkill", reason="other_namespace") == 1
    assert g.metric("gpufence_node_actions_total", action="report", reason="host") == 1


@pytest.mark.parametrize("setup", ["audit", "default"])
def test_audit_and_the_default_leave_the_foreign_container_running(
    gpu: GpuSandbox, bed: CgroupBed, setup: str
) -> None:
    if setup == "audit":
        g, w = node(gpu, bed, {"other-namespace-gpu-processes": "terminate"}, "--mode", "audit")
        audit = g.wait_event("guardian_audit", 20, reason="other_namespace")
        assert audit["pod"] == "theirs" and audit["action"] == "none (audit)"
        assert "(audit: nothing done)" in audit["why"]
    else:
        g, w = node(gpu, bed, {})  # a policy ConfigMap without the keys: their defaults, allow
    wait_polls(g, 10)  # well past the grace period
    for name in ("ours", "theirs", "far", "host"):
        assert w[name].alive() and not w[name].said("got SIGTERM"), name
    assert not g.events("guardian_sigterm") and not g.events("guardian_sigkill") and not g.events("guardian_report")
    assert [e["pod"] for e in g.events("guardian_audit")] == (["theirs"] if setup == "audit" else [])
    assert g.metric("gpufence_node_actions_total", action="sigterm", reason="other_namespace") == 0
