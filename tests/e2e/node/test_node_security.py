"""What the sidecar can do to the workloads, and they to it, with the users and capabilities as shipped.

docs/install.md ("Pod Security of the namespaces you opt in") says mutated GPU pods pass only
`privileged` (the root sidecar adds SYS_PTRACE, which `baseline` forbids); these pods run in a
namespace that enforces `privileged` and warns/audits `baseline`, the documented setup. The user
matrix is the one gpufence/webhook/core/sidecar.py documents ("Which user the enforcer runs as").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.tenant import Tenant
from tests.node.node import Node
from tests.node.workloads import (
    SABOTEUR,
    clear_namespace,
    container_log,
    enforcer_records,
    events,
    get_pod,
    gpu_pod,
    host_pid,
    metrics,
    process_state,
    sidecar_terminates_over_memory,
    statuses,
    wait_record,
    wait_running,
    wait_sidecar_restarted,
    workload_container,
    write_gpu_state,
)

GIB = 1 << 30
DOCUMENTED_SETUP = {"pod-security.kubernetes.io/enforce": "privileged",
                    "pod-security.kubernetes.io/warn": "baseline", "pod-security.kubernetes.io/audit": "baseline"}


@pytest.fixture
def psa_namespace(admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node) -> Any:
    namespace = kube.create_namespace(admin, "node-psa", {**kube.OPT_IN, **DOCUMENTED_SETUP})
    yield namespace
    clear_namespace(cluster, node, namespace)


# name -> (pod securityContext, greedy's own securityContext, enforced per the documentation)
USERS = {
    # Most CUDA images: root workloads; the sidecar is uid 0 with KILL + SYS_PTRACE.
    "root-workload": ({}, {"runAsUser": 0}, True),
    # The workload's image runs as a non-root user and the pod sets none: the sidecar is uid 0
    # with KILL + SYS_PTRACE, documented to reach "processes of any user".
    "image-user-workload": ({}, {}, True),
    # Pod-level runAsUser: the sidecar does not follow it (runAsUser: 0 of its own, KILL + SYS_PTRACE).
    "pod-run-as-user": ({"runAsUser": 1000, "runAsGroup": 1000}, {}, True),
    # A container with a user of its own under a pod-level runAsUser: reached all the same.
    "container-own-user": ({"runAsUser": 1000, "runAsGroup": 1000}, {"runAsUser": 2000}, True),
    # Issue 32 row 3, as the tenant wrote it: the pod runs as 1000, the GPU container as root (the
    # sidecar used to inherit uid 1000 and report the root process as uninspectable, 9 GiB untouched).
    "root-container-under-pod-user": ({"runAsUser": 1000, "runAsGroup": 1000}, {"runAsUser": 0}, True),
    "root-group-under-pod-user": ({"runAsUser": 1000, "runAsGroup": 1000}, {"runAsUser": 0, "runAsGroup": 0}, True),
}


@pytest.mark.parametrize("case", sorted(USERS))
def test_sidecar_reads_and_signals_workloads_as_documented(admin: client.ApiClient, cluster: ControlPlane,
                                                           node: Node, sim: Node, psa_namespace: str, case: str):
    pod_context, greedy_context, enforced = USERS[case]
    greedy = workload_container("greedy", user=None)
    if greedy_context:
        greedy["securityContext"] = greedy_context
    spec: dict[str, Any] = {"securityContext": pod_context} if pod_context else {}
    created = kube.create_pod(admin, psa_namespace, gpu_pod(
        [greedy], {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "3"}, **spec))
    assert created.admitted, created.message
    name = created.obj["metadata"]["name"]
    running = wait_running(cluster, node, psa_namespace, name)
    pid = host_pid(node, running, "greedy")
    write_gpu_state(node, [(pid, 9 * GIB, 10)])
    # Twenty polls (0.5 s each) after the state change are enough for a decision either way.
    polls = metrics(running)["gpufence_poll_duration_seconds_count"]
    kube.wait_for(lambda: metrics(running)["gpufence_poll_duration_seconds_count"] >= polls + 20,
                  "twenty enforcer polls", 60, 0.5)
    sigterms = [r for r in enforcer_records(running) if r.get("event") == "sigterm" and r.get("container") == "greedy"]
    refused = [r for r in enforcer_records(running) if r.get("outcome") == "refused"]
    if enforced:
        assert sigterms, (f"{case}: the sidecar did not terminate greedy (refused: {refused}); enforcer log:\n"
                          f"{container_log(running, SIDECAR_NAME)[-3000:]}")
        kube.wait_for(lambda: statuses(get_pod(cluster, psa_namespace, name))["greedy"]["restartCount"] >= 1,
                      "greedy restarted", 60, 0.3)
    else:
        assert not sigterms, f"{case}: documented as out of reach, yet terminated: {sigterms}"
        assert statuses(get_pod(cluster, psa_namespace, name))["greedy"]["restartCount"] == 0


@pytest.mark.parametrize(("sig", "within"), [("SIGKILL", 60.0), ("SIGSTOP", 90.0)])
def test_root_workload_stopping_the_sidecar_gets_it_restarted(admin: client.ApiClient, cluster: ControlPlane,
                                                              node: Node, sim: Node, psa_namespace: str,
                                                              sig: str, within: float):
    """A root workload shares the PID namespace and the sidecar's uid: it can signal the enforcer.
    The kubelet restarts a killed native sidecar at once, and a stopped one once its liveness probe
    (10 s period, 3 failures) gives up; the restarted enforcer enforces again."""
    saboteur = workload_container("saboteur", SABOTEUR, user=0)
    saboteur["command"] = [*saboteur["command"], sig]
    created = kube.create_pod(admin, psa_namespace, gpu_pod(
        [saboteur, workload_container("greedy")], {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "3"}))
    assert created.admitted, created.message
    name = created.obj["metadata"]["name"]
    wait_running(cluster, node, psa_namespace, name)
    started = time.monotonic()
    restarted = wait_sidecar_restarted(cluster, psa_namespace, name, f"the sidecar restarted after {sig}", within)
    assert f"sent {sig}" in container_log(restarted, "saboteur"), container_log(restarted, "saboteur")
    elapsed = time.monotonic() - started
    # The saboteur ran once (it is not restarted); the new enforcer is not stopped and enforces.
    write_gpu_state(node, [(host_pid(node, restarted, "greedy"), 9 * GIB, 10)])
    wait_record(restarted, lambda r: r.get("event") == "sigterm" and r.get("container") == "greedy",
                "the restarted enforcer terminating greedy", timeout=40)
    assert process_state(host_pid(node, restarted, SIDECAR_NAME)) != "T"
    print(f"{sig}: sidecar restarted after {elapsed:.1f}s")


def test_pod_deletion_stops_everything_within_grace(admin: client.ApiClient, cluster: ControlPlane,
                                                    node: Node, sim: Node, psa_namespace: str):
    """Deleting a pod whose workload is held stopped by throttling: every process ends within the
    pod's grace period (a stopped process ignores SIGTERM until continued)."""
    from tests.node.workloads import SPINNER

    grace = 15
    created = kube.create_pod(admin, psa_namespace, gpu_pod(
        [workload_container("hog", SPINNER), workload_container("steady")],
        {"gpufence.io/memory": "8Gi", "gpufence.io/compute.hog": "20"}, terminationGracePeriodSeconds=grace))
    assert created.admitted, created.message
    name = created.obj["metadata"]["name"]
    running = wait_running(cluster, node, psa_namespace, name)
    pids = {c: host_pid(node, running, c) for c in ("hog", "steady", SIDECAR_NAME)}
    write_gpu_state(node, [(pids["hog"], 1 * GIB, 95), (pids["steady"], 1 * GIB, 5)])
    wait_record(running, lambda r: r.get("event") == "throttle_start", "hog throttled", timeout=40)
    kube.wait_for(lambda: process_state(pids["hog"]) == "T", "hog seen stopped", 10, 0.005)
    started = time.monotonic()
    cluster.kubectl("-n", psa_namespace, "delete", "pod", name, "--wait=false")
    kube.wait_for(lambda: not any(process_state(p) for p in pids.values()),
                  "every process of the pod gone", grace + 10, 0.05)
    gone_after = time.monotonic() - started
    assert gone_after < grace, f"the pod's processes took {gone_after:.1f}s, over its grace period {grace}s"
    kube.wait_for(lambda: cluster.kubectl("-n", psa_namespace, "get", "pod", name, check=False).returncode != 0,
                  "the pod object removed", 30, 0.3)
    print(f"pod processes gone {gone_after:.1f}s after deletion (grace {grace}s)")


