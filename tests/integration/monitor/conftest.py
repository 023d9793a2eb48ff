"""The monitoring scenario, shared by the tests of this directory: real enforcer processes against
the simulated driver, the real webhook, and a real Prometheus server scraping them with the jobs
prometheus-operator generates from our PodMonitor and ServiceMonitor, loading our PrometheusRule.

Pods (each its own enforcer, state file and device file: as in a pod, each sidecar's NVML lists its
own pod's processes only):

========================================  ======  =====  =============================================
pod                                       node    GPU    what happens
========================================  ======  =====  =============================================
team-a/train-5c8f9d7b6d-q2w4x (trainer)   node-a  GPU-0  within: 6Gi of 8Gi, SM 40 % of 50 %; plus one
                                                         unattributed process of 512Mi (no container)
team-a/greedy-0 (loader)                  node-a  GPU-0  over its memory share: 1Gi, then 3Gi of 2Gi;
                                                         ignores SIGTERM, SIGKILLed after its grace
team-a/eager-5d7f8c9b6-m4n7q (jax)        node-a  GPU-0  3Gi of 2Gi from its start: SIGTERMed before
                                                         Prometheus first scrapes its sidecar
team-b/render-6b7c9f8d5-zx9kp (render)    node-b  GPU-1  over its compute share: SM 10 %, then 90 %
                                                         of 30 %, throttled; 2Gi of 4Gi
team-b/etl-7f9c6d5b8-k4m2p (etl)          node-b  GPU-1  audit mode: 5Gi of 4Gi, SM 35 % of 20 %; measured
                                                         and counted, never signalled
team-b/broken-0 (solver)                  node-b  GPU-1  NVML does not load (driver not loaded)
========================================  ======  =====  =============================================

Everything waits on events (an enforcer's log line, a workload's report, a Prometheus query's
answer) with a deadline; nothing sleeps in their place.
"""

from __future__ import annotations

import json
import pathlib
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from gpufence.contract import SIDECAR_NAME, SIDECAR_PORT_NAME
from tests.deploy.test_alerts import rule_groups
from tests.support.enforcer_harness import Enforcer, GpuSandbox, Workload, enforcer_config
from tests.support.prerequisites import missing
from tests.support.prometheus import (
    MISSING,
    PrometheusServer,
    endpoint_target,
    kubernetes_pod_targets,
    podmonitor_job,
    prometheus_binary,
    servicemonitor_job,
    write_file_sd,
)
from tests.support.server_process import free_port, gpufence_server
from tests.support.tlsutil import make_pki, pod_review

ROOT = pathlib.Path(__file__).resolve().parents[3]
MONITORING = ROOT / "k8s" / "components" / "monitoring"
GIB = 1 << 30
MIB = 1 << 20
SCRAPE = "1s"  # the PodMonitor's 15s and the ServiceMonitor's 30s, shortened for the test
INTERVAL = 0.25  # the enforcers' poll interval
DEADLINE = 60  # seconds any one wait may take on a loaded 2-core machine


