"""What ``gpufence top`` shows, built from metric samples by pure functions (no I/O).

A :class:`Sample` is one series at one instant (name, labels, value), whether it came from a
Prometheus instant query or from a sidecar's /metrics text read through the API server. The labels
are the enforcer's own (gpufence/metric_names.py) plus the target's ``node``
(the PodMonitor's relabelling; ``""`` when unknown). The node guardian's unaccounted series name the
workload's namespace/pod/container and the guardian's node the same way (its PodMonitor); its
counts by standing carry the node only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpufence import metric_names as m

NO_DEVICE = ""  # the UUID of a container's row when none of its processes is on a GPU


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Action:
    action: str
    resource: str
    count: float


@dataclass(frozen=True)
class ContainerRow:
    """One container on one GPU (or on none, ``uuid == NO_DEVICE``: a share with no process now)."""

    node: str
    namespace: str
    pod: str
    container: str
    uuid: str
    gpu: str
    used_bytes: float | None = None
    limit_bytes: float | None = None
    limit_from_percent: bool = False
    sm_ratio: float | None = None
    compute_share: float | None = None
    throttled: bool = False
    mechanism: str | None = None
    actions: tuple[Action, ...] = ()

    @property
    def memory_ratio(self) -> float | None:
        if self.used_bytes is None or not self.limit_bytes:
            return None
        return self.used_bytes / self.limit_bytes

    @property
    def over_memory(self) -> bool:
        return self.memory_ratio is not None and self.memory_ratio > 1

    @property
    def over_compute(self) -> bool:
        return self.sm_ratio is not None and self.compute_share is not None and self.sm_ratio > self.compute_share


@dataclass(frozen=True)
class PodDeviceRow:
    """A pod's totals on one GPU: every GPU process, attributed or not, and its budget."""

    node: str
    namespace: str
    pod: str
    uuid: str
    gpu: str
    used_bytes: float = 0
    unattributed_bytes: float = 0
    unattributed_processes: int = 0
    budget_bytes: float | None = None
    mig_unenforced: bool = False


@dataclass(frozen=True)
class GpuView:
    node: str
    uuid: str
    gpu: str
    containers: tuple[ContainerRow, ...] = ()
    pods: tuple[PodDeviceRow, ...] = ()

    @property
    def used_bytes(self) -> float:
        return sum(p.used_bytes for p in self.pods) or sum(c.used_bytes or 0 for c in self.containers)


@dataclass(frozen=True)
class EnforcerRow:
    node: str
    namespace: str
    pod: str
    nvml_up: bool | None = None
    last_poll: float | None = None  # unix time
    uninspectable: int = 0


@dataclass(frozen=True)
class UnaccountedRow:
    """A container whose GPU processes hold no admitted share, as the node guardian counts them."""

    node: str
    namespace: str
    pod: str
    container: str
    processes: int
    memory_bytes: float | None = None  # absent from a guardian that does not export it


@dataclass(frozen=True)
class ForeignRow:
    """A node's GPU processes that gpufence does not govern, as the node guardian counts them: per
    node and standing, not per GPU (``admitted``: the opted-in containers' processes on that node)."""

    node: str
    other_namespace: int
    host: int
    admitted: int


@dataclass(frozen=True)
class View:
    gpus: tuple[GpuView, ...] = ()
    enforcers: tuple[EnforcerRow, ...] = ()
    time: float = 0.0
    source: str = ""
    errors: tuple[str, ...] = field(default=())
    unaccounted: tuple[UnaccountedRow, ...] = ()
    admin_allowed: tuple[UnaccountedRow, ...] = ()  # the same, where the admin's policy allowed device access
    foreign: tuple[ForeignRow, ...] = ()  # nodes with GPU processes of other namespaces or of the host

    @property
    def containers(self) -> tuple[ContainerRow, ...]:
        return tuple(c for g in self.gpus for c in g.containers)


@dataclass
class _Facts:
    """What the per-container series say of one container (collected before the rows are built)."""

    compute_share: float | None = None
    throttled: bool = False
    mechanism: str | None = None
    actions: list[Action] = field(default_factory=list)

    def worth_a_row(self) -> bool:
        """Shown without a device row: it has a share, a throttle, a mechanism or an action."""
        return self.compute_share is not None or self.throttled or self.mechanism is not None or bool(self.actions)


def _label(sample: Sample, key: str) -> str:
    return str(sample.labels.get(key, ""))


