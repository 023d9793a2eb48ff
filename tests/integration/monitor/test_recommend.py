"""``gpufence recommend`` on the scenario's history in a real Prometheus (conftest.py)."""

from __future__ import annotations

import json

import pytest

from tests.integration.monitor.conftest import Scenario
from tests.integration.monitor.test_top import gpufence
from tests.support.prerequisites import needs
from tests.support.prometheus import MISSING, prometheus_binary

pytestmark = [needs(prometheus_binary() is not None, MISSING), pytest.mark.timeout(300)]


def test_recommend_json(scenario: Scenario) -> None:
    result = gpufence("recommend", "--prometheus", scenario.prometheus.url, "--window", "10m", "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["headroom"] == 0.2
    recs = {(r["namespace"], r["kind"], r["workload"], r["container"]): r for r in doc["recommendations"]}
    assert set(recs) == {("team-a", "Deployment", "train", "trainer"), ("team-a", "StatefulSet", "greedy", "loader"),
                         ("team-a", "Deployment", "eager", "jax"), ("team-b", "Deployment", "render", "render"),
                         ("team-b", "Deployment", "etl", "etl")}
    train = recs["team-a", "Deployment", "train", "trainer"]
    # 6Gi peak x 1.2 = 7.2Gi -> 8Gi; SM p99 40 % x 1.2 = 48 -> 50 (the unattributed 512Mi is no container's).
    assert (train["memory_peak_bytes"], train["memory_share"], train["sm_p99_ratio"], train["compute_share_percent"]) \
        == (6 << 30, "8Gi", 0.4, 50)
    assert train["annotations"] == {"gpufence.io/memory": "8Gi", "gpufence.io/compute": "50"}
    assert train["notes"] == []
    greedy = recs["team-a", "StatefulSet", "greedy", "loader"]
    # It held 3Gi through its grace period before the SIGKILL: 3 x 1.2 = 3.6 -> 4Gi; no SM, no compute share.
    assert (greedy["memory_peak_bytes"], greedy["memory_share"], greedy["compute_share_percent"]) == \
        (3 << 30, "4Gi", None)
    assert "terminated" in greedy["notes"][0]
    render = recs["team-b", "Deployment", "render", "render"]
    assert (render["memory_share"], render["sm_peak_ratio"], render["compute_share_percent"]) == ("3Gi", 0.9, 100)
    assert "throttled" in render["notes"][0]
    # Audit mode, what it is made for: 5Gi x 1.2 = 6Gi, SM 35 % x 1.2 = 42 -> 45; no note (not a floor).
    etl = recs["team-b", "Deployment", "etl", "etl"]
    assert (etl["memory_share"], etl["compute_share_percent"], etl["notes"]) == ("6Gi", 45, [])
    # Terminated before Prometheus first scraped it: no usage to size from, and it says so.
    eager = recs["team-a", "Deployment", "eager", "jax"]
    assert (eager["memory_peak_bytes"], eager["memory_share"], eager["annotations"]) == (None, None, {})
    assert eager["notes"] == ["terminated before any scrape: no usage recorded (measure in audit mode)"]


def test_recommend_table_and_annotations(scenario: Scenario) -> None:
    result = gpufence("recommend", "--prometheus", scenario.prometheus.url, "--window", "10m", "--headroom", "50",
                      "--memory-step", "512Mi")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "memory share = peak + 50 % rounded up to 512Mi" in text
    train = next(line for line in text.splitlines() if line.startswith("team-a") and " trainer " in line).split()
    # 6Gi x 1.5 = 9Gi exactly; SM 40 % x 1.5 = 60.
    assert train == ["team-a", "Deployment/train", "trainer", "1", "6.00Gi", "6.00Gi", "8.00Gi", "9Gi", "40%", "40%",
                     "50%", "60%"]
    assert "# team-a StatefulSet/greedy\ngpufence.io/memory: \"4608Mi\"\n" in text  # 3 x 1.5 = 4.5Gi
    assert ("kubectl -n team-a patch deployment train --type merge -p "
            "'{\"spec\":{\"template\":{\"metadata\":{\"annotations\":{\"gpufence.io/memory\":\"9Gi\","
            "\"gpufence.io/compute\":\"60\"}}}}}'") in text


def test_recommend_namespace_filter(scenario: Scenario) -> None:
    result = gpufence("recommend", "--prometheus", scenario.prometheus.url, "--window", "10m", "-n", "team-b",
                      "-o", "json")
    assert {r["workload"] for r in json.loads(result.stdout)["recommendations"]} == {"render", "etl"}


def test_recommend_says_what_prometheus_refused(scenario: Scenario) -> None:
    result = gpufence("recommend", "--prometheus", scenario.prometheus.url, "--window", "ten minutes")
    assert result.returncode == 1
    assert result.stderr.startswith(f"gpufence: Prometheus {scenario.prometheus.url} answered 400: ")
    assert "parse error" in result.stderr
