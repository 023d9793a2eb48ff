"""``gpufence recommend``: the shares to set, from what each workload really used.

Audit mode is made for this: the enforcer measures and never signals, so the history shows what a
workload wants, not what it was allowed. From Prometheus over a window, per workload (the pod's
controller) and container: the peak and the p99 of GPU memory and SM utilisation, and

* the memory share: the **peak** plus the headroom, rounded up to the step (1Gi by default). The
  peak, not the p99: going over a memory share gets the container terminated;
* the compute share: the **p99** of SM utilisation plus the headroom, rounded up to the step (5 %),
  at most 100. Over a compute share the container is slowed down, not stopped. None for a
  container that used no SM and has no compute share (a compute share is optional).

A container that was throttled during the window used at most its compute share, and one that was
terminated for memory peaked where it was stopped: its real demand is higher. Such rows say so
(``notes``), and the share they give is a floor.

Everything here but :func:`collect` is pure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpufence import metric_names as m
from gpufence.contract import ANNOTATION_COMPUTE, ANNOTATION_MEMORY

GI = 1 << 30
_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}

# The characters Kubernetes uses for generated name suffixes (k8s.io/apimachinery rand.SafeEncodeString).
_SAFE = "bcdfghjklmnpqrstvwxz2456789"
_DEPLOYMENT_POD = re.compile(rf"^(?P<name>.+)-(?P<hash>[{_SAFE}]{{6,10}})-(?P<suffix>[{_SAFE}]{{5}})$")
_STATEFULSET_POD = re.compile(r"^(?P<name>.+)-(?P<ordinal>\d+)$")
_GENERATED_POD = re.compile(rf"^(?P<name>.+)-(?P<suffix>[{_SAFE}]{{5}})$")


def parse_bytes(text: str) -> int:
    """'1Gi' -> 1073741824; a plain integer is bytes. Only the binary suffixes (the steps to round to)."""
    text = text.strip()
    for suffix, factor in _BINARY.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def quantity(value: int) -> str:
    """Bytes as the shortest exact Kubernetes quantity: 8589934592 -> '8Gi', 1536 MiB -> '1536Mi'."""
    for suffix, factor in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
        if value and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)


@dataclass(frozen=True)
class Workload:
    namespace: str
    kind: str  # Deployment, StatefulSet, DaemonSet, Job, ReplicaSet, CronJob..., Pod; "generated" when unsure
    name: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


def workload_of(namespace: str, pod: str, owner_kind: str | None = None, owner_name: str | None = None) -> Workload:
    """The pod's controller. With kube-state-metrics' ``kube_pod_owner`` (``owner_kind``/``owner_name``)
    that is the owner, a ReplicaSet being traced to its Deployment by its pod-template-hash suffix;
    without it, the pod's name as its controller generates it: ``<deployment>-<hash>-<5>``,
    ``<statefulset>-<ordinal>``, ``<job or daemonset>-<5>`` (which of the two the name cannot say:
    kind ``generated``), else the pod itself."""
    if owner_kind and owner_name and owner_kind != "<none>":
        if owner_kind == "ReplicaSet":
            match = re.fullmatch(rf"(?P<name>.+)-[{_SAFE}]{{6,10}}", owner_name)
            if match:
                return Workload(namespace, "Deployment", match["name"])
        return Workload(namespace, owner_kind, owner_name)
    if match := _DEPLOYMENT_POD.fullmatch(pod):
        return Workload(namespace, "Deployment", match["name"])
    if match := _STATEFULSET_POD.fullmatch(pod):
        return Workload(namespace, "StatefulSet", match["name"])
    if match := _GENERATED_POD.fullmatch(pod):
        return Workload(namespace, "generated", match["name"])
    return Workload(namespace, "Pod", pod)


@dataclass(frozen=True)
class ContainerUsage:
    """One pod's container over the window (max over its GPUs)."""

    namespace: str
    pod: str
    container: str
    memory_peak: float | None = None
    memory_p99: float | None = None
    sm_peak: float | None = None  # 0-1
    sm_p99: float | None = None
    memory_share: float | None = None  # bytes, the last in the window
    compute_share: float | None = None  # 0-1
    throttled: bool = False
    kills: float = 0


@dataclass(frozen=True)
class Recommendation:
    workload: Workload
    container: str
    pods: int
    memory_peak: float | None
    memory_p99: float | None
    sm_peak: float | None
    sm_p99: float | None
    memory_share_now: float | None
    compute_share_now: float | None
    memory_bytes: int | None  # the share to set
    compute_percent: int | None
    notes: tuple[str, ...] = field(default=())

    @property
    def memory_annotation(self) -> str | None:
        return None if self.memory_bytes is None else quantity(self.memory_bytes)


def round_up(value: float, step: float) -> float:
    # A float product such as 3 GiB x 1.2 lands a hair above or below the exact value: round to the
    # nearest millionth of a step first, so an exact multiple is not pushed one step up.
    return math.ceil(round(value / step, 6)) * step


