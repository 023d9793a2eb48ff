"""The driver's per-container GPU memory limit: for which pods the webhook writes it, and its value (pure).

NVIDIA's container toolkit (>= 1.20.1) puts an ``apply-cuda-memory-limits`` hook into the CDI spec
of each GPU; at the container's createRuntime it reads ``NVIDIA_GPU_MEMORY_LIMIT`` and
``NVIDIA_GPU_MEMORY_REQUEST`` (whole MiB) from the container's OCI spec and has the driver (>= R615)
refuse the container's cgroup any allocation past the limit on each of its GPUs. Absent variables:
the hook does nothing. Present on a node that cannot apply them (cgroup v1, an older driver) the
hook fails, and so does the container's start: hence the variables go only where the admin says
the nodes can apply them (``driver-memory-limits``):

* ``on``: every GPU pod;
* ``off``: none;
* ``auto`` (the default): a pod that can only be scheduled onto nodes labelled
  ``gpufence.io/driver-memory-limits=true``: its ``nodeSelector`` has the label with ``"true"``, or
  every term of its required node affinity has a matchExpression ``In ["true"]`` on it; or, however
  it names them (``nodeName``, a hostname ``nodeSelector``, ``matchFields`` on ``metadata.name``,
  any other labels), every node the webhook knows that the pod's ``nodeName``, ``nodeSelector``
  and required node affinity let it land on carries the label (``confined_to_driver_limit_nodes``:
  the node watch cache, webhook.cluster.nodes, gives the names and labels). The scheduler and the kubelet
  check the same three fields; what else narrows the choice (taints, resources, claims) only takes
  nodes away, so the set computed here holds every node the pod can run on. A pod none of whose
  nodes are known, or whose constraints this module cannot read (an unknown operator or field), gets
  no variables: polling alone enforces its share, as before the cache.

Never in audit mode (audit measures, never limits). The value is the container's memory share in
bytes, floored to MiB (request = limit). A percentage share becomes bytes through the GPU's memory
where the webhook knows it (``frameworks.device_memory``: the pod's ``nvidia.com/gpu.memory`` node
selector, ``--gpu-memory``); the resolved bytes go into the enforcer config next to the percentage
(``memoryBytes`` + ``memoryPercent``: the enforcer applies the smaller on each device), so that the
config and the variables say the same bytes. The hook sets the
same limit on every GPU of the container, which matches the share: it holds per device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gpufence.contract import DRIVER_LIMITS_NODE_LABEL, MemoryShare, Mode
from gpufence.quantity import mebibytes_floor
from gpufence.webhook.core.denial import quote
from gpufence.webhook.core.frameworks import DeviceMemory
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import SharePlan

ON, OFF, AUTO = "on", "off", "auto"


def pinned_to_driver_limit_nodes(spec: Mapping[str, Any]) -> bool:
    """Whether the scheduler (and the kubelet's own admission check) can place the pod only on nodes
    labelled ``gpufence.io/driver-memory-limits=true``. Node affinity terms are alternatives, so
    each must require the label; the expressions of one term all hold, so one of them suffices."""
    selector = spec.get("nodeSelector")
    if isinstance(selector, dict) and selector.get(DRIVER_LIMITS_NODE_LABEL) == "true":
        return True
    affinity = spec.get("affinity")
    node = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution") if isinstance(node, dict) else None
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if not isinstance(terms, list) or not terms:
        return False
    return all(isinstance(term, dict) and any(_requires_label(e) for e in term.get("matchExpressions") or ())
               for term in terms)


def _requires_label(expression: Any) -> bool:
    if not isinstance(expression, dict):
        return False
    values = expression.get("values")
    return (expression.get("key") == DRIVER_LIMITS_NODE_LABEL and expression.get("operator") == "In"
            and isinstance(values, list) and bool(values) and all(v == "true" for v in values))


# Every node the webhook knows, by name, with its labels; None while the webhook knows none (its
# cache has not listed them, or cannot: no RBAC for nodes, outside a cluster).
NodeLabels = Mapping[str, Mapping[str, str]]


class KnownNodes(Protocol):
    """The nodes' labels as the webhook's cache holds them now (webhook.cluster.nodes.NodeCache)."""

    def node_labels(self) -> NodeLabels | None: ...


NODE_NAME_FIELD = "metadata.name"  # the one field matchFields may name (the API server's validation)


def confined_to_driver_limit_nodes(spec: Mapping[str, Any], nodes: NodeLabels | None) -> bool:
    """Whether every node in ``nodes`` that the pod may land on is labelled
    ``gpufence.io/driver-memory-limits=true``, and there is at least one.

    "May land on" is what the scheduler and the kubelet's admission both check: ``spec.nodeName``
    (the scheduler is skipped, the kubelet still checks the rest), ``spec.nodeSelector`` (every
    label equal) and the required node affinity (any term; in a term, every matchExpression on the
    labels and every matchField on the name). Anything this cannot read makes the answer False."""
    if nodes is None:
        return False
    name = spec.get("nodeName")
    if name is not None and not isinstance(name, str):
        return False
    candidates: Any = ((name, nodes[name]),) if name and name in nodes else () if name else nodes.items()
    selector = spec.get("nodeSelector")
    if selector is not None and not (isinstance(selector, dict)
                                     and all(isinstance(v, str) for v in selector.values())):
        return False
    terms = _required_terms(spec)
    found = False
    for node, labels in candidates:
        if selector and any(labels.get(k) != v for k, v in selector.items()):
            continue
        if terms is not None:
            matched = [_term_matches(term, node, labels) for term in terms]
            if None in matched:
                return False  # a term this cannot read: it might admit an unlabelled node
            if not any(matched):
                continue
        if labels.get(DRIVER_LIMITS_NODE_LABEL) != "true":
            return False
        found = True
    return found


def _required_terms(spec: Mapping[str, Any]) -> list[Any] | None:
    """The required node affinity's terms, None without one; where they are not a list, one term that
    ``_term_matches`` cannot read (so that no node counts as confined)."""
    affinity = spec.get("affinity")
    node = affinity.get("nodeAffinity") if isinstance(affinity, dict) else None
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution") if isinstance(node, dict) else None
    if required is None:
        return None
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    return terms if isinstance(terms, list) else [None]


def _term_matches(term: Any, node: str, labels: Mapping[str, str]) -> bool | None:
    """Whether one node selector term admits the node; None where it says what this cannot read.
    A term with neither expressions nor fields admits no node (the API's rule)."""
    if not isinstance(term, dict):
        return None
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not isinstance(expressions, list) or not isinstance(fields, list):
        return None
    if not expressions and not fields:
        return False
    answers = [_requirement(e, labels) for e in expressions]
    answers += [_requirement(f, {NODE_NAME_FIELD: node}, fields=True) for f in fields]
    if None in answers:
        return None
    return all(answers)


def _requirement(requirement: Any, values_of: Mapping[str, str], *, fields: bool = False) -> bool | None:
    """One NodeSelectorRequirement against the node's labels (or its name, for a matchField)."""
    if not isinstance(requirement, dict):
        return None
    key, operator, values = requirement.get("key"), requirement.get("operator"), requirement.get("values") or []
    if not isinstance(key, str) or not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        return None
    if fields and (key != NODE_NAME_FIELD or operator not in ("In", "NotIn")):
        return None
    value = values_of.get(key)
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and len(values) == 1:
        try:
            bound = int(values[0])
        except ValueError:
            return None
        try:
            have = int(value) if value is not None else None
        except ValueError:
            have = None  # a label that is no integer: the scheduler's match fails too
        return have is not None and (have > bound if operator == "Gt" else have < bound)
    return None


def driver_limits_apply(spec: Mapping[str, Any], settings: InjectionSettings, mode: Mode,
                        nodes: NodeLabels | None = None) -> bool:
    """Whether the webhook writes driver limits into this pod's GPU containers (``nodes``: the
    known nodes' labels, for ``auto``)."""
    if mode is not Mode.ENFORCE or settings.driver_memory_limits == OFF:
        return False
    return (settings.driver_memory_limits == ON or pinned_to_driver_limit_nodes(spec)
            or confined_to_driver_limit_nodes(spec, nodes))


def driver_limit_mib(memory: MemoryShare | None) -> int | None:
    """The limit in whole MiB for a share whose byte part is known, None below 1 MiB or without one."""
    if memory is None or memory.bytes is None:
        return None
    mib = mebibytes_floor(memory.bytes)
    return mib if mib >= 1 else None


@dataclass(frozen=True)
class DriverLimitPlan:
    plan: SharePlan  # with percentages resolved to bytes where the GPU's memory is known
    applies: bool  # the webhook writes the variables into this pod
    resolved: frozenset[str]  # containers whose byte part was resolved from their percentage
    warning: str | None  # at most one per pod: the containers the driver limit leaves to polling


def plan_driver_limits(plan: SharePlan, spec: Mapping[str, Any], settings: InjectionSettings,
                       device_of: Callable[[str], DeviceMemory | None],
                       nodes: NodeLabels | None = None) -> DriverLimitPlan:
    """``plan`` as the driver limits need it; ``device_of(name)``: the GPU memory of that container;
    ``nodes``: the known nodes' labels."""
    if not driver_limits_apply(spec, settings, plan.mode, nodes):
        return DriverLimitPlan(plan, False, frozenset(), None)
    containers, resolved, left = [], set(), []
    for name, share in plan.containers:
        memory = share.memory
        if memory is not None and memory.percent is not None:
            device = device_of(name)
            found = memory.limit_on(device.bytes) if device is not None else None
            if found is not None and mebibytes_floor(found[0]) >= 1:
                memory = MemoryShare(bytes=found[0], percent=memory.percent)
                share = dataclasses.replace(share, memory=memory)
                resolved.add(name)
            elif found is not None:
                left.append(f"{quote(name)} ({memory.describe()}: below 1Mi)")
            elif memory.bytes is None:
                left.append(f"{quote(name)} ({memory.percent:g}%, GPU memory unknown)")
            else:
                left.append(f"{quote(name)} (its {memory.percent:g}% part, GPU memory unknown)")
        containers.append((name, share))
    warning = None
    if left:
        # One warning per pod, short enough for the API server's limit on warnings.
        hint = ("; a GPU's memory comes from node selector nvidia.com/gpu.memory or --gpu-memory"
                if any("unknown" in part for part in left) else "")
        warning = (f"gpufence: driver-memory-limits={settings.driver_memory_limits}, but polling alone enforces "
                   f"the memory share of {', '.join(left)}{hint}")
    return DriverLimitPlan(dataclasses.replace(plan, containers=tuple(containers)), True,
                           frozenset(resolved), warning)