def _plain_container(name: str, script: str, *args: str, **extra: Any) -> dict[str, Any]:
    """A non-GPU container of the tenant's (root, as most images run)."""
    return {"name": name, "image": SABOTEUR_IMAGE, "imagePullPolicy": "Never",
            "command": ["python3", "-u", "-c", script, *args], "securityContext": {"runAsUser": 0},
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}, **extra}


SABOTEUR_IMAGE = workload_container("x")["image"]
METRICS_PORT = 9401

# Takes the enforcer's port the moment it is free (retrying every 5 ms) and answers every request 200.
SQUATTER = """
import socket, time
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
while True:
    try:
        sock.bind(("0.0.0.0", PORT))
        break
    except OSError:
        time.sleep(0.005)
sock.listen()
print("holding the enforcer's port", flush=True)
while True:
    conn, _ = sock.accept()
    conn.recv(4096)
    conn.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: 3\\r\\n\\r\\nok\\n")
    conn.close()
""".replace("PORT", str(METRICS_PORT))


def test_a_workload_holding_the_port_of_a_killed_sidecar_does_not_end_enforcement(
        cluster: ControlPlane, node: Node, sim: Node, tenant_on_node: Tenant):
    """The sidecar dies (the attack killed it from an exec into the sidecar; a root workload of the
    shared PID namespace kills it the same way, and this test bed has no exec) while a workload
    takes its HTTP port. The restarted enforcer cannot bind it, and enforces all the same: its
    probes read the heartbeat. Before, it exited on `address already in use`: CrashLoopBackOff."""
    tenant = tenant_on_node
    saboteur = workload_container("saboteur", SABOTEUR, user=0)
    saboteur["command"] = [*saboteur["command"], "SIGKILL"]
    pod = gpu_pod([_plain_container("squatter", SQUATTER), saboteur, workload_container("greedy")],
                  {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "3"})
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted, created.message
    name = created.obj["metadata"]["name"]
    assert created.obj["spec"]["initContainers"][0]["livenessProbe"]["exec"], "the probe is not the port"
    wait_running(cluster, node, tenant.namespace, name)

    def sidecar_back() -> dict[str, Any] | None:
        current = get_pod(cluster, tenant.namespace, name)
        status = statuses(current)[SIDECAR_NAME]
        return current if status["restartCount"] >= 1 and status.get("started") else None

    try:
        restarted = kube.wait_for(sidecar_back, "the killed sidecar started again", 60, 0.3)
    except AssertionError:
        current = get_pod(cluster, tenant.namespace, name)
        raise AssertionError(f"sidecar: {statuses(current)[SIDECAR_NAME]}\nlog:\n"
                             f"{container_log(current, SIDECAR_NAME)[-3000:]}") from None
    assert "sent SIGKILL" in container_log(restarted, "saboteur")
    assert "holding the enforcer's port" in container_log(restarted, "squatter")
    failed = wait_record(restarted, lambda r: r.get("event") == "http_failed", "an enforcer without its port")
    assert "in use" in failed["error"], failed

    write_gpu_state(node, [(host_pid(node, restarted, "greedy"), 9 * GIB, 10)])
    wait_record(restarted, lambda r: r.get("event") == "sigterm" and r.get("container") == "greedy",
                "the restarted enforcer terminating greedy", timeout=40)
    kube.wait_for(lambda: statuses(get_pod(cluster, tenant.namespace, name))["greedy"]["restartCount"] >= 1,
                  "greedy restarted", 60, 0.3)
    sidecar = statuses(get_pod(cluster, tenant.namespace, name))[SIDECAR_NAME]
    assert sidecar["restartCount"] == 1 and "running" in sidecar["state"], sidecar


