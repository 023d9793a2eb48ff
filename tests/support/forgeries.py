"""Forgeries of the webhook's output: what a tenant (or a mutating step after gpufence's) could make
of an injected GPU pod to weaken its enforcement, one change each.

Shared by tests/unit/webhook/test_forgeries.py (the webhook rebuilds or denies each; the validating
webhook refuses each that reaches it) and the end-to-end tests (tests/e2e/test_forged_sidecar.py,
tests/e2e/test_driver_limit_forgeries.py), where the real kube-apiserver calls the webhook, or
refuses the pod because the webhook is down.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from typing import Any

import jsonpatch

from gpufence.contract import (
    DRIVER_LIMITS_NODE_LABEL,
    ENV_DRIVER_MEMORY_LIMIT,
    ENV_DRIVER_MEMORY_REQUEST,
    INJECTION_ENABLED,
    INJECTION_LABEL,
    SIDECAR_NAME,
)
from gpufence.webhook import client
from gpufence.webhook.core import admission
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo

Forge = Callable[[dict[str, Any]], None]
SHARES = {"gpufence.io/memory": "4Gi", "gpufence.io/compute": "50"}
CEILINGS = {"gpufence.io/max-memory": "20Gi", "gpufence.io/max-compute": "50"}


def gpu_pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train-0", "namespace": "team-a", "annotations": annotations or {}},
        "spec": {"containers": [{"name": "trainer", "image": "cuda:12",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }


def injected(pod: dict[str, Any], ns_annotations: dict[str, str],
             settings: InjectionSettings | None = None) -> dict[str, Any]:
    """The pod as the webhook mutates it in a namespace with ``ns_annotations``."""

    class Lookup:
        def get(self, name: str) -> NamespaceInfo:
            return NamespaceInfo(name=name, labels={INJECTION_LABEL: INJECTION_ENABLED}, annotations=ns_annotations)

    review = admission.review(client.pod_admission_review(copy.deepcopy(pod), uid="u", namespace="team-a"),
                              settings or InjectionSettings(), Lookup())
    assert review.outcome == "mutated", review.review["response"]
    patch = json.loads(base64.b64decode(review.review["response"]["patch"]))
    return jsonpatch.apply_patch(pod, patch)


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME]
    return sidecar


def same_but_config(sidecar: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two sidecars are the same, their GPUFENCE_CONFIG aside (a forgery that adds a GPU
    container legitimately changes the config; the containers' entries are compared apart)."""
    def without(c: dict[str, Any]) -> dict[str, Any]:
        return {**c, "env": [e for e in c.get("env", []) if e["name"] != "GPUFENCE_CONFIG"]}
    return without(sidecar) == without(other)


def config_of(pod: dict[str, Any]) -> dict[str, Any]:
    (entry,) = [e for e in sidecar_of(pod)["env"] if e["name"] == "GPUFENCE_CONFIG"]
    return json.loads(entry["value"])


