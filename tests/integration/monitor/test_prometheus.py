"""A real Prometheus scraping real enforcers and the real webhook (the scenario: conftest.py): the
targets, the labels of every series, every alert of the PrometheusRule and every query of the
Grafana dashboard, on what was really scraped."""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

import pytest

from gpufence import metric_names as m
from tests.integration.monitor.conftest import DEADLINE, GIB, MIB, ROOT, Scenario
from tests.support.prerequisites import needs
from tests.support.prometheus import MISSING, prometheus_binary

pytestmark = [needs(prometheus_binary() is not None, MISSING), pytest.mark.timeout(300)]

DASHBOARD = ROOT / "k8s" / "components" / "monitoring" / "dashboards" / "gpufence.json"
ENFORCER_JOB = "gpufence/gpufence-enforcer"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval: 4 x the scrape interval (1 s here)


def _pods(s: Scenario) -> dict[str, tuple[str, str, str]]:
    """pod name -> (namespace, node, GPU UUID)."""
    return {p.name: (p.namespace, p.node, p.uuid) for p in s.pods.values()}


def test_every_target_is_up_with_the_podmonitors_labels(scenario: Scenario) -> None:
    targets = scenario.prometheus.api("targets")["activeTargets"]
    enforcers = [t for t in targets if t["labels"]["job"] == ENFORCER_JOB]
    webhook = [t for t in targets if t["labels"]["job"] == "gpufence-webhook"]
    assert len(enforcers) == len(scenario.pods) == 6 and len(webhook) == 1, [t["labels"] for t in targets]
    assert [t["lastError"] for t in targets if t["health"] != "up"] == []
    pods = _pods(scenario)
    for t in enforcers:
        labels = t["labels"]
        namespace, node, _ = pods[labels["pod"]]
        assert labels == {"job": ENFORCER_JOB, "instance": labels["instance"], "namespace": namespace,
                          "pod": labels["pod"], "container": "gpufence-enforcer", "endpoint": "gpufence-metric",
                          "node": node}
    assert webhook[0]["labels"]["service"] == "gpufence-webhook" and webhook[0]["scrapeUrl"].startswith("https://")
    # Every workload container's own port was discovered too, and dropped by the port-name keep.
    dropped = scenario.prometheus.api("targets", state="dropped")["droppedTargets"]
    workload_ports = [t for t in dropped if t["discoveredLabels"].get("__meta_kubernetes_pod_container_port_name")
                      == "http"]
    assert len(workload_ports) == len(scenario.pods)


def test_every_enforcer_series_carries_namespace_pod_container_uuid_gpu_and_node(scenario: Scenario) -> None:
    series = scenario.prometheus.query(f'{{__name__=~"gpufence_.*", job="{ENFORCER_JOB}"}}')
    pods = _pods(scenario)
    seen: set[str] = set()
    for entry in series:
        labels = entry["metric"]
        name = labels["__name__"]
        base = _family(name)
        seen.add(base)
        namespace, node, uuid = pods[labels["pod"]]
        assert (labels["namespace"], labels[m.NODE_LABEL]) == (namespace, node), labels
        if base in (m.CONTAINER_MEMORY_USED, m.CONTAINER_MEMORY_LIMIT, m.CONTAINER_LIMIT_FROM_PERCENT,
                    m.CONTAINER_SM_UTILIZATION):
            assert labels["container"] != "gpufence-enforcer" and (labels["UUID"], labels["gpu"]) == (uuid, "0")
        elif base in (m.POD_MEMORY_USED, m.POD_MEMORY_UNATTRIBUTED, m.POD_MEMORY_BUDGET,
                      m.POD_UNATTRIBUTED_PROCESSES):
            # The enforcer sets no container here: the sidecar's target label stands.
            assert (labels["UUID"], labels["gpu"], labels["container"]) == (uuid, "0", "gpufence-enforcer")
        elif base in (m.CONTAINER_COMPUTE_SHARE, m.CONTAINER_THROTTLED, m.CONTAINER_MEMORY_ENFORCEMENT,
                      m.ENFORCEMENT_ACTIONS):
            assert "UUID" not in labels
        else:  # per enforcer: the sidecar's own
            assert labels["container"] == "gpufence-enforcer", labels
    # Every metric the enforcer exports was scraped, but MIG's (no device here is in MIG mode).
    assert seen == set(m.ENFORCER_METRICS) - {m.DEVICE_MIG_UNENFORCED}


