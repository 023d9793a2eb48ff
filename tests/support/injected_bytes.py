"""How many bytes the injection adds to a pod, over the goldens (tests/golden).

For each case the webhook mutates (outcome ``mutated``): the length of the output pod minus the
input pod, both as compact JSON (UTF-8), as the webhook's patch leaves it and before the API
server's defaults and managed fields, by part and by piece, each piece with what it is for.
Shared by bench/injected_bytes.py (the figures) and tests/unit/webhook/test_injected_bytes.py (the
gate).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gpufence.contract import ANNOTATION_STATUS, SIDECAR_NAME

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
# libyaml's parser where PyYAML has it (the same documents, about ten times faster than pure Python).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
ENV_PART = "gpu containers' env"


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_LOADER)


def compact_size(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def bytes_added(golden: Path = GOLDEN) -> dict[str, int]:
    """Case name -> bytes the injection adds, for every mutated case."""
    added: dict[str, int] = {}
    for out_file in sorted(golden.glob("*.out.yaml")):
        out = load_yaml(out_file)
        if out.get("outcome") != "mutated":
            continue
        case = out_file.name.removesuffix(".out.yaml")
        before = load_yaml(golden / f"{case}.in.yaml")["pod"]
        added[case] = compact_size(out["pod"]) - compact_size(before)
    return added


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = pod.get("spec") or {}
    return {c["name"]: c for key in ("initContainers", "containers") for c in spec.get(key) or ()}


def _pods(golden: Path, case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The golden's output pod and input pod."""
    return load_yaml(golden / f"{case}.out.yaml")["pod"], load_yaml(golden / f"{case}.in.yaml")["pod"]


def _gained(out: dict[str, Any], before: dict[str, Any], key: str) -> Iterator[dict[str, Any]]:
    """The entries of list ``key`` (``env``, ``volumeMounts``) the workload containers (not the
    sidecar) gained, by name: each entry once per container."""
    for name, container in _containers(out).items():
        old = _containers(before).get(name)
        if old is None or name == SIDECAR_NAME:
            continue
        had = {e["name"] for e in old.get(key) or ()}
        yield from (e for e in container.get(key) or () if e["name"] not in had)


def _new_volumes(out: dict[str, Any], before: dict[str, Any]) -> list[dict[str, Any]]:
    had = {v["name"] for v in before["spec"].get("volumes") or ()}
    return [v for v in out["spec"].get("volumes") or () if v["name"] not in had]


def parts(golden: Path = GOLDEN) -> dict[str, dict[str, int]]:
    """Case -> bytes per part of what the injection adds (the parts' JSON, keys and separators)."""
    found: dict[str, dict[str, int]] = {}
    for case, total in bytes_added(golden).items():
        out, before = _pods(golden, case)
        sidecar = _containers(out).get(SIDECAR_NAME)
        status = (out["metadata"].get("annotations") or {}).get(ANNOTATION_STATUS)
        row = {"sidecar": compact_size(sidecar) + 1 if sidecar else 0,
               "status": compact_size({ANNOTATION_STATUS: status}) - 1 if status else 0,
               ENV_PART: sum(compact_size(e) + 1 for e in _gained(out, before, "env")),
               "volumes": sum(compact_size(v) + 1 for v in _new_volumes(out, before))}
        row["rest"] = total - sum(row.values())
        found[case] = {"total": total, **row}
    return found


