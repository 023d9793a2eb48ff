"""The pod-proxy source's pure parts: the sidecar's port in a pod object, its target labels, the
exposition parser, and the selectors passed to Prometheus."""

from __future__ import annotations

from types import SimpleNamespace

from gpufence.contract import SIDECAR_NAME, SIDECAR_PORT_NAME
from gpufence.monitor.sources import TOP_METRICS, parse_metrics, selector, sidecar_port, target_labels


def container(name: str, *ports: tuple[str, int]) -> SimpleNamespace:
    return SimpleNamespace(name=name, ports=[SimpleNamespace(name=n, container_port=p) for n, p in ports] or None)


def pod(init: list[SimpleNamespace], containers: list[SimpleNamespace], node: str | None = "node-a") -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(name="p-0", namespace="ns"),
                           spec=SimpleNamespace(init_containers=init, containers=containers, node_name=node))


def test_the_sidecar_port_native_or_plain() -> None:
    native = pod([container(SIDECAR_NAME, (SIDECAR_PORT_NAME, 9401))], [container("train", ("http", 8080))])
    assert sidecar_port(native) == 9401
    plain = pod(None, [container("train"), container(SIDECAR_NAME, (SIDECAR_PORT_NAME, 40123))])  # hostNetwork
    assert sidecar_port(plain) == 40123
    assert sidecar_port(pod(None, [container("web", ("http", 80))])) is None


def test_target_labels_are_the_podmonitors() -> None:
    assert target_labels(pod(None, [])) == {"namespace": "ns", "pod": "p-0", "container": SIDECAR_NAME,
                                            "node": "node-a"}
    assert target_labels(pod(None, [], node=None))["node"] == ""


def test_parse_drops_created_series() -> None:
    text = ("# TYPE gpufence_poll_errors counter\ngpufence_poll_errors_total 2.0\n"
            "gpufence_poll_errors_created 1.7e9\n"
            '# TYPE gpufence_container_throttled gauge\ngpufence_container_throttled{container="a"} 1.0\n')
    samples = parse_metrics(text)
    assert [(s.name, dict(s.labels), s.value) for s in samples] == [
        ("gpufence_poll_errors_total", {}, 2.0), ("gpufence_container_throttled", {"container": "a"}, 1.0)]


def test_selector() -> None:
    assert selector() == ""
    assert selector("team-a", "node-b") == 'namespace="team-a",node="node-b"'
    assert "gpufence_poll_duration_seconds" not in TOP_METRICS  # histograms are not shown
