"""The PrometheusRule's alerts, proven with promtool over series shaped like the real /metrics.

* ``promtool check rules`` on the rule groups of the rendered PrometheusRule (what
  ``kubectl apply -k k8s/overlays/monitoring`` applies);
* ``promtool test rules`` runs tests/deploy/promtool/alerts_test.yaml against those groups: every alert
  fires in at least one case (the first kill among them) and stays silent in another;
* every input series of those tests has the name, label names and enum label values of a series
  the enforcer, the webhook or the node guardian really exports, so the tests cannot drift from the code;
* the counters the alerts take ``increase()``/``rate()`` of exist at zero before the first event;
* every alert links a section of docs/runbook.md.

promtool comes from Debian's ``prometheus`` package; without it the promtool tests skip.
"""

from __future__ import annotations

import copy
import datetime as dt
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpufence.enforcer.report.metrics import ACTION_KINDS, EnforcerMetrics
from gpufence.node.report import ACTION_REASONS, NodeMetrics
from gpufence.webhook.metrics import OUTCOMES, WebhookMetrics
from tests.deploy.test_manifests import K8S, _kubectl_missing_reason, one, render
from tests.support.prerequisites import missing

ROOT = Path(__file__).resolve().parents[2]
UNIT_TESTS = ROOT / "tests" / "deploy" / "promtool" / "alerts_test.yaml"
RUNBOOK = ROOT / "docs" / "runbook.md"
RUNBOOK_URL = "https://github.com/gpufence/gpufence/blob/main/docs/runbook.md"
PROMTOOL_MISSING = "promtool not installed (Debian/Ubuntu: apt-get install prometheus)"

# Labels Prometheus adds to a scraped series: job and instance always, the rest from the Prometheus
# Operator's PodMonitor/ServiceMonitor relabelling (the enforcer's own namespace/pod/container win
# through honorLabels).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint", "node"}
# Series Prometheus makes itself, not the exporters.
SYNTHETIC = {"up"}


def rule_groups() -> list[dict[str, Any]]:
    """The PrometheusRule's groups as applied: rendered by kustomize, or the file as written without
    kubectl (kustomize only adds labels to this object)."""
    if _kubectl_missing_reason() is None:
        rule = one(render("k8s/overlays/monitoring"), "PrometheusRule")
    else:
        rule = one(yaml.safe_load_all((K8S / "components" / "monitoring" / "prometheusrule.yaml").read_text()),
                   "PrometheusRule")  # fmt: skip
    # A copy: render() is cached for the whole session, and a test here edits the groups.
    return copy.deepcopy(rule["spec"]["groups"])


def alerts() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"] if "alert" in rule]


def unit_tests() -> dict[str, Any]:
    return yaml.safe_load(UNIT_TESTS.read_text())


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        missing(PROMTOOL_MISSING)
    return path


def write_rules(directory: Path, groups: list[dict[str, Any]]) -> Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return path