def _family(name: str) -> str:
    """The metric a scraped series belongs to: a histogram's _bucket/_sum/_count, and the _created
    series prometheus_client exports for counters and histograms (ingested as gauges)."""
    if name.startswith(m.POLL_DURATION):
        return m.POLL_DURATION
    if name.endswith("_created"):
        return name.removesuffix("_created") + "_total"
    return name


def _alerts(scenario: Scenario) -> set[tuple[str, str, str, str]]:
    """(alertname, alertstate, pod, container) of every active alert."""
    return {(a["metric"]["alertname"], a["metric"]["alertstate"], a["metric"].get("pod", ""),
             a["metric"].get("container", ""))
            for a in scenario.prometheus.query("ALERTS")}


# Each alert with what it does in the scenario. ``for`` (2 m, 15 m) is not waited out: an alert whose
# expression holds is pending, which is what the scenario proves for those.
EXPECTED_ALERTS = {
    ("GpufenceContainerKilled", "firing", "greedy-0", "loader"),
    # Killed before the first scrape: its counter was first seen at 1 (the rule's second part).
    ("GpufenceContainerKilled", "firing", "eager-5d7f8c9b6-m4n7q", "jax"),
    ("GpufenceContainerThrottledSustained", "pending", "render-6b7c9f8d5-zx9kp", "render"),
    ("GpufenceNvmlDown", "pending", "broken-0", "gpufence-enforcer"),
    # Never a successful poll: its timestamp is 0, more than a minute ago.
    ("GpufenceEnforcerPollStale", "pending", "broken-0", "gpufence-enforcer"),
}


def test_each_alert_fires_or_stays_silent(scenario: Scenario) -> None:
    from tests.deploy.test_alerts import alerts

    prom = scenario.prometheus
    prom.wait_until(lambda: _alerts(scenario) >= EXPECTED_ALERTS or None, DEADLINE, "the expected alerts")
    # Two evaluations later (1 s each), nothing else has come up: the silent ones stay silent.
    evaluated = time.time()
    prom.wait_until(lambda: all(g["lastEvaluation"] > _rfc3339(evaluated + 1) for g in prom.api("rules")["groups"]),
                    DEADLINE, "two more rule evaluations")
    assert _alerts(scenario) == EXPECTED_ALERTS
    silent = {a["alert"] for a in alerts()} - {name for name, *_ in EXPECTED_ALERTS}
    # The guardian's alerts stay silent where no guardian is installed (this scenario has none),
    # GpufenceNodeGuardianDown included although every node here runs gpufence pods.
    assert silent == {"GpufenceWebhookErrors", "GpufenceWebhookSlow", "GpufenceWebhookDown",
                      "GpufenceWebhookCertificateExpiresSoon", "GpufenceWebhookCertificateReloadFailing",
                      "GpufenceNodeGuardianDown", "GpufenceNodeGuardianNotPolling", "GpufenceUnaccountedGpuProcess",
                      "GpufenceNodeGuardianActed", "GpufenceNodeGuardianErrors", "GpufenceForeignGpuProcess",
                      "GpufenceAdminAllowedGpuMemoryGrowing"}
    killed = prom.query('ALERTS{alertname="GpufenceContainerKilled"}')
    assert {(a["metric"]["namespace"], a["metric"]["resource"]) for a in killed} == {("team-a", "memory")}
    # Every rule evaluated without error on the real series.
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    assert [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"] == []


def _rfc3339(unix: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix))


# --- the dashboard ------------------------------------------------------------------------------


