"""The real guardian scraped by a real Prometheus through the job the Prometheus Operator makes of our
PodMonitor gpufence-node (the DaemonSet's own pod template as Kubernetes discovery lists it), with
our PrometheusRule loaded: an unaccounted GPU process in a real cgroup raises
GpufenceUnaccountedGpuProcess with the workload's namespace/pod/container and the guardian's node,
its audit raises GpufenceNodeGuardianActed, the guardian-down alert stays silent until the guardian
is stopped, and
``gpufence top --prometheus`` lists the process with its memory, and the dashboard's guardian panels
show it. GPU processes of another namespace and of the host beside an opted-in container, and one
the admin's policy allowed, show in the standing and admin-allowed panels and in ``gpufence top``,
and raise GpufenceForeignGpuProcess and (once its memory grows) GpufenceAdminAllowedGpuMemoryGrowing."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare
from gpufence.monitor.model import ForeignRow, UnaccountedRow
from gpufence.monitor.sources import prometheus_view
from tests.deploy.test_alerts import rule_groups
from tests.integration.monitor.conftest import monitoring_object
from tests.integration.node.conftest import CgroupBed, Guardian, start_guardian
from tests.support.enforcer_harness import GpuSandbox
from tests.support.prerequisites import needs
from tests.support.prometheus import (
    MISSING,
    kubernetes_pod_targets,
    podmonitor_job,
    prometheus,
    prometheus_binary,
    write_file_sd,
)
from tests.support.server_process import free_port

pytestmark = [needs(prometheus_binary() is not None, MISSING), pytest.mark.timeout(300)]

GIB = 1 << 30
DEADLINE = 60
NODE = "gpu-node-1"
K8S = pathlib.Path(__file__).resolve().parents[3] / "k8s"
DAEMONSET = K8S / "components" / "node-guardian" / "daemonset.yaml"
DASHBOARD = K8S / "components" / "monitoring" / "dashboards" / "gpufence.json"


def guardian_panels() -> dict[str, list[dict[str, Any]]]:
    """The dashboard row "Node guardian": panel title -> its targets."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"].startswith("Node guardian"))
    following = panels[row + 1 :]
    end = next((i for i, p in enumerate(following) if p["type"] == "row"), len(following))
    return {p["title"]: p["targets"] for p in following[:end]}


def panel_values(prom: Any) -> dict[str, dict[tuple[str, ...], float]]:
    """Each guardian panel's queries now, as Grafana runs them ($__rate_interval: 4 x the 1 s scrape),
    keyed by refId and the labels its legend names (every one of which must be there)."""
    values: dict[str, dict[tuple[str, ...], float]] = {}
    for title, targets in guardian_panels().items():
        for target in targets:
            legend = re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"])
            result = prom.query(target["expr"].replace("$__rate_interval", "4s"))
            for r in result:
                assert all(k in r["metric"] for k in legend), (title, target["legendFormat"], r["metric"])
            values[f"{title}/{target['refId']}"] = {
                tuple(r["metric"][k] for k in legend): float(r["value"][1]) for r in result}
    return values


def guardian_pod(port: int) -> dict[str, Any]:
    """A pod of the DaemonSet as the API server lists it, its metrics port the test guardian's."""
    (daemonset,) = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d and d["kind"] == "DaemonSet"]
    template = daemonset["spec"]["template"]
    spec = {**template["spec"], "nodeName": NODE}
    spec["containers"] = [
        {**c, "ports": [{**p, "containerPort": port} if p["name"] == "metrics" else p for p in c.get("ports", [])]}
        for c in spec["containers"]
    ]
    return {
        "metadata": {"name": "gpufence-node-x7k2p", "namespace": daemonset["metadata"]["namespace"],
                     "labels": template["metadata"]["labels"]},
        "spec": spec,
        "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


@contextlib.contextmanager
def scraped(g: Guardian, tmp_path: pathlib.Path) -> Iterator[Any]:
    """A Prometheus scraping ``g`` every second through the PodMonitor's job, our rules loaded."""
    binary = prometheus_binary()
    assert binary is not None and g.port
    sd = tmp_path / "guardian.json"
    write_file_sd(sd, kubernetes_pod_targets(guardian_pod(g.port)))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [podmonitor_job(monitoring_object("PodMonitor", "gpufence-node"),
                                          sd={"file_sd_configs": [{"files": [str(sd)], "refresh_interval": "1s"}]},
                                          scrape_interval="1s")],
    }
    (tmp_path / "prometheus").mkdir()
    with prometheus(tmp_path / "prometheus", free_port(), config, binary) as prom:
        yield prom


def alerts(prom: Any, name: str, state: str) -> list[dict[str, str]]:
    return [a["metric"] for a in prom.query(f'ALERTS{{alertname="{name}", alertstate="{state}"}}')]


