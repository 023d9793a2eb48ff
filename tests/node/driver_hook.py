"""NVIDIA's real ``apply-cuda-memory-limits`` hook on the node: runtime handlers and their RuntimeClasses.

The NVIDIA Container Toolkit (v1.20.1+) writes, into the CDI spec of every full GPU, a
``createRuntime`` hook ``nvidia-cdi-hook apply-cuda-memory-limits --driver-root R --gpu-id UUID``
(pkg/nvcdi/full-gpu-nvml.go, internal/discover/hooks.go). A CDI-aware runtime copies the spec's
hooks into the container's OCI spec. This node's containerd (Debian 1.6.20) has no CDI support in
its CRI plugin (``enable_cdi`` came with 1.7), so the hook reaches the OCI spec the way containerd
1.6 offers: a runtime handler whose ``base_runtime_spec`` carries it, chosen by a RuntimeClass.
Every container the handler creates, the pod sandbox included, starts from that spec; runc then
runs the hook with the container's state (its pid, its bundle) on stdin, and the hook reads the
``config.json`` that containerd and the simulated driver's wrapper wrote from the pod.

* ``HOOK_HANDLER`` runs the hook exactly as the toolkit generates it, with the simulated
  ``libnvidia-ml.so.1`` in its driver root. On this machine's hybrid cgroup layout it stops at its
  cgroup v2 check, which fails the container's start: the safety case.
* ``V2_VIEW_HANDLER`` runs the same binary inside a private mount namespace where the unified
  hierarchy (``/sys/fs/cgroup/unified``) is mounted on ``/sys/fs/cgroup``: the view the hook has on
  a v2 node. Nothing else is needed: runc (1.1.5, cgroupfs driver) already puts each container of
  this hybrid host into the unified hierarchy at the path of its v1 cgroups
  (``0::/kubepods/<qos>/pod<uid>/<container id>``), so the hook goes on to NVML and sets the limit
  on the container's own cgroup. The wrapper is this file, installed as an executable (standard
  library only); on a v2 node it runs the hook unchanged.
* ``OLD_DRIVER_HANDLER`` is the v2 view with a driver root whose ``libnvidia-ml.so.1`` predates
  R615 (no ``nvmlDeviceSetMemoryLimits_v1``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HOOK_HANDLER = "gpufence-nvidia-hook"
V2_VIEW_HANDLER = "gpufence-nvidia-hook-v2view"
# The v2 view again, with a driver older than R615 (the simulator built without the limit calls).
OLD_DRIVER_HANDLER = "gpufence-nvidia-hook-v2view-old-driver"
HANDLERS = (HOOK_HANDLER, V2_VIEW_HANDLER, OLD_DRIVER_HANDLER)
# The simulated GPU every node test uses (tests.node.workloads writes it into the state file).
GPU_UUID = "GPU-5e1f0c0d-0000-4000-8000-000000000000"
UNIFIED = "/sys/fs/cgroup/unified"
# Filled in by ``install_v2_view`` (the file runs as runc's hook, outside the test process).
UNSHARE = "@UNSHARE@"
MOUNT = "@MOUNT@"


def main(argv: list[str]) -> int:
    """As runc's hook: ``<this file> <real hook> apply-cuda-memory-limits ...``, state on stdin."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # a cgroup v2 node: the hook's own view
        os.execv(argv[0], argv)
    script = f'{MOUNT} --bind {UNIFIED} /sys/fs/cgroup && exec "$0" "$@"'
    # The container's state stays on stdin for the hook.
    os.execv(UNSHARE, [UNSHARE, "--mount", "--propagation", "private", "/bin/sh", "-c", script, *argv])
    return 1


def install_v2_view(target: Path) -> Path:
    text = Path(__file__).read_text()
    for marker, value in (("@UNSHARE@", shutil.which("unshare") or "/usr/bin/unshare"),
                          ("@MOUNT@", shutil.which("mount") or "/usr/bin/mount")):
        text = text.replace(f'"{marker}"', json.dumps(value), 1)
    text = "#!/usr/bin/python3\n" + text
    target.write_text(text)
    target.chmod(0o755)
    return target