# Declares the enforcer's port (so the webhook gives the enforcer a free one), serves its own /healthz
# there, stops the enforcer and, while it is stopped, keeps rewriting what it can reach of the
# enforcer's state volume: the port file earlier exec probes followed, and the heartbeat, with the
# stopped enforcer's pid (argv[1] "enforcer-pid") or its own ("own-pid").
IMPOSTOR = """
import http.server, os, signal, sys, threading, time
STATE = "/gpufence-state"

class Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok\\n")
    def log_message(self, *args):
        pass

try:  # where admission let the port be declared, the enforcer took a free one and this binds it
    server = http.server.ThreadingHTTPServer(("0.0.0.0", PORT), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
except OSError as exc:
    print(f"port PORT not served: {exc}", flush=True)

def start_time(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]

victim = None
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if any(arg.rsplit(b"/", 1)[-1] == b"gpufence-enforcer" for arg in argv):
            victim = int(pid)
os.kill(victim, signal.SIGSTOP)
print(f"stopped enforcer pid {victim}", flush=True)
mounted = os.path.isdir(STATE)
print("forging in the state volume" if mounted else "no state volume to forge in", flush=True)
while os.path.exists(f"/proc/{victim}"):
    if mounted:
        with open(f"{STATE}/http-port", "w") as f:
            f.write("PORT\\n")
        try:
            fields = open(f"{STATE}/heartbeat").read().split("\\n")[0].split()
        except OSError:
            fields = []
        if len(fields) == 7:
            pid = victim if sys.argv[1] == "enforcer-pid" else os.getpid()
            fields[2], fields[3] = "1", f"{time.clock_gettime(time.CLOCK_BOOTTIME):.3f}"
            fields[5], fields[6] = str(pid), start_time(pid)
            with open(f"{STATE}/.forged", "w") as f:
                f.write(" ".join(fields) + "\\nok\\n")
            os.replace(f"{STATE}/.forged", f"{STATE}/heartbeat")
    time.sleep(0.2)
print("the stopped enforcer is gone", flush=True)
while True:
    time.sleep(3600)
""".replace("PORT", str(METRICS_PORT))


