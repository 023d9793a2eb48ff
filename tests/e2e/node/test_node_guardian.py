"""The node guardian on the real node (issue 39's "Done when" rows), as the ``edit`` tenant with root workloads.

The guardian is the real ``gpufence-node`` process on the node's host (``tests/node/guardian.py``):
the host's PID namespace and cgroupfs, the simulated driver's state that the pods' sidecars read,
its pod watch against the kube-apiserver with a bound token of its own ServiceAccount and the RBAC
of ``k8s/components/node-guardian``. The tenant reaches none of it: what a workload does inside
its pod (stopping every gpufence process, opening a device that admission never saw) does not
stop the guardian from ending it through its cgroup.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufence.contract import SIDECAR_NAME, EnforcerConfig
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.tenant import Tenant
from tests.node.guardian import POLL_INTERVAL, UNACCOUNTED_GRACE, GuardianProcess, running_guardian
from tests.node.images import GPUFENCE_IMAGE
from tests.node.node import NODE_NAME, Node
from tests.node.simruntime import PLANTED_DEVICE_ENV
from tests.node.workloads import (
    container_log,
    enforcer_records,
    get_pod,
    gpu_pod,
    host_pid,
    process_state,
    statuses,
    wait_running,
    workload_container,
    write_gpu_state,
)

GIB = 1 << 30
GRACE = 3


@pytest.fixture(scope="module")
def guardian(cluster: ControlPlane, node: Node, sim: Node,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardianProcess]:
    with running_guardian(cluster, node, tmp_path_factory.mktemp("gpufence-node")) as running:
        yield running


@pytest.fixture
def tenant_on_node(cluster: ControlPlane, node: Node, sim: Node, tenant: Tenant) -> Iterator[Tenant]:
    """The ``edit`` tenant (tests/e2e/tenant.py), its pods on the node; they are gone before the next test."""
    yield tenant
    write_gpu_state(node, ())
    cluster.kubectl("-n", tenant.namespace, "delete", "pods", "--all", "--wait=true", "--timeout=90s", check=False)
    cluster.kubectl("delete", "namespace", tenant.namespace, "--wait=false", check=False)


# Root, in the pod's shared PID namespace: holds the device and SIGSTOPs every gpufence process of
# its pod the moment it appears (the enforcer, each probe and postStart process, a restarted
# enforcer), as issue 39's attack did. Its own text names gpufence too: it skips itself.
STOPPER = """
import os, signal, time
device = open("/dev/nvidia0")
me = os.getpid()
print(f"gpu process {me}", flush=True)
seen = set()
while True:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if b"gpufence" in argv:
            try:
                os.kill(int(entry), signal.SIGSTOP)
            except ProcessLookupError:
                continue
            if entry not in seen:
                seen.add(entry)
                print(f"stopped {entry} {argv[:80]!r}", flush=True)
    time.sleep(0.05)
"""


def test_a_workload_stopping_every_gpufence_process_is_terminated_by_the_guardian(
        cluster: ControlPlane, node: Node, tenant_on_node: Tenant, guardian: GuardianProcess) -> None:
    """9 GiB on an 8 GiB share with the pod's enforcer held stopped: the guardian SIGKILLs the
    container through its cgroup at the pod's grace period plus the handover (the pod's poll and
    two of the guardian's), with nothing from the stopped sidecar."""
    tenant = tenant_on_node
    pod = gpu_pod([workload_container("greedy", STOPPER, user=0)],
                  {"gpufence.io/memory": "8Gi", "gpufence.io/grace-period": str(GRACE)}, restartPolicy="Never")
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted and kube.is_mutated(created.obj), created.message
    name = created.obj["metadata"]["name"]
    running = wait_running(cluster, node, tenant.namespace, name)
    sidecar = host_pid(node, running, SIDECAR_NAME)
    kube.wait_for(lambda: process_state(sidecar) == "T", "the enforcer stopped by the workload", 30, 0.05)
    greedy = host_pid(node, running, "greedy")
    write_gpu_state(node, [(greedy, 9 * GIB, 10)])

    record = guardian.wait_record(lambda r: r.get("event") == "guardian_sigkill" and r.get("pod") == name,
                                  f"the guardian's SIGKILL of {name}", timeout=120)
    assert (record["namespace"], record["container"], record["reason"]) == \
        (tenant.namespace, "greedy", "memory_over_share"), record
    assert greedy in record["sent"] and record["used_bytes"] == 9 * GIB and record["limit_bytes"] == 8 * GIB, record
    assert running["metadata"]["uid"].replace("-", "_") in record["cgroup"].replace("-", "_"), record
    config = EnforcerConfig.from_dict(kube.enforcer_config(running))
    assert config.grace_period_seconds == GRACE
    # The deadline the guardian held: the grace period plus the pod's poll and two of its own, never more.
    assert record["grace_seconds"] == pytest.approx(GRACE + config.poll_interval_seconds + 2 * POLL_INTERVAL), record

    def terminated() -> dict[str, Any] | None:
        current = get_pod(cluster, tenant.namespace, name)
        return current if "terminated" in (statuses(current)["greedy"].get("state") or {}) else None

    ended = kube.wait_for(terminated, "greedy terminated", 60, 0.3)
    assert statuses(ended)["greedy"]["state"]["terminated"]["exitCode"] == 137, statuses(ended)["greedy"]
    assert process_state(greedy) == ""
    assert "stopped" in container_log(ended, "greedy"), container_log(ended, "greedy")
    # The stopped sidecar did nothing: the termination was the guardian's alone.
    assert not [r for r in enforcer_records(ended) if r.get("event") in ("sigterm", "sigkill")]
    print(f"guardian SIGKILL after {record['held_seconds']} s held (deadline {record['grace_seconds']} s)")