def memory_share(peak: float, headroom: float, step: int) -> int:
    """The peak plus ``headroom`` (0.2 = 20 %), rounded up to ``step`` bytes; at least one step."""
    return max(step, int(round_up(peak * (1 + headroom), step)))


def compute_share(p99: float, headroom: float, step: int = 5) -> int:
    """The p99 SM ratio (0-1) plus ``headroom``, in percent rounded up to ``step``, in [step, 100]."""
    return min(100, max(step, int(round_up(p99 * 100 * (1 + headroom), step))))


def _max(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def recommend(usages: Iterable[ContainerUsage], owners: Mapping[tuple[str, str], tuple[str, str]] | None = None, *,
              headroom: float = 0.2, memory_step: int = GI, compute_step: int = 5) -> list[Recommendation]:
    """One row per (workload, container): the max over its pods of their peaks and p99s (a p99 per
    pod, then the highest: the share must fit the busiest replica)."""
    owners = owners or {}
    groups: dict[tuple[Workload, str], list[ContainerUsage]] = {}
    for u in usages:
        kind, name = owners.get((u.namespace, u.pod), (None, None))
        groups.setdefault((workload_of(u.namespace, u.pod, kind, name), u.container), []).append(u)
    result = []
    for (workload, container), rows in sorted(groups.items(), key=lambda kv: (kv[0][0].namespace, str(kv[0][0]),
                                                                             kv[0][1])):
        memory_peak = _max(r.memory_peak for r in rows)
        sm_p99 = _max(r.sm_p99 for r in rows)
        compute_now = _max(r.compute_share for r in rows)
        notes = []
        if memory_peak is None and any(r.kills for r in rows):
            notes.append("terminated before any scrape: no usage recorded (measure in audit mode)")
        elif any(r.kills for r in rows):
            notes.append("terminated for its share in the window: the real peak may be higher (measure in audit mode)")
        throttled = any(r.throttled for r in rows)
        if throttled:
            notes.append("throttled in the window: SM held at its share, the real need may be higher")
        # No SM use seen and no compute share now: none to recommend (a compute share is optional).
        wants_compute = sm_p99 is not None and (sm_p99 > 0 or compute_now is not None)
        compute = compute_share(sm_p99, headroom, compute_step) if wants_compute and sm_p99 is not None else None
        if compute is not None and throttled and compute_now is not None:
            compute = max(compute, min(100, int(round_up(compute_now * 100, compute_step))))
        result.append(Recommendation(
            workload, container, len({r.pod for r in rows}), memory_peak, _max(r.memory_p99 for r in rows),
            _max(r.sm_peak for r in rows), sm_p99, _max(r.memory_share for r in rows), compute_now,
            memory_share(memory_peak, headroom, memory_step) if memory_peak is not None else None, compute,
            tuple(notes),
        ))
    return result


def annotations_to_set(recs: Iterable[Recommendation]) -> dict[Workload, dict[str, str]]:
    """Per workload, the pod-template annotations to set: ``gpufence.io/memory`` and
    ``gpufence.io/compute`` for a workload with one GPU container, ``gpufence.io/memory.<container>``
    and ``gpufence.io/compute.<container>`` for each when it has more."""
    by_workload: dict[Workload, list[Recommendation]] = {}
    for r in recs:
        by_workload.setdefault(r.workload, []).append(r)
    result: dict[Workload, dict[str, str]] = {}
    for workload, rows in by_workload.items():
        doc: dict[str, str] = {}
        for r in rows:
            suffix = f".{r.container}" if len(rows) > 1 else ""
            if r.memory_annotation is not None:
                doc[ANNOTATION_MEMORY + suffix] = r.memory_annotation
            if r.compute_percent is not None:
                doc[ANNOTATION_COMPUTE + suffix] = str(r.compute_percent)
        result[workload] = doc
    return result


# --- output -------------------------------------------------------------------------------------


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GI:.2f}Gi"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


HEADER = ("NAMESPACE", "WORKLOAD", "CONTAINER", "PODS", "MEM PEAK", "MEM P99", "MEM SHARE", "-> MEMORY",
          "SM PEAK", "SM P99", "COMPUTE", "-> COMPUTE")


def render_table(recs: list[Recommendation], *, window: str, headroom: float, memory_step: int,
                 compute_step: int) -> str:
    lines = [f"Over the last {window}: memory share = peak + {headroom * 100:g} % rounded up to "
             f"{quantity(memory_step)}; compute share = SM p99 + {headroom * 100:g} % rounded up to "
             f"{compute_step} %.", ""]
    rows = [HEADER] + [
        (r.workload.namespace, str(r.workload), r.container, str(r.pods), _gib(r.memory_peak), _gib(r.memory_p99),
         _gib(r.memory_share_now), r.memory_annotation or "-", _pct(r.sm_peak), _pct(r.sm_p99),
         _pct(r.compute_share_now), "-" if r.compute_percent is None else f"{r.compute_percent}%")
        for r in recs
    ]
    if not recs:
        return "\n".join([*lines, "no gpufence container usage in that window"]) + "\n"
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    noted = [r for r in recs if r.notes]
    if noted:
        lines.append("")
        lines += [f"{r.workload.namespace}/{r.workload} {r.container}: {note}" for r in noted for note in r.notes]
    lines += ["", "Annotations to apply (the pod template's metadata.annotations):"]
    for workload, doc in annotations_to_set(recs).items():
        lines.append(f"# {workload.namespace} {workload}" + ("" if doc else ": nothing to set, no usage recorded"))
        lines += [f'{key}: "{value}"' for key, value in doc.items()]
        if workload.kind in ("Deployment", "StatefulSet", "DaemonSet") and doc:
            lines.append(_patch_command(workload, doc))
    return "\n".join(lines) + "\n"