@pytest.mark.parametrize(("forged_pid", "probe_says"), [("enforcer-pid", "is stopped"),
                                                       ("own-pid", "runs in another container")])
def test_a_workload_forging_the_sidecars_health_while_stopping_it_gets_it_restarted(
        cluster: ControlPlane, node: Node, sim: Node, tenant_on_node: Tenant, forged_pid: str, probe_says: str):
    """The attack on the exec probe that asked /healthz on the port recorded in the state volume:
    a workload declares the enforcer's port, mounts its state volume, points the record at its own
    /healthz and SIGSTOPs the enforcer (stopped 95 s, never restarted, 9 GiB on 8 GiB untouched).
    Now the probe reads the heartbeat and checks the process it names: the stopped enforcer fails
    its liveness probe whatever the workload writes, and the restarted one terminates greedy.
    Where admission refuses the state-volume mount and the declared port, the attack runs without
    them."""
    tenant = tenant_on_node
    impostor = _plain_container("impostor", IMPOSTOR, forged_pid,
                                ports=[{"containerPort": METRICS_PORT, "protocol": "TCP"}],
                                volumeMounts=[{"name": "gpufence-state", "mountPath": "/gpufence-state"}])
    pod = gpu_pod([workload_container("greedy"), impostor],
                  {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "3"})
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    if not created.admitted:  # admission keeps workloads off the enforcer's volume and port
        assert "gpufence-state" in created.message or str(METRICS_PORT) in created.message, created.message
        del impostor["volumeMounts"], impostor["ports"]
        created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted, created.message
    name = created.obj["metadata"]["name"]
    wait_running(cluster, node, tenant.namespace, name)
    started = time.monotonic()
    restarted = wait_sidecar_restarted(cluster, tenant.namespace, name, "the stopped sidecar restarted", 90)
    elapsed = time.monotonic() - started
    said = container_log(restarted, "impostor")
    assert "stopped enforcer pid" in said and "the stopped enforcer is gone" in said, said
    unhealthy = [e["message"] for e in events(cluster, tenant.namespace, name) if e.get("reason") == "Unhealthy"]
    assert unhealthy, "no failed probe recorded"
    if "forging in the state volume" in said:
        assert any(probe_says in message for message in unhealthy), unhealthy

    write_gpu_state(node, [(host_pid(node, restarted, "greedy"), 9 * GIB, 10)])
    wait_record(restarted, lambda r: r.get("event") == "sigterm" and r.get("container") == "greedy",
                "the restarted enforcer terminating greedy", timeout=40)
    assert process_state(host_pid(node, restarted, SIDECAR_NAME)) != "T"
    print(f"{forged_pid}: stopped sidecar restarted after {elapsed:.1f}s; probe said {unhealthy[-1]!r}")


