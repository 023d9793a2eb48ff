"""docs/monitoring.md's metric reference is the code's (scripts/metrics_doc.py), and names every alert."""

from __future__ import annotations

import re

import yaml

from gpufence import metric_names as m
from scripts import metrics_doc

ALERTS = metrics_doc.ROOT / "k8s" / "components" / "monitoring" / "prometheusrule.yaml"


def test_the_metric_reference_is_current() -> None:
    assert metrics_doc.main(["--check"]) == 0, "run: python -m scripts.metrics_doc"


def test_the_reference_lists_every_enforcer_metric_with_its_labels() -> None:
    text = metrics_doc.DOC.read_text()
    for name in m.ENFORCER_METRICS:
        assert f"| `{name}` |" in text, name
    assert f"| `{m.CONTAINER_MEMORY_USED}` | gauge | {', '.join(m.DEVICE_LABELS)} |" in text


def test_the_check_notices_a_stale_reference(tmp_path, monkeypatch) -> None:
    stale = tmp_path / "monitoring.md"
    stale.write_text(metrics_doc.DOC.read_text().replace(m.NVML_UP, "gpufence_nvml_ok"))
    monkeypatch.setattr(metrics_doc, "DOC", stale)
    monkeypatch.setattr(metrics_doc, "ROOT", tmp_path)
    assert metrics_doc.main(["--check"]) == 1


def test_every_alert_is_in_the_alert_table() -> None:
    rule = yaml.safe_load(ALERTS.read_text())
    names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    documented = set(re.findall(r"^\| `(Gpufence\w+)` \|", metrics_doc.DOC.read_text(), re.M))
    assert documented == names
