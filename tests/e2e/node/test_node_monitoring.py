"""Monitoring as an operator meets it: a real Prometheus finds the mutated pods through the real
kube-apiserver (Kubernetes service discovery, as the ServiceAccount a Prometheus runs as, with the
RBAC it needs and nothing more) and scrapes their real sidecars on the real node; the
PrometheusRule's alerts and the dashboard's enforcer panels are evaluated on what it scraped, and
``gpufence top`` reads the same pods through Prometheus and through the API server's pod proxy.

Debian's Prometheus has no Kubernetes discovery, so the binary is built from Prometheus's Go module
with only that discovery linked (tests/e2e/binaries.py). The scrape job is the one
prometheus-operator generates from our PodMonitor (tests/support/prometheus.py, the same function
tests/integration/monitor proves against the operator's rules), with ``kubernetes_sd_configs`` as
its discovery. The webhook runs beside the API server here, not as a Service, so its
ServiceMonitor job and the webhook panels are proven in tests/integration/monitor only.

The scenario, one pod each: ``within`` (2 GiB of an 8 GiB share, SM under its share), ``greedy``
(over its 2 GiB share: terminated), ``hog`` (over its 20 % compute share: throttled), ``stray``
(a process under a name that is no container of its pod: unattributed, within the pod's budget).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from gpufence import metric_names as m
from gpufence.contract import SIDECAR_NAME
from tests.deploy.test_alerts import rule_groups
from tests.e2e import kube
from tests.e2e.binaries import GoMissing, prometheus_with_kubernetes_sd
from tests.e2e.controlplane import ControlPlane
from tests.integration.monitor.conftest import monitoring_object
from tests.integration.monitor.test_prometheus import GUARDIAN_PANELS, panels, substitute
from tests.node.driver_hook import GPU_UUID
from tests.node.node import NODE_NAME, Node
from tests.node.workloads import (
    RENAMED,
    get_pod,
    gpu_pod,
    host_pid,
    wait_record,
    wait_running,
    workload_container,
    write_gpu_state,
)
from tests.support.prerequisites import missing
from tests.support.prometheus import PrometheusServer, podmonitor_job
from tests.support.server_process import free_port

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[3]
DEADLINE = 90.0
SCRAPE = "1s"  # the PodMonitor's interval, shortened for the test
ENFORCER_JOB = "gpufence/gpufence-enforcer"

# What a Prometheus needs to discover pods, and nothing more: prometheus-operator's own
# ClusterRole also reads services, endpoints and nodes for the other roles; role `pod` reads pods.
PROMETHEUS_RBAC = """
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: gpufence-test-prometheus}
rules:
  - apiGroups: [""]
    resources: [pods]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: gpufence-test-prometheus}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: gpufence-test-prometheus}
