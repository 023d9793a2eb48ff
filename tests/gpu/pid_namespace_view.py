#!/usr/bin/env python3
"""Which PIDs NVML reports across PID namespaces, as a container sees them: real driver, real CUDA.

The enforcer trusts NVML's PIDs only after translating them into its own PID namespace
(``PidMode.LOCAL`` expects the driver to have done that). This run answers, on a real GPU, the
three cases a pod meets, each with a CUDA process holding ``--mib`` MiB (PyTorch, else CuPy):

* ``outside_seen_from_inside``: the holder runs in this namespace, NVML is read from a new PID
  namespace (``unshare --pid --fork --mount-proc``), as a container would see a neighbour's
  process. A translating driver hides it; a legacy one lists its host PID.
* ``inside_seen_from_outside``: the holder runs in a new PID namespace, NVML is read here (the
  node's view). Expect the holder's PID in this namespace, not its PID inside.
* ``inside_seen_from_inside``: holder and reader share a new PID namespace, as the enforcer and
  a workload of one pod do with ``shareProcessNamespace``. Expect the holder's PID there.

Prints ``pid_namespaces: {...}`` (one JSON object). Exit status 0, or ``skipped:`` with exit 0
when there is no GPU, no torch/cupy or no ``unshare``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]

HOLDER = HERE / "cuda_holder.py"


def backend() -> str | None:
    for name in ("torch", "cupy"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def facts(prefix: list[str]) -> dict[str, Any]:
    """nvml_facts.py's processes per device, run under ``prefix`` (e.g. a new PID namespace)."""
    run = subprocess.run([*prefix, sys.executable, str(HERE / "nvml_facts.py")], capture_output=True, text=True,
                         timeout=120, check=False)
    line = next((x for x in run.stdout.splitlines() if x.startswith("facts: ")), None)
    if line is None:
        return {"error": (run.stdout + run.stderr)[-1500:]}
    parsed = json.loads(line.removeprefix("facts: "))
    return {"processes": [d.get("processes") for d in parsed["devices"]]}


def start_holder(prefix: list[str], kind: str, mib: int) -> tuple[subprocess.Popen[str], int]:
    holder = subprocess.Popen([*prefix, sys.executable, str(HOLDER), kind, str(mib)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    line = holder.stdout.readline().split()
    if not line or line[0] != "READY":
        holder.kill()
        raise RuntimeError(f"the CUDA holder did not get ready (exit {holder.wait()})")
    return holder, int(line[1])


def stop(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    holder.wait(timeout=30)


def outer_pid(unshare_pid: int) -> int | None:
    """The holder's PID in this namespace: the child ``unshare --fork`` started."""
    children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children")
    try:
        pids = children.read_text().split()
    except OSError:
        return None
    return int(pids[0]) if pids else None


def inside(kind: str, mib: int) -> int:
    """Run inside a new PID namespace: a holder and a reader side by side."""
    holder, pid = start_holder([], kind, mib)
    try:
        print("inside: " + json.dumps({"holder_pid": pid, "seen": facts([])}), flush=True)
    finally:
        stop(holder)
    return 0


def main(argv: list[str]) -> int:
    mib = 1024
    kind = backend()
    if kind is None:
        print("skipped: neither torch nor cupy is importable")
        return 0
    if argv[:1] == ["--inside"]:
        return inside(kind, mib)
    if shutil.which("unshare") is None:
        print("skipped: no unshare")
        return 0
    result: dict[str, Any] = {"backend": kind, "own_pid": os.getpid()}

    holder, pid = start_holder([], kind, mib)
    try:
        result["outside_seen_from_inside"] = {"holder_pid": pid, "seen": facts(UNSHARE)}
    finally:
        stop(holder)

    holder, pid = start_holder(UNSHARE, kind, mib)
    try:
        result["inside_seen_from_outside"] = {"holder_pid_inside": pid, "holder_pid_here": outer_pid(holder.pid),
                                              "seen": facts([])}
    finally:
        stop(holder)

    run = subprocess.run([*UNSHARE, sys.executable, __file__, "--inside"], capture_output=True, text=True,
                         timeout=180, check=False)
    line = next((x for x in run.stdout.splitlines() if x.startswith("inside: ")), None)
    result["inside_seen_from_inside"] = (json.loads(line.removeprefix("inside: ")) if line
                                         else {"error": (run.stdout + run.stderr)[-1500:]})
    print("pid_namespaces: " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