def with_config(pod: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrites the sidecar's config as the webhook would write it (compact, keys sorted)."""
    doc = config_of(pod)
    change(doc)
    for entry in sidecar_of(pod)["env"]:
        if entry["name"] == "GPUFENCE_CONFIG":
            entry["value"] = json.dumps(doc, separators=(",", ":"), sort_keys=True)


def set_env(pod: dict[str, Any], name: str, value: str) -> None:
    env = sidecar_of(pod)["env"]
    env[:] = [e for e in env if e["name"] != name] + [{"name": name, "value": value}]





GIB = 1 << 30


def _twice(pod: dict[str, Any]) -> None:
    """A small share listed first and none after: JSON keeps the last of two equal keys (no limit),
    a regular expression would find the first."""
    text = json.dumps(config_of(pod), separators=(",", ":"), sort_keys=True)
    entry = text[text.index('"trainer":{'):].split("}", 1)[0] + "}"
    set_env(pod, "GPUFENCE_CONFIG", text.replace(entry, '"trainer":{"memoryBytes":1073741824},"trainer":{}'))


def _mount_over_code(pod: dict[str, Any]) -> None:
    """A ConfigMap of the author's own over the enforcer's package (the volume must exist: the API
    server validates the pod before the guard sees it)."""
    pod["spec"].setdefault("volumes", []).append({"name": "mine", "configMap": {"name": "my-enforcer"}})
    sidecar_of(pod)["volumeMounts"].append(
        {"name": "mine", "mountPath": "/opt/gpufence/lib/python3.11/site-packages/enforcer"})


def replace_env(pod: dict[str, Any], name: str, value: str) -> None:
    """The sidecar's variable ``name`` with another value, in its place."""
    for entry in sidecar_of(pod)["env"]:
        if entry["name"] == name:
            entry["value"] = value


def _other_user(pod: dict[str, Any]) -> None:
    """Not root: the enforcer can no longer read or signal the workloads' processes."""
    context = sidecar_of(pod)["securityContext"]
    context.pop("runAsNonRoot", None)
    context.update(runAsUser=1000, capabilities={"drop": ["ALL"]})


def _to_containers(pod: dict[str, Any]) -> None:
    """A regular container (it starts with the workload, not before it) with a limit it cannot live in."""
    sidecar = sidecar_of(pod)
    pod["spec"]["initContainers"].remove(sidecar)
    sidecar.pop("restartPolicy")
    sidecar["resources"] = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "16Mi"}}
    pod["spec"]["containers"].append(sidecar)


def _no_probes(pod: dict[str, Any]) -> None:
    """Nothing restarts an enforcer that is stopped or hung."""
    sidecar_of(pod).pop("livenessProbe")


def _no_post_start(pod: dict[str, Any]) -> None:
    """The workload starts at once, before the enforcer is up."""
    sidecar_of(pod).pop("lifecycle")


def _post_start_sleeps(pod: dict[str, Any]) -> None:
    """A hook that returns whether or not the enforcer came up."""
    sidecar_of(pod)["lifecycle"]["postStart"] = {"exec": {"command": ["python3", "-c", "pass"]}}


def _pre_stop(pod: dict[str, Any]) -> None:
    """A preStop hook of the author's, run inside the enforcer's container."""
    sidecar_of(pod)["lifecycle"]["preStop"] = {"exec": {"command": ["kill", "-STOP", "1"]}}


TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
# The volume the API server's ServiceAccount plugin adds (its name ends in a random suffix).
TOKEN_VOLUME = {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}


def _mount_in_sidecar(pod: dict[str, Any], volume: dict[str, Any], path: str) -> None:
    pod["spec"].setdefault("volumes", []).append(volume)
    sidecar = sidecar_of(pod)
    sidecar["volumeMounts"] = [m for m in sidecar["volumeMounts"] if m["mountPath"] != TOKEN_PATH]
    sidecar["volumeMounts"].append({"name": volume["name"], "mountPath": path, "readOnly": True})


def _authors_file_as_token(pod: dict[str, Any]) -> None:
    """The pod opts out of the token and puts a JWT of its own making where the enforcer reads
    the name of its pod (its logs, metrics and Events would be about another pod)."""
    pod["spec"]["automountServiceAccountToken"] = False
    _mount_in_sidecar(pod, {"name": "kube-api-access-fake", "configMap": {"name": "forged-token"}}, TOKEN_PATH)


def _token_for_another_audience(pod: dict[str, Any]) -> None:
    volume = copy.deepcopy(TOKEN_VOLUME)
    volume["name"] = "vault-token"
    volume["projected"]["sources"][0]["serviceAccountToken"]["audience"] = "vault"
    _mount_in_sidecar(pod, volume, TOKEN_PATH)


def _secrets_above_the_token(pod: dict[str, Any]) -> None:
    """Without the pod's own token mounted below it, a volume at /var/run/secrets shows its files."""
    pod["spec"]["automountServiceAccountToken"] = False
    _mount_in_sidecar(pod, {"name": "secrets", "secret": {"secretName": "forged"}}, "/var/run/secrets")


def _shared_state(pod: dict[str, Any]) -> None:
    """The sidecar's state directory on a volume of the author's, which the workload mounts too."""
    pod["spec"]["volumes"].append({"name": "shared", "emptyDir": {}})
    for mount in sidecar_of(pod)["volumeMounts"]:
        if mount["name"] == "gpufence-state":
            mount["name"] = "shared"
    pod["spec"]["containers"][0].setdefault("volumeMounts", []).append({"name": "shared", "mountPath": "/state"})