def driver_root(directory: Path, library: Path) -> Path:
    """A driver root as the hook searches it (``<root>/usr/lib64/libnvidia-ml.so.1``)."""
    (directory / "usr" / "lib64").mkdir(parents=True, exist_ok=True)
    shutil.copy(library, directory / "usr" / "lib64" / "libnvidia-ml.so.1")
    return directory


def hook_entry(hook: Path, root: Path, sim_state: Path, wrapper: Path | None = None) -> dict[str, object]:
    """The OCI hook the toolkit generates (``cdiHookCreator.Create``): args[0] is the binary's base
    name, then the hook's name and flags; its env is ``NVIDIA_CTK_DEBUG`` (here true, so that the
    kubelet's message carries the hook's log) plus where the simulated driver keeps its state."""
    args = [hook.name, "apply-cuda-memory-limits", "--driver-root", str(root), "--gpu-id", GPU_UUID]
    env = ["NVIDIA_CTK_DEBUG=true", f"GPUFENCE_SIM_STATE={sim_state}"]
    if wrapper is None:
        return {"path": str(hook), "args": args, "env": env}
    return {"path": str(wrapper), "args": [wrapper.name, str(hook), *args[1:]], "env": env}


def base_spec(ctr: list[str], hook: dict[str, object]) -> dict[str, object]:
    """containerd's own default spec (``ctr oci spec``) with the hook among its createRuntime hooks."""
    spec = json.loads(subprocess.run([*ctr, "oci", "spec"], check=True, capture_output=True, text=True).stdout)
    spec.setdefault("hooks", {}).setdefault("createRuntime", []).append(hook)
    return spec


def containerd_runtimes(handlers: dict[str, tuple[str, Path]]) -> str:
    """The containerd 1.6 config for each handler: runc through the v2 shim, ``BinaryName`` the
    simulated driver's wrapper, ``base_runtime_spec`` the spec with the hook."""
    out = []
    for name, (binary, spec) in handlers.items():
        out.append(f"""    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{name}]
      runtime_type = "io.containerd.runc.v2"
      base_runtime_spec = "{spec}"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{name}.options]
        SystemdCgroup = false
        BinaryName = "{binary}"
""")
    return "".join(out)


def runtime_classes() -> str:
    """The RuntimeClasses, as a kubectl List (JSON: this file runs outside the venv, without yaml)."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": name}, "handler": name}
        for name in HANDLERS]})


def configure(workdir: Path, sim_dir: Path, runc: str) -> str:
    """Builds the hook (cached), writes the handlers' wrapper and base specs; returns containerd's
    config for them."""
    from gpufence.simnvml import build_library
    from tests.e2e.binaries import nvidia_cdi_hook
    from tests.node import simruntime

    hook = nvidia_cdi_hook()
    root = driver_root(sim_dir / "driver-root", sim_dir / "libnvidia-ml.so.1")
    old_root = driver_root(sim_dir / "driver-root-old", build_library(memory_limits=False))
    runtime = simruntime.install(str(workdir / "runc-simnvml-gpu"), str(sim_dir), runc, driver_in_gpu_containers=True)
    wrapper = install_v2_view(workdir / "nvidia-hook-v2view")
    handlers = {}
    for name, entry in ((HOOK_HANDLER, hook_entry(hook, root, sim_dir / "state")),
                        (V2_VIEW_HANDLER, hook_entry(hook, root, sim_dir / "state", wrapper)),
                        (OLD_DRIVER_HANDLER, hook_entry(hook, old_root, sim_dir / "state", wrapper))):
        spec = workdir / f"base-spec-{name}.json"
        spec.write_text(json.dumps(base_spec(["ctr"], entry), indent=1))
        handlers[name] = (runtime, spec)
    return containerd_runtimes(handlers)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
