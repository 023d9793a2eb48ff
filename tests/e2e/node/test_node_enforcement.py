"""The mutated pod on a real node (kubelet, containerd, runc): the sidecar enforces inside it.

Only NVML is simulated (the simulator's library loaded by the real pynvml in the real sidecar); the
webhook, the pod as it mutates it, the shared PID namespace with our pause as PID 1, the native
sidecar's ordering and probes, runc's securityContext, the kernel's kill and ptrace checks between
containers and the kubelet's restarts are the real ones.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.node.node import Node
from tests.node.simruntime import DEVICE_PATH
from tests.node.workloads import (
    RENAMED,
    SPINNER,
    container_log,
    enforcer_records,
    events,
    get_pod,
    gpu_pod,
    host_pid,
    sample_states,
    statuses,
    wait_record,
    wait_running,
    workload_container,
    write_gpu_state,
)

GIB = 1 << 30


def _instant(cri_timestamp: str) -> tuple[str, int]:
    """A CRI log timestamp (RFC 3339, up to 9 fractional digits, trailing zeros dropped) as a sortable key."""
    seconds, _, fraction = cri_timestamp.rstrip("Z").partition(".")
    return seconds, int(fraction.ljust(9, "0") or 0)


def _create(admin: client.ApiClient, namespace: str, pod: dict) -> dict:
    created = kube.create_pod(admin, namespace, pod)
    assert created.admitted, created.message
    return created.obj


def test_gpu_pod_starts_sidecar_first_with_healthy_probes(admin: client.ApiClient, cluster: ControlPlane,
                                                          node: Node, sim: Node, gpu_namespace: str):
    pod = _create(admin, gpu_namespace, gpu_pod([workload_container("trainer"), workload_container("eval")],
                                                {"gpufence.io/memory": "8Gi"}))
    assert pod["spec"]["initContainers"][0]["name"] == SIDECAR_NAME, "gpufence did not inject its sidecar"
    assert pod["spec"]["shareProcessNamespace"] is True
    running = wait_running(cluster, node, gpu_namespace, pod["metadata"]["name"])
    found = statuses(running)
    sidecar = found[SIDECAR_NAME]
    # Native sidecar: started (its postStart hook returned) and ready, never restarted.
    assert sidecar["started"] is True and sidecar["ready"] is True and sidecar["restartCount"] == 0, sidecar
    sidecar_started = sidecar["state"]["running"]["startedAt"]
    for name in ("trainer", "eval"):
        assert found[name]["restartCount"] == 0, found[name]
        # RFC 3339 seconds in UTC compare as strings; the postStart hook holds the
        # workloads back until the heartbeat passes, so they cannot start before the sidecar.
        assert found[name]["state"]["running"]["startedAt"] >= sidecar_started
    # The real pynvml in the sidecar loaded the simulator and the enforcer is polling.
    started = wait_record(running, lambda r: r.get("event") == "started", "the enforcer's started record")
    wait_record(running, lambda r: r.get("event") == "nvml_opened", "NVML opened (simulator loaded)")
    assert started.get("pod") == pod["metadata"]["name"], started
    # The workloads hold the stand-in device, and their first output comes after the enforcer's
    # started record (CRI log timestamps, nanoseconds, one clock): enforcement was up first.
    started_at = next(line.split(" ", 1)[0] for line in container_log(running, SIDECAR_NAME).splitlines()
                      if '"event":"started"' in line)
    for name in ("trainer", "eval"):
        kube.wait_for(lambda n=name: "gpu process" in container_log(running, n), f"{name} holding {DEVICE_PATH}")
        first = container_log(running, name).splitlines()[0].split(" ", 1)[0]
        assert _instant(first) > _instant(started_at), (name, first, started_at)
    ready = {c["type"]: c["status"] for c in running["status"]["conditions"]}
    assert ready.get("Ready") == "True", running["status"]["conditions"]


def test_container_over_memory_share_is_terminated_and_restarted(admin: client.ApiClient, cluster: ControlPlane,
                                                                 node: Node, sim: Node, gpu_namespace: str):
    pod = _create(admin, gpu_namespace, gpu_pod([workload_container("steady"), workload_container("greedy")],
                                                {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "5"}))
    name = pod["metadata"]["name"]
    running = wait_running(cluster, node, gpu_namespace, name)
    steady, greedy = host_pid(node, running, "steady"), host_pid(node, running, "greedy")
    write_gpu_state(node, [(steady, 4 * GIB, 10), (greedy, 9 * GIB, 10)])

    def greedy_restarted() -> dict | None:
        current = get_pod(cluster, gpu_namespace, name)
        status = statuses(current).get("greedy", {})
        return current if status.get("restartCount", 0) >= 1 and "running" in status.get("state", {}) else None

    try:
        restarted = kube.wait_for(greedy_restarted, "greedy terminated and restarted by the kubelet", 60, 0.3)
    except AssertionError as exc:
        current = get_pod(cluster, gpu_namespace, name)
        raise AssertionError(f"{exc}\nstatuses: {statuses(current)}\nenforcer log:\n"
                             f"{container_log(current, SIDECAR_NAME)[-5000:]}") from None
    # The restarted greedy is a new process: it holds no memory yet.
    write_gpu_state(node, [(steady, 4 * GIB, 10)])
    found = statuses(restarted)
    last = found["greedy"]["lastState"]["terminated"]
    # It ended on the enforcer's SIGTERM (its handler exits 143 and says so), not the kubelet's.
    assert last["exitCode"] == 143, last
    assert "got SIGTERM" in container_log(restarted, "greedy", restart=0)
    assert found["steady"]["restartCount"] == 0 and "running" in found["steady"]["state"], found["steady"]
    assert host_pid(node, restarted, "steady") == steady, "the container under its share was touched"
    record = wait_record(restarted, lambda r: r.get("event") == "sigterm" and r.get("container") == "greedy",
                         "the enforcer's sigterm record")
    assert record.get("used_bytes") == 9 * GIB and record.get("limit_bytes") == 8 * GIB, record
    assert not [r for r in enforcer_records(restarted) if r.get("container") == "steady"
                and r.get("event") in ("sigterm", "sigkill", "memory_over_share")]


def test_memory_over_share_event_in_pod_events(admin: client.ApiClient, cluster: ControlPlane,
                                              node: Node, sim: Node, gpu_namespace: str):
    """gpufence's Event reaches the pod's Events (the enforcer posts it with the pod's ServiceAccount
    token, through the `kubernetes` Service, under the install's gpufence-enforcer-events role)."""
    pod = _create(admin, gpu_namespace, gpu_pod([workload_container("greedy")],
                                                {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "5"}))
    name = pod["metadata"]["name"]
    running = wait_running(cluster, node, gpu_namespace, name)
    greedy = host_pid(node, running, "greedy")
    write_gpu_state(node, [(greedy, 9 * GIB, 10)])
    wait_record(running, lambda r: r.get("event") == "sigterm" and r.get("container") == "greedy",
                "the enforcer's sigterm record")
    write_gpu_state(node, [])
    disabled = [r for r in enforcer_records(running) if r.get("event") in ("events_disabled", "events_forbidden")]
    assert not disabled, f"the enforcer cannot record Events: {disabled}"

    def over_share_event() -> dict | None:
        return next((e for e in events(cluster, gpu_namespace, name) if e["reason"] == "GPUMemoryOverShare"), None)

    event = kube.wait_for(over_share_event, "gpufence's GPUMemoryOverShare Event on the pod", 30, 0.3)
    assert event["source"]["component"] == "gpufence-enforcer", event
    assert str(9 * GIB) in event["message"] and str(8 * GIB) in event["message"], event["message"]
    assert "greedy" in event["message"], event["message"]


def test_container_over_compute_share_is_stopped_and_continued(admin: client.ApiClient, cluster: ControlPlane,
                                                               node: Node, sim: Node, gpu_namespace: str):
    pod = _create(admin, gpu_namespace, gpu_pod(
        [workload_container("hog", SPINNER), workload_container("modest", SPINNER)],
        {"gpufence.io/memory": "8Gi", "gpufence.io/compute.hog": "25", "gpufence.io/compute.modest": "50"}))
    name = pod["metadata"]["name"]
    running = wait_running(cluster, node, gpu_namespace, name)
    hog, modest = host_pid(node, running, "hog"), host_pid(node, running, "modest")
    write_gpu_state(node, [(hog, 1 * GIB, 90), (modest, 1 * GIB, 10)])
    wait_record(running, lambda r: r.get("event") == "throttle_start" and r.get("container") == "hog",
                "throttle_start for hog", timeout=40)
    # The kernel shows hog both stopped (T) and running (R/S) within a few duty-cycle periods.
    seen = sample_states(hog, 3.0)
    assert "T" in seen and ({"R", "S"} & seen), seen
    assert "T" not in sample_states(modest, 1.0), "the container under its compute share was stopped"
    # Back under its share: throttling ends and hog is left running.
    write_gpu_state(node, [(hog, 1 * GIB, 5), (modest, 1 * GIB, 10)])
    wait_record(get_pod(cluster, gpu_namespace, name),
                lambda r: r.get("event") == "throttle_stop" and r.get("container") == "hog",
                "throttle_stop for hog", timeout=40)
    assert "T" not in sample_states(hog, 1.5), "hog left stopped after throttling ended"
    assert "gap" in container_log(get_pod(cluster, gpu_namespace, name), "hog"), \
        "hog saw no stopped interval of its own"


def test_nothing_left_stopped_after_sidecar_restart(admin: client.ApiClient, cluster: ControlPlane,
                                                    node: Node, sim: Node, gpu_namespace: str):
    pod = _create(admin, gpu_namespace, gpu_pod([workload_container("hog", SPINNER)],
                                                {"gpufence.io/memory": "8Gi", "gpufence.io/compute": "20"}))
    name = pod["metadata"]["name"]
    running = wait_running(cluster, node, gpu_namespace, name)
    hog = host_pid(node, running, "hog")
    write_gpu_state(node, [(hog, 1 * GIB, 95)])
    wait_record(running, lambda r: r.get("event") == "throttle_start", "throttle_start for hog", timeout=40)
    # Kill the sidecar at a moment hog is held stopped: the worst case for a crash.
    sidecar = host_pid(node, running, SIDECAR_NAME)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sample_states(hog, 0.01) == {"T"}:
            break
    import os
    import signal

    os.kill(sidecar, signal.SIGKILL)

    def sidecar_restarted() -> dict | None:
        current = get_pod(cluster, gpu_namespace, name)
        status = statuses(current)[SIDECAR_NAME]
        return current if status["restartCount"] >= 1 and status.get("started") else None

    restarted = kube.wait_for(sidecar_restarted, "the kubelet restarting the sidecar", 60, 0.3)
    # No compute demand any more: the restarted enforcer must continue what its predecessor stopped.
    write_gpu_state(node, [(hog, 1 * GIB, 0)])
    kube.wait_for(lambda: "T" not in sample_states(hog, 1.5), "hog continued after the sidecar restart", 30, 0)
    assert statuses(restarted)["hog"]["restartCount"] == 0


# A GPU process with a helper of its own (same container, same user) that sends it SIGCONT every
# millisecond: without the evasion check the throttle's SIGSTOPs hold for about a millisecond.
EVADER = """
import os, signal, time
device = open("/dev/nvidia0")
print(f"gpu process {os.getpid()}", flush=True)
parent = os.getpid()
if os.fork() == 0:
    device.close()
    while True:
        try:
            os.kill(parent, signal.SIGCONT)
        except ProcessLookupError:
            os._exit(0)
        time.sleep(0.001)
while True:
    pass
"""


def test_a_throttled_container_whose_helper_sends_sigcont_is_terminated(admin: client.ApiClient,
                                                                      cluster: ControlPlane, node: Node,
                                                                      sim: Node, gpu_namespace: str):
    """Issue row: time stopped fell from 95 % to 0 % while the container stayed reported throttled.
    Now the throttle sees the process running in its stopped phases and the container is terminated
    (its helper with it: same cgroup), says why in its log and in an Event, and the kubelet restarts it."""
    pod = _create(admin, gpu_namespace, gpu_pod([workload_container("hog", EVADER)],
                                                {"gpufence.io/memory": "8Gi", "gpufence.io/compute": "20",
                                                 "gpufence.io/grace-period": "2"}))
    name = pod["metadata"]["name"]
    running = wait_running(cluster, node, gpu_namespace, name)
    hog = host_pid(node, running, "hog")
    write_gpu_state(node, [(hog, 1 * GIB, 95)])
    evaded = wait_record(running, lambda r: r.get("event") == "throttle_evaded" and r.get("container") == "hog",
                         "throttle_evaded for hog", timeout=60)
    assert evaded["phases"] >= 2 and evaded["action"] == "sigterm", evaded

    def hog_restarted() -> dict | None:
        current = get_pod(cluster, gpu_namespace, name)
        status = statuses(current).get("hog", {})
        return current if status.get("restartCount", 0) >= 1 else None

    restarted = kube.wait_for(hog_restarted, "hog terminated and restarted by the kubelet", 60, 0.3)
    write_gpu_state(node, [])
    terms = [r for r in enforcer_records(restarted) if r.get("event") == "sigterm"]
    sent = [r for r in terms if r.get("outcome") == "sent"]
    assert sent and {r.get("reason") for r in terms} == {"throttle_evaded"}, terms
    # The helper is a target too (found in the container's cgroup). Once the GPU process dies the
    # helper's own kill() fails and it exits, or the runtime ends the container, so its SIGTERM may
    # find it already gone: either outcome shows the enforcer took the whole container.
    targeted = {r["pid"] for r in terms if r.get("outcome") in ("sent", "gone")}
    assert len(targeted) >= 2, f"the helper was not a target with its container: {terms}"

    def evaded_event() -> dict | None:
        return next((e for e in events(cluster, gpu_namespace, name) if e["reason"] == "GPUThrottleEvaded"), None)

    event = kube.wait_for(evaded_event, "gpufence's GPUThrottleEvaded Event on the pod", 30, 0.3)
    assert event["source"]["component"] == "gpufence-enforcer", event
    assert "hog" in event["message"] and "SIGCONT" in event["message"], event["message"]


# Issue 32 row 5: the helper (a child of the GPU process, same container) continues it only in every
# other stopped phase: when a stopped phase begins it sends SIGCONT every millisecond for 0.3 s, lets
# the throttle stop it again, and leaves the next stopped phase alone. Never two phases in a row.
ALTERNATE_EVADER = """
import os, signal, time
device = open("/dev/nvidia0")
print(f"gpu process {os.getpid()}", flush=True)
parent = os.getpid()

def state():
    try:
        return open(f"/proc/{parent}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        os._exit(0)

def wait(stopped):
    while (state() == "T") != stopped:
        time.sleep(0.0005)

if os.fork() == 0:
    device.close()
    act, phase = True, 0
    wait(False)
    while True:
        wait(True)
        phase += 1
        if act:
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                os.kill(parent, signal.SIGCONT)
                time.sleep(0.001)
            print(f"helper acted in phase {phase}", flush=True)
            wait(True)
        wait(False)
        act = not act
while True:
    pass
"""


def test_a_helper_continuing_every_other_stopped_phase_gets_the_container_terminated(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str):
    """Issue 32 row 5 on the real node (not run by its author): running time 18-19 % -> 37-38 % on a
    20 % share, never escalated, because evasion needed two stopped phases in a row. Two within 60 s
    are enough now: the container is terminated with its helper."""
    pod = _create(admin, gpu_namespace, gpu_pod([workload_container("hog", ALTERNATE_EVADER)],
                                                {"gpufence.io/memory": "8Gi", "gpufence.io/compute": "20",
                                                 "gpufence.io/grace-period": "2"}))
    name = pod["metadata"]["name"]
    running = wait_running(cluster, node, gpu_namespace, name)
    hog = host_pid(node, running, "hog")
    write_gpu_state(node, [(hog, 1 * GIB, 95)])
    evaded = wait_record(running, lambda r: r.get("event") == "throttle_evaded" and r.get("container") == "hog",
                         "throttle_evaded for hog", timeout=60)
    assert evaded["phases"] >= 2 and evaded["action"] == "sigterm", evaded
    write_gpu_state(node, [])
    said = container_log(get_pod(cluster, gpu_namespace, name), "hog")
    assert "helper acted in phase 1" in said, said  # it acts in phases 1, 3, 5...: never two in a row

    def evaded_event() -> dict | None:
        return next((e for e in events(cluster, gpu_namespace, name) if e["reason"] == "GPUThrottleEvaded"), None)

    kube.wait_for(evaded_event, "gpufence's GPUThrottleEvaded Event on the pod", 30, 0.3)


def test_gpu_work_running_while_its_process_is_stopped_gets_the_container_terminated(
        admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node, gpu_namespace: str):
    """Issue 32 row 6 on the real node (not run by its author): the simulated driver reports 100 % SM
    use whether hog runs or is stopped (kernels that keep running while it is stopped). Held at the
    minimum run fraction and still over its 20 % share for 10 s, the container is terminated
    (``throttle_ineffective``), with an Event, and the kubelet restarts it."""
    from tests.node.workloads import SPINNER

    pod = _create(admin, gpu_namespace, gpu_pod([workload_container("hog", SPINNER)],
                                                {"gpufence.io/memory": "8Gi", "gpufence.io/compute": "20",
                                                 "gpufence.io/grace-period": "2"}))
    name = pod["metadata"]["name"]
    running = wait_running(cluster, node, gpu_namespace, name)
    hog = host_pid(node, running, "hog")
    write_gpu_state(node, [(hog, 1 * GIB, 100)])
    wait_record(running, lambda r: r.get("event") == "throttle_start" and r.get("container") == "hog",
                "throttle_start for hog", timeout=40)
    started = time.monotonic()
    held = wait_record(running, lambda r: r.get("event") == "throttle_ineffective" and r.get("container") == "hog",
                       "throttle_ineffective for hog", timeout=40)
    took = time.monotonic() - started
    assert held["sm_utilization"] == 1.0 and held["compute_share"] == 0.2 and held["action"] == "sigterm", held

    def hog_restarted() -> dict | None:
        current = get_pod(cluster, gpu_namespace, name)
        return current if statuses(current).get("hog", {}).get("restartCount", 0) >= 1 else None

    kube.wait_for(hog_restarted, "hog terminated and restarted by the kubelet", 60, 0.3)
    write_gpu_state(node, [])

    def ineffective_event() -> dict | None:
        return next((e for e in events(cluster, gpu_namespace, name) if e["reason"] == "GPUThrottleIneffective"),
                    None)

    event = kube.wait_for(ineffective_event, "gpufence's GPUThrottleIneffective Event on the pod", 30, 0.3)
    assert "hog" in event["message"] and "20%" in event["message"], event["message"]
    print(f"throttle_ineffective {took:.1f}s after throttle_start")


# The GPU process re-execs itself (same PID, same cgroup) with GPUFENCE_CONTAINER naming no
# container of the pod, then holds the device like any workload.
def test_a_process_renamed_to_no_container_of_the_pod_is_held_to_the_pod_budget(admin: client.ApiClient,
                                                                               cluster: ControlPlane, node: Node,
                                                                               sim: Node, gpu_namespace: str):
    """Issue row: a GPU process that re-execs itself under a made-up name was an attribution with no
    limit (9 GiB on an 8 GiB share, untouched). Now the name is no key: the process is unattributed,
    the pod is over its budget, and the process is terminated."""
    pod = _create(admin, gpu_namespace, gpu_pod([workload_container("renamed", RENAMED)],
                                                {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "2"}))
    name = pod["metadata"]["name"]
    running = wait_running(cluster, node, gpu_namespace, name)
    renamed = host_pid(node, running, "renamed")
    environ = Path(f"/proc/{renamed}/environ").read_bytes().split(b"\0")
    assert b"GPUFENCE_CONTAINER=not-a-container" in environ, "the workload did not re-exec under its new name"
    write_gpu_state(node, [(renamed, 9 * GIB, 10)])
    record = wait_record(running, lambda r: r.get("event") == "unattributed_process", "unattributed_process")
    assert record.get("claim") == "not-a-container", json.dumps(record)
    over = wait_record(running, lambda r: r.get("event") == "pod_over_budget", "pod_over_budget", timeout=30)
    assert over.get("used_bytes") == 9 * GIB and over.get("limit_bytes") == 8 * GIB, over

    def renamed_restarted() -> dict | None:
        current = get_pod(cluster, gpu_namespace, name)
        return current if statuses(current).get("renamed", {}).get("restartCount", 0) >= 1 else None

    restarted = kube.wait_for(renamed_restarted, "the renamed process terminated and its container restarted", 60, 0.3)
    write_gpu_state(node, [])
    assert "got SIGTERM" in container_log(restarted, "renamed", restart=0)
    term = wait_record(restarted, lambda r: r.get("event") == "sigterm" and r.get("outcome") == "sent", "sigterm")
    assert term.get("reason") == "pod_over_budget", term
