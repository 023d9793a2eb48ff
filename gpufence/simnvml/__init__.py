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
* A lost device (or one removed from the state) answers ``NVML_ERROR_GPU_IS_LOST``, including from
  ``nvmlDeviceGetHandleByIndex_v2``; ``nvmlDeviceGetCount_v2`` still counts it.
* ``failures`` keys: an NVML function name (the unversioned name also matches ``_vN`` symbols),
  ``name@<device index>`` for one device, or ``"*"`` for every call after init.
"""

from gpufence.simnvml.build import (
    LIBRARY_NAME,
    CompilerNotFoundError,
    SimNvmlBuildError,
    build_library,
    default_cache_dir,
    simulated_env,
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
    "CompilerNotFoundError",
    "SimDevice",
    "SimNvmlBuildError",
    "SimProcess",
    "SimState",
    "build_library",
    "default_cache_dir",
    "error_code",
    "pid_namespace_inode",
    "render_state",
    "simulated_env",
    "write_state",
]
