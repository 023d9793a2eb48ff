#!/usr/bin/python3
"""The node's OCI runtime: runc, with the simulated NVIDIA driver put into containers first.

On a GPU node the NVIDIA container toolkit does this at the same layer: containerd calls its
runtime, which edits the container's OCI spec (``config.json``) before runc creates the container,
adding the driver's ``libnvidia-ml.so.1`` and the ``/dev/nvidia*`` devices. This wrapper does the
equivalent for the simulator, so neither the gpufence webhook nor the pods change:

* a container whose environment has ``NVIDIA_VISIBLE_DEVICES`` (the gpufence sidecar, as the
  webhook injects it; the toolkit keys on the same variable) gets the node's simulator directory
  read-only at ``/opt/simnvml`` plus ``LD_LIBRARY_PATH`` and ``GPUFENCE_SIM_STATE`` into it, so the
  real pynvml loads the simulator and reads the state file the test writes;
* a container whose environment has ``GPUFENCE_CONTAINER`` (a GPU container, as the webhook marks
  it) gets the stand-in device file at ``/dev/nvidia0``;
* on the runtime handlers that run NVIDIA's real memory-limit hook (``tests.node.driver_hook``,
  ``DRIVER_IN_GPU_CONTAINERS``), a GPU container also gets the simulator, as the toolkit gives every
  GPU container the driver's libraries, so that its workload allocates through the simulated driver
  and meets the limit the hook set. Read-write there: the simulated driver's allocations are a file
  beside the state (``<state>.driver``), where the real driver's are behind ``/dev/nvidia*``;
* a container whose environment has ``TESTBED_NRI_DEVICE`` gets the stand-in device too, whatever
  admission saw: a path to a GPU that no admission check sees (what the toolkit's NRI plugin or
  another device-injecting runtime does from a pod annotation), for the node guardian's census.

The OCI spec is a runtime detail, so Pod Security admission sees the pods exactly as users write
them (no hostPath). containerd runs this file as ``BinaryName``; it must only use the standard
library. ``SIM_DIR`` and ``RUNC`` are written in when the node starts (``install``).
"""

from __future__ import annotations

import json
import os
import sys

SIM_DIR = "@SIM_DIR@"
RUNC = "@RUNC@"
DRIVER_IN_GPU_CONTAINERS = "@DRIVER_IN_GPU_CONTAINERS@" == "yes"
SIM_MOUNT = "/opt/simnvml"
DEVICE_PATH = "/dev/nvidia0"
PLANTED_DEVICE_ENV = "TESTBED_NRI_DEVICE"


def _bundle(argv: list[str]) -> str | None:
    if "create" not in argv and "run" not in argv:
        return None
    for flag in ("--bundle", "-b"):
        if flag in argv:
            return argv[argv.index(flag) + 1]
    return os.getcwd()


def edit_spec(spec: dict, sim_dir: str, driver_in_gpu_containers: bool = False) -> bool:
    """Adds the simulator to an OCI spec in place; True when it changed anything."""
    process = spec.get("process") or {}
    env = process.get("env") or []
    names = {entry.split("=", 1)[0] for entry in env}
    mounts = spec.setdefault("mounts", [])
    changed = False
    gpu_driver = driver_in_gpu_containers and "GPUFENCE_CONTAINER" in names
    if ("NVIDIA_VISIBLE_DEVICES" in names or gpu_driver) and not any(m.get("destination") == SIM_MOUNT for m in mounts):
        mounts.append({"destination": SIM_MOUNT, "type": "bind", "source": sim_dir,
                       "options": ["rbind", "rw" if gpu_driver else "ro", "nosuid", "nodev"]})
        env[:] = [e for e in env if not e.startswith(("LD_LIBRARY_PATH=", "GPUFENCE_SIM_STATE="))]
        env += [f"LD_LIBRARY_PATH={SIM_MOUNT}", f"GPUFENCE_SIM_STATE={SIM_MOUNT}/state"]
        changed = True
    wants_device = "GPUFENCE_CONTAINER" in names or PLANTED_DEVICE_ENV in names
    if wants_device and not any(m.get("destination") == DEVICE_PATH for m in mounts):
        mounts.append({"destination": DEVICE_PATH, "type": "bind", "source": os.path.join(sim_dir, "nvidia0"),
                       "options": ["rbind", "rw", "nosuid"]})
        changed = True
    if changed:
        process["env"] = env
        spec["process"] = process
    return changed


def main(argv: list[str]) -> None:
    bundle = _bundle(argv)
    if bundle is not None:
        path = os.path.join(bundle, "config.json")
        with open(path) as f:
            spec = json.load(f)
        if edit_spec(spec, SIM_DIR, DRIVER_IN_GPU_CONTAINERS):
            with open(path + ".tmp", "w") as f:
                json.dump(spec, f)
            os.replace(path + ".tmp", path)
    os.execv(RUNC, [RUNC, *argv])


def install(target: str, sim_dir: str, runc: str, driver_in_gpu_containers: bool = False) -> str:
    """Writes this file, with the node's paths filled in, as an executable at ``target``."""
    with open(__file__) as f:
        text = f.read()
    text = text.replace('"@SIM_DIR@"', json.dumps(sim_dir), 1).replace('"@RUNC@"', json.dumps(runc), 1)
    text = text.replace('"@DRIVER_IN_GPU_CONTAINERS@"', '"yes"' if driver_in_gpu_containers else '"no"', 1)
    with open(target, "w") as f:
        f.write(text)
    os.chmod(target, 0o755)
    return target


if __name__ == "__main__":
    main(sys.argv[1:])
