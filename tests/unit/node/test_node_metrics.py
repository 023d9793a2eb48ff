"""The guardian's census as Prometheus series: processes and memory of each unaccounted container."""

from __future__ import annotations

from prometheus_client import generate_latest

from gpufence.node.census import placement
from gpufence.node.decide import CensusEntry, GpuProc, Standing
from gpufence.node.pods import Admission, NodePod
from gpufence.node.report import NodeMetrics

GIB = 1 << 30
POD = NodePod("uid-1", "team-b", "sneaky-0", Admission.NOT_ADMITTED, None)


def entry(pid: int, used: int | None, standing: Standing = Standing.UNACCOUNTED, container: str = "main",
          ) -> CensusEntry:
    proc = GpuProc(pid, 1000 + pid, 0, "GPU-0", used, None, placement("0::/kubepods/poduid-1/" + "a" * 64 + "\n"))
    return CensusEntry(proc, standing, POD, container, "test")


def value(metrics: NodeMetrics, name: str, container: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"namespace": "team-b", "pod": "sneaky-0", "container": container})


def test_unaccounted_memory_is_summed_per_container_and_cleared_when_gone() -> None:
    metrics = NodeMetrics()
    metrics.census([entry(1, 2 * GIB), entry(2, GIB), entry(3, None), entry(4, 5 * GIB, container="side"),
                    entry(5, 7 * GIB, Standing.ADMITTED)])
    assert value(metrics, "gpufence_node_unaccounted_processes", "main") == 3
    # NVML without a figure for a process counts as nothing; the admitted process is not counted.
    assert value(metrics, "gpufence_node_unaccounted_memory_bytes", "main") == 3 * GIB
    assert value(metrics, "gpufence_node_unaccounted_memory_bytes", "side") == 5 * GIB
    metrics.census([entry(5, 7 * GIB, Standing.ADMITTED)])
    text = generate_latest(metrics.registry).decode()
    assert "gpufence_node_unaccounted_memory_bytes{" not in text
    assert "gpufence_node_unaccounted_processes{" not in text


def test_admin_allowed_processes_have_series_of_their_own() -> None:
    metrics = NodeMetrics()
    metrics.census([entry(1, 2 * GIB, Standing.ADMIN_ALLOWED), entry(2, GIB, Standing.ADMIN_ALLOWED),
                    entry(3, 4 * GIB, container="side")])
    assert value(metrics, "gpufence_node_admin_allowed_processes", "main") == 2
    assert value(metrics, "gpufence_node_admin_allowed_memory_bytes", "main") == 3 * GIB
    assert value(metrics, "gpufence_node_unaccounted_processes", "main") is None  # not counted as unaccounted
    assert value(metrics, "gpufence_node_unaccounted_processes", "side") == 1
    assert metrics.registry.get_sample_value("gpufence_node_gpu_processes", {"standing": "admin_allowed"}) == 2
    metrics.census([])
    assert "gpufence_node_admin_allowed_processes{" not in generate_latest(metrics.registry).decode()
