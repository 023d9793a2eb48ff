"""Root by setuid beside a non-root sidecar, on the real node (issue 38 row 2, issue 39's setuid row).

The tenant's image holds a setuid-root binary (``images.SETUID_ROOT_PYTHON``, a root-owned copy of
python3 with the setuid bit). Every pod here is created by the ``edit`` ServiceAccount through the
API server in a namespace that enforces Pod Security ``baseline``, with pod-level ``runAsUser:
1000``: the webhook runs the sidecar as uid 1000 there (``baseline`` forbids the SYS_PTRACE a root
sidecar needs to inspect other users' processes, so it runs as the GPU containers' user), and a
process that became root would be out of its reach. What the kernel reports about the processes
(``/proc/<pid>/status`` on the node's host) is what is asserted, not only the stored spec.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from datetime import UTC, datetime

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.tenant import Tenant
from tests.node.guardian import POLL_INTERVAL, GuardianDaemonSet
from tests.node.images import GPUFENCE_IMAGE, SETUID_ROOT_PYTHON
from tests.node.node import Node
from tests.node.simruntime import PLANTED_DEVICE_ENV
from tests.node.workloads import (
    container_log,
    enforcer_records,
    events,
    get_pod,
    gpu_pod,
    host_pid,
    proc_status,
    process_state,
    setuid_root_command,
    sidecar_terminates_over_memory,
    statuses,
    wait_running,
    wait_terminated,
    workload_container,
    write_gpu_state,
)

GIB = 1 << 30
GRACE = 3
POD_USER = {"runAsUser": 1000, "runAsGroup": 1000}
# The guardian's records are checked against its bound after the fact, with this much slack: the
# guardian and the kubelet share two busy cores with the control plane and the test.
MARGIN_SECONDS = 10.0


def _uids(pid: int) -> list[int]:
    """Real, effective, saved and filesystem uid of ``pid``, as the kernel reports them."""
    return [int(u) for u in proc_status(pid)["Uid"].split()]


def _runs_the_setuid_binary(pid: int) -> None:
    """``pid`` executes the image's setuid-root binary, and the bit reached the container: without
    that a euid of 1000 would prove nothing about no_new_privs."""
    exe = os.readlink(f"/proc/{pid}/exe")  # the path within the container's root
    assert exe.endswith(SETUID_ROOT_PYTHON), exe
    binary = os.stat(f"/proc/{pid}/exe")
    assert binary.st_uid == 0 and binary.st_mode & stat.S_ISUID, oct(binary.st_mode)


def _first_line(pod: dict, container: str) -> str:
    return kube.wait_for(lambda: container_log(pod, container) or None, f"{container}'s first line", 30, 0.2)


def _epoch(record: dict) -> float:
    """A record's ``time`` (RFC 3339, UTC, milliseconds) as seconds since the epoch."""
    return datetime.strptime(record["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def test_a_setuid_root_binary_stays_uid_1000_and_the_uid_1000_sidecar_terminates_it(
        cluster: ControlPlane, node: Node, sim: Node, tenant_at_level: Callable[[str | None], Tenant]) -> None:
    """Issue 38 row 2 on the node: the GPU container runs the setuid-root binary as uid 1000, which
    tries to make itself root and holds 9 GiB on an 8 GiB share. Before, it became root and the
    uid-1000 sidecar's SIGTERMs failed (9 GiB kept). Now the webhook sets
    ``allowPrivilegeEscalation: false`` on the GPU container: the runtime gives the process the
    kernel's no_new_privs, the setuid bit does not raise its euid, and the sidecar terminates it."""
    tenant = tenant_at_level("baseline")
    greedy = workload_container("greedy", user=None, command=setuid_root_command())
    created = kube.create_pod(tenant.api, tenant.namespace, gpu_pod(
        [greedy], {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": str(GRACE)}, securityContext=POD_USER))
    assert created.admitted and kube.is_mutated(created.obj), created.message
    assert kube.container(created.obj, "greedy")["securityContext"]["allowPrivilegeEscalation"] is False
    assert kube.container(created.obj, SIDECAR_NAME)["securityContext"]["runAsUser"] == 1000
    name = created.obj["metadata"]["name"]
    running = wait_running(cluster, node, tenant.namespace, name)
    said = _first_line(running, "greedy")

    pid = host_pid(node, running, "greedy")
    _runs_the_setuid_binary(pid)
    status = proc_status(pid)
    assert status["NoNewPrivs"] == "1", status
    # The setuid bit raised nothing (the same binary in a container without no_new_privs makes
    # uid 0: the guardian test below), so a webhook that stopped setting the field fails here too.
    assert _uids(pid) == [1000] * 4, (status["Uid"], said)
    assert "stayed uid 1000" in said, said
    assert _uids(host_pid(node, running, SIDECAR_NAME))[1] == 1000

    write_gpu_state(node, [(pid, 9 * GIB, 10)])
    sidecar_terminates_over_memory(cluster, running, "greedy", 9 * GIB, 8 * GIB, "the uid-1000 sidecar")
    assert not [r for r in enforcer_records(running) if r.get("event") == "process_uninspectable"]

    def over_share_event() -> dict | None:
        return next((e for e in events(cluster, tenant.namespace, name) if e["reason"] == "GPUMemoryOverShare"), None)

    event = kube.wait_for(over_share_event, "the sidecar's GPUMemoryOverShare Event on the pod", 30, 0.3)
    assert "greedy" in event["message"] and event["source"]["component"] == "gpufence-enforcer", event


def test_a_setuid_root_process_beside_a_uid_1000_sidecar_is_terminated_by_the_guardian(
        cluster: ControlPlane, node: Node, sim: Node, tenant_at_level: Callable[[str | None], Tenant],
        guardian: GuardianDaemonSet) -> None:
    """Issue 39's row "a setuid-root process beside a non-root sidecar over its share is
    terminated", with the node guardian (the shipped DaemonSet, tests/node/guardian.py).

    Which path still gives a root process beside a uid-1000 sidecar: the webhook sets
    ``allowPrivilegeEscalation: false`` on every GPU container wherever the sidecar is not root
    (``sidecar_reaches_root``: every level but ``privileged``/unset, where the sidecar is root
    itself), and denies ``true``; nobody is exempt, admins included. It leaves a container without
    a GPU as written (``test_round_four``: "no GPU: left as written"), and Pod Security ``baseline``
    allows escalation there. So the tenant's GPU pod has a second container, ``helper``, with no GPU
    request, that runs the setuid-root binary as uid 1000 and becomes root; it gets the GPU by a
    path admission does not see (the node's runtime plants the device, as the toolkit's NRI plugin
    would: ``simruntime.PLANTED_DEVICE_ENV``) and holds 9 GiB, over its share (it has none) and
    over the pod's 8 GiB, ignoring SIGTERM. The sidecar (uid 1000) cannot signal it; the guardian
    ends it through its cgroup from the host, within its grace period plus two polls, and leaves the
    pod's GPU container, within its share, running."""
    tenant = tenant_at_level("baseline")
    helper = {"name": "helper", "image": GPUFENCE_IMAGE, "imagePullPolicy": "Never",
              "command": setuid_root_command("ignore"), "env": [{"name": PLANTED_DEVICE_ENV, "value": "nvidia0"}],
              "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}}
    pod = gpu_pod([workload_container("worker", user=None), helper],
                  {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": str(GRACE)},
                  securityContext=POD_USER, restartPolicy="Never")
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted and kube.is_mutated(created.obj), created.message
    assert kube.container(created.obj, "worker")["securityContext"]["allowPrivilegeEscalation"] is False
    assert "allowPrivilegeEscalation" not in (kube.container(created.obj, "helper").get("securityContext") or {})
    assert kube.container(created.obj, SIDECAR_NAME)["securityContext"]["runAsUser"] == 1000
    name = created.obj["metadata"]["name"]
    running = wait_running(cluster, node, tenant.namespace, name)
    said = _first_line(running, "helper")

    # The kernel's view: helper root for good, beside a uid-1000 sidecar; the GPU container confined.
    root, worker, sidecar = (host_pid(node, running, c) for c in ("helper", "worker", SIDECAR_NAME))
    _runs_the_setuid_binary(root)
    assert _uids(root) == [0] * 4 and proc_status(root)["NoNewPrivs"] == "0", (proc_status(root), said)
    assert "became root" in said, said
    assert _uids(sidecar)[1] == 1000 and proc_status(worker)["NoNewPrivs"] == "1"

    written = time.time()
    write_gpu_state(node, [(root, 9 * GIB, 10), (worker, 1 * GIB, 10)])
    kill = guardian.wait_record(lambda r: r.get("event") == "guardian_sigkill" and r.get("pod") == name,
                                f"the guardian's SIGKILL of {name}", timeout=120)
    assert (kill["namespace"], kill["container"], kill["reason"]) == (tenant.namespace, "helper", "unaccounted"), kill
    assert root in kill["sent"] and kill["used_bytes"] == 9 * GIB, kill
    assert running["metadata"]["uid"].replace("-", "_") in kill["cgroup"].replace("-", "_"), kill
    term = next(r for r in guardian.records() if r.get("event") == "guardian_sigterm" and r.get("pod") == name)
    assert root in term["sent"], term  # sent at once, and ignored: only the SIGKILL ended it
    # Within the grace period plus two polls of the state written (the recorded times, after the fact).
    took = _epoch(kill) - written
    assert took <= kill["grace_seconds"] + 2 * POLL_INTERVAL + MARGIN_SECONDS, (took, kill)

    ended = wait_terminated(cluster, tenant.namespace, name, "helper")
    assert statuses(ended)["helper"]["state"]["terminated"]["exitCode"] == 137, statuses(ended)["helper"]
    assert process_state(root) == ""
    write_gpu_state(node, [(worker, 1 * GIB, 10)])
    assert "running" in statuses(get_pod(cluster, tenant.namespace, name))["worker"]["state"]
    assert process_state(worker) not in ("", "T")
    # What the uid-1000 sidecar made of the root process (it cannot signal it): for the report.
    tried = [{k: r.get(k) for k in ("event", "outcome", "reason", "container", "victims", "error")}
             for r in enforcer_records(ended) if r.get("event") in ("sigterm", "sigkill", "pod_over_budget",
                                                                     "process_uninspectable")]
    print(f"guardian SIGKILL {took:.1f} s after the state was written (grace {kill['grace_seconds']} s, "
          f"held {kill['held_seconds']} s); the sidecar: {tried[:4]}")
    assert process_state(sidecar) != ""  # the sidecar ran throughout