def standings(**counts: int) -> dict[tuple[str, ...], float]:
    """The standing panel's series: every standing of the census on NODE, 0 but those given."""
    every = ("admitted", "unaccounted", "pending", "other_namespace", "host", "admin_allowed")
    return {(NODE, s): counts.get(s, 0) for s in every}


def evaluated_after(prom: Any, unix: float) -> bool:
    """Every rule group has been evaluated since ``unix`` (RFC 3339 strings compare as times)."""
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix))
    return all(group["lastEvaluation"] > since for group in prom.api("rules")["groups"])


@pytest.mark.parametrize("bed", ["v2"], indirect=True)
def test_an_unaccounted_gpu_process_alerts_and_shows_in_top(gpu: GpuSandbox, bed: CgroupBed,
                                                            tmp_path: pathlib.Path) -> None:
    c = bed.pod("plain").container("app")
    bed.publish({})  # team-a opted in, the pod admitted without a GPU
    stray = c.start(gpu)
    gpu.write(gpu.device_with(gpu.proc(stray, 6 * GIB)))
    g = start_guardian(gpu, bed, "--mode", "audit")
    g.wait_event("guardian_audit", 20, reason="unaccounted")  # before the first scrape: its counter is born at 1

    with scraped(g, tmp_path) as prom:
        up = prom.wait_for('up{job="gpufence/gpufence-node"} == 1', DEADLINE)
        assert up[0]["metric"]["node"] == NODE and up[0]["metric"]["namespace"] == "gpufence-node"

        def firing(name: str) -> list[dict[str, str]]:
            return alerts(prom, name, "firing")

        unaccounted = prom.wait_until(lambda: firing("GpufenceUnaccountedGpuProcess") or None, DEADLINE,
                                      "GpufenceUnaccountedGpuProcess")
        assert [(a["node"], a["namespace"], a["pod"], a["container"]) for a in unaccounted] == [
            (NODE, "team-a", "plain", "app")]
        acted = prom.wait_until(lambda: firing("GpufenceNodeGuardianActed") or None, DEADLINE,
                                "GpufenceNodeGuardianActed")
        assert [(a["node"], a["action"], a["reason"]) for a in acted] == [(NODE, "audit", "unaccounted")]
        assert firing("GpufenceNodeGuardianDown") == [] and firing("GpufenceNodeGuardianNotPolling") == []
        rules = [r for group in prom.api("rules")["groups"] for r in group["rules"]]
        assert [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"] == []

        # Rates need samples: the panels are read once four scrapes fill Grafana's window.
        prom.wait_for('count_over_time(gpufence_node_poll_errors_total[4s]) >= 4', DEADLINE)
        panels = panel_values(prom)
        assert set(panels) == {"Unaccounted GPU processes/A", "Unaccounted GPU processes/B",
                               "GPU processes by standing/A", "Admin-allowed GPU processes/A",
                               "Admin-allowed GPU processes/B", "Guardian actions/A",
                               "Guardian up per node/A", "Guardian up per node/B", "Guardian up per node/C",
                               "Guardian: time since last poll/A"}
        assert panels["Unaccounted GPU processes/A"] == {(NODE, "team-a", "plain", "app"): 1}
        assert panels["Unaccounted GPU processes/B"] == {(NODE, "team-a", "plain", "app"): 6 * GIB}
        assert panels["GPU processes by standing/A"] == standings(unaccounted=1)
        assert panels["Admin-allowed GPU processes/A"] == panels["Admin-allowed GPU processes/B"] == {}
        assert (NODE, "audit", "unaccounted") in panels["Guardian actions/A"]
        assert panels["Guardian up per node/A"] == panels["Guardian up per node/B"] == {(NODE,): 1}
        assert panels["Guardian up per node/C"] == {(NODE,): 1}  # the pods file read
        assert 0 <= panels["Guardian: time since last poll/A"][NODE,] < 10

        view = prometheus_view(prom.url)
        assert view.errors == ()
        assert view.unaccounted == (UnaccountedRow(NODE, "team-a", "plain", "app", 1, 6 * GIB),)
        assert view.foreign == ()  # nothing of other namespaces or of the host here
        assert prometheus_view(prom.url, namespace="team-b").unaccounted == ()

        # A stopped guardian: its scrapes time out (up 0), GpufenceNodeGuardianDown goes pending for
        # its node (firing would take its 5 minutes).
        os.kill(g.proc.pid, signal.SIGSTOP)
        try:
            pending = prom.wait_until(
                lambda: prom.query('ALERTS{alertname="GpufenceNodeGuardianDown", alertstate="pending"}') or None,
                DEADLINE, "GpufenceNodeGuardianDown pending")
            assert [a["metric"]["node"] for a in pending] == [NODE]
        finally:
            os.kill(g.proc.pid, signal.SIGCONT)
    assert stray.alive()  # audit: reported, never signalled


@pytest.mark.parametrize("bed", ["v2"], indirect=True)
def test_other_namespaces_host_and_admin_allowed_processes_show_and_alert(gpu: GpuSandbox, bed: CgroupBed,
                                                                         tmp_path: pathlib.Path) -> None:
    # On one GPU: an opted-in container within its share, a pod of a namespace that did not opt in,
    # a process in no pod's cgroup, and an exporter in a namespace the policy lets reach devices.
    bed.namespaces.append({"metadata": {"name": "gpu-operator", "labels": {"gpufence.io/injection": "enabled"}}})
    bed.policy = {"device-access-namespaces": "gpu-operator"}
    train = bed.pod("train").container("train")
    theirs = bed.pod("theirs", namespace="other").container("app")
    exporter = bed.pod("exporter", namespace="gpu-operator").container("dcgm")
    bed.publish({"train": EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 * GIB))},
                                         grace_period_seconds=1.0, poll_interval_seconds=0.1)})
    work, other, allowed = train.start(gpu), theirs.start(gpu), exporter.start(gpu)
    host = gpu.workload(None)

    def processes(exporter_bytes: int) -> None:
        gpu.write(gpu.device_with(gpu.proc(work, 2 * GIB), gpu.proc(other, 3 * GIB), gpu.proc(host, GIB),
                                  gpu.proc(allowed, exporter_bytes)))

    processes(GIB)
    g = start_guardian(gpu, bed)
    g.wait_event("gpu_process", 20, standing="admin_allowed", pod="exporter")

    with scraped(g, tmp_path) as prom:
        # Pending, not firing: the rule's 10 minutes are longer than the test.
        prom.wait_until(lambda: len(alerts(prom, "GpufenceForeignGpuProcess", "pending")) == 2 or None,
                        DEADLINE, "GpufenceForeignGpuProcess pending for both standings")
        assert sorted((a["node"], a["standing"], a["severity"])
                      for a in alerts(prom, "GpufenceForeignGpuProcess", "pending")) == [
            (NODE, "host", "warning"), (NODE, "other_namespace", "warning")]

        prom.wait_for('count_over_time(gpufence_node_admin_allowed_memory_bytes[1m]) >= 4', DEADLINE)
        panels = panel_values(prom)
        assert panels["GPU processes by standing/A"] == standings(admitted=1, other_namespace=1, host=1,
                                                                  admin_allowed=1)
        assert panels["Admin-allowed GPU processes/A"] == {(NODE, "gpu-operator", "exporter", "dcgm"): 1}
        assert panels["Admin-allowed GPU processes/B"] == {(NODE, "gpu-operator", "exporter", "dcgm"): GIB}
        assert panels["Unaccounted GPU processes/A"] == {}

        # Steady memory over several scrapes and two more evaluations: no growth alert.
        steady = time.time()
        prom.wait_until(lambda: evaluated_after(prom, steady + 1), DEADLINE, "two more rule evaluations")
        assert prom.query('ALERTS{alertname="GpufenceAdminAllowedGpuMemoryGrowing"}') == []

        processes(3 * GIB)  # the exporter grows
        growing = prom.wait_until(
            lambda: alerts(prom, "GpufenceAdminAllowedGpuMemoryGrowing", "pending") or None, DEADLINE,
            "GpufenceAdminAllowedGpuMemoryGrowing pending")
        assert [(a["node"], a["namespace"], a["pod"], a["container"], a["severity"]) for a in growing] == [
            (NODE, "gpu-operator", "exporter", "dcgm", "info")]

        view = prometheus_view(prom.url)
        assert view.errors == () and view.unaccounted == ()
        assert view.admin_allowed == (UnaccountedRow(NODE, "gpu-operator", "exporter", "dcgm", 1, 3 * GIB),)
        assert view.foreign == (ForeignRow(NODE, other_namespace=1, host=1, admitted=1),)
        assert prometheus_view(prom.url, node=NODE).foreign == view.foreign
        # -n narrows to a workload namespace: the node's counts are no namespace's.
        assert prometheus_view(prom.url, namespace="team-a").foreign == ()

        for name in ("GpufenceUnaccountedGpuProcess", "GpufenceNodeGuardianActed", "GpufenceNodeGuardianErrors"):
            assert prom.query(f'ALERTS{{alertname="{name}"}}') == [], name
        rules = [r for group in prom.api("rules")["groups"] for r in group["rules"]]
        assert [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"] == []
    # Reported, never signalled: the policy's default lets them share.
    assert work.alive() and other.alive() and host.alive() and allowed.alive()
    assert not g.events("guardian_sigterm") and not g.events("guardian_sigkill")