def panels() -> list[dict[str, Any]]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def substitute(expr: str) -> str:
    """Grafana's variables as the dashboard's defaults give them (All: .*)."""
    return (expr.replace("$namespace", ".*").replace("$pod", ".*").replace("$__rate_interval", RATE_INTERVAL)
            .replace("$__interval", "1s"))


Series = dict[tuple[str, ...], list[float]]


def run_target(scenario: Scenario, target: dict[str, Any]) -> tuple[list[dict[str, str]], Series]:
    """The target as Grafana runs it: a range query over the scenario (an instant one for a table),
    keyed by the labels its legend names."""
    prom = scenario.prometheus
    expr = substitute(target["expr"])
    legend_labels = re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"])
    if target.get("instant"):
        result = prom.query(expr)
        raw = [(r["metric"], [float(r["value"][1])]) for r in result]
    else:
        result = prom.query_range(expr, scenario.started, time.time(), 1)
        raw = [(r["metric"], [float(v) for _, v in r["values"]]) for r in result]
    for labels, _ in raw:
        missing = [k for k in legend_labels if k not in labels]
        assert not missing, f"{target['expr']}: legend {target['legendFormat']!r} names {missing}, not in {labels}"
    return [labels for labels, _ in raw], {tuple(labels[k] for k in legend_labels): values for labels, values in raw}


def last(values: list[float]) -> float:
    return values[-1]


