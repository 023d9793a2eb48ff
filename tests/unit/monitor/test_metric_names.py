"""The shared metric names (gpufence/metric_names.py) are exactly what the enforcer exports."""

from __future__ import annotations

from gpufence import metric_names as m
from gpufence.enforcer.report.metrics import EnforcerMetrics


def test_the_names_are_the_enforcers_metrics() -> None:
    registry = EnforcerMetrics("ns", "pod").registry
    exported = {family.name + ("_total" if family.type == "counter" else "") for family in registry.collect()}
    assert exported == set(m.ENFORCER_METRICS)


def test_the_label_sets() -> None:
    metrics = EnforcerMetrics("ns", "pod")
    assert tuple(metrics.memory_used._labelnames) == m.DEVICE_LABELS
    assert tuple(metrics.throttled._labelnames) == m.CONTAINER_LABELS
    assert tuple(metrics.pod_memory_used._labelnames) == m.POD_DEVICE_LABELS
    assert tuple(metrics.memory_enforcement._labelnames) == (*m.CONTAINER_LABELS, "mechanism")


def test_the_standings_top_reads_are_the_censuss() -> None:
    from gpufence.node.decide import Standing

    read = (m.STANDING_ADMITTED, m.STANDING_OTHER_NAMESPACE, m.STANDING_HOST)
    assert read == (Standing.ADMITTED.value, Standing.OTHER.value, Standing.HOST.value)
