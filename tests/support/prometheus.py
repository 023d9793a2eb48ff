"""A real Prometheus server (Debian's ``/usr/bin/prometheus``) for the monitoring tests, and the
scrape configuration prometheus-operator generates from our PodMonitor and ServiceMonitor.

:func:`podmonitor_job` and :func:`servicemonitor_job` turn the objects in k8s/components/monitoring
into the job the operator writes for them (its relabelling rules, in its order: the keep on the port
name, the target labels namespace/pod/container/endpoint/job, then the monitor's own
``relabelings``). Only the discovery differs: here ``file_sd`` targets carry the ``__meta_kubernetes_*``
labels that Kubernetes service discovery would give the pods (:func:`kubernetes_pod_targets`), so the
same relabelling runs on them; on a cluster the job takes ``kubernetes_sd_configs`` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import yaml

PROMETHEUS = "/usr/bin/prometheus"
MISSING = "no Prometheus server at /usr/bin/prometheus (Debian/Ubuntu: apt-get install prometheus)"


def prometheus_binary() -> str | None:
    return PROMETHEUS if os.access(PROMETHEUS, os.X_OK) else shutil.which("prometheus")


def _sanitize(name: str) -> str:
    """Kubernetes label name -> the __meta_ label suffix Prometheus uses."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _relabelings(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The monitor's ``relabelings`` (camelCase, the CRD's) as Prometheus relabel_configs."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
            "regex": "regex", "replacement": "replacement", "action": "action", "modulus": "modulus"}
    return [{keys[k]: v for k, v in entry.items()} for entry in entries]