def finite(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


T, G, R, B = "train-5c8f9d7b6d-q2w4x", "greedy-0", "render-6b7c9f8d5-zx9kp", "broken-0"
E, A = "eager-5d7f8c9b6-m4n7q", "etl-7f9c6d5b8-k4m2p"


def check_memory(refid: str, s: Series) -> None:
    if refid == "A":
        assert last(s["team-a", T, "trainer"]) == 6 * GIB and last(s["team-b", R, "render"]) == 2 * GIB
        assert max(s["team-a", G, "loader"]) == 3 * GIB  # before the kill; gone after it
    else:
        assert last(s["team-a", T, "trainer"]) == 8 * GIB and last(s["team-b", R, "render"]) == 4 * GIB
        assert max(s["team-a", G, "loader"]) == 2 * GIB


def check_sm(refid: str, s: Series) -> None:
    expected = {"A": (0.4, 0.9), "B": (0.5, 0.3)}[refid]
    assert (last(s["team-a", T, "trainer"]), last(s["team-b", R, "render"])) == expected


def check_actions(refid: str, s: Series) -> None:
    acted = {key for key, values in s.items() if max(finite(values), default=0) > 0}
    assert {("team-a", G, "loader", "sigterm", "memory"), ("team-a", G, "loader", "sigkill", "memory"),
            ("team-b", R, "render", "throttle_start", "compute")} <= acted
    # etl's audit actions and eager's kill came before the first scrape: no increase to show.
    assert {key[:3] for key in acted} <= {("team-a", G, "loader"), ("team-b", R, "render")}
    # The pod budget's actions (the enforcer's container="", which honor_labels turns into no label)
    # are named in the legend, not left as an empty container.
    assert ("team-a", G, "(pod budget)", "sigterm", "memory") in s


def check_throttled(refid: str, s: Series) -> None:
    assert last(s["team-b", R, "render"]) == 1
    assert all(last(v) == 0 for key, v in s.items() if key[2] != "render")


def check_pod_memory(refid: str, s: Series) -> None:
    expected = {"A": 6 * GIB + 512 * MIB, "B": 512 * MIB, "C": 8 * GIB}[refid]
    assert last(s["team-a", T]) == expected
    if refid == "C":
        assert last(s["team-b", R]) == 4 * GIB and last(s["team-a", G]) == 2 * GIB


def check_mechanism(refid: str, s: Series) -> None:
    held = {key[:3]: key[3] for key in s}
    assert held[("team-a", T, "trainer")] == held[("team-b", R, "render")] == "polling"


def check_poll_duration(refid: str, s: Series) -> None:
    values = finite(s[()])
    assert values and all(0 < v < 1 for v in values)


def check_poll_age(refid: str, s: Series) -> None:
    for pod in (("team-a", T), ("team-a", G), ("team-a", E), ("team-b", R), ("team-b", A)):
        assert 0 <= last(s[pod]) < 10, pod
    assert last(s["team-b", B]) > 1e9  # never polled: its timestamp is 0


def check_nvml(refid: str, s: Series) -> None:
    if refid == "A":
        assert {key[1]: last(v) for key, v in s.items()} == {T: 1, G: 1, R: 1, E: 1, A: 1, B: 0}
    else:
        assert max(finite(s["nvmlInit", "DRIVER_NOT_LOADED"])) > 0


def check_webhook_requests(refid: str, s: Series) -> None:
    assert max(finite(s[("mutated",)])) > 0
    assert set(s) >= {("mutated",), ("error",), ("denied",)}  # every outcome at zero from the start


def check_webhook_latency(refid: str, s: Series) -> None:
    values = finite(s[()])
    assert values and all(0 < v < 5 for v in values)


def check_webhook_certificate(refid: str, s: Series) -> None:
    if refid == "A":
        assert last(s[()]) > 24 * 3600
    else:
        assert set(s) == {("success",), ("failure",)}


CHECKS = {
    "GPU memory used vs share": check_memory,
    "SM utilisation vs compute share": check_sm,
    "Enforcement actions": check_actions,
    "Throttled containers": check_throttled,
    "Pod GPU memory: all processes, unattributed, budget": check_pod_memory,
    "What holds each memory share": check_mechanism,
    "Poll duration": check_poll_duration,
    "Time since last successful poll": check_poll_age,
    "NVML": check_nvml,
    "Webhook requests by outcome": check_webhook_requests,
    "Webhook latency": check_webhook_latency,
    "Webhook certificate": check_webhook_certificate,
}


# The node guardian's panels: this scenario runs no guardian, so on its scrapes they are only shown
# to be valid PromQL that Prometheus evaluates, and empty (their metric names and labels are checked
# against the guardian's in tests/deploy; their values on the real guardian's scrapes in
# tests/integration/node/test_guardian_monitoring.py).
GUARDIAN_PANELS = {"Unaccounted GPU processes", "GPU processes by standing", "Admin-allowed GPU processes",
                   "Guardian actions", "Guardian up per node", "Guardian: time since last poll"}


def test_every_panel_has_a_check_a_unit_and_legends() -> None:
    assert {p["title"] for p in panels()} == set(CHECKS) | GUARDIAN_PANELS
    for panel in panels():
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        for target in panel["targets"]:
            assert target.get("legendFormat"), (panel["title"], target["refId"])


@pytest.mark.parametrize("title", list(CHECKS))
def test_dashboard_panel_on_real_scrapes(scenario: Scenario, title: str) -> None:
    panel = next(p for p in panels() if p["title"] == title)
    for target in panel["targets"]:
        _, series = run_target(scenario, target)
        assert series, f"{title} {target['refId']}: no series ({substitute(target['expr'])})"
        CHECKS[title](target["refId"], series)


@pytest.mark.parametrize("title", sorted(GUARDIAN_PANELS))
def test_guardian_panels_evaluate_and_are_empty_without_a_guardian(scenario: Scenario, title: str) -> None:
    panel = next(p for p in panels() if p["title"] == title)
    for target in panel["targets"]:
        _, series = run_target(scenario, target)  # an invalid query raises here
        assert series == {}, f"{title} {target['refId']}: {series}"


def test_the_template_variables_offer_every_pod(scenario: Scenario) -> None:
    """label_values(gpufence_nvml_up, ...): one series per sidecar, whatever its containers' shares."""
    templating = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    values = {}
    for name in ("namespace", "pod"):
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", templating[name]["query"]["query"])
        assert match, templating[name]
        selector = substitute(match[1])
        series = scenario.prometheus.api("series", **{"match[]": selector})
        values[name] = {s[match[2]] for s in series}
    assert values == {"namespace": {"team-a", "team-b"}, "pod": {T, G, R, B, E, A}}