def monitoring_object(kind: str, name: str | None = None) -> dict[str, Any]:
    for path in sorted(MONITORING.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind and name in (None, doc["metadata"]["name"]):
                return doc
    raise AssertionError(f"no {kind} {name or ''} in {MONITORING}")


def pod_object(namespace: str, name: str, node: str, port: int, containers: list[str]) -> dict[str, Any]:
    """The pod as the API server returns it after the webhook mutated it: the sidecar a native sidecar
    (the first init container, restartPolicy Always) with its metrics port, and each workload
    container with a port of its own (which the PodMonitor must not scrape)."""
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name.rsplit("-", 2)[0]}},
        "spec": {
            "nodeName": node,
            "initContainers": [{"name": SIDECAR_NAME, "image": "gpufence", "restartPolicy": "Always",
                                "ports": [{"name": SIDECAR_PORT_NAME, "containerPort": port, "protocol": "TCP"}]}],
            "containers": [{"name": c, "image": "workload", "ports": [{"name": "http", "containerPort": 8080}]}
                           for c in containers],
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


@dataclass
class Pod:
    namespace: str
    name: str
    node: str
    uuid: str
    sandbox: GpuSandbox
    enforcer: Enforcer
    workloads: dict[str, Workload] = field(default_factory=dict)

    @property
    def object(self) -> dict[str, Any]:
        return pod_object(self.namespace, self.name, self.node, self.enforcer.port or 0,
                          [c for c in self.workloads if c] or ["solver"])


@dataclass
class Scenario:
    prometheus: PrometheusServer
    pods: dict[str, Pod]
    webhook_port: int
    started: float  # unix time, before the first scrape
    over_at: float = 0.0  # when greedy-0's loader went over its share
    killed_at: float = 0.0  # when it was SIGKILLed
    events: dict[str, Any] = field(default_factory=dict)


def _start_pod(root: pathlib.Path, lib: pathlib.Path, namespace: str, name: str, config: dict[str, Any],
               args: tuple[str, ...]) -> tuple[GpuSandbox, Enforcer]:
    root.mkdir(parents=True)
    sandbox = GpuSandbox(root, lib)
    return sandbox, sandbox.enforcer(config, *args, wait=False, env={"GPUFENCE_POD_NAME": name,
                                                                     "GPUFENCE_POD_NAMESPACE": namespace})


@pytest.fixture(scope="package")
def scenario(tmp_path_factory: pytest.TempPathFactory, sim_lib: pathlib.Path) -> Iterator[Scenario]:
    binary = prometheus_binary()
    if binary is None:
        missing(MISSING)
    root = tmp_path_factory.mktemp("monitoring")
    sandboxes: list[GpuSandbox] = []
    prom: PrometheusServer | None = None
    pki = make_pki(root / "pki")
    try:
        with gpufence_server(pki, log_path=root / "webhook.log") as (_, webhook_port):
            pods: dict[str, Pod] = {}

            # -- the pods, each with its own sidecar ------------------------------------------------
            train_cfg = enforcer_config({"trainer": {"memoryBytes": 8 * GIB, "computePercent": 50}}, interval=INTERVAL)
            greedy_cfg = enforcer_config({"loader": {"memoryBytes": 2 * GIB}}, interval=INTERVAL, grace=3)
            render_cfg = enforcer_config({"render": {"memoryBytes": 4 * GIB, "computePercent": 30}},
                                         interval=INTERVAL)
            eager_cfg = enforcer_config({"jax": {"memoryBytes": 2 * GIB}}, interval=INTERVAL)
            etl_cfg = enforcer_config({"etl": {"memoryBytes": 4 * GIB, "computePercent": 20}}, mode="audit",
                                      interval=INTERVAL)
            broken_cfg = enforcer_config({"solver": {"memoryBytes": 4 * GIB}}, interval=INTERVAL)
            specs = [
                ("train", "team-a", "train-5c8f9d7b6d-q2w4x", "node-a", "GPU-0", train_cfg),
                ("greedy", "team-a", "greedy-0", "node-a", "GPU-0", greedy_cfg),
                ("eager", "team-a", "eager-5d7f8c9b6-m4n7q", "node-a", "GPU-0", eager_cfg),
                ("render", "team-b", "render-6b7c9f8d5-zx9kp", "node-b", "GPU-1", render_cfg),
                ("etl", "team-b", "etl-7f9c6d5b8-k4m2p", "node-b", "GPU-1", etl_cfg),
                ("broken", "team-b", "broken-0", "node-b", "GPU-1", broken_cfg),
            ]
            for key, namespace, name, node, uuid, config in specs:
                # The simulated driver reports render's SM at 90 % whether it runs or is stopped (no
                # util_lag_ms), which the enforcer rightly judges an ineffective throttle after 10 s and
                # terminates; the scenario wants it throttled for as long as it runs.
                args = ("--throttle-ineffective-after", "3600") if key == "render" else ()
                sandbox, enforcer = _start_pod(root / key, sim_lib, namespace, name, config, args)
                sandboxes.append(sandbox)
                pods[key] = Pod(namespace, name, node, uuid, sandbox, enforcer)

            train, greedy, render, etl, broken = (pods[k] for k in ("train", "greedy", "render", "etl", "broken"))
            train.workloads = {"trainer": train.sandbox.workload("trainer"), "": train.sandbox.workload(None)}
            greedy.workloads = {"loader": greedy.sandbox.workload("loader", ignore_term=True)}
            render.workloads = {"render": render.sandbox.workload("render")}
            etl.workloads = {"etl": etl.sandbox.workload("etl")}
            eager = pods["eager"]
            eager.workloads = {"jax": eager.sandbox.workload("jax")}
            s = train.sandbox
            train.sandbox.write(s.device_with(s.proc(train.workloads["trainer"], 6 * GIB, sm=40),
                                              s.proc(train.workloads[""], 512 * MIB), uuid="GPU-0"))
            s = greedy.sandbox
            greedy.sandbox.write(s.device_with(s.proc(greedy.workloads["loader"], 1 * GIB), uuid="GPU-0"))
            s = render.sandbox
            render.sandbox.write(s.device_with(s.proc(render.workloads["render"], 2 * GIB, sm=10), uuid="GPU-1"))
            s = eager.sandbox
            eager.sandbox.write(s.device_with(s.proc(eager.workloads["jax"], 3 * GIB), uuid="GPU-0"))
            s = etl.sandbox
            etl.sandbox.write(s.device_with(s.proc(etl.workloads["etl"], 5 * GIB, sm=35), uuid="GPU-1"))
            broken.sandbox.write(init_error="DRIVER_NOT_LOADED")
            for pod in pods.values():
                pod.enforcer.wait_started(DEADLINE)
            # eager's jax is terminated before Prometheus runs: its kill counter is first scraped at 1.
            eager.workloads["jax"].wait_line("got SIGTERM", DEADLINE)
            eager.workloads["jax"].proc.wait(DEADLINE)

            # -- Prometheus, with the operator's jobs for our monitors --------------------------------
            pod_sd, webhook_sd = root / "enforcers.json", root / "webhook.json"
            # Every container's ports, as Kubernetes pod discovery lists them: the PodMonitor's
            # relabelling keeps the sidecars' and drops the workloads' own (port "http").
            write_file_sd(pod_sd, [t for p in pods.values() for t in kubernetes_pod_targets(p.object)])
            service = monitoring_object("ServiceMonitor")["spec"]["selector"]["matchLabels"]
            write_file_sd(webhook_sd, [endpoint_target(
                f"127.0.0.1:{webhook_port}", namespace="gpufence", service="gpufence-webhook", service_labels=service,
                pod="gpufence-webhook-6d9c7b8f4-k2x7p", container="webhook", port_name="https", node="node-c",
            )])
            (root / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
            config = {
                "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE, "scrape_timeout": SCRAPE},
                "rule_files": [str(root / "rules.yaml")],
                "scrape_configs": [
                    podmonitor_job(monitoring_object("PodMonitor", "gpufence-enforcer"), sd={"file_sd_configs": [
                        {"files": [str(pod_sd)], "refresh_interval": "1s"}]}, scrape_interval=SCRAPE),
                    servicemonitor_job(monitoring_object("ServiceMonitor"), sd={"file_sd_configs": [
                        {"files": [str(webhook_sd)], "refresh_interval": "1s"}]}, ca_file=str(pki.ca_file),
                        scrape_interval=SCRAPE),
                ],
            }
            # The webhook's serving certificate is for localhost/127.0.0.1, not the Service's name.
            config["scrape_configs"][1]["tls_config"]["server_name"] = "localhost"
            prom = PrometheusServer(root / "prometheus", free_port())
            prom.root.mkdir()
            started = time.time()
            prom.start(config, binary)
            result = Scenario(prom, pods, webhook_port, started)

            # -- admission reviews, for the webhook's series, once its counters were scraped at 0 ----
            prom.wait_for('gpufence_webhook_requests_total{outcome="mutated"} == 0', DEADLINE)
            ctx = pki.client_context()
            for i in range(5):
                body = json.dumps(pod_review(f"uid-{i}")).encode()
                request = urllib.request.Request(f"https://127.0.0.1:{webhook_port}/mutate", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, context=ctx, timeout=10) as resp:
                    assert resp.status == 200

            prom.wait_for('gpufence_webhook_requests_total{outcome="mutated"} == 5', DEADLINE)

            # -- the scenario ------------------------------------------------------------------------
            # Every target up, and greedy's kill counter scraped at 0 before the kill (else increase()
            # has nothing to measure and the kill alert cannot fire).
            prom.wait_for('up{job="gpufence/gpufence-enforcer"} == 1', DEADLINE,
                          check=lambda r: len(r) == len(pods))
            prom.wait_for('gpufence_enforcement_actions_total{pod="greedy-0",container="loader",action="sigterm",'
                          'resource="memory"} == 0', DEADLINE)
            prom.wait_for('gpufence_container_gpu_memory_used_bytes{pod="greedy-0"} == 1073741824', DEADLINE)
            # render goes over its compute share once its throttle counter was scraped at 0.
            prom.wait_for('gpufence_enforcement_actions_total{pod="render-6b7c9f8d5-zx9kp",container="render",'
                          'action="throttle_start"} == 0', DEADLINE)
            s = render.sandbox
            render.sandbox.write(s.device_with(s.proc(render.workloads["render"], 2 * GIB, sm=90), uuid="GPU-1"))
            render.enforcer.wait_event("throttle_start", DEADLINE, container="render")
            etl.enforcer.wait_event("memory_over_share", DEADLINE, container="etl", action="audit")
            mark = greedy.enforcer.mark()
            s = greedy.sandbox
            result.over_at = time.time()
            greedy.sandbox.write(s.device_with(s.proc(greedy.workloads["loader"], 3 * GIB), uuid="GPU-0"))
            greedy.workloads["loader"].wait_line("ignored SIGTERM", DEADLINE)
            # It holds 3Gi for its 3 s grace: wait until Prometheus has scraped that, the peak recommend sees.
            prom.wait_for('gpufence_container_gpu_memory_used_bytes{pod="greedy-0"} == 3221225472', DEADLINE)
            result.events["sigkill"] = greedy.enforcer.wait_event("sigkill", DEADLINE, start=mark)
            greedy.workloads["loader"].proc.wait(DEADLINE)
            result.killed_at = time.time()
            prom.wait_for('gpufence_enforcement_actions_total{pod="greedy-0",container="loader",action="sigkill",'
                          'resource="memory"} == 1', DEADLINE)
            yield result
    finally:
        if prom is not None:
            prom.stop()
        for sandbox in sandboxes:
            sandbox.cleanup()
