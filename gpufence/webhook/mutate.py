"""The injection's one path (pure): the desired pod from the pod and the plan, then the JSON Patch
between them, encoded. Nothing else computes a patch.

Module map of the core: ``podshape`` (what the pod is), ``shares`` (the plan), ``sidecar`` (what
the plan and settings add), ``container_env`` (each GPU container's part), ``desired`` (the pod
as gpufence wants it), ``patch`` (the RFC 6902 difference), ``codec`` (JSON bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpufence.webhook.codec import dumps
from gpufence.webhook.desired import desired_plain_pod, desired_pod
from gpufence.webhook.patch import diff
from gpufence.webhook.settings import InjectionSettings
from gpufence.webhook.shares import SharePlan


def injection_patch(
    pod: dict[str, Any], plan: SharePlan, settings: InjectionSettings, pod_security: str | None = None,
    namespace_annotations: Mapping[str, object] | None = None,
) -> tuple[bytes | None, list[str]]:
    """The JSON Patch (compact UTF-8 JSON; None when the pod needs none) and the warnings.

    Raises ``MutationError`` (a denial). The pod must have passed ``podshape.check_shape``.
    """
    new_pod, warnings = desired_pod(pod, plan, settings, pod_security, namespace_annotations)
    ops = diff(pod, new_pod)
    return (dumps(ops) if ops else None), warnings


def plain_pod_patch(pod: dict[str, Any], settings: InjectionSettings) -> bytes | None:
    """The same for a pod that requests no GPU: only ``NVIDIA_VISIBLE_DEVICES=void`` where missing."""
    ops = diff(pod, desired_plain_pod(pod, settings))
    return dumps(ops) if ops else None
