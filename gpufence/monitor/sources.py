"""Where the monitor's samples come from: a Prometheus server's HTTP API (instant queries, urllib),
or, without one, each enforcer sidecar's /metrics read through the API server's pod proxy.

The pod proxy needs ``get`` on ``pods/proxy`` (and ``list`` on ``pods``) in the namespaces looked at;
each sidecar is read once per refresh, one request per pod.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpufence import metric_names as m
from gpufence.contract import SIDECAR_NAME, SIDECAR_PORT_NAME
from gpufence.monitor.model import Sample, View, build_view, with_target_labels

# What ``top`` reads: every enforcer series but the histograms and error counters, and the node
# guardian's GPU processes without a share (unaccounted, and those the admin allowed) and its
# counts by standing (other namespaces' and the host's processes).
TOP_METRICS = (
    m.CONTAINER_MEMORY_USED, m.CONTAINER_MEMORY_LIMIT, m.CONTAINER_LIMIT_FROM_PERCENT, m.CONTAINER_SM_UTILIZATION,
    m.CONTAINER_COMPUTE_SHARE, m.CONTAINER_THROTTLED, m.CONTAINER_MEMORY_ENFORCEMENT, m.ENFORCEMENT_ACTIONS,
    m.POD_MEMORY_USED, m.POD_MEMORY_UNATTRIBUTED, m.POD_MEMORY_BUDGET, m.POD_UNATTRIBUTED_PROCESSES,
    m.DEVICE_MIG_UNENFORCED, m.NVML_UP, m.LAST_SUCCESSFUL_POLL, m.UNINSPECTABLE_PROCESSES,
    m.NODE_UNACCOUNTED_PROCESSES, m.NODE_UNACCOUNTED_MEMORY, m.NODE_ADMIN_ALLOWED_PROCESSES,
    m.NODE_ADMIN_ALLOWED_MEMORY, m.NODE_GPU_PROCESSES,
)


class SourceError(RuntimeError):
    """The source could not be read (said in words, for the user)."""


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    value: float


class Prometheus:
    """The HTTP API of a Prometheus server (``/api/v1/query``)."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                doc = json.load(resp)
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            try:
                detail = json.loads(body).get("error", body)
            except ValueError:
                detail = body
            raise SourceError(f"Prometheus {self.url} answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise SourceError(f"cannot query Prometheus at {self.url}: {exc}") from None
        if doc.get("status") != "success":
            raise SourceError(f"Prometheus {self.url}: {doc.get('error', doc)}")
        return doc["data"]

    def query(self, expr: str, at: float | None = None) -> list[Series]:
        """An instant vector (a scalar comes back as one series without labels)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", params)
        if data["resultType"] == "scalar":
            return [Series({}, float(data["result"][1]))]
        if data["resultType"] != "vector":
            raise SourceError(f"{expr}: expected an instant vector, got a {data['resultType']}")
        return [Series(dict(r["metric"]), float(r["value"][1])) for r in data["result"]]

    def samples(self, selector: str = "") -> list[Sample]:
        names = "|".join(TOP_METRICS)
        extra = f",{selector}" if selector else ""
        return [Sample(s.labels.pop("__name__", ""), s.labels, s.value)
                for s in self.query(f'{{__name__=~"{names}"{extra}}}')]


def selector(namespace: str | None = None, node: str | None = None) -> str:
    parts = []
    if namespace:
        parts.append(f'namespace="{namespace}"')
    if node:
        parts.append(f'{m.NODE_LABEL}="{node}"')
    return ",".join(parts)


def prometheus_view(url: str, namespace: str | None = None, node: str | None = None) -> View:
    now = time.time()
    try:
        samples = Prometheus(url).samples(selector(namespace, node))
        errors: list[str] = []
    except SourceError as exc:
        samples, errors = [], [str(exc)]
    return build_view(samples, time=now, source=f"Prometheus {url}", errors=errors)


# --- the API server's pod proxy -------------------------------------------------------------


def parse_metrics(text: str) -> list[Sample]:
    """Exposition text -> the samples (``_created`` series dropped, as Prometheus ignores them)."""
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    ]


def sidecar_port(pod: Any) -> int | None:
    """The port named gpufence-metric of the pod's sidecar (a native sidecar is an init container)."""
    for container in [*(pod.spec.init_containers or []), *(pod.spec.containers or [])]:
        for port in container.ports or []:
            if port.name == SIDECAR_PORT_NAME:
                return int(port.container_port)
    return None


def target_labels(pod: Any) -> dict[str, str]:
    """The labels the PodMonitor's relabelling gives the sidecar's target."""
    return {"namespace": pod.metadata.namespace, "pod": pod.metadata.name, "container": SIDECAR_NAME,
            m.NODE_LABEL: pod.spec.node_name or ""}


class ApiServerPods:
    """Reads every sidecar's /metrics through ``GET /api/v1/namespaces/<ns>/pods/<pod>:<port>/proxy/metrics``."""

    def __init__(self, context: str | None = None, kubeconfig: str | None = None) -> None:
        from kubernetes import client, config

        try:
            config.load_kube_config(config_file=kubeconfig, context=context)
        except config.ConfigException:
            try:
                config.load_incluster_config()
            except config.ConfigException as exc:
                raise SourceError(f"no kubeconfig and not in a cluster: {exc}") from None
        self.api = client.CoreV1Api()
        self.source = f"API server {client.Configuration.get_default_copy().host} (pod proxy)"

    def pods(self, namespace: str | None, node: str | None) -> list[Any]:
        fields = "status.phase=Running" + (f",spec.nodeName={node}" if node else "")
        if namespace:
            return self.api.list_namespaced_pod(namespace, field_selector=fields).items
        return self.api.list_pod_for_all_namespaces(field_selector=fields).items

    def samples(self, namespace: str | None = None, node: str | None = None) -> tuple[list[Sample], list[str]]:
        samples: list[Sample] = []
        errors: list[str] = []
        for pod in self.pods(namespace, node):
            port = sidecar_port(pod)
            if port is None:
                continue
            name = f"{pod.metadata.name}:{port}"
            try:
                text = self.api.connect_get_namespaced_pod_proxy_with_path(name, pod.metadata.namespace, "metrics")
            except Exception as exc:  # the client raises ApiException, urllib3 errors ...
                errors.append(f"{pod.metadata.namespace}/{pod.metadata.name}: {type(exc).__name__}: "
                              f"{getattr(exc, 'reason', exc)}")
                continue
            samples += with_target_labels(parse_metrics(text), target_labels(pod))
        return samples, errors


def apiserver_view(pods: ApiServerPods, namespace: str | None = None, node: str | None = None) -> View:
    now = time.time()
    try:
        samples, errors = pods.samples(namespace, node)
    except Exception as exc:
        samples, errors = [], [f"cannot list pods: {getattr(exc, 'reason', exc)}"]
    return build_view(samples, time=now, source=pods.source, errors=errors)