def run_promtool(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


# ---------------------------------------------------------------------------------------------
# promtool


def test_promtool_check_rules(promtool: str, tmp_path: Path) -> None:
    rules = write_rules(tmp_path, rule_groups())
    result = run_promtool(promtool, "check", "rules", str(rules), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len([r for g in rule_groups() for r in g['rules']])} rules found" in result.stdout


def test_promtool_unit_tests_pass(promtool: str, tmp_path: Path) -> None:
    write_rules(tmp_path, rule_groups())
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    result = run_promtool(promtool, "test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_can_fail(promtool: str, tmp_path: Path) -> None:
    """The harness notices a broken rule: the kill alert on a threshold it can never reach."""
    groups = rule_groups()
    killed = next(r for g in groups for r in g["rules"] if r.get("alert") == "GpufenceContainerKilled")
    killed["expr"] = killed["expr"].replace(") > 0", ") > 1")
    write_rules(tmp_path, groups)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    result = run_promtool(promtool, "test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "first kill fires" in result.stdout + result.stderr


def test_the_guardian_action_alert_takes_any_action_value(promtool: str, tmp_path: Path) -> None:
    """An action value the guardian does not export today (a policy may add one) fires
    GpufenceNodeGuardianActed with its own label, whether its counter starts at 0 or is born at 1:
    the guardian's action case with its sigterm and audit renamed."""
    tests = unit_tests()
    (case,) = [c for c in tests["tests"] if c["name"] == "a guardian action fires, the first audit too"]
    renamed = copy.deepcopy(case)
    for entry in renamed["input_series"]:
        entry["series"] = re.sub(r'action="(sigterm|audit)"', r'action="new_\1"', entry["series"])
    for check in renamed["alert_rule_test"]:
        for alert in check["exp_alerts"]:
            action = alert["exp_labels"]["action"]
            alert["exp_labels"]["action"] = f"new_{action}"
            notes = alert["exp_annotations"]
            notes["summary"] = notes["summary"].replace(f"action {action} ", f"action new_{action} ")
            notes["description"] = notes["description"].replace(f"guardian_{action} ", f"guardian_new_{action} ")
    assert sum('action="new_' in e["series"] for e in renamed["input_series"]) == 2
    tests["tests"] = [renamed]
    write_rules(tmp_path, rule_groups())
    (tmp_path / UNIT_TESTS.name).write_text(yaml.safe_dump(tests, sort_keys=False))
    result = run_promtool(promtool, "test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_fires_and_stays_silent_in_some_test() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for case in unit_tests()["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {a["alert"] for a in alerts()}
    assert names - fired == set(), "alerts never shown to fire"
    assert names - silent == set(), "alerts never shown to stay silent"
    assert fired | silent <= names, "tests name alerts the rule does not have"


# ---------------------------------------------------------------------------------------------
# The input series are the real series


def _series_of(text: str) -> dict[str, list[dict[str, str]]]:
    """Exposition text -> sample name -> label sets."""
    series: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


def real_series() -> dict[str, list[dict[str, str]]]:
    enforcer = EnforcerMetrics("team-a", "train-0")
    enforcer.declare_containers(["trainer"])
    enforcer.set_throttled("trainer", True)
    enforcer.last_successful_poll.set(1.0)
    webhook = WebhookMetrics()
    webhook.watch_certificates(SimpleNamespace(  # type: ignore[arg-type]  # what the collector reads
        cert=SimpleNamespace(not_valid_after_utc=dt.datetime(2030, 1, 1, tzinfo=dt.UTC)), successes=0, failures=0,
    ))
    webhook.observe("mutated", 0.002)
    series = _series_of(enforcer.render()[0].decode())
    for name, label_sets in _series_of(webhook.render()[0].decode()).items():
        series.setdefault(name, []).extend(label_sets)
    for name, label_sets in _series_of(generate_latest(node_metrics().registry).decode()).items():
        series.setdefault(name, []).extend(label_sets)
    return series


def node_metrics() -> NodeMetrics:
    """The guardian's registry as its loop leaves it after an unaccounted container and audits
    (gpufence/node/loop.py: ``census`` each poll, ``actions.labels("audit", reason).inc()`` per audit)."""
    metrics = NodeMetrics()
    metrics.unaccounted.labels("team-b", "sneaky-0", "main").set(2)
    metrics.admin_allowed.labels("gpu-operator", "dcgm-exporter-x", "exporter").set(1)
    metrics.admin_allowed_memory.labels("gpu-operator", "dcgm-exporter-x", "exporter").set(1 << 30)
    for reason in sorted({reason for _, reason in ACTION_REASONS}):
        metrics.actions.labels("audit", reason).inc()
    metrics.pods_synced.set(1)
    metrics.nvml_up.set(1)
    metrics.last_poll.set(1.0)
    return metrics


_SERIES_RE = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"\s*,?')


def parse_series(text: str) -> tuple[str, dict[str, str]]:
    match = _SERIES_RE.fullmatch(text.strip())
    assert match, text
    labels = dict(_LABEL_RE.findall(match["labels"] or ""))
    return match["name"], labels


def test_parse_series() -> None:
    assert parse_series('a_total{x="1",le="+Inf"}') == ("a_total", {"x": "1", "le": "+Inf"})
    assert parse_series("up") == ("up", {})


def shape_errors(series: str, real: dict[str, list[dict[str, str]]]) -> list[str]:
    """Why a promtool input series is not one the exporters produce (empty when it is)."""
    name, labels = parse_series(series)
    if name in SYNTHETIC:
        return []
    if name not in real:
        return [f"{name} is not exported by the enforcer, the webhook or the node guardian"]
    own = set().union(*(set(ls) for ls in real[name]))
    errors = [f"{series}: unknown label {key}" for key in sorted(set(labels) - own - TARGET_LABELS)]
    # Labels the exporter sets itself (action, resource, outcome, result, le) take its values.
    for key in sorted(set(labels) & own - TARGET_LABELS):
        values = {ls[key] for ls in real[name] if key in ls}
        if labels[key] not in values:
            errors.append(f"{series}: {key}={labels[key]!r} never exported ({sorted(values)})")
    return errors


def test_input_series_are_shaped_like_the_real_metrics() -> None:
    real = real_series()
    series = [entry["series"] for case in unit_tests()["tests"] for entry in case["input_series"]]
    assert len(series) >= 20
    errors = [e for s in series for e in shape_errors(s, real)]
    assert errors == []


def test_the_shape_check_rejects_what_the_exporters_never_produce() -> None:
    real = real_series()
    assert shape_errors('gpufence_enforcement_actions_total{action="kill",resource="memory"}', real)
    assert shape_errors('gpufence_enforcement_actions_total{action="sigterm",kind="memory"}', real)
    assert shape_errors('gpufence_webhook_requests_total{outcome="failed"}', real)
    assert shape_errors("gpufence_webhook_requests", real)  # the counter's name without _total
    assert shape_errors('gpufence_webhook_request_duration_seconds_bucket{le="1"}', real)  # exported as 1.0
    assert not shape_errors('gpufence_nvml_up{namespace="a",pod="b",container="gpufence-enforcer"}', real)


# ---------------------------------------------------------------------------------------------
# Counters at zero before the first event


def test_enforcer_action_counters_start_at_zero_per_container() -> None:
    metrics = EnforcerMetrics("team-a", "train-0")
    metrics.declare_containers(["trainer", "eval"])
    samples = {
        (ls["container"], ls["action"], ls["resource"])
        for ls in _series_of(metrics.render()[0].decode())["gpufence_enforcement_actions_total"]
    }
    assert samples == {(c, a, r) for c in ("trainer", "eval") for a, r in ACTION_KINDS}
    text = metrics.render()[0].decode()
    assert ('gpufence_enforcement_actions_total{action="sigterm",container="trainer",namespace="team-a",'
            'pod="train-0",resource="memory"} 0.0') in text
    metrics.action("trainer", "sigterm", "memory")
    assert ('gpufence_enforcement_actions_total{action="sigterm",container="trainer",namespace="team-a",'
            'pod="train-0",resource="memory"} 1.0') in metrics.render()[0].decode()


def test_webhook_counters_start_at_zero() -> None:
    real = real_series()
    outcomes = {ls["outcome"] for ls in real["gpufence_webhook_requests_total"]}
    assert outcomes == set(OUTCOMES)
    results = {ls["result"] for ls in real["gpufence_webhook_certificate_reloads_total"]}
    assert results == {"success", "failure"}


def test_running_enforcer_exports_kill_counters_at_zero(gpu, make_config) -> None:
    """The real enforcer process, before any kill: the series the kill alert needs are there at 0."""
    work = gpu.workload("trainer")
    gpu.write(gpu.device_with(gpu.proc(work, 1 << 30)))
    config = make_config({"trainer": {"memoryPercent": 50}, "eval": {"computePercent": 30}}, interval=0.1)
    enforcer = gpu.enforcer(config, env={"GPUFENCE_POD_NAME": "train-0", "GPUFENCE_POD_NAMESPACE": "team-a"})
    enforcer.wait_polls(2)
    for container in ("trainer", "eval"):
        for action in ("sigterm", "sigkill"):
            value = enforcer.metric("gpufence_enforcement_actions_total", container=container, action=action,
                                    resource="memory", namespace="team-a", pod="train-0")  # fmt: skip
            assert value == 0, (container, action, value)
    assert enforcer.stop() == 0


# ---------------------------------------------------------------------------------------------
# Runbook


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return anchors


def test_every_alert_links_its_runbook_section() -> None:
    anchors = _anchors(RUNBOOK.read_text())
    for alert in alerts():
        url = alert.get("annotations", {}).get("runbook_url", "")
        base, _, anchor = url.partition("#")
        assert base == RUNBOOK_URL, f"{alert['alert']}: runbook_url {url!r}"
        assert anchor == alert["alert"].lower(), f"{alert['alert']}: anchor {anchor!r}"
        assert anchor in anchors, f"{alert['alert']}: docs/runbook.md has no section #{anchor}"