subjects: [{kind: ServiceAccount, name: prometheus, namespace: NAMESPACE}]
"""


@dataclass
class Monitored:
    prometheus: PrometheusServer
    namespace: str
    pods: dict[str, str]  # role in the scenario -> pod name
    started: float
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)


def _create(admin: client.ApiClient, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
    created = kube.create_pod(admin, namespace, pod)
    assert created.admitted, created.message
    return created.obj


@pytest.fixture(scope="module")
def monitored(admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    try:
        binary = prometheus_with_kubernetes_sd()
    except GoMissing as exc:
        missing(f"no Prometheus with Kubernetes discovery: {exc}")
    root = tmp_path_factory.mktemp("node-monitoring")
    namespace = kube.create_namespace(admin, "monitored", kube.OPT_IN)
    cluster.kubectl("-n", namespace, "create", "rolebinding", "gpufence-enforcer-events",
                    "--clusterrole=gpufence-enforcer-events", f"--group=system:serviceaccounts:{namespace}")
    monitoring = kube.create_namespace(admin, "prometheus", {})
    cluster.kubectl("-n", monitoring, "create", "serviceaccount", "prometheus")
    cluster.kubectl("apply", "-f", "-", input=PROMETHEUS_RBAC.replace("NAMESPACE", monitoring))
    token = root / "token"
    token.write_text(cluster.kubectl("create", "token", "prometheus", "-n", monitoring, "--duration", "1h")
                     .stdout.strip())
    prom: PrometheusServer | None = None
    try:
        pods = {
            "within": _create(admin, namespace, gpu_pod(
                [workload_container("trainer")], {"gpufence.io/memory": "8Gi", "gpufence.io/compute": "50"})),
            "greedy": _create(admin, namespace, gpu_pod(
                [workload_container("loader")], {"gpufence.io/memory": "2Gi", "gpufence.io/grace-period": "2"})),
            "hog": _create(admin, namespace, gpu_pod(
                [workload_container("hog")], {"gpufence.io/memory": "8Gi", "gpufence.io/compute": "20"})),
            "stray": _create(admin, namespace, gpu_pod(
                [workload_container("renamed", RENAMED)], {"gpufence.io/memory": "8Gi"})),
        }
        names = {role: p["metadata"]["name"] for role, p in pods.items()}
        running = {role: wait_running(cluster, node, namespace, name) for role, name in names.items()}
        pids = {role: host_pid(node, running[role], c) for role, c in
                (("within", "trainer"), ("greedy", "loader"), ("hog", "hog"), ("stray", "renamed"))}
        write_gpu_state(node, [(pids["within"], 2 * GIB, 10), (pids["greedy"], 1 * GIB, 0),
                               (pids["stray"], 1 * GIB, 0)])

        # -- Prometheus: the operator's job for our PodMonitor, discovering through the API server ----
        discovery = {"kubernetes_sd_configs": [{
            "role": "pod", "api_server": cluster.server,
            "tls_config": {"ca_file": str(cluster.pki.ca_cert)},
            "authorization": {"credentials_file": str(token)},
        }]}
        (root / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
        config = {
            "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE, "scrape_timeout": SCRAPE},
            "rule_files": [str(root / "rules.yaml")],
            "scrape_configs": [podmonitor_job(monitoring_object("PodMonitor", "gpufence-enforcer"), sd=discovery,
                                              scrape_interval=SCRAPE)],
        }
        prom = PrometheusServer(root / "prometheus", free_port())
        prom.root.mkdir()
        started = time.time()
        prom.start(config, str(binary))
        scenario = Monitored(prom, namespace, names, started)

        # -- the scenario, each step once Prometheus has seen the state before it -----------------
        prom.wait_for(f'up{{job="{ENFORCER_JOB}",namespace="{namespace}"}} == 1', DEADLINE,
                      check=lambda r: len(r) == len(names))
        # greedy's kill counter and hog's throttle counter scraped at 0 first (else increase() has
        # nothing to measure).
        prom.wait_for(f'{m.ENFORCEMENT_ACTIONS}{{pod="{names["greedy"]}",action="sigterm",resource="memory"}} == 0',
                      DEADLINE)
        prom.wait_for(f'{m.ENFORCEMENT_ACTIONS}{{pod="{names["hog"]}",action="throttle_start"}} == 0', DEADLINE)
        write_gpu_state(node, [(pids["within"], 2 * GIB, 10), (pids["greedy"], 3 * GIB, 0),
                               (pids["stray"], 1 * GIB, 0), (pids["hog"], 1 * GIB, 95)])
        wait_record(running["greedy"], lambda r: r.get("event") == "sigterm" and r.get("outcome") == "sent",
                    "greedy's loader terminated", timeout=DEADLINE)
        wait_record(running["hog"], lambda r: r.get("event") == "throttle_start", "hog throttled", timeout=DEADLINE)
        prom.wait_for(f'{m.ENFORCEMENT_ACTIONS}{{pod="{names["greedy"]}",action="sigterm",resource="memory"}} >= 1',
                      DEADLINE)
        prom.wait_for(f'{m.CONTAINER_THROTTLED}{{pod="{names["hog"]}",container="hog"}} == 1', DEADLINE)
        prom.wait_for(f'{m.POD_MEMORY_UNATTRIBUTED}{{pod="{names["stray"]}"}} == {GIB}', DEADLINE)
        scenario.objects = {role: get_pod(cluster, namespace, name) for role, name in names.items()}
        yield scenario
    finally:
        write_gpu_state(node, ())
        if prom is not None:
            prom.stop()
        cluster.kubectl("-n", namespace, "delete", "pods", "--all", "--wait=true", "--timeout=90s", check=False)
        cluster.kubectl("delete", "namespace", namespace, monitoring, "--wait=false", check=False)
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", "gpufence-test-prometheus", check=False)


def test_discovery_through_the_api_server_finds_every_sidecar_with_its_labels(monitored: Monitored) -> None:
    targets = [t for t in monitored.prometheus.api("targets")["activeTargets"]
               if t["labels"].get("namespace") == monitored.namespace]
    assert sorted(t["labels"]["pod"] for t in targets) == sorted(monitored.pods.values()), targets
    assert [t["lastError"] for t in targets if t["health"] != "up"] == []
    for t in targets:
        pod = next(o for o in monitored.objects.values() if o["metadata"]["name"] == t["labels"]["pod"])
        assert t["labels"] == {"job": ENFORCER_JOB, "instance": t["labels"]["instance"],
                               "namespace": monitored.namespace, "pod": pod["metadata"]["name"],
                               "container": SIDECAR_NAME, "endpoint": "gpufence-metric", "node": NODE_NAME}
        # Scraped at the pod's own IP, the sidecar's port as the webhook declared it.
        assert t["labels"]["instance"].split(":")[0] == pod["status"]["podIP"]
    # The workloads' containers were discovered too (no ports: one target each) and dropped by the
    # PodMonitor's keep on the port name.
    dropped = [t for t in monitored.prometheus.api("targets", state="dropped")["droppedTargets"]
               if t["discoveredLabels"].get("__meta_kubernetes_namespace") == monitored.namespace]
    assert {t["discoveredLabels"]["__meta_kubernetes_pod_container_name"] for t in dropped} >= \
        {"trainer", "loader", "hog", "renamed"}


def test_every_series_names_the_real_pod_container_gpu_and_node(monitored: Monitored) -> None:
    series = monitored.prometheus.query(f'{{__name__=~"gpufence_.*", namespace="{monitored.namespace}"}}')
    names = set(monitored.pods.values())
    containers = {o["metadata"]["name"]: {c["name"] for c in o["spec"]["containers"]}
                  for o in monitored.objects.values()}
    seen = set()
    for entry in series:
        labels = entry["metric"]
        seen.add(labels["__name__"])
        assert labels["pod"] in names and labels[m.NODE_LABEL] == NODE_NAME, labels
        if "UUID" in labels:
            assert (labels["UUID"], labels["gpu"]) == (GPU_UUID, "0"), labels
        allowed = containers[labels["pod"]] | {SIDECAR_NAME}
        if labels["__name__"].startswith(m.ENFORCEMENT_ACTIONS.removesuffix("_total")):
            # Actions on the pod's unattributed processes: the enforcer's empty container label, which
            # Prometheus drops (the counters exist at 0 from the start, so increase() sees the first).
            allowed |= {None}
        assert labels.get("container") in allowed, labels
    used = _by_container(monitored, m.CONTAINER_MEMORY_USED)
    share = _by_container(monitored, m.CONTAINER_MEMORY_LIMIT)
    within = monitored.pods["within"]
    assert (used[(within, "trainer")], share[(within, "trainer")]) == (2 * GIB, 8 * GIB)
    assert share[(monitored.pods["greedy"], "loader")] == 2 * GIB
    for name in (m.CONTAINER_MEMORY_USED, m.CONTAINER_MEMORY_LIMIT, m.CONTAINER_SM_UTILIZATION,
                 m.CONTAINER_COMPUTE_SHARE, m.CONTAINER_THROTTLED, m.CONTAINER_MEMORY_ENFORCEMENT,
                 m.ENFORCEMENT_ACTIONS, m.POD_MEMORY_USED, m.POD_MEMORY_UNATTRIBUTED, m.POD_MEMORY_BUDGET):
        assert any(s == name or s.startswith(name + "_") for s in seen), f"{name} not scraped: {sorted(seen)}"


def _by_container(monitored: Monitored, metric: str) -> dict[tuple[str, str], float]:
    """The highest value of each container's series during the scenario (a terminated container's
    series end with its GPU process)."""
    return {(r["metric"]["pod"], r["metric"]["container"]): float(r["value"][1])
            for r in monitored.prometheus.query(f'max_over_time({metric}{{namespace="{monitored.namespace}"}}[10m])')}


def test_the_kill_alert_fires_for_the_terminated_container_only(monitored: Monitored) -> None:
    prom = monitored.prometheus
    greedy = monitored.pods["greedy"]

    def killed() -> set[tuple[str, str, str]] | None:
        query = f'ALERTS{{alertname="GpufenceContainerKilled",namespace="{monitored.namespace}"}}'
        found = {(a["metric"]["pod"], a["metric"]["container"], a["metric"]["alertstate"])
                 for a in prom.query(query)}
        return found or None

    alerts = prom.wait_until(killed, DEADLINE, "GpufenceContainerKilled")
    # hog may be terminated too once its throttle proves ineffective (the simulated SM use does
    # not fall while it is stopped); trainer and the stray's container, within their shares, never.
    assert (greedy, "loader", "firing") in alerts, alerts
    assert not {(p, c) for p, c, _ in alerts} & {(monitored.pods["within"], "trainer"),
                                                  (monitored.pods["stray"], "renamed")}, alerts
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"] == []


# The webhook is not scraped here, and no guardian runs on this node (its panels on the real
# guardian's scrapes: tests/integration/node/test_guardian_monitoring.py).
ENFORCER_PANELS = [p for p in panels() if p["title"] not in GUARDIAN_PANELS
                   and not any("webhook" in t["expr"] for t in p["targets"])]


@pytest.mark.parametrize("panel", ENFORCER_PANELS, ids=[p["title"] for p in ENFORCER_PANELS])
def test_each_enforcer_panel_shows_the_scenario(monitored: Monitored, panel: dict[str, Any]) -> None:
    """Every enforcer panel returns series for this namespace's pods on the real scrapes (the
    values each panel must show are checked on the integration scenario; here: not empty, and the
    legend's labels are there)."""
    prom = monitored.prometheus
    shown = []
    for target in panel["targets"]:
        expr = substitute(target["expr"])
        result = prom.query_range(expr, monitored.started, time.time(), 1) if not target.get("instant") \
            else prom.query(expr)
        for r in result:
            missing_labels = [k for k in _legend(target) if k not in r["metric"]]
            assert not missing_labels, (target["expr"], r["metric"])
        shown += [r for r in result if r["metric"].get("namespace", monitored.namespace) == monitored.namespace]
    assert shown, f"panel {panel['title']!r} shows nothing on the node's real scrapes"


