"""The jobs generated from the PodMonitor and ServiceMonitor, with the discovery a cluster needs in
place of the scenario's file_sd, and our rule groups, are a configuration Prometheus accepts
(``promtool check config``).

Debian's Prometheus (2.42, the one `scripts/install_system_deps.sh` installs) is built without
Kubernetes service discovery: ``kubernetes_sd_configs`` is "not found in type config.ScrapeConfig".
On the node test bed the targets must then come through ``http_sd_configs`` (an endpoint that turns
the API server's pods into targets with the same ``__meta_kubernetes_*`` labels) or from an upstream
Prometheus. The second test checks this binary has the discovery the tests rely on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.test_alerts import PROMTOOL_MISSING, rule_groups
from tests.integration.monitor.conftest import monitoring_object
from tests.support.prerequisites import needs
from tests.support.prometheus import podmonitor_job, servicemonitor_job

pytestmark = needs(shutil.which("promtool") is not None, PROMTOOL_MISSING)


def check_config(tmp_path: Path, config: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    return subprocess.run([shutil.which("promtool") or "promtool", "check", "config", "prometheus.yml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)


def test_the_http_sd_configuration_is_valid(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    (tmp_path / "ca.crt").write_text("")
    config = {
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            podmonitor_job(monitoring_object("PodMonitor", "gpufence-enforcer"),
                           sd={"http_sd_configs": [{"url": "http://127.0.0.1:8080/targets/pods"}]}),
            servicemonitor_job(monitoring_object("ServiceMonitor"), ca_file="ca.crt",
                               sd={"http_sd_configs": [{"url": "http://127.0.0.1:8080/targets/endpoints"}]}),
        ],
    }
    result = check_config(tmp_path, config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout + result.stderr


def test_this_prometheus_has_the_discovery_the_tests_use(tmp_path: Path) -> None:
    for sd in ("http_sd_configs", "file_sd_configs"):
        result = check_config(tmp_path, {"scrape_configs": [{"job_name": "x", sd: []}]})
        assert result.returncode == 0, (sd, result.stdout + result.stderr)