# Issue 32 row 1: chroot()s into the enforcer's root (/proc/<pid>/root: the sidecar's files, its state
# volume included), writes a fresh heartbeat naming itself every 0.2 s, then SIGSTOPs the enforcer. Its
# pid, start time, state and root directory are what the probe checked; its cgroup is not the sidecar's.
CHROOT_DECOY = """
import os, signal, time
STATE = "/var/run/gpufence"

def start_time(pid):
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]

victim = None
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) != os.getpid():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if any(arg.rsplit(b"/", 1)[-1] == b"gpufence-enforcer" for arg in argv):
            victim = int(pid)
me, started = os.getpid(), start_time(os.getpid())
try:
    os.chroot(f"/proc/{victim}/root")
    os.chdir("/")
    print(f"chrooted into the root of enforcer pid {victim}", flush=True)
except OSError as exc:
    print(f"cannot chroot into the enforcer's root: {exc}", flush=True)
os.kill(victim, signal.SIGSTOP)
print(f"stopped enforcer pid {victim}", flush=True)
while os.path.exists(f"/proc/{victim}"):
    try:
        fields = open(f"{STATE}/heartbeat").read().split("\\n")[0].split()
        if len(fields) == 7:
            fields[2], fields[3] = "1", f"{time.clock_gettime(time.CLOCK_BOOTTIME):.3f}"
            fields[5], fields[6] = str(me), started
            with open(f"{STATE}/.forged", "w") as f:
                f.write(" ".join(fields) + "\\nok\\n")
            os.replace(f"{STATE}/.forged", f"{STATE}/heartbeat")
    except OSError as exc:
        print(f"cannot forge: {exc}", flush=True)
    time.sleep(0.2)
print("the stopped enforcer is gone", flush=True)
while True:
    time.sleep(3600)
"""


def test_a_decoy_chrooted_into_the_sidecars_root_cannot_keep_a_stopped_enforcer_alive(
        cluster: ControlPlane, node: Node, sim: Node, tenant_on_node: Tenant):
    """Issue 32 row 1 on the real node (not run by its author: the node test bed is the lead's): the
    decoy's forged heartbeat passed the probe's pid, start-time and root checks (stopped 100 s, 0
    restarts). Now the probe also requires the heartbeat's process to be in its own cgroup (the
    sidecar's, where the kubelet's exec runs it): the stopped sidecar is restarted and the restarted
    enforcer terminates greedy."""
    tenant = tenant_on_node
    pod = gpu_pod([workload_container("greedy"), _plain_container("decoy", CHROOT_DECOY)],
                  {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "3"})
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted, created.message
    name = created.obj["metadata"]["name"]
    wait_running(cluster, node, tenant.namespace, name)
    started = time.monotonic()
    restarted = wait_sidecar_restarted(cluster, tenant.namespace, name, "the stopped sidecar restarted", 90)
    elapsed = time.monotonic() - started
    said = container_log(restarted, "decoy")
    assert "stopped enforcer pid" in said and "the stopped enforcer is gone" in said, said
    unhealthy = [e["message"] for e in events(cluster, tenant.namespace, name) if e.get("reason") == "Unhealthy"]
    assert unhealthy, "no failed probe recorded"
    if "chrooted into the root" in said and "cannot forge" not in said:
        assert any("another cgroup" in m or "another container" in m for m in unhealthy), unhealthy
    write_gpu_state(node, [(host_pid(node, restarted, "greedy"), 9 * GIB, 10)])
    wait_record(restarted, lambda r: r.get("event") == "sigterm" and r.get("container") == "greedy",
                "the restarted enforcer terminating greedy", timeout=40)
    print(f"chroot decoy: stopped sidecar restarted after {elapsed:.1f}s; probe said {unhealthy[-1]!r}; "
          f"decoy said {said.strip().splitlines()[:2]}")


