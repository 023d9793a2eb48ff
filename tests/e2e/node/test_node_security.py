"""What the sidecar can do to the workloads, and they to it, with the users and capabilities as shipped.

docs/install.md ("Pod Security of the namespaces you opt in") says mutated GPU pods pass only
`privileged` (the root sidecar adds SYS_PTRACE, which `baseline` forbids); these pods run in a
namespace that enforces `privileged` and warns/audits `baseline`, the documented setup. The user
matrix is the one gpufence/webhook/sidecar.py documents ("Which user the enforcer runs as").
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.node.node import Node
from tests.node.workloads import (
    SABOTEUR,
    container_log,
    enforcer_records,
    get_pod,
    gpu_pod,
    host_pid,
    metrics,
    process_state,
    statuses,
    wait_record,
    wait_running,
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
    write_gpu_state(node, ())
    cluster.kubectl("-n", namespace, "delete", "pods", "--all", "--wait=true", "--timeout=90s", check=False)
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# name -> (pod securityContext, greedy's own securityContext, enforced per the documentation)
USERS = {
    # Most CUDA images: root workloads; the sidecar is uid 0 with KILL + SYS_PTRACE.
    "root-workload": ({}, {"runAsUser": 0}, True),
    # The workload's image runs as a non-root user and the pod sets none: the sidecar is uid 0
    # with KILL + SYS_PTRACE, documented to reach "processes of any user".
    "image-user-workload": ({}, {}, True),
    # Pod-level runAsUser: the sidecar inherits it and needs no capability (same uid).
    "pod-run-as-user": ({"runAsUser": 1000, "runAsGroup": 1000}, {}, True),
    # A container with a user of its own under a pod-level runAsUser: documented (and warned at
    # admission) as out of a non-root sidecar's reach.
    "container-own-user": ({"runAsUser": 1000, "runAsGroup": 1000}, {"runAsUser": 2000}, False),
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

    def sidecar_restarted() -> dict[str, Any] | None:
        current = get_pod(cluster, psa_namespace, name)
        status = statuses(current)[SIDECAR_NAME]
        return current if status["restartCount"] >= 1 and status.get("started") else None

    restarted = kube.wait_for(sidecar_restarted, f"the sidecar restarted after {sig}", within, 0.3)
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
