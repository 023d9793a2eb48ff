"""tests/gpu/nvml_facts.py, the first part of a real-GPU validation run, read through the real pynvml
from the simulated driver: what it reports is what the simulation holds (so the same script answers
for a real node), and a driver without the R615 limit calls is reported as such, not as a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpufence.simnvml import (
    SimDevice,
    SimLimit,
    SimProcess,
    SimState,
    build_library,
    preset_limits,
    process_cgroup_namespace,
    simulated_env,
    write_state,
)

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "nvml_facts.py"


def test_facts_report_versions_processes_and_missing_limit_calls(tmp_path: Path):
    state = tmp_path / "state.json"
    me = os.getpid()
    write_state(state, SimState(devices=(
        SimDevice("GPU-facts-0", 80 << 30, (SimProcess(me, 3 << 30, sm_util=40), SimProcess(2**31 - 7, 1 << 30))),
    )))
    env = {**os.environ, **simulated_env(build_library(memory_limits=False), state)}
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60,
                            check=True)
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("facts: ")]
    facts = json.loads(line.removeprefix("facts: "))
    assert facts["driver_version"] and facts["nvml_version"].endswith(facts["driver_version"])
    (device,) = facts["devices"]
    assert (device["uuid"], device["memory_total"]) == ("GPU-facts-0", 80 << 30)
    listed = {p["pid"]: p for p in device["processes"]}
    assert listed[me] == {"pid": me, "usedGpuMemory": 3 << 30, "pid_is_local": True}
    assert listed[2**31 - 7]["pid_is_local"] is False  # a PID this namespace does not have: host PIDs
    assert device["memory_limits"]["symbols"] == {"nvmlDeviceGetMemoryLimits_v1": False,
                                                  "nvmlDeviceSetMemoryLimits_v1": False}
    assert device["memory_limits"]["get"].startswith("function not found")
    costs = device["call_costs"]
    assert all(isinstance(c, dict) and c["median_us"] > 0 for c in costs.values()), costs
    assert facts["cgroup"]["version"] in ("v1", "v2")


def test_facts_report_the_limit_of_their_own_cgroup_on_a_driver_with_the_calls(tmp_path: Path):
    namespace = process_cgroup_namespace()
    assert namespace is not None, "no unified (0::) line in /proc/self/cgroup"
    state = tmp_path / "state.json"
    me = os.getpid()
    mine = SimProcess(me, 3 << 30, cgroup=namespace)
    write_state(state, SimState(devices=(SimDevice("GPU-facts-0", 80 << 30, (mine,)),)))
    preset_limits(state, SimLimit("GPU-facts-0", namespace, 4 << 30, 6 << 30))
    env = {**os.environ, **simulated_env(build_library(), state)}
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60,
                            check=True)
    facts = json.loads(result.stdout.split("facts: ", 1)[1])
    (device,) = facts["devices"]
    assert facts["cgroup"]["own_namespace"] == namespace
    assert device["memory_limits"] == {
        "symbols": {"nvmlDeviceGetMemoryLimits_v1": True, "nvmlDeviceSetMemoryLimits_v1": True},
        "get": {"nameSpace": namespace, "softLimit": 4 << 30, "hardLimit": 6 << 30, "currentUsed": 3 << 30},
    }