def build_view(samples: Iterable[Sample], *, time: float = 0.0, source: str = "",
               errors: Iterable[str] = ()) -> View:
    """Group samples per node and GPU. Samples of other metrics are ignored."""
    grouped = _group(samples)
    pod_rows = [
        PodDeviceRow(node, ns, pod, uuid, gpu, v.get(m.POD_MEMORY_USED, 0), v.get(m.POD_MEMORY_UNATTRIBUTED, 0),
                     int(v.get(m.POD_UNATTRIBUTED_PROCESSES, 0)), v.get(m.POD_MEMORY_BUDGET),
                     v.get(m.DEVICE_MIG_UNENFORCED, 0) == 1)
        for (node, ns, pod, uuid, gpu), v in grouped.pods.items()
    ]
    enforcer_rows = tuple(
        EnforcerRow(node, ns, pod, None if m.NVML_UP not in v else v[m.NVML_UP] == 1, v.get(m.LAST_SUCCESSFUL_POLL),
                    int(v.get(m.UNINSPECTABLE_PROCESSES, 0)))
        for (node, ns, pod), v in sorted(grouped.enforcers.items())
    )
    return View(_gpu_views(_container_rows(grouped), pod_rows), enforcer_rows, time, source, tuple(errors),
                _unaccounted_rows(grouped.unaccounted, m.NODE_UNACCOUNTED_PROCESSES, m.NODE_UNACCOUNTED_MEMORY),
                _unaccounted_rows(grouped.unaccounted, m.NODE_ADMIN_ALLOWED_PROCESSES, m.NODE_ADMIN_ALLOWED_MEMORY),
                _foreign_rows(grouped.standings))


def _unaccounted_rows(grouped: Mapping[tuple[str, ...], Mapping[str, float]], processes: str,
                      memory: str) -> tuple[UnaccountedRow, ...]:
    return tuple(
        UnaccountedRow(node, ns, pod, container, int(v.get(processes, 0)), v.get(memory))
        for (node, ns, pod, container), v in sorted(grouped.items())
        if v.get(processes, 0) > 0
    )


def _foreign_rows(standings: Mapping[str, Mapping[str, float]]) -> tuple[ForeignRow, ...]:
    rows = (ForeignRow(node, int(v.get(m.STANDING_OTHER_NAMESPACE, 0)), int(v.get(m.STANDING_HOST, 0)),
                       int(v.get(m.STANDING_ADMITTED, 0)))
            for node, v in sorted(standings.items()))
    return tuple(r for r in rows if r.other_namespace or r.host)


@dataclass
class _Grouped:
    """The samples by what they describe."""

    # (node, ns, pod, container, uuid, gpu) -> metric -> value
    device: dict[tuple[str, ...], dict[str, float]] = field(default_factory=dict)
    per_container: dict[tuple[str, ...], _Facts] = field(default_factory=dict)  # (node, ns, pod, container)
    pods: dict[tuple[str, ...], dict[str, float]] = field(default_factory=dict)  # (node, ns, pod, uuid, gpu)
    enforcers: dict[tuple[str, ...], dict[str, float]] = field(default_factory=dict)  # (node, ns, pod)
    # the guardian's: (node, ns, pod, container) -> metric -> value
    unaccounted: dict[tuple[str, ...], dict[str, float]] = field(default_factory=dict)
    standings: dict[str, dict[str, float]] = field(default_factory=dict)  # the guardian's: node -> standing -> count


_DEVICE_METRICS = (m.CONTAINER_MEMORY_USED, m.CONTAINER_MEMORY_LIMIT, m.CONTAINER_LIMIT_FROM_PERCENT,
                   m.CONTAINER_SM_UTILIZATION)
_POD_METRICS = (m.POD_MEMORY_USED, m.POD_MEMORY_UNATTRIBUTED, m.POD_MEMORY_BUDGET, m.POD_UNATTRIBUTED_PROCESSES,
                m.DEVICE_MIG_UNENFORCED)
_ENFORCER_METRICS = (m.NVML_UP, m.LAST_SUCCESSFUL_POLL, m.UNINSPECTABLE_PROCESSES)
_UNACCOUNTED_METRICS = (m.NODE_UNACCOUNTED_PROCESSES, m.NODE_UNACCOUNTED_MEMORY, m.NODE_ADMIN_ALLOWED_PROCESSES,
                        m.NODE_ADMIN_ALLOWED_MEMORY)


