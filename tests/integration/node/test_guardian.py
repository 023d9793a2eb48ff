"""The node guardian against real processes in real cgroups, under cgroup v1 and v2: a container over
its memory share is killed from the host with no sidecar to help (SIGTERM ignored, other users'
processes included), a freezer throttle that no SIGCONT undoes, an unaccounted GPU process ended in
enforce and only reported in audit, GPU processes the admin allowed (device-access-namespaces, the
webhook's record of an admin's pod) reported once per episode and never ended, and a restart mid-termination that
neither grants a new grace period nor signals twice (nor leaves a container frozen)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.enforcer.decide.compute import ComputeTracker
from gpufence.node.throttle import PERIOD_JITTER
from tests.integration.node.conftest import CgroupBed, start_guardian, wait_polls
from tests.support.enforcer_harness import GpuSandbox, wait_state

GIB = 1 << 30
HERE = pathlib.Path(__file__).resolve().parent
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")


def share(memory_gib: int | None = None, compute: float | None = None, grace: float = 1.0) -> EnforcerConfig:
    memory = MemoryShare(bytes=memory_gib * GIB) if memory_gib else None
    return EnforcerConfig(containers={"train": ContainerShare(memory=memory, compute_percent=compute)},
                          grace_period_seconds=grace, poll_interval_seconds=0.1)


def test_a_container_over_its_memory_share_is_killed_from_the_host_with_every_process_of_it(
    gpu: GpuSandbox, bed: CgroupBed
) -> None:
    pod = bed.pod()
    train, side = pod.container("train"), pod.container("data")
    bed.publish({"p": share(memory_gib=8, grace=1.0)})
    hog = train.start(gpu, ignore_term=True)  # root, traps SIGTERM; no sidecar is running to act
    # Another user's process of the container, with no GPU context, that ignores SIGTERM too.
    helper = train.spawn([*NOBODY, "sh", "-c", "trap '' TERM; while :; do sleep 1; done"])
    neighbour = side.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(hog, 9 * GIB)))
    g = start_guardian(gpu, bed)
    started = g.wait_event("guardian_episode_started", 20, reason="memory_over_share")
    assert started["container"] == "train" and started["limit_bytes"] == 8 * GIB and started["used_bytes"] == 9 * GIB
    assert "sigterm_in" not in started  # the SIGTERM is the sidecar's; the guardian only follows up
    killed = g.wait_event("guardian_sigkill", 20, reason="memory_over_share")
    # One grace period (1 s) plus the handover (the pod's poll and two of the guardian's), never less.
    assert killed["grace_seconds"] == 1.0 + 0.1 + 2 * 0.1
    assert killed["held_seconds"] >= killed["grace_seconds"]
    assert hog.pid in killed["sent"] and helper.pid in killed["sent"]
    assert hog.proc.wait(10) == -signal.SIGKILL and helper.wait(10) == -signal.SIGKILL
    assert not hog.said("got SIGTERM")  # the guardian sent none: one termination per breach
    # Nothing of the container runs on (a killed process's zombie leaves the cgroup once reaped).
    for pid in train.pids():
        wait_state(pid, lambda s: s in (None, "Z"), 10)
    assert neighbour.alive()
    assert g.metric("gpufence_node_actions_total", action="sigkill", reason="memory_over_share") == 1


def test_a_breach_the_sidecar_ends_within_its_grace_gets_nothing_from_the_guardian(
    gpu: GpuSandbox, bed: CgroupBed
) -> None:
    pod = bed.pod()
    train = pod.container("train")
    bed.publish({"p": share(memory_gib=8, grace=5.0)})
    hog = train.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(hog, 9 * GIB)))
    g = start_guardian(gpu, bed)
    g.wait_event("guardian_episode_started", 20, reason="memory_over_share")
    os.kill(hog.pid, signal.SIGTERM)  # what the sidecar does at once
    assert hog.proc.wait(10) == 0
    g.wait_event("guardian_episode_ended", 20, reason="memory_over_share")
    assert not g.events("guardian_sigkill") and not g.events("guardian_sigterm")


def test_a_freezer_throttle_holds_whatever_sigcont_a_helper_sends(gpu: GpuSandbox, bed: CgroupBed) -> None:
    pod = bed.pod()
    train, side = pod.container("train"), pod.container("helper")
    bed.publish({"p": share(compute=20)})
    spinner = train.start(gpu, script=str(HERE / "spin.py"))
    gpu.write(gpu.device_with(gpu.proc(spinner, GIB, sm=100)))
    period = 0.4
    g = start_guardian(gpu, bed, "--compute-window", "1", "--compute-period", str(period))
    start = g.wait_event("guardian_throttle_start", 30, container="train")
    assert 0 < start["fraction"] < 0.5
    # A helper in another container of the pod sends SIGCONT to the spinner without pause.
    blaster = subprocess.Popen(
        ["sh", "-c", f"{side.enter_command()}; exec {sys.executable} -c "
         f"'import os,signal\nwhile True: os.kill({spinner.pid}, signal.SIGCONT)'"],
    )
    # FROZEN at both ends of a check means frozen throughout only if no whole thawed phase fits
    # between the two reads: the shortest is the controller's smallest run fraction (the spinner
    # stays at 100 % on its 20 % share, so its fraction falls there) of the shortest period the
    # freezer draws. The elapsed time is measured: on a busy machine a short sleep lasts longer.
    shortest_thawed = ComputeTracker().min_run_fraction * period * (1 - PERIOD_JITTER)
    try:
        watched = 0.0  # seconds of checks frozen throughout
        deadline = time.monotonic() + 60
        while watched < period:
            assert time.monotonic() < deadline, f"saw the container frozen throughout for {watched:.3f} s in 60 s"
            began = time.monotonic()
            if train.freezer_state != "FROZEN":
                time.sleep(0.005)
                continue
            before = cpu_ticks(spinner.pid)
            time.sleep(shortest_thawed / 10)
            advanced = cpu_ticks(spinner.pid) - before
            still = train.freezer_state == "FROZEN"  # read last, so the ticks lie between the two states
            elapsed = time.monotonic() - began
            if still and elapsed < shortest_thawed:
                assert advanced == 0, f"{advanced} ticks of CPU while frozen throughout {elapsed:.3f} s"
                watched += elapsed
        assert blaster.poll() is None  # the helper kept sending all along
    finally:
        blaster.kill()
        blaster.wait()
    assert spinner.alive()
    # SIGKILLed mid-cycle, the guardian leaves the container frozen or not; the next one thaws it.
    g.proc.kill()
    g.proc.wait(10)
    again = start_guardian(gpu, bed, "--mode", "audit")
    recovered = again.wait_event("guardian_state_recovered", 10)
    assert train.path in recovered["thawed"]
    assert train.freezer_state == "THAWED"
    wait_state(spinner.pid, lambda s: s == "R", 10)


def test_an_unaccounted_gpu_process_is_ended_in_enforce(gpu: GpuSandbox, bed: CgroupBed) -> None:
    pod = bed.pod("plain")  # admitted without a GPU: no sidecar, no share
    c = pod.container("app")
    bed.publish({})
    stray = c.start(gpu, ignore_term=True)
    gpu.write(gpu.device_with(gpu.proc(stray, 6 * GIB)))
    g = start_guardian(gpu, bed, "--unaccounted-grace", "1")
    seen = g.wait_event("gpu_process", 20, standing="unaccounted")
    assert seen["pod"] == "plain" and seen["container"] == "app" and seen["why"] == "a pod admitted without a GPU share"
    term = g.wait_event("guardian_sigterm", 20, reason="unaccounted")
    assert term["sent"] == [stray.pid] and term["namespace"] == "team-a"
    stray.wait_line("ignored SIGTERM", 10)
    kill = g.wait_event("guardian_sigkill", 20, reason="unaccounted")
    assert kill["held_seconds"] >= 1.0
    assert stray.proc.wait(10) == -signal.SIGKILL


def test_gpu_processes_the_admin_allowed_are_reported_not_ended(gpu: GpuSandbox, bed: CgroupBed) -> None:
    # The admin's policy lets pods of gpu-operator reach devices without a request (an exporter, a
    # diagnostic): its GPU process is the admin's, while one of team-a without a share is ended.
    bed.namespaces.append({"metadata": {"name": "gpu-operator", "labels": {"gpufence.io/injection": "enabled"}}})
    bed.policy = {"device-access-namespaces": "gpu-operator"}
    exporter = bed.pod("exporter", namespace="gpu-operator").container("dcgm")
    plain = bed.pod("plain").container("app")
    # And a pod of team-a that a member of admin-groups created with device access (the webhook's record).
    diag = bed.pod("diag")
    diag.annotations["gpufence.io/admin-device-access"] = "oncall"
    bed.publish({})
    allowed = exporter.start(gpu)
    stray = plain.start(gpu, ignore_term=True)
    diagnostic = diag.container("probe").start(gpu)
    gpu.write(gpu.device_with(gpu.proc(allowed, GIB), gpu.proc(stray, 6 * GIB), gpu.proc(diagnostic, GIB)))
    g = start_guardian(gpu, bed, "--unaccounted-grace", "0.5")
    seen = g.wait_event("gpu_process", 20, standing="admin_allowed")
    assert seen["pod"] == "exporter" and seen["pid"] == allowed.pid and seen["why"] == (
        "admin-allowed device access: namespace gpu-operator is in device-access-namespaces "
        "(a pod admitted without a GPU share)")
    g.wait_event("guardian_sigkill", 20, reason="unaccounted", pod="plain")
    assert stray.proc.wait(10) == -signal.SIGKILL
    wait_polls(g, 5)  # polls after the other container's end: the allowed one is still only reported
    assert allowed.alive() and not allowed.said("got SIGTERM")
    assert diagnostic.alive() and not diagnostic.said("got SIGTERM")
    assert g.events("gpu_process", standing="admin_allowed", pod="diag")[0]["why"].startswith(
        "admin-allowed device access: created with it by oncall, a member of admin-groups")
    assert [e["pod"] for e in g.events("guardian_sigterm") + g.events("guardian_sigkill")] == ["plain", "plain"]
    assert g.metric("gpufence_node_admin_allowed_processes", namespace="gpu-operator", pod="exporter",
                    container="dcgm") == 1
    assert g.metric("gpufence_node_gpu_processes", standing="admin_allowed") == 2  # the exporter and diag
    # Said once per container's episode (log line, Event on its pod), not once per poll; not an action.
    assert sorted(e["pod"] for e in g.events("guardian_admin_allowed")) == ["diag", "exporter"]
    assert g.metric("gpufence_node_actions_total", action="allow", reason="admin_allowed") is None
    assert g.metric("gpufence_node_unaccounted_processes", namespace="gpu-operator", pod="exporter",
                    container="dcgm") is None


def test_an_unaccounted_gpu_process_is_only_reported_in_audit(gpu: GpuSandbox, bed: CgroupBed) -> None:
    pod = bed.pod("plain")
    c = pod.container("app")
    bed.publish({})
    stray = c.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(stray, 6 * GIB)))
    g = start_guardian(gpu, bed, "--mode", "audit", "--unaccounted-grace", "0.2")
    audit = g.wait_event("guardian_audit", 20, reason="unaccounted")
    assert audit["action"] == "none (audit)" and audit["pod"] == "plain"
    wait_polls(g, 10)  # well past the grace period
    assert stray.alive() and not stray.said("got SIGTERM")
    assert not g.events("guardian_sigterm") and not g.events("guardian_sigkill")
    assert g.metric("gpufence_node_unaccounted_processes", namespace="team-a", pod="plain", container="app") == 1


def test_a_process_of_another_namespace_or_the_host_is_reported_not_ended(gpu: GpuSandbox, bed: CgroupBed) -> None:
    pod = bed.pod("theirs", namespace="other")
    c = pod.container("app")
    bed.publish({})
    theirs = c.start(gpu)
    host = gpu.workload(None)  # in no pod's cgroup
    gpu.write(gpu.device_with(gpu.proc(theirs, 6 * GIB), gpu.proc(host, GIB)))
    g = start_guardian(gpu, bed, "--unaccounted-grace", "0.2")
    g.wait_event("gpu_process", 20, standing="other_namespace", pod="theirs")
    g.wait_event("gpu_process", 20, standing="host", pid=host.pid)
    wait_polls(g, 5)
    assert theirs.alive() and host.alive() and not g.events("guardian_sigterm")


def test_a_restart_mid_termination_neither_grants_a_new_grace_nor_signals_twice(
    gpu: GpuSandbox, bed: CgroupBed
) -> None:
    pod = bed.pod("plain")
    c = pod.container("app")
    bed.publish({})
    stray = c.start(gpu, ignore_term=True)
    gpu.write(gpu.device_with(gpu.proc(stray, 6 * GIB)))
    grace = 6.0
    first = start_guardian(gpu, bed, "--unaccounted-grace", str(grace))
    term = first.wait_event("guardian_sigterm", 20, reason="unaccounted")
    stray.wait_line("ignored SIGTERM", 10)
    first.proc.kill()  # mid-grace, as an OOM kill or a node drain's SIGKILL would
    first.proc.wait(10)
    second = start_guardian(gpu, bed, "--unaccounted-grace", str(grace))
    recovered = second.wait_event("guardian_state_recovered", 10)
    assert recovered["episodes"] == 1 and recovered["termed"] == 1
    kill = second.wait_event("guardian_sigkill", 20, reason="unaccounted")
    assert stray.proc.wait(10) == -signal.SIGKILL
    # The deadline is the first guardian's: the grace period counted from its SIGTERM.
    assert kill["grace_seconds"] == grace and kill["held_seconds"] >= grace
    # The same episode, not a new one: its start (CLOCK_BOOTTIME) is the first guardian's SIGTERM's.
    assert kill["episode_started"] == term["episode_started"]
    assert not second.events("guardian_sigterm")
    assert [line for line in stray.out.snapshot() if line == "got SIGTERM"] == ["got SIGTERM"]


def cpu_ticks(pid: int) -> int:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime + stime