# Why each piece the injection adds is there (the rows of the per-field table); a piece with no
# entry here is printed with "?" so that a new field cannot arrive without a reason.
PURPOSE = {
    "sidecar name": "the webhook, the protect policy and the enforcer find the sidecar by it",
    "sidecar image": "the enforcer's image (the policy's sidecar-image)",
    "sidecar command": "runs the enforcer (the image has no entrypoint of its own)",
    "sidecar restartPolicy": "a native sidecar: up before the workload, restarted on exit",
    "sidecar env GPUFENCE_CONFIG": "each GPU container's share, the mode, the grace period",
    "sidecar env NVIDIA_VISIBLE_DEVICES": "every GPU of the node visible to NVML, without taking a device",
    "sidecar env NVIDIA_DRIVER_CAPABILITIES": "NVML only (utility), no CUDA libraries in the sidecar",
    "sidecar env GPUFENCE_POD_STATUS": "the warnings in the status annotation, for the enforcer's Events",
    "sidecar ports": "the metrics port, declared so a workload cannot declare it and for scrapers",
    "sidecar resources": "the sidecar's CPU and memory (request and limit, from the policy)",
    "sidecar livenessProbe": "restarts a stopped or hung enforcer (exec: a workload can take a port)",
    "sidecar lifecycle": "postStart: holds the workload back until the enforcer is up",
    "sidecar securityContext": "root with three capabilities to read and signal the workloads; no escalation",
    "sidecar volumeMounts": "the state directory (stopped processes, pending SIGKILLs, heartbeat)",
    "sidecar resources.claims": "the pod's GPU claims, so NVML sees a DRA GPU",
    "status annotation": "what gpufence did (GPU containers, mode, version, warnings), read by the enforcer",
    "sidecar env (key)": "the list that holds the sidecar's variables",
    "sidecar env GPUFENCE_HOST_PROC": "where the host's /proc is mounted (flag, legacy drivers)",
    "sidecar env GPUFENCE_METRICS_PORT": "a metrics port other than the default (policy)",
    "container env GPUFENCE_CONTAINER": "names the container's cgroup for attribution",
    "container env GPUFENCE_MEMORY_LIMIT": "the share, readable by the workload itself",
    "container env TF_FORCE_GPU_ALLOW_GROWTH": "TensorFlow does not take the whole GPU at start",
    "container env XLA_PYTHON_CLIENT_PREALLOCATE": "JAX does not take 75 % of the GPU at start",
    "container env XLA_PYTHON_CLIENT_MEM_FRACTION": "JAX's allocator capped at the share",
    "container env CUDA_MEMORY_FRACTION": "TGI's allocator capped at the share",
    "container env PYTORCH_CUDA_ALLOC_CONF": "PyTorch's allocator capped at the share",
    "container env PYTORCH_ALLOC_CONF": "PyTorch's allocator capped at the share (its newer name)",
    "container env NVIDIA_VISIBLE_DEVICES": "void in a container without a GPU: no image ENV or envFrom hands it one",
    "container env NVIDIA_GPU_MEMORY_LIMIT": "the driver's per-container limit (R615, the toolkit's hook)",
    "container env NVIDIA_GPU_MEMORY_REQUEST": "the driver's per-container limit (R615, the toolkit's hook)",
    "container env CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "MPS's memory limit per client (flag)",
    "container env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "MPS's compute limit per client (flag)",
    "container env CUDA_DEVICE_MEMORY_LIMIT": "the LD_PRELOAD limiter's memory limit (flag)",
    "container env CUDA_DEVICE_SM_LIMIT": "the LD_PRELOAD limiter's compute limit (flag)",
    "container env LD_PRELOAD": "loads the LD_PRELOAD limiter (flag)",
    "container volumeMounts gpufence-preload": "the LD_PRELOAD limiter's library, read-only (flag)",
    "volume gpufence-preload": "the LD_PRELOAD limiter's library on the node (flag)",
    "volume gpufence-host-proc": "the host's /proc for drivers that report host PIDs (flag)",
    "state volume": "the state directory: a tmpfs of 16Mi",
    "shareProcessNamespace": "the enforcer sees and signals the workloads' processes",
}


def fields(golden: Path = GOLDEN) -> dict[str, list[tuple[str, int]]]:
    """Piece -> (golden, its bytes) for each time a golden has it: each sidecar field (the env per
    variable), each variable the workload containers gain (once per container), the status
    annotation, the pod's new volumes and shareProcessNamespace; each with its key and one
    separator."""
    found: dict[str, list[tuple[str, int]]] = {}

    for case in bytes_added(golden):

        def add(name: str, size: int, case: str = case) -> None:
            found.setdefault(name, []).append((case, size))

        out, before = _pods(golden, case)
        sidecar = _containers(out).get(SIDECAR_NAME)
        for key, value in (sidecar or {}).items():
            if key == "env":
                for entry in value:
                    add(f"sidecar env {entry['name']}", compact_size(entry) + 1)
                add("sidecar env (key)", len('"env":[],'))
            elif key == "resources" and "claims" in value:
                add("sidecar resources.claims", compact_size({"claims": value["claims"]}))
                add("sidecar resources", compact_size({key: {k: v for k, v in value.items() if k != "claims"}}))
            else:
                add(f"sidecar {key}", compact_size({key: value}) - 1)
        for key in ("env", "volumeMounts"):
            for entry in _gained(out, before, key):
                add(f"container {key} {entry['name']}", compact_size(entry) + 1)
        status = (out["metadata"].get("annotations") or {}).get(ANNOTATION_STATUS)
        if status:
            add("status annotation", compact_size({ANNOTATION_STATUS: status}) - 1)
        for volume in _new_volumes(out, before):
            add("state volume" if volume["name"] == "gpufence-state" else f"volume {volume['name']}",
                compact_size(volume) + 1)
        if out["spec"].get("shareProcessNamespace") and not before["spec"].get("shareProcessNamespace"):
            add("shareProcessNamespace", len('"shareProcessNamespace":true,'))
    return found