def podmonitor_job(podmonitor: dict[str, Any], endpoint_index: int = 0, *, sd: dict[str, Any],
                   scrape_interval: str | None = None) -> dict[str, Any]:
    """The job prometheus-operator generates for one podMetricsEndpoint (its order of rules)."""
    meta, spec = podmonitor["metadata"], podmonitor["spec"]
    endpoint = spec["podMetricsEndpoints"][endpoint_index]
    relabel: list[dict[str, Any]] = [
        {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
    ]
    for key, value in sorted(spec.get("selector", {}).get("matchLabels", {}).items()):
        relabel.append({"action": "keep", "source_labels": [f"__meta_kubernetes_pod_label_{_sanitize(key)}",
                                                            f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}"],
                        "regex": f"({value});true"})
    assert not spec.get("selector", {}).get("matchExpressions"), "not generated here"
    relabel += [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"]},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
        *_relabelings(endpoint.get("relabelings", [])),
    ]
    return {
        "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{endpoint_index}",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "scrape_interval": scrape_interval or endpoint.get("interval", "30s"),
        "metrics_path": endpoint.get("path", "/metrics"),
        "scheme": endpoint.get("scheme", "http"),
        **sd,
        "relabel_configs": relabel,
    }


def servicemonitor_job(servicemonitor: dict[str, Any], endpoint_index: int = 0, *, sd: dict[str, Any],
                       ca_file: str, scrape_interval: str | None = None) -> dict[str, Any]:
    """The job prometheus-operator generates for one ServiceMonitor endpoint (role endpoints)."""
    meta, spec = servicemonitor["metadata"], servicemonitor["spec"]
    endpoint = spec["endpoints"][endpoint_index]
    relabel: list[dict[str, Any]] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    for key, value in sorted(spec["selector"].get("matchLabels", {}).items()):
        relabel.append({"action": "keep",
                        "source_labels": [f"__meta_kubernetes_service_label_{_sanitize(key)}",
                                          f"__meta_kubernetes_service_labelpresent_{_sanitize(key)}"],
                        "regex": f"({value});true"})
    relabel += [
        {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": endpoint["port"]},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job", "replacement": "${1}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
        *_relabelings(endpoint.get("relabelings", [])),
    ]
    tls = endpoint.get("tlsConfig", {})
    return {
        "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{endpoint_index}",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "scrape_interval": scrape_interval or endpoint.get("interval", "30s"),
        "metrics_path": endpoint.get("path", "/metrics"),
        "scheme": endpoint.get("scheme", "http"),
        "tls_config": {"ca_file": ca_file, "server_name": tls.get("serverName", "")},
        **sd,
        "relabel_configs": relabel,
    }


def kubernetes_pod_targets(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets Kubernetes pod discovery (role ``pod``) makes of a pod object as the API server
    returns it: one per container port (``<podIP>:<port>``), one per container without ports
    (``<podIP>``), init containers included, each with the ``__meta_kubernetes_pod_*`` labels the
    PodMonitor's relabelling reads. What the node test bed would serve through ``http_sd_configs``
    from the real API server's pods (Debian's Prometheus has no ``kubernetes_sd_configs``)."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
    common = {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": status.get("podIP", ""),
        "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_ready": "true" if ready else "false",
    }
    for key, value in (meta.get("labels") or {}).items():
        common[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = value
        common[f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}"] = "true"
    targets = []
    containers = [(c, "true") for c in spec.get("initContainers") or []] + \
        [(c, "false") for c in spec.get("containers") or []]
    for container, init in containers:
        labels = {**common, "__meta_kubernetes_pod_container_name": container["name"],
                  "__meta_kubernetes_pod_container_init": init}
        ports = container.get("ports") or []
        if not ports:
            targets.append({"targets": [common["__meta_kubernetes_pod_ip"]], "labels": labels})
        for port in ports:
            targets.append({
                "targets": [f"{common['__meta_kubernetes_pod_ip']}:{port['containerPort']}"],
                "labels": {**labels, "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                           "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                           "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")},
            })
    return targets


def endpoint_target(address: str, *, namespace: str, service: str, service_labels: dict[str, str], pod: str,
                    container: str, port_name: str, node: str) -> dict[str, Any]:
    """A file_sd target with the labels Kubernetes endpoints discovery gives one Service port."""
    meta = {
        "__meta_kubernetes_namespace": namespace,
        "__meta_kubernetes_service_name": service,
        "__meta_kubernetes_endpoint_port_name": port_name,
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_pod_container_name": container,
        "__meta_kubernetes_pod_node_name": node,
    }
    for key, value in service_labels.items():
        meta[f"__meta_kubernetes_service_label_{_sanitize(key)}"] = value
        meta[f"__meta_kubernetes_service_labelpresent_{_sanitize(key)}"] = "true"
    return {"targets": [address], "labels": meta}


class PrometheusServer:
    """A Prometheus process on 127.0.0.1 with a temporary data directory."""

    def __init__(self, root: pathlib.Path, port: int) -> None:
        self.root = root
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "prometheus.log"

    def start(self, config: dict[str, Any], binary: str, timeout: float = 60) -> None:
        config_file = self.root / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [binary, f"--config.file={config_file}", f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
                "--storage.tsdb.retention.time=1d"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        self.wait_until(lambda: self._ready(), timeout, "Prometheus /-/ready")

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                doc = json.load(resp)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read().decode()}") from None
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector: [{"metric": {...}, "value": [t, "v"]}]."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.api("query", **params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step}")["result"]

    def wait_until(self, condition: Callable[[], Any], timeout: float, what: str, poll: float = 0.25) -> Any:
        """Polls ``condition`` until it returns something truthy, or fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            last = condition()
            if last:
                return last
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not true after {timeout}s (last: {last!r})")
            time.sleep(poll)

    def wait_for(self, expr: str, timeout: float, what: str | None = None,
                 check: Callable[[list[dict[str, Any]]], bool] = bool) -> list[dict[str, Any]]:
        """Polls the instant query until ``check(result)`` holds (default: any series)."""
        holder: list[list[dict[str, Any]]] = []

        def condition() -> bool:
            result = self.query(expr)
            holder[:] = [result]
            return check(result)

        self.wait_until(condition, timeout, what or expr)
        return holder[0]


@contextlib.contextmanager
def prometheus(root: pathlib.Path, port: int, config: dict[str, Any], binary: str) -> Iterator[PrometheusServer]:
    server = PrometheusServer(root, port)
    try:
        server.start(config, binary)
        yield server
    finally:
        server.stop()


def write_file_sd(path: pathlib.Path, targets: list[dict[str, Any]]) -> None:
    """Replaced atomically: Prometheus watches the file and must never read half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(targets))
    os.replace(tmp, path)
