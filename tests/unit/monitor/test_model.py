"""build_view on the enforcer's real exposition text (EnforcerMetrics, no process)."""

from __future__ import annotations

from types import SimpleNamespace

from gpufence.enforcer.report.metrics import EnforcerMetrics, UsageSample
from gpufence.monitor.model import NO_DEVICE, build_view, with_target_labels
from gpufence.monitor.sources import parse_metrics

GIB = 1 << 30


def enforcer_text() -> str:
    metrics = EnforcerMetrics("team-a", "train-0")
    metrics.declare_containers(["trainer", "loader", "idle"])
    metrics.set_container_usage([
        UsageSample("trainer", "GPU-0", 0, 3 * GIB, 4 * GIB, 0.9),
        UsageSample("loader", "GPU-0", 0, 5 * GIB, 4 * GIB, None),
    ])
    metrics.set_compute_shares({"trainer": 0.5, "loader": None, "idle": 0.25})
    metrics.set_throttled("trainer", True)
    metrics.set_memory_enforcement("trainer", "polling")
    metrics.set_memory_enforcement("loader", "driver")
    metrics.action("loader", "sigterm", "memory")
    metrics.action("trainer", "throttle_start", "compute")
    metrics.set_pod_usage([SimpleNamespace(device_uuid="GPU-0", device_index=0, used_bytes=9 * GIB,
                                           unattributed_bytes=GIB, unattributed=(1, 2), budget_bytes=8 * GIB)])
    metrics.nvml_up.set(1)
    metrics.last_successful_poll.set(1000.0)
    return metrics.render()[0].decode()


def view():
    target = {"namespace": "team-a", "pod": "train-0", "container": "gpufence-enforcer", "node": "node-a"}
    return build_view(with_target_labels(parse_metrics(enforcer_text()), target), time=1001.0, source="test")


def test_containers_per_gpu() -> None:
    v = view()
    gpus = {(g.node, g.uuid, g.gpu): g for g in v.gpus}
    assert set(gpus) == {("node-a", "GPU-0", "0")}
    rows = {c.container: c for c in gpus["node-a", "GPU-0", "0"].containers}
    assert set(rows) == {"trainer", "loader", "idle"}  # idle: a compute share, no process now, shown on the pod's GPU
    trainer, loader, idle = rows["trainer"], rows["loader"], rows["idle"]
    assert (trainer.used_bytes, trainer.limit_bytes, trainer.sm_ratio) == (3 * GIB, 4 * GIB, 0.9)
    assert trainer.compute_share == 0.5 and trainer.throttled and trainer.mechanism == "polling"
    assert trainer.over_compute and not trainer.over_memory
    assert [(a.action, a.resource, a.count) for a in trainer.actions] == [("throttle_start", "compute", 1)]
    assert loader.over_memory and loader.memory_ratio == 1.25 and loader.mechanism == "driver"
    assert loader.sm_ratio is None and loader.compute_share is None
    assert [(a.action, a.resource) for a in loader.actions] == [("sigterm", "memory")]
    assert idle.used_bytes is None and idle.compute_share == 0.25 and idle.uuid == "GPU-0"
    assert all(c.node == "node-a" and c.namespace == "team-a" for c in rows.values())


def test_pod_rows_and_enforcers() -> None:
    v = view()
    (pod,) = v.gpus[0].pods
    assert (pod.used_bytes, pod.unattributed_bytes, pod.unattributed_processes, pod.budget_bytes) == \
        (9 * GIB, GIB, 2, 8 * GIB)
    assert v.gpus[0].used_bytes == 9 * GIB
    (enforcer,) = v.enforcers
    assert (enforcer.node, enforcer.namespace, enforcer.pod, enforcer.nvml_up, enforcer.last_poll) == \
        ("node-a", "team-a", "train-0", True, 1000.0)


def test_the_enforcers_labels_win_over_the_targets() -> None:
    samples = with_target_labels(parse_metrics(enforcer_text()), {"namespace": "gpu-ns", "pod": "x", "node": "n"})
    used = [s for s in samples if s.name == "gpufence_container_gpu_memory_used_bytes"]
    assert {s.labels["namespace"] for s in used} == {"team-a"}
    nvml = [s for s in samples if s.name == "gpufence_nvml_up"]
    assert nvml[0].labels["namespace"] == "gpu-ns"  # the pod-level series take the target's


def test_a_container_without_any_gpu_row() -> None:
    metrics = EnforcerMetrics("ns", "p")
    metrics.declare_containers(["gone"])
    metrics.action("gone", "sigterm", "memory")
    v = build_view(parse_metrics(metrics.render()[0].decode()))
    (gpu,) = v.gpus
    assert gpu.uuid == NO_DEVICE and [c.container for c in gpu.containers] == ["gone"]