# A container of a pod admitted without a GPU that opens the device the node's runtime planted
# into it (tests/node/simruntime.py, as an NRI plugin would from an annotation).
PLANTED = """
import os, time
device = open("/dev/nvidia0")
print(f"planted device open in {os.getpid()}", flush=True)
while True:
    time.sleep(3600)
"""


def test_a_container_with_a_gpu_admission_never_saw_is_terminated_as_unaccounted(
        cluster: ControlPlane, node: Node, tenant_on_node: Tenant, guardian: GuardianProcess) -> None:
    tenant = tenant_on_node
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": kube.unique("plain")}, "spec": {
        "nodeName": NODE_NAME, "restartPolicy": "Never",
        "containers": [{"name": "sneaky", "image": GPUFENCE_IMAGE, "imagePullPolicy": "Never",
                        "command": ["python3", "-u", "-c", PLANTED], "securityContext": {"runAsUser": 0},
                        "env": [{"name": PLANTED_DEVICE_ENV, "value": "nvidia0"}],
                        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}}]}}
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted and SIDECAR_NAME not in kube.container_names(created.obj), created.message
    name = created.obj["metadata"]["name"]
    running = wait_running(cluster, node, tenant.namespace, name)
    kube.wait_for(lambda: "planted device open" in container_log(running, "sneaky"), "the device opened", 30, 0.2)
    sneaky = host_pid(node, running, "sneaky")
    write_gpu_state(node, [(sneaky, 6 * GIB, 30)])

    census = guardian.wait_record(
        lambda r: r.get("event") == "gpu_process" and r.get("pid") == sneaky and r.get("standing") == "unaccounted",
        "the planted process counted unaccounted", timeout=60)
    assert (census["namespace"], census["pod"], census["container"]) == (tenant.namespace, name, "sneaky"), census
    term = guardian.wait_record(lambda r: r.get("event") == "guardian_sigterm" and r.get("pod") == name,
                                f"the guardian's SIGTERM of {name}", timeout=60)
    assert (term["namespace"], term["container"], term["reason"]) == (tenant.namespace, "sneaky", "unaccounted"), term
    assert sneaky in term["sent"] and term["used_bytes"] == 6 * GIB, term
    assert term["grace_seconds"] == pytest.approx(UNACCOUNTED_GRACE), term
    assert term["why"] and term["cgroup"] == census["cgroup"], term

    def terminated() -> dict[str, Any] | None:
        current = get_pod(cluster, tenant.namespace, name)
        return current if "terminated" in (statuses(current)["sneaky"].get("state") or {}) else None

    ended = kube.wait_for(terminated, "sneaky terminated", 60, 0.3)
    assert statuses(ended)["sneaky"]["state"]["terminated"]["exitCode"] in (143, 137), statuses(ended)["sneaky"]
    assert process_state(sneaky) == ""
    print(f"unaccounted: {term['why']}; cgroup {term['cgroup']}")


