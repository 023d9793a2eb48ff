"""Ephemeral containers (``kubectl debug``) added to pods of opted-in namespaces (pure).

An ephemeral container cannot request resources, so the device plugin never gives it a GPU; the
NVIDIA container toolkit's variable is its only way to one (CUDA images set
``NVIDIA_VISIBLE_DEVICES=all`` in their ENV, and the toolkit honours it by default). The API server
adds one with an UPDATE of the ``pods/ephemeralcontainers`` subresource whose object is the whole
pod; each ephemeral container that ``oldObject`` does not have gets what every container without a
GPU gets at creation (``container_env.with_void``), whatever the setting
``void_non_gpu_containers`` says: a debug container never needs the toolkit's GPUs, and an admin who
wants them sets the variable explicitly (kept as it is). Existing ephemeral containers are never
touched: the API server refuses any change to them.

What to refuse (an ephemeral container with NVIDIA_* of its own, one that targets the sidecar or
mounts its volumes, one without the void because this webhook was unavailable) is the
gpufence-protect policy's (k8s/base/protect-policy.yaml): it holds with the webhook down, and it
knows the admin groups. This module only adds.
"""

from __future__ import annotations

from typing import Any

from gpufence.webhook.core.container_env import with_void
from gpufence.webhook.core.patch import diff, dumps
from gpufence.webhook.core.podshape import MutationError

SUBRESOURCE = "ephemeralcontainers"
_KEY = "ephemeralContainers"


def _ephemeral_containers(pod: Any, where: str) -> list[dict[str, Any]]:
    """``spec.ephemeralContainers`` of ``pod``, shape-checked where the injection reads it."""
    if not isinstance(pod, dict):
        raise MutationError(f"the pod is malformed: {where} must be a Pod object")
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise MutationError(f"the pod is malformed: {where}.spec must be an object")
    containers = spec.get(_KEY)
    if containers is None:
        return []
    if not isinstance(containers, list):
        raise MutationError(f"the pod is malformed: {where}.spec.{_KEY} must be a list")
    for i, container in enumerate(containers):
        at = f"{where}.spec.{_KEY}[{i}]"
        if not isinstance(container, dict) or not isinstance(container.get("name"), str):
            raise MutationError(f"the pod is malformed: {at} must be an object with a string name")
        env = container.get("env")
        if env is not None and not (isinstance(env, list) and all(isinstance(e, dict) for e in env)):
            raise MutationError(f"the pod is malformed: {at}.env must be a list of objects")
    return containers


def new_ephemeral_names(pod: Any, old_pod: Any) -> list[str]:
    """The names of the ephemeral containers ``pod`` has and ``old_pod`` has not, in pod order."""
    old = {c["name"] for c in _ephemeral_containers(old_pod, "oldObject")} if old_pod is not None else set()
    return [c["name"] for c in _ephemeral_containers(pod, "object") if c["name"] not in old]


def desired_ephemeral_pod(pod: dict[str, Any], old_pod: Any) -> dict[str, Any]:
    """``pod`` with each new ephemeral container voided (copy-on-write; ``pod`` itself when none
    needs it). Raises ``MutationError`` for a malformed pod."""
    new = set(new_ephemeral_names(pod, old_pod))
    if not new:
        return pod
    # An ephemeral container has no resources (the API server refuses them), so it never gets a device.
    containers = [with_void(c) if c["name"] in new else c for c in pod["spec"][_KEY]]
    return {**pod, "spec": {**pod["spec"], _KEY: containers}}


def ephemeral_patch(pod: dict[str, Any], old_pod: Any) -> bytes | None:
    """The JSON Patch (None when none is needed) for an UPDATE of ``pods/ephemeralcontainers``."""
    ops = diff(pod, desired_ephemeral_pod(pod, old_pod))
    return dumps(ops) if ops else None