def test_counters_at_zero_alone_show_nothing() -> None:
    metrics = EnforcerMetrics("ns", "p")
    metrics.declare_containers(["a", "b"])
    assert build_view(parse_metrics(metrics.render()[0].decode())).gpus == ()


def guardian_view():
    """The node guardian's real exposition (NodeMetrics after a census with two unaccounted
    containers, an admitted one, one the admin allowed, a pod of another namespace and two host
    processes) as Prometheus stores it through its PodMonitor, beside a sidecar's."""
    from gpufence.node.census import placement
    from gpufence.node.decide import CensusEntry, GpuProc, Standing
    from gpufence.node.pods import Admission, NodePod
    from gpufence.node.report import NodeMetrics

    def entry(pid: int, used: int | None, pod: NodePod | None, container: str | None,
              standing=Standing.UNACCOUNTED):
        proc = GpuProc(pid, pid, 0, "GPU-0", used, None, placement("0::/kubepods/podu/" + "a" * 64 + "\n"))
        return CensusEntry(proc, standing, pod, container, "test")

    sneaky = NodePod("u1", "team-b", "sneaky-0", Admission.NOT_ADMITTED, None)
    alias = NodePod("u2", "team-a", "alias-0", Admission.NOT_ADMITTED, None)
    exporter = NodePod("u3", "gpu-operator", "dcgm-exporter-0", Admission.NOT_ADMITTED, None)
    theirs = NodePod("u4", "other", "theirs-0", Admission.NOT_ADMITTED, None)
    metrics = NodeMetrics()
    metrics.census([entry(1, 2 * GIB, sneaky, "main"), entry(2, GIB, sneaky, "main"), entry(3, None, alias, "cuda"),
                    entry(4, 6 * GIB, sneaky, "ok", Standing.ADMITTED),
                    entry(5, GIB, exporter, "exporter", Standing.ADMIN_ALLOWED),
                    entry(6, GIB, theirs, "app", Standing.OTHER),
                    entry(7, GIB, None, None, Standing.HOST), entry(8, None, None, None, Standing.HOST)])
    guardian = {"namespace": "gpufence-node", "pod": "gpufence-node-x1", "container": "gpufence-node", "node": "node-b"}
    sidecar = {"namespace": "team-a", "pod": "train-0", "container": "gpufence-enforcer", "node": "node-a"}
    from prometheus_client import generate_latest

    samples = with_target_labels(parse_metrics(generate_latest(metrics.registry).decode()), guardian)
    samples += with_target_labels(parse_metrics(enforcer_text()), sidecar)
    return build_view(samples, time=1001.0, source="test")


def test_unaccounted_rows_from_the_guardians_series() -> None:
    v = guardian_view()
    assert [(u.node, u.namespace, u.pod, u.container, u.processes, u.memory_bytes) for u in v.unaccounted] == [
        ("node-b", "team-a", "alias-0", "cuda", 1, 0),  # NVML gave no figure for its process
        ("node-b", "team-b", "sneaky-0", "main", 2, 3 * GIB),
    ]
    # Admin-allowed processes have rows of their own, never among the unaccounted.
    assert [(u.namespace, u.pod, u.container, u.processes, u.memory_bytes) for u in v.admin_allowed] == [
        ("gpu-operator", "dcgm-exporter-0", "exporter", 1, GIB)]
    # The guardian's own series (its node, its pod) make no GPU, container or enforcer row.
    assert {g.node for g in v.gpus} == {"node-a"}
    assert {(e.namespace, e.pod) for e in v.enforcers} == {("team-a", "train-0")}


def test_foreign_rows_count_other_namespaces_and_host_processes_per_node() -> None:
    from gpufence.monitor.model import ForeignRow, Sample

    assert guardian_view().foreign == (ForeignRow("node-b", other_namespace=1, host=2, admitted=1),)

    def counts(node: str, **by_standing: float) -> list[Sample]:
        return [Sample("gpufence_node_gpu_processes", {"standing": s, "node": node}, v) for s, v in by_standing.items()]

    # A node with none of them has no row; two guardians of one node (a rollout) are not added up.
    samples = counts("a", admitted=3, other_namespace=0, host=0) + counts("b", host=1) + counts("b", host=1)
    assert build_view(samples).foreign == (ForeignRow("b", other_namespace=0, host=1, admitted=0),)


def test_no_unaccounted_rows_without_the_guardian() -> None:
    assert view().unaccounted == () and view().admin_allowed == () and view().foreign == ()