def _group(samples: Iterable[Sample]) -> _Grouped:
    found = _Grouped()
    for s in samples:
        node, ns, pod = _label(s, m.NODE_LABEL), _label(s, "namespace"), _label(s, "pod")
        container_key = (node, ns, pod, _label(s, "container"))
        if s.name in _DEVICE_METRICS:
            found.device.setdefault((*container_key, _label(s, "UUID"), _label(s, "gpu")), {})[s.name] = s.value
            found.per_container.setdefault(container_key, _Facts())
        elif s.name == m.CONTAINER_COMPUTE_SHARE:
            found.per_container.setdefault(container_key, _Facts()).compute_share = s.value
        elif s.name == m.CONTAINER_THROTTLED:
            found.per_container.setdefault(container_key, _Facts()).throttled = s.value == 1
        elif s.name == m.CONTAINER_MEMORY_ENFORCEMENT:
            if s.value == 1:
                found.per_container.setdefault(container_key, _Facts()).mechanism = _label(s, "mechanism")
        elif s.name == m.ENFORCEMENT_ACTIONS:
            facts = found.per_container.setdefault(container_key, _Facts())
            if s.value > 0:
                facts.actions.append(Action(_label(s, "action"), _label(s, "resource"), s.value))
        elif s.name in _POD_METRICS:
            found.pods.setdefault((node, ns, pod, _label(s, "UUID"), _label(s, "gpu")), {})[s.name] = s.value
        elif s.name in _ENFORCER_METRICS:
            found.enforcers.setdefault((node, ns, pod), {})[s.name] = s.value
        elif s.name in _UNACCOUNTED_METRICS:
            found.unaccounted.setdefault(container_key, {})[s.name] = s.value
        elif s.name == m.NODE_GPU_PROCESSES:
            # Two guardians of one node (a rollout's overlap) count the same processes: the larger.
            counts = found.standings.setdefault(node, {})
            standing = _label(s, "standing")
            counts[standing] = max(counts.get(standing, 0), s.value)
    return found


def _container_rows(grouped: _Grouped) -> list[ContainerRow]:
    """A row per container and device; a container with facts but no device row gets one on its
    pod's first device (or none)."""
    rows: list[ContainerRow] = []
    with_device: set[tuple[str, ...]] = set()
    for (node, ns, pod, container, uuid, gpu), values in grouped.device.items():
        with_device.add((node, ns, pod, container))
        rows.append(_container_row(grouped.per_container.get((node, ns, pod, container), _Facts()), node, ns, pod,
                                   container, uuid, gpu, values))
    pod_devices: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for node, ns, pod, uuid, gpu in grouped.pods:
        pod_devices.setdefault((node, ns, pod), []).append((uuid, gpu))
    for key, facts in grouped.per_container.items():
        if key in with_device or key[3] == "":
            continue  # the pod budget's actions (container "") show on the pod's unattributed row
        if not facts.worth_a_row():
            continue
        devices = sorted(pod_devices.get(key[:3], [])) or [(NO_DEVICE, "")]
        uuid, gpu = devices[0]
        node, ns, pod, container = key
        rows.append(_container_row(facts, node, ns, pod, container, uuid, gpu, {}))
    return rows


def _gpu_views(rows: list[ContainerRow], pod_rows: list[PodDeviceRow]) -> tuple[GpuView, ...]:
    """The rows per (node, GPU), GPUs in order (the unknown device last on its node)."""
    gpus: dict[tuple[str, str, str], tuple[list[ContainerRow], list[PodDeviceRow]]] = {}
    for row in rows:
        gpus.setdefault((row.node, row.uuid, row.gpu), ([], []))[0].append(row)
    for p in pod_rows:
        gpus.setdefault((p.node, p.uuid, p.gpu), ([], []))[1].append(p)
    return tuple(
        GpuView(node, uuid, gpu, tuple(sorted(cs, key=lambda c: (c.namespace, c.pod, c.container))),
                tuple(sorted(ps, key=lambda p: (p.namespace, p.pod))))
        for (node, uuid, gpu), (cs, ps) in sorted(gpus.items(), key=lambda kv: (kv[0][0], kv[0][1] == NO_DEVICE,
                                                                               _gpu_order(kv[0][2]), kv[0][1]))
    )


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), "") if gpu.isdigit() else (1 << 30, gpu)


def _container_row(facts: _Facts, node: str, ns: str, pod: str, container: str, uuid: str, gpu: str,
                   values: Mapping[str, float]) -> ContainerRow:
    return ContainerRow(
        node, ns, pod, container, uuid, gpu,
        used_bytes=values.get(m.CONTAINER_MEMORY_USED),
        limit_bytes=values.get(m.CONTAINER_MEMORY_LIMIT),
        limit_from_percent=values.get(m.CONTAINER_LIMIT_FROM_PERCENT) == 1,
        sm_ratio=values.get(m.CONTAINER_SM_UTILIZATION),
        compute_share=facts.compute_share,
        throttled=facts.throttled,
        mechanism=facts.mechanism,
        actions=tuple(sorted(facts.actions, key=lambda a: (a.resource, a.action))),
    )


def with_target_labels(samples: Iterable[Sample], target: Mapping[str, str]) -> list[Sample]:
    """The samples as Prometheus stores them with ``honor_labels: true``: a target label is added
    where the exporter did not set it (the enforcer's own namespace/pod/container win)."""
    return [Sample(s.name, {**target, **s.labels}, s.value) for s in samples]