def _legend(target: dict[str, Any]) -> list[str]:
    import re

    return re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))


def test_the_throttled_panel_shows_the_hog(monitored: Monitored) -> None:
    prom = monitored.prometheus
    shown = prom.query(f'max_over_time({m.CONTAINER_THROTTLED}{{namespace="{monitored.namespace}"}}[10m])')
    throttled = {(r["metric"]["pod"], r["metric"]["container"]) for r in shown if float(r["value"][1]) == 1}
    assert throttled == {(monitored.pods["hog"], "hog")}, shown


def _gpufence(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufence.monitor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def test_gpufence_top_through_prometheus_and_through_the_pod_proxy(monitored: Monitored,
                                                                     cluster: ControlPlane) -> None:
    through_prometheus = _gpufence("top", "--prometheus", monitored.prometheus.url, "--once",
                                   "-n", monitored.namespace, "-o", "json")
    through_proxy = _gpufence("top", "--kubeconfig", str(cluster.admin_kubeconfig), "--once",
                              "-n", monitored.namespace, "-o", "json")
    for result in (through_prometheus, through_proxy):
        assert result.returncode == 0, result.stderr
        view = json.loads(result.stdout)
        text = json.dumps(view)
        for name in monitored.pods.values():
            assert name in text, (name, view)
        assert NODE_NAME in text and GPU_UUID in text, view


def test_gpufence_recommend_on_the_nodes_history(monitored: Monitored) -> None:
    result = _gpufence("recommend", "--prometheus", monitored.prometheus.url, "--window", "10m",
                       "-n", monitored.namespace, "-o", "json")
    assert result.returncode == 0, result.stderr
    recs = {r["container"]: r for r in json.loads(result.stdout)["recommendations"]}
    # The stray's process is no container's: nothing to size a container's share from.
    assert set(recs) == {"trainer", "loader", "hog"}, recs
    trainer = recs["trainer"]
    # Peak 2Gi x 1.2 = 2.4Gi -> 3Gi; SM 10 % x 1.2 = 12 -> 15.
    assert (trainer["memory_peak_bytes"], trainer["memory_share"], trainer["compute_share_percent"]) == \
        (2 * GIB, "3Gi", 15), trainer
    assert trainer["annotations"] == {"gpufence.io/memory": "3Gi", "gpufence.io/compute": "15"}
    # It held 3Gi only until its SIGTERM (a scrape may or may not have seen it): the note says the
    # share it was sized from is a floor, the container having been terminated.
    loader = recs["loader"]
    assert loader["memory_peak_bytes"] in (1 * GIB, 3 * GIB) and "terminated" in loader["notes"][0], loader
    assert any("throttled" in note for note in recs["hog"]["notes"]), recs["hog"]