def _patch_command(workload: Workload, doc: Mapping[str, str]) -> str:
    import json

    patch = json.dumps({"spec": {"template": {"metadata": {"annotations": dict(doc)}}}}, separators=(",", ":"))
    return f"kubectl -n {workload.namespace} patch {workload.kind.lower()} {workload.name} --type merge -p '{patch}'"


def recommendations_json(recs: list[Recommendation]) -> list[dict[str, object]]:
    notes = annotations_to_set(recs)
    return [
        {"namespace": r.workload.namespace, "kind": r.workload.kind, "workload": r.workload.name,
         "container": r.container, "pods": r.pods, "memory_peak_bytes": r.memory_peak, "memory_p99_bytes": r.memory_p99,
         "sm_peak_ratio": r.sm_peak, "sm_p99_ratio": r.sm_p99, "memory_share_now_bytes": r.memory_share_now,
         "compute_share_now_ratio": r.compute_share_now, "memory_share_bytes": r.memory_bytes,
         "memory_share": r.memory_annotation, "compute_share_percent": r.compute_percent, "notes": list(r.notes),
         "annotations": notes[r.workload]}
        for r in recs
    ]


# --- from Prometheus ---------------------------------------------------------------------------


def queries(window: str, selector: str = "") -> dict[str, str]:
    """The instant queries, each over ``[window]`` ending now."""
    sel = f"{{{selector}}}" if selector else ""
    kill_sel = 'action=~"sigterm|sigkill",resource="memory"' + (f",{selector}" if selector else "")
    kills = f"{m.ENFORCEMENT_ACTIONS}{{{kill_sel}}}"
    by = "max by (namespace, pod, container)"
    return {
        "memory_peak": f"{by} (max_over_time({m.CONTAINER_MEMORY_USED}{sel}[{window}]))",
        "memory_p99": f"{by} (quantile_over_time(0.99, {m.CONTAINER_MEMORY_USED}{sel}[{window}]))",
        "sm_peak": f"{by} (max_over_time({m.CONTAINER_SM_UTILIZATION}{sel}[{window}]))",
        "sm_p99": f"{by} (quantile_over_time(0.99, {m.CONTAINER_SM_UTILIZATION}{sel}[{window}]))",
        "memory_share": f"{by} (last_over_time({m.CONTAINER_MEMORY_LIMIT}{sel}[{window}]))",
        "compute_share": f"{by} (last_over_time({m.CONTAINER_COMPUTE_SHARE}{sel}[{window}]))",
        "throttled": f"{by} (max_over_time({m.CONTAINER_THROTTLED}{sel}[{window}]))",
        # Kills in the window: an increase, or a series new in the window already above 0 (a kill
        # before the sidecar's first scrape, which increase() cannot see).
        "kills": f"{by} (increase({kills}[{window}])) > 0 or {by} ({kills} unless {kills} offset {window}) > 0",
        "owners": f"max by (namespace, pod, owner_kind, owner_name) (last_over_time(kube_pod_owner{sel}[{window}]))",
    }


def usages_from(results: Mapping[str, list[tuple[dict[str, str], float]]]) -> list[ContainerUsage]:
    """The queries' results (name -> [(labels, value)]) as one usage per (namespace, pod, container)."""
    values: dict[tuple[str, str, str], dict[str, float]] = {}
    for name, series in results.items():
        if name == "owners":
            continue
        for labels, value in series:
            key = (labels.get("namespace", ""), labels.get("pod", ""), labels.get("container", ""))
            if key[2] == "":
                continue  # the pod budget's actions: no container to size
            values.setdefault(key, {})[name] = value
    return [
        ContainerUsage(ns, pod, container, v.get("memory_peak"), v.get("memory_p99"), v.get("sm_peak"),
                       v.get("sm_p99"), v.get("memory_share"), v.get("compute_share"), v.get("throttled", 0) >= 1,
                       v.get("kills", 0))
        for (ns, pod, container), v in sorted(values.items())
        if "memory_peak" in v or "sm_peak" in v or v.get("kills", 0) > 0
    ]


def owners_from(series: Iterable[tuple[dict[str, str], float]]) -> dict[tuple[str, str], tuple[str, str]]:
    return {(labels.get("namespace", ""), labels.get("pod", "")): (labels.get("owner_kind", ""),
                                                                   labels.get("owner_name", ""))
            for labels, _ in series}
