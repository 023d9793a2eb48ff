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
  every term of its required node affinity has a matchExpression ``In ["true"]`` on it.

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
from typing import Any

from gpufence.contract import DRIVER_LIMITS_NODE_LABEL, MemoryShare, Mode
from gpufence.webhook.frameworks import DeviceMemory
from gpufence.webhook.quantity import mebibytes_floor
from gpufence.webhook.settings import InjectionSettings
from gpufence.webhook.shares import SharePlan, quote

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


def driver_limits_apply(spec: Mapping[str, Any], settings: InjectionSettings, mode: Mode) -> bool:
    """Whether the webhook writes driver limits into this pod's GPU containers."""
    if mode is not Mode.ENFORCE or settings.driver_memory_limits == OFF:
        return False
    return settings.driver_memory_limits == ON or pinned_to_driver_limit_nodes(spec)


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
                       device_of: Callable[[str], DeviceMemory | None]) -> DriverLimitPlan:
    """``plan`` as the driver limits need it; ``device_of(name)``: the GPU memory of that container."""
    if not driver_limits_apply(spec, settings, plan.mode):
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
