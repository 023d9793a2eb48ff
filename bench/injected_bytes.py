"""Bytes the injection adds per pod, over the goldens (tests/golden): median, min, max, per golden.

    python -m bench.injected_bytes [--against REF] [--probe-cost [--python PATH]] [--no-write]

For every golden the webhook mutates: the output pod minus the input pod, both compact JSON, as
the webhook's patch leaves it (before the API server's defaults and managed fields). The parts:
the sidecar, the status annotation, what the GPU containers gain, the pod's volumes and the rest
(shareProcessNamespace). ``--against REF`` measures the goldens of a git revision as well, for a
before/after. ``--probe-cost`` times the probe command as the kubelet runs it against a console
script doing the same (pip's wrapper), with ``--python``'s interpreter (one with gpufence installed
from a wheel, as in the image: an editable install's start-up hides the difference).

Target: median <= 1200 bytes, owned here: the report says met or MISSED (what remains is the
sidecar's own spec and the GPU containers' variables, each an enforcement point,
docs/PERFORMANCE.md); tests/unit/webhook/test_injected_bytes.py only keeps the median from growing.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, command_line, table, write_section
from gpufence.contract import ANNOTATION_STATUS, PROBE_COMMAND, SIDECAR_NAME
from tests.support.injected_bytes import GOLDEN, bytes_added, compact_size, load_yaml
from tests.support.stats import median

TARGET_MEDIAN_BYTES = 1200
ENV_PART = "gpu containers' env"


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


def render_fields(found: dict[str, list[tuple[str, int]]], goldens: int) -> str:
    def cases(item: tuple[str, list[tuple[str, int]]]) -> int:
        return len({case for case, _ in item[1]})

    rows = sorted(found.items(), key=lambda item: (-cases(item), -median([n for _, n in item[1]])))
    return table(["piece", "median bytes", "goldens with it", "what it is for"],
                 [[name, f"{median([n for _, n in sizes]):.0f}", f"{cases((name, sizes))} of {goldens}",
                   PURPOSE.get(name, "?")] for name, sizes in rows])


def _golden_at(ref: str, into: Path) -> Path:
    """tests/golden as of git revision ``ref``, extracted under ``into``."""
    archive = subprocess.run(["git", "archive", ref, "tests/golden"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "tests" / "golden"


def summary(rows: dict[str, dict[str, int]]) -> dict[str, float]:
    keys = next(iter(rows.values())).keys()
    return {key: median([r[key] for r in rows.values()]) for key in keys}


def probe_cost(python: str, runs: int = 60) -> list[tuple[str, float]]:
    """CPU ms per run of the probe command, against pip's console-script wrapper calling the same
    function (no heartbeat to find: the check fails at once, so this is the start-up)."""
    wrapper = ("import re\nimport sys\nfrom gpufence.enforcer.probe import main\nif __name__ == '__main__':\n"
               "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "gpufence-probe"
        script.write_text(f"#!{python}\n{wrapper}")
        script.chmod(0o755)
        commands = [(" ".join(PROBE_COMMAND[:2]) + " ...", [python, *PROBE_COMMAND[1:]]),
                    ("console script (pip's wrapper)", [str(script)])]
        env = {"PATH": "/usr/bin:/bin", "GPUFENCE_STATE_DIR": str(Path(tmp) / "none")}
        totals = {name: 0.0 for name, _ in commands}
        for _ in range(3):  # interleaved rounds: the machine is shared
            for name, argv in commands:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                for _ in range(runs):
                    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, cwd="/", check=False)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                totals[name] += after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return [(name, totals[name] / (3 * runs) * 1000) for name, _ in commands]


def render(rows: dict[str, dict[str, int]], before: dict[str, dict[str, int]] | None, ref: str | None,
           probe: list[tuple[str, float]] | None) -> str:
    now = summary(rows)
    totals = [r["total"] for r in rows.values()]
    verdict = "met" if now["total"] <= TARGET_MEDIAN_BYTES else "MISSED"
    headers = ["", "goldens", "median total", "min", "max", "sidecar", "status", "GPU containers' env", "volumes",
               "rest"]

    def line(name: str, data: dict[str, dict[str, int]]) -> list[Any]:
        m = summary(data)
        values = [r["total"] for r in data.values()]
        return [name, len(data), f"{m['total']:.0f}", min(values), max(values), f"{m['sidecar']:.0f}",
                f"{m['status']:.0f}", f"{m[ENV_PART]:.0f}",
                f"{m['volumes']:.0f}", f"{m['rest']:.0f}"]

    lines = ([line(f"before ({ref})", before)] if before else []) + [line("now", rows)]
    text = table(headers, lines)
    text += (f"\n\nBytes added per mutated golden (compact JSON of the output pod minus the input pod, before "
             f"the API server's defaults and managed fields); the parts are medians of their own, so they need "
             f"not add up to the median total. Target: median <= {TARGET_MEDIAN_BYTES} bytes: **{verdict}** "
             f"({now['total']:.0f}; min {min(totals)}, max {max(totals)}).\n")
    if probe:
        text += "\n" + table(["probe command", "CPU ms per run"], [[n, f"{ms:.1f}"] for n, ms in probe]) + "\n"
        text += ("\nThe probe's start-up, measured as host processes (not in a pod) on the machine named above, "
                 "with PYTHON an interpreter that has gpufence installed from a wheel as in the image "
                 "(`python3 -m venv v && v/bin/pip install .`); the check finds no heartbeat and fails at once.\n")
    text += ("\nWhat each piece costs, over the mutated goldens (median of its sizes: a variable a workload "
             "container gains counts once per container; a piece in few goldens is there only for their "
             "settings or flags):\n\n"
             + render_fields(fields(), len(rows)) + "\n")
    text += "\n<details><summary>per golden</summary>\n\n" + table(
        ["golden", "bytes added", "sidecar", "status"],
        [[case, r["total"], r["sidecar"], r["status"]] for case, r in sorted(rows.items())]) + "\n\n</details>\n"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REF", help="also measure the goldens of this git revision")
    parser.add_argument("--probe-cost", action="store_true", help="time the probe command against a console script")
    parser.add_argument("--python", default=sys.executable, help="interpreter for --probe-cost")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/PERFORMANCE.md")
    args = parser.parse_args(argv)
    rows = parts()
    before = None
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            before = parts(_golden_at(args.against, Path(tmp)))
    text = render(rows, before, args.against, probe_cost(args.python) if args.probe_cost else None)
    print(text)
    if not args.no_write:
        # The interpreter's path is this machine's: the docs name it PYTHON.
        command = command_line().replace(args.python, "PYTHON") if args.probe_cost else None
        write_section("injected_bytes", "Bytes the injection adds per pod (goldens)", text, command=command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
