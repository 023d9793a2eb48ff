#!/usr/bin/env python3
"""Whether CUDA MPS holds the limits the webhook writes, and how NVML lists MPS clients: real driver.

With ``--mps-limits`` the webhook gives a GPU container ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its
memory share) and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (its compute share); they hold only where an
MPS control daemon serves the container. This run starts one (``nvidia-cuda-mps-control -d``, pipe
and log directories of its own), starts a PyTorch client with exactly the variables
``webhook.core.container_env.share_env`` writes for a ``--share-mib`` share and a 30 % compute
share, lets it allocate 256 MiB blocks until its own allocation fails (or it holds the whole GPU),
and while it holds them reads NVML's compute and MPS process lists: the enforcer finds MPS clients
only in the second (``nvmlDeviceGetMPSComputeRunningProcesses``).

Prints ``mps: {...}``. ``skipped:`` (exit 0) without NVML, PyTorch or the MPS control binary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# argv: MiB per block. Prints "HELD <MiB> OOM|NOOM", then holds until stdin closes.
GREEDY = r"""
import sys, torch
block = int(sys.argv[1]) << 20
total = torch.cuda.get_device_properties(0).total_memory
held, outcome = [], "NOOM"
try:
    while (len(held) + 1) * block <= total:
        held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
except torch.cuda.OutOfMemoryError:
    outcome = "OOM"
print(f"HELD {len(held) * block >> 20} {outcome}", flush=True)
sys.stdin.read()
"""


def mps_variables(share_mib: int, compute_percent: float) -> dict[str, str]:
    """The MPS variables the webhook writes for this share (its own code, not a copy)."""
    from gpufence.contract import ContainerShare, MemoryShare
    from gpufence.webhook.core.container_env import share_env
    from gpufence.webhook.core.settings import InjectionSettings

    share = ContainerShare(memory=MemoryShare(bytes=share_mib << 20), compute_percent=compute_percent)
    variables, _ = share_env("greedy", share, InjectionSettings(mps_limits=True), None)
    env = dict(variables)
    return {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}


def nvml_lists() -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        out: dict[str, Any] = {}
        for name, call in (("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
                           ("mps", pynvml.nvmlDeviceGetMPSComputeRunningProcesses)):
            try:
                out[name] = [{"pid": p.pid, "usedGpuMemory": p.usedGpuMemory} for p in call(handle)]
            except pynvml.NVMLError as exc:
                out[name] = f"error: {exc}"
        return out
    finally:
        pynvml.nvmlShutdown()


def main(argv: list[str]) -> int:
    share_mib = int(argv[0]) if argv else 4096
    control = shutil.which("nvidia-cuda-mps-control") or next(
        (p for p in ("/usr/local/nvidia/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control")
         if os.access(p, os.X_OK)), None)
    if control is None:
        print("skipped: no nvidia-cuda-mps-control")
        return 0
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("pynvml") is None:
        print("skipped: needs PyTorch and pynvml")
        return 0
    variables = mps_variables(share_mib, 30)
    result: dict[str, Any] = {"share_mib": share_mib, "variables": variables, "control": control}
    with tempfile.TemporaryDirectory(prefix="gpufence-mps-") as tmp:
        mps_env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": f"{tmp}/pipe", "CUDA_MPS_LOG_DIRECTORY": f"{tmp}/log"}
        os.makedirs(f"{tmp}/pipe")
        os.makedirs(f"{tmp}/log")
        started = subprocess.run([control, "-d"], env=mps_env, capture_output=True, text=True, timeout=30,
                                 check=False)
        result["daemon_start"] = {"rc": started.returncode, "output": (started.stdout + started.stderr)[-500:]}
        greedy = None
        try:
            greedy = subprocess.Popen([sys.executable, "-c", GREEDY, "256"], env={**mps_env, **variables},
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
            assert greedy.stdout is not None and greedy.stderr is not None
            line = greedy.stdout.readline().split()
            if line[:1] == ["HELD"]:
                result["greedy_held_mib"], result["greedy_outcome"] = int(line[1]), line[2]
                result["greedy_pid"] = greedy.pid
                result["nvml_lists_while_it_holds"] = nvml_lists()
            else:
                result["greedy_error"] = greedy.stderr.read()[-1500:]
        finally:
            if greedy is not None:
                if greedy.stdin is not None:
                    greedy.stdin.close()
                try:
                    greedy.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    greedy.kill()
            subprocess.run([control], input="quit\n", env=mps_env, capture_output=True, text=True, timeout=30,
                           check=False)
            logs = pathlib.Path(tmp, "log", "control.log")
            result["control_log_tail"] = logs.read_text()[-800:] if logs.exists() else None
    held = result.get("greedy_held_mib")
    result["result"] = "pass" if result.get("greedy_outcome") == "OOM" and held is not None and held <= share_mib \
        else "fail"
    print("mps: " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