# Root, in the pod's shared PID namespace: SIGSTOPs every gpufence process (so no sidecar throttles)
# and SIGCONTs every other process of the pod every 5 ms (what would undo a SIGSTOP duty cycle).
CONTINUER = """
import os, signal, time
me = os.getpid()
print(f"helper {me}", flush=True)
sent = 0
while True:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (me, 1):
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read()
            os.kill(int(entry), signal.SIGSTOP if b"gpufence" in argv else signal.SIGCONT)
        except OSError:
            continue
        sent += 1
        if sent in (1, 100, 10000):
            print(f"signals sent {sent}", flush=True)
    time.sleep(0.005)
"""


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _freezer_state(pid: int) -> Callable[[], str]:
    """The freezer state of ``pid``'s container as the guardian drives it: ``cgroup.events``' frozen
    flag where the container is in the v2 tree (runc puts it there on this hybrid host too), else
    v1 ``freezer.state``. "FROZEN" only once every task is held."""
    paths = dict(line.split(":", 2)[1:] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    unified = Path("/sys/fs/cgroup/unified")
    if paths.get("", "/") != "/" and (unified / "cgroup.controllers").exists():
        events = unified / paths[""].lstrip("/") / "cgroup.events"
        return lambda: "FROZEN" if "frozen 1" in events.read_text() else "THAWED"
    v1 = next(Path("/sys/fs/cgroup/freezer") / p.lstrip("/") / "freezer.state"
              for c, p in paths.items() if "freezer" in c.split(","))
    return lambda: v1.read_text().strip()


def test_a_compute_hog_with_a_sigcont_helper_is_held_by_the_guardians_freezer(
        cluster: ControlPlane, node: Node, tenant_on_node: Tenant, guardian: GuardianProcess) -> None:
    """95 % SM on a 20 % share, the sidecar held stopped and every process of the pod SIGCONTed
    every 5 ms: the guardian's freezer holds the hog (no CPU tick while its cgroup is frozen), and
    it runs while thawed."""
    from tests.node.workloads import SPINNER

    tenant = tenant_on_node
    helper = {"name": "helper", "image": GPUFENCE_IMAGE, "imagePullPolicy": "Never",
              "command": ["python3", "-u", "-c", CONTINUER], "securityContext": {"runAsUser": 0},
              "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}}
    pod = gpu_pod([workload_container("hog", SPINNER, user=0), helper],
                  {"gpufence.io/memory": "4Gi", "gpufence.io/compute": "20"})
    created = kube.create_pod(tenant.api, tenant.namespace, pod)
    assert created.admitted and kube.is_mutated(created.obj), created.message
    name = created.obj["metadata"]["name"]
    running = wait_running(cluster, node, tenant.namespace, name)
    kube.wait_for(lambda: process_state(host_pid(node, running, SIDECAR_NAME)) == "T",
                  "the enforcer stopped by the helper", 30, 0.05)
    hog = host_pid(node, running, "hog")
    write_gpu_state(node, [(hog, 1 * GIB, 95)])
    uid = running["metadata"]["uid"]
    start = guardian.wait_record(lambda r: r.get("event") == "guardian_throttle_start" and r.get("pod_uid") == uid,
                                 "the guardian throttling the hog", timeout=90)
    assert start["container"] == "hog", start

    state = _freezer_state(hog)
    frozen: list[int] = []
    thawed: list[int] = []
    # FROZEN at both ends of a sample means frozen throughout only if no whole thawed phase fits
    # between the two reads: the shortest is the controller's smallest run fraction (the hog stays
    # at 95 % on its 20 % share, so its fraction falls there) of the shortest period the freezer
    # draws (the guardian runs with the default --compute-period). The elapsed time is measured, not
    # assumed: on a busy machine a short sleep can last longer than a thawed phase.
    # Samples a tenth of that long; together they watch the frozen hog for a second.
    from gpufence.enforcer.decide.compute import ComputeTracker
    from gpufence.node.cli import parser
    from gpufence.node.throttle import PERIOD_JITTER
    period = parser().get_default("compute_period")
    shortest_thawed = ComputeTracker().min_run_fraction * period * (1 - PERIOD_JITTER)
    watched = [0.0]  # seconds of samples frozen throughout

    def sampled_enough() -> bool:
        began = time.monotonic()
        before = state()
        ticks = _cpu_ticks(hog)
        time.sleep(shortest_thawed / 10)
        advanced = _cpu_ticks(hog) - ticks
        after = state()  # read last, so the ticks lie between the two states
        elapsed = time.monotonic() - began
        if before == after == "FROZEN" and elapsed < shortest_thawed:
            frozen.append(advanced)
            watched[0] += elapsed
        elif before == after == "THAWED":
            thawed.append(advanced)
        return watched[0] >= period and sum(thawed) > 0

    kube.wait_for(sampled_enough, "a second of samples of the hog frozen, and one running while thawed", 60, 0.0)
    assert not any(frozen), f"the hog ran while frozen: ticks {frozen}"
    assert "signals sent 100" in container_log(get_pod(cluster, tenant.namespace, name), "helper")
    print(f"frozen samples {len(frozen)} ({watched[0]:.2f} s, 0 ticks), "
          f"thawed samples {len(thawed)} ({sum(thawed)} ticks)")