def _dev_hidden(pod: dict[str, Any]) -> None:
    """An emptyDir over /dev: NVML finds no GPU device nodes."""
    pod["spec"]["volumes"].append({"name": "nodev", "emptyDir": {}})
    sidecar_of(pod)["volumeMounts"].append({"name": "nodev", "mountPath": "/dev"})


def _workload_mounts_state(pod: dict[str, Any]) -> None:
    """The workload mounts the enforcer's own state volume (the webhook's name for it)."""
    pod["spec"]["containers"][0].setdefault("volumeMounts", []).append(
        {"name": "gpufence-state", "mountPath": "/var/run/gpufence"})


def _helper_without_void(pod: dict[str, Any]) -> None:
    """A container with no device whose CUDA image (or envFrom) sets NVIDIA_VISIBLE_DEVICES=all,
    without the void the webhook gives it."""
    pod["spec"]["containers"].append({"name": "helper", "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
                                      "envFrom": [{"configMapRef": {"name": "gpus", "optional": True}}]})


def _gpu_init_first(pod: dict[str, Any]) -> None:
    """A GPU init container placed before the sidecar runs before enforcement starts."""
    pod["spec"]["initContainers"].insert(0, {"name": "warmup", "image": "cuda:12", "resources": {
        "limits": {"nvidia.com/gpu": "1"}}})
    with_config(pod, lambda d: d["containers"].update(warmup=dict(d["containers"]["trainer"])))


