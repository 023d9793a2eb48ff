"""Compiling ``fake_nvml.c`` into ``libnvidia-ml.so.1`` with the system C compiler.

``fake_nvml.c`` includes ``fake_nvml_state.c``, ``fake_nvml_processes.c`` and
``fake_nvml_limits.c`` (NVML R615's per-cgroup memory limits); all four are hashed.
``build_library(memory_limits=False)`` builds the "old driver": the same library without
``nvmlDeviceSetMemoryLimits_v1``/``nvmlDeviceGetMemoryLimits_v1``, so pynvml raises
``NVMLError_FunctionNotFound`` for them. Each build has its own directory (``LD_LIBRARY_PATH`` names
a directory).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shlex
import shutil
import subprocess
import tempfile

LIBRARY_NAME = "libnvidia-ml.so.1"
SOURCE = pathlib.Path(__file__).with_name("fake_nvml.c")
# The others are #included by the first (one translation unit).
SOURCES = (SOURCE, *(SOURCE.with_name(f"fake_nvml_{part}.c") for part in ("state", "processes", "limits")))
OLD_DRIVER_FLAGS = ("-DSIMNVML_NO_MEMORY_LIMITS",)
ENV_CACHE_DIR = "GPUFENCE_CACHE_DIR"
CFLAGS = ("-O2", "-Wall", "-shared", "-fPIC", f"-Wl,-soname,{LIBRARY_NAME}")
LIBS = ("-lpthread",)


class SimNvmlBuildError(RuntimeError):
    """The simulated NVML library could not be built."""


class CompilerNotFoundError(SimNvmlBuildError):
    """No C compiler: set $CC or install one (e.g. ``apt-get install gcc``)."""


def find_compiler() -> list[str]:
    """$CC if set, else the first of cc, gcc, clang on PATH."""
    env_cc = os.environ.get("CC", "").strip()
    if env_cc:
        argv = shlex.split(env_cc)
        if shutil.which(argv[0]):
            return argv
        raise CompilerNotFoundError(f"$CC is set to {env_cc!r}, but {argv[0]!r} is not an executable on PATH")
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    raise CompilerNotFoundError(
        "no C compiler found (looked for $CC, cc, gcc, clang on PATH); the simulated NVML library "
        f"({SOURCE.name}) needs one: install gcc or clang, or set CC"
    )


def _writable_dir(path: pathlib.Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def default_cache_dir() -> pathlib.Path:
    """$GPUFENCE_CACHE_DIR, else <repository or cwd>/.gpufence-cache, else ~/.cache/gpufence."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return pathlib.Path(env)
    repo = SOURCE.resolve().parent.parent
    base = repo if (repo / "pyproject.toml").is_file() else pathlib.Path.cwd()
    candidate = base / ".gpufence-cache"
    if _writable_dir(candidate):
        return candidate
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "gpufence"


def build_library(cache_dir: str | os.PathLike[str] | None = None, *, memory_limits: bool = True) -> pathlib.Path:
    """Compiles fake_nvml.c once per source hash; returns the path of the built libnvidia-ml.so.1.

    Its directory is what ``LD_LIBRARY_PATH`` needs. Safe under concurrent callers (each builds to
    a temp file and renames it into place). ``memory_limits=False``: the "old driver" build, a
    driver before R615 that lacks the memory-limit entry points.
    """
    cflags = CFLAGS if memory_limits else CFLAGS + OLD_DRIVER_FLAGS
    digest = hashlib.sha256(
        b"".join(path.read_bytes() + b"\0" for path in SOURCES) + "\0".join(cflags + LIBS).encode()
    ).hexdigest()[:16]
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out_dir = root / (f"simnvml-{digest}" if memory_limits else f"simnvml-old-driver-{digest}")
    library = out_dir / LIBRARY_NAME
    if library.is_file():
        return library
    compiler = find_compiler()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SimNvmlBuildError(f"cannot create the build directory {out_dir}: {exc}") from exc
    fd, tmp = tempfile.mkstemp(prefix=f".{LIBRARY_NAME}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        argv = [*compiler, *cflags, "-o", tmp, str(SOURCE), *LIBS]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
        except OSError as exc:
            raise CompilerNotFoundError(f"cannot run the C compiler {compiler[0]!r}: {exc}") from exc
        if result.returncode != 0:
            raise SimNvmlBuildError(
                f"compiling {SOURCE} failed (exit {result.returncode}): {shlex.join(argv)}\n{result.stderr.strip()}"
            )
        os.chmod(tmp, 0o755)
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library


def simulated_env(library: str | os.PathLike[str], state_path: str | os.PathLike[str]) -> dict[str, str]:
    """The environment additions for a child process that should load the simulated NVML."""
    lib_dir = os.path.dirname(os.path.abspath(os.fspath(library)))
    current = os.environ.get("LD_LIBRARY_PATH")
    return {
        "LD_LIBRARY_PATH": f"{lib_dir}:{current}" if current else lib_dir,
        "GPUFENCE_SIM_STATE": os.fspath(state_path),
    }
