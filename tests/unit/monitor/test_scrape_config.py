"""The scrape jobs the monitoring tests give a real Prometheus are the PodMonitor's and the
ServiceMonitor's as prometheus-operator generates them (tests/support/prometheus.py): same port,
path, scheme, honorLabels and relabelling, read from the objects in k8s/components/monitoring."""

from __future__ import annotations

from pathlib import Path

import yaml

from gpufence.contract import SIDECAR_PORT_NAME
from tests.support.prometheus import kubernetes_pod_targets, podmonitor_job, servicemonitor_job

MONITORING = Path(__file__).resolve().parents[3] / "k8s" / "components" / "monitoring"
SD = {"kubernetes_sd_configs": [{"role": "pod"}]}


def load(name: str) -> dict:
    return yaml.safe_load((MONITORING / name).read_text())


def test_the_enforcer_job_is_the_podmonitors() -> None:
    monitor = load("podmonitor-enforcer.yaml")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    job = podmonitor_job(monitor, sd=SD)
    assert job["job_name"] == "podMonitor/gpufence/gpufence-enforcer/0"
    assert (job["honor_labels"], job["scrape_interval"], job["metrics_path"], job["scheme"]) == \
        (endpoint["honorLabels"], endpoint["interval"], endpoint["path"], endpoint["scheme"])
    assert job["kubernetes_sd_configs"] == SD["kubernetes_sd_configs"]
    rules = job["relabel_configs"]
    keep = [r for r in rules if r.get("action") == "keep"]
    # An empty selector in every namespace: the port name alone selects, and it is the sidecar's.
    assert keep == [{"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                     "regex": SIDECAR_PORT_NAME}]
    targets = {r["target_label"]: r.get("source_labels", r.get("replacement")) for r in rules if "target_label" in r}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]
    assert targets["container"] == ["__meta_kubernetes_pod_container_name"]
    assert targets["node"] == ["__meta_kubernetes_pod_node_name"]  # the monitor's own relabelling
    assert targets["job"] == "gpufence/gpufence-enforcer"
    assert targets["endpoint"] == SIDECAR_PORT_NAME


def test_the_webhook_job_is_the_servicemonitors() -> None:
    monitor = load("servicemonitor-webhook.yaml")
    job = servicemonitor_job(monitor, sd=SD, ca_file="/ca.crt")
    assert job["job_name"] == "serviceMonitor/gpufence/gpufence-webhook/0"
    assert (job["scheme"], job["metrics_path"], job["scrape_interval"]) == ("https", "/metrics", "30s")
    assert job["tls_config"] == {"ca_file": "/ca.crt", "server_name": "gpufence-webhook.gpufence.svc"}
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keeps == {
        ("__meta_kubernetes_service_label_app_kubernetes_io_name",
         "__meta_kubernetes_service_labelpresent_app_kubernetes_io_name"): "(gpufence-webhook);true",
        ("__meta_kubernetes_service_label_app_kubernetes_io_component",
         "__meta_kubernetes_service_labelpresent_app_kubernetes_io_component"): "(webhook);true",
        ("__meta_kubernetes_endpoint_port_name",): "https",
    }
    # The job label is the Service's name, which the GpufenceWebhookDown alert selects on.
    assert {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"} in \
        job["relabel_configs"]


def test_kubernetes_pod_targets_are_what_pod_discovery_gives() -> None:
    pod = {
        "metadata": {"name": "train-0", "namespace": "team-a", "labels": {"app.kubernetes.io/name": "train"}},
        "spec": {"nodeName": "node-a",
                 "initContainers": [{"name": "gpufence-enforcer", "ports": [{"name": SIDECAR_PORT_NAME,
                                                                            "containerPort": 9401}]}],
                 "containers": [{"name": "trainer"}, {"name": "web", "ports": [{"name": "http", "containerPort": 80,
                                                                                "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    targets = kubernetes_pod_targets(pod)
    assert [t["targets"] for t in targets] == [["10.0.0.7:9401"], ["10.0.0.7"], ["10.0.0.7:80"]]
    sidecar = targets[0]["labels"]
    assert sidecar["__meta_kubernetes_pod_container_port_name"] == SIDECAR_PORT_NAME
    assert sidecar["__meta_kubernetes_pod_container_init"] == "true"
    assert (sidecar["__meta_kubernetes_pod_node_name"], sidecar["__meta_kubernetes_pod_phase"],
            sidecar["__meta_kubernetes_pod_ready"]) == ("node-a", "Running", "true")
    assert sidecar["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == "train"
    assert "__meta_kubernetes_pod_container_port_name" not in targets[1]["labels"]  # no ports: the pod's IP