@pytest.mark.parametrize("level", [None, "baseline"])
def test_a_root_gpu_container_under_a_pod_user_is_enforced_for_the_tenant(
        cluster: ControlPlane, node: Node, sim: Node, tenant_at_level: Callable[[str | None], Tenant],
        level: str | None):
    """Issue 32 row 3 as the tenant wrote it: pod-level ``runAsUser: 1000`` / ``runAsGroup: 1000``,
    the GPU container ``runAsUser: 0``, 9 GiB on an 8 GiB share. The sidecar used to inherit uid 1000
    and report the root process as uninspectable, untouched. Now it is uid 0 of its own: with
    SYS_PTRACE where Pod Security is unset, and under ``baseline`` (no SYS_PTRACE) as the GPU
    container's user, root, with the pod's group: either way it reads the process and terminates it."""
    tenant = tenant_at_level(level)
    greedy = workload_container("greedy", user=0)
    created = kube.create_pod(tenant.api, tenant.namespace, gpu_pod(
        [greedy], {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": "3"},
        securityContext={"runAsUser": 1000, "runAsGroup": 1000}))
    assert created.admitted, created.message
    name = created.obj["metadata"]["name"]
    assert kube.container(created.obj, SIDECAR_NAME)["securityContext"]["runAsUser"] == 0
    running = wait_running(cluster, node, tenant.namespace, name)
    write_gpu_state(node, [(host_pid(node, running, "greedy"), 9 * GIB, 10)])
    wait_record(running, lambda r: r.get("event") == "sigterm" and r.get("container") == "greedy",
                "the enforcer terminating the root GPU container", timeout=40)
    assert not [r for r in enforcer_records(running) if r.get("event") == "process_uninspectable"]
    kube.wait_for(lambda: statuses(get_pod(cluster, tenant.namespace, name))["greedy"]["restartCount"] >= 1,
                  "greedy restarted", 60, 0.3)


# Issue 38 row 5 (round three's row 2 on the node): a root GPU container with SYS_ADMIN bind-mounts
# its /dev/nvidia0 at /dev/xgpu0 and holds the GPU only there. The sidecar's own /dev has no
# nvidia0 (the runtime gives it none here) and the simulated device is a plain file, so only the
# workload's own root tells the enforcer what its alias is.
ALIASED = """
import ctypes, os, signal, sys, time
MS_BIND = 4096
open("/dev/xgpu0", "w").close()
libc = ctypes.CDLL(None, use_errno=True)
if libc.mount(b"/dev/nvidia0", b"/dev/xgpu0", None, MS_BIND, None) != 0:
    print(f"bind mount failed: errno {ctypes.get_errno()}", flush=True)
    sys.exit(1)
device = open("/dev/xgpu0")
held = []
for fd in os.listdir("/proc/self/fd"):
    try:  # the descriptor listdir used is closed by now
        held.append(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        pass
def on_term(signum, frame):
    print("got SIGTERM", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
print(f"gpu process {os.getpid()} holds {sorted(h for h in held if h.startswith('/dev/'))}", flush=True)
while True:
    time.sleep(3600)
"""


def test_a_root_workload_holding_its_gpu_only_through_a_bind_mounted_alias_is_terminated(
        cluster: ControlPlane, node: Node, sim: Node, tenant_on_node: Tenant):
    """The tenant's pod, as the ``edit`` account submits it: a root GPU container adding SYS_ADMIN
    (Pod Security unset) bind-mounts the device node at /dev/xgpu0 and holds it only there, using
    5 GiB on a 4 GiB share at 100 % SM. The sidecar must see it as the pod's GPU process and
    terminate it (before: nothing logged beyond start-up, 30 s untouched)."""
    tenant = tenant_on_node
    greedy = workload_container("greedy", ALIASED, securityContext={"runAsUser": 0,
                                                                       "capabilities": {"add": ["SYS_ADMIN"]}})
    pod = gpu_pod([greedy], {"gpufence.io/memory": "4Gi", "gpufence.io/compute": "20",
                             "gpufence.io/grace-period": "3"})
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted and kube.is_mutated(created.obj), created.message
    name = created.obj["metadata"]["name"]
    running = wait_running(cluster, node, tenant.namespace, name)
    said = kube.wait_for(lambda: container_log(running, "greedy") or None, "greedy's first line", 30, 0.2)
    assert "'/dev/xgpu0'" in said and "/dev/nvidia" not in said, said  # the alias, no name under /dev/nvidia

    write_gpu_state(node, [(host_pid(node, running, "greedy"), 5 * GIB, 100)])
    sidecar_terminates_over_memory(cluster, running, "greedy", 5 * GIB, 4 * GIB, "which holds only /dev/xgpu0")