def _workload_declares_the_port(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": 9401, "protocol": "TCP"}]


# name -> a forgery of the webhook's output for gpu_pod(SHARES) in a namespace with CEILINGS
FORGERIES: dict[str, Forge] = {
    "audit mode": lambda p: with_config(p, lambda d: d.update(mode="audit")),
    "share above the ceiling": lambda p: with_config(
        p, lambda d: d["containers"]["trainer"].update(memoryBytes=30 * GIB)),
    "no memory share": lambda p: with_config(p, lambda d: d["containers"]["trainer"].pop("memoryBytes")),
    "compute above the ceiling": lambda p: with_config(
        p, lambda d: d["containers"]["trainer"].update(computePercent=90)),
    "container left out": lambda p: with_config(p, lambda d: d.update(containers={})),
    "more GPUs than requested": lambda p: with_config(p, lambda d: d["containers"]["trainer"].update(gpus=8)),
    "GPU count left out": lambda p: with_config(p, lambda d: d["containers"]["trainer"].pop("gpus")),
    "poll interval stretched": lambda p: with_config(p, lambda d: d.update(pollIntervalSeconds=60)),
    "container twice": _twice,
    "not the webhook's JSON": lambda p: set_env(p, "GPUFENCE_CONFIG", json.dumps(config_of(p), indent=1)),
    "config from a ConfigMap": lambda p: sidecar_of(p)["env"].__setitem__(0, {"name": "GPUFENCE_CONFIG", "valueFrom": {
            "configMapKeyRef": {"name": "weak", "key": "config"}}}),
    "a second config": lambda p: sidecar_of(p)["env"].append({"name": "GPUFENCE_CONFIG", "value": '{"mode":"audit"}'}),
    "args": lambda p: sidecar_of(p).update(args=["--config", "/tmp/weak.json"]),
    "envFrom": lambda p: sidecar_of(p).update(envFrom=[{"configMapRef": {"name": "x"}}]),
    "LD_PRELOAD": lambda p: set_env(p, "LD_PRELOAD", "/tmp/fake-nvml.so"),
    "PYTHONPATH": lambda p: set_env(p, "PYTHONPATH", "/tmp/mine"),
    "device prefix": lambda p: set_env(p, "GPUFENCE_NVIDIA_DEVICE_PREFIX", "/dev/none"),
    "no GPUs for NVML": lambda p: replace_env(p, "NVIDIA_VISIBLE_DEVICES", "void"),
    "mount over the code": _mount_over_code,
    "another uid, capabilities dropped": _other_user,
    "moved to containers with a 16Mi limit": _to_containers,
    "probes removed": _no_probes,
    "postStart hook removed": _no_post_start,
    "postStart hook that waits for nothing": _post_start_sleeps,
    "preStop hook added": _pre_stop,
    "startup probe of its own": lambda p: sidecar_of(p).update(startupProbe={"exec": {"command": ["true"]}}),
    "liveness probe every 5 minutes": lambda p: sidecar_of(p)["livenessProbe"].update(periodSeconds=300),
    "liveness probe failing 1000 times": lambda p: sidecar_of(p)["livenessProbe"].update(failureThreshold=1000),
    "state directory variable of its own": lambda p: set_env(p, "GPUFENCE_STATE_DIR", "/tmp/state"),
    "a GPU init container before it": _gpu_init_first,
    "driver capabilities compute": lambda p: replace_env(p, "NVIDIA_DRIVER_CAPABILITIES", "compute"),
    "fake host-proc directory": lambda p: set_env(p, "GPUFENCE_HOST_PROC", "/var/run/gpufence/proc"),
    "state directory shared with a workload": _shared_state,
    "an emptyDir over /dev": _dev_hidden,
    "workload mounts the state volume": _workload_mounts_state,
    "workload declares the metrics port": _workload_declares_the_port,
    "a file of the author's as the token": _authors_file_as_token,
    "a token for another audience": _token_for_another_audience,
    "a volume above the token": _secrets_above_the_token,
    "a container without a device and without the void": _helper_without_void,
}


def pinned_gpu_pod() -> dict[str, Any]:
    """A GPU pod that driver-memory-limits=auto (as shipped) gives the driver's limit."""
    pod = gpu_pod(dict(SHARES))
    pod["spec"]["nodeSelector"] = {DRIVER_LIMITS_NODE_LABEL: "true"}
    return pod


def workload_env(pod: dict[str, Any]) -> list[dict[str, Any]]:
    (trainer,) = [c for c in pod["spec"]["containers"] if c["name"] == "trainer"]
    return trainer.setdefault("env", [])


def _set(name: str, value: str) -> Callable[[dict[str, Any]], None]:
    def change(pod: dict[str, Any]) -> None:
        for entry in workload_env(pod):
            if entry["name"] == name:
                entry["value"] = value
    return change


def _drop(name: str) -> Callable[[dict[str, Any]], None]:
    def change(pod: dict[str, Any]) -> None:
        workload_env(pod)[:] = [e for e in workload_env(pod) if e["name"] != name]
    return change


def _add(entry: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda pod: workload_env(pod).append(copy.deepcopy(entry))


def _from_configmap(pod: dict[str, Any]) -> None:
    for i, entry in enumerate(workload_env(pod)):
        if entry["name"] == ENV_DRIVER_MEMORY_REQUEST:
            workload_env(pod)[i] = {"name": ENV_DRIVER_MEMORY_REQUEST,
                                    "valueFrom": {"configMapKeyRef": {"name": "limits", "key": "request"}}}


def _unpinned(pod: dict[str, Any]) -> None:
    """The variables kept, the pin dropped: the pod could land where the hook fails its start."""
    pod["spec"].pop("nodeSelector")


# name -> a forgery of the webhook's output for ``pinned_gpu_pod``
LIMIT_FORGERIES: dict[str, Forge] = {
    "driver limit left out": _drop(ENV_DRIVER_MEMORY_LIMIT),
    "driver limits left out": lambda p: (_drop(ENV_DRIVER_MEMORY_LIMIT)(p), _drop(ENV_DRIVER_MEMORY_REQUEST)(p)),
    "driver limit raised": _set(ENV_DRIVER_MEMORY_LIMIT, "81920"),
    "soft limit from a ConfigMap": _from_configmap,
    "a second, higher limit": _add({"name": ENV_DRIVER_MEMORY_LIMIT, "value": "81920"}),
    "the same limit twice": _add({"name": ENV_DRIVER_MEMORY_LIMIT, "value": "4096"}),
    "an MPS limit the policy does not set": _add({"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=80000M"}),
    "limits on a pod not pinned to capable nodes": _unpinned,
}
