"""simnvml: a fake ``libnvidia-ml.so.1`` (C, at the driver boundary) and the API to drive it.

The real ``pynvml`` loads the fake library, so everything above the driver boundary is the code
that runs on real GPUs. Typical use::

    lib = build_library()                     # compiled once per source hash, cached
    write_state(state_path, SimState(devices=(SimDevice("GPU-0", 80 << 30, (SimProcess(pid, 1 << 30),)),)))
    env = {**os.environ, **simulated_env(lib, state_path)}   # LD_LIBRARY_PATH + GPUFENCE_SIM_STATE
    subprocess.run([...], env=env)            # its pynvml now talks to the simulated driver

Simulated driver behaviour worth knowing:

* The state file is re-read when it changes (inode/mtime/size); ``$GPUFENCE_SIM_STATE`` is read at
  every call. A missing or malformed file keeps the last good state; with none, ``nvmlInit``
  returns ``NVML_ERROR_DRIVER_NOT_LOADED`` (and says why on stderr).
* ``nvmlDeviceGetProcessUtilization`` returns one sample per visible process per 10 ms window,
  timestamped with the window start (microseconds since the epoch); within the same window, or with
  ``lastSeenTimeStamp`` at or after it, ``NVML_ERROR_NOT_FOUND``.
* With ``SimState.util_lag_ms``, a process's SM use is its ``sm_util`` only while it runs: the
  driver samples every listed process's run state every 10 ms on a thread of its own (not at the
  callers' reads), and a process stopped by a signal (``T`` in ``/proc/<pid>/stat``) or held by the
  cgroup freezer (v1 ``freezer.state`` FROZEN/FREEZING, v2 ``cgroup.events`` ``frozen 1``, read from
  ``/proc/<pid>/cgroup``) counts as idle, with that lag (queued kernels). Each reading is the mean
  since the reader's previous one, so a sampler weighting its readings by the time between them
  measures the mean use over any span.
* A lost device (or one removed from the state) answers ``NVML_ERROR_GPU_IS_LOST``, including from
  ``nvmlDeviceGetHandleByIndex_v2``; ``nvmlDeviceGetCount_v2`` still counts it.
* ``failures`` keys: an NVML function name (the unversioned name also matches ``_vN`` symbols),
  ``name@<device index>`` for one device, or ``"*"`` for every call after init.

NVML R615's per-cgroup memory limits (``fake_nvml_limits.c``, ``limits.py``, ``workload.py``):

* ``nvmlDeviceSetMemoryLimits_v1`` / ``nvmlDeviceGetMemoryLimits_v1`` with nvml.h's structs
  (``nameSpace`` = ``/sys/fs/cgroup/<path>``, ``softLimit``, ``hardLimit``, ``currentUsed``, bytes).
  Set: INVALID_ARGUMENT for a NULL/empty/relative namespace, soft > hard, or a hard limit below what
  an already limited cgroup holds; NOT_SUPPORTED for the root cgroup. Get: the nearest limited
  ancestor-or-self's limits and what its processes hold; NOT_SUPPORTED when none is limited.
* Limits and allocations are shared by every process through ``<state>.driver`` (``read_limits``,
  ``read_allocations``, ``preset_limits``, ``reset_driver_state``); ``write_state`` leaves it alone.
* A process's cgroup: ``SimProcess.cgroup``, else ``cgroup_namespace(/proc/<pid>/cgroup)``.
* ``workload.allocate(uuid, n)`` (``simnvmlAllocate`` through ctypes) charges the caller:
  ``SimOutOfMemoryError`` (NVML_ERROR_MEMORY) past its cgroup's hard limit or the device's memory;
  else its usage (state file value + allocations) grows in NVML's process lists and ``currentUsed``.
* ``build_library(memory_limits=False)``: the old driver, without the two limit symbols (pynvml
  raises ``NVMLError_FunctionNotFound``).
"""

from gpufence.simnvml.build import (
    LIBRARY_NAME,
    CompilerNotFoundError,
    SimNvmlBuildError,
    build_library,
    default_cache_dir,
    simulated_env,
)
from gpufence.simnvml.limits import (
    NO_LIMIT,
    SimAllocation,
    SimLimit,
    cgroup_namespace,
    driver_state_path,
    preset_limits,
    process_cgroup_namespace,
    read_allocations,
    read_limits,
    reset_driver_state,
)
from gpufence.simnvml.state import (
    ENV_STATE,
    ERROR_CODES,
    SimDevice,
    SimProcess,
    SimState,
    error_code,
    pid_namespace_inode,
    render_state,
    write_state,
)

__all__ = [
    "ENV_STATE",
    "ERROR_CODES",
    "LIBRARY_NAME",
    "NO_LIMIT",
    "CompilerNotFoundError",
    "SimAllocation",
    "SimDevice",
    "SimLimit",
    "SimNvmlBuildError",
    "SimProcess",
    "SimState",
    "build_library",
    "cgroup_namespace",
    "default_cache_dir",
    "driver_state_path",
    "error_code",
    "pid_namespace_inode",
    "preset_limits",
    "process_cgroup_namespace",
    "read_allocations",
    "read_limits",
    "render_state",
    "reset_driver_state",
    "simulated_env",
    "write_state",
]
