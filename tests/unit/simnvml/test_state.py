"""simnvml without the library: the state file it reads, and the build's configuration errors.

The library itself, loaded by the real pynvml in child processes, is tested in
tests/integration/simnvml.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest

from gpufence import simnvml
from gpufence.simnvml import (
    CompilerNotFoundError,
    SimDevice,
    SimProcess,
    SimState,
    build_library,
    pid_namespace_inode,
    write_state,
)

REPO = pathlib.Path(__file__).resolve().parents[3]
GiB = 1 << 30


def one_device(*processes: SimProcess, **kwargs: Any) -> SimState:
    return SimState(devices=(SimDevice("GPU-11111111-2222-3333-4444-555555555555", 80 * GiB, processes),), **kwargs)


@pytest.fixture
def state_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "state"


# -- build configuration --------------------------------------------------------------------------


def test_build_without_compiler_is_a_clear_error(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(CompilerNotFoundError, match="no C compiler found"):
        build_library(tmp_path / "cache")
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(CompilerNotFoundError, match="no-such-compiler"):
        build_library(tmp_path / "cache")


def test_default_cache_dir_honours_env(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFENCE_CACHE_DIR", str(tmp_path / "c"))
    assert simnvml.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GPUFENCE_CACHE_DIR")
    assert simnvml.default_cache_dir() == REPO / ".gpufence-cache"


# -- state (pure Python) --------------------------------------------------------------------------


def test_write_state_is_atomic_and_validated(state_path: pathlib.Path) -> None:
    write_state(state_path, one_device(SimProcess(10, GiB, sm_util=5)))
    first = state_path.stat()
    write_state(state_path, one_device(SimProcess(10, GiB, sm_util=6)))  # same size, new content
    second = state_path.stat()
    assert (second.st_ino, second.st_mtime_ns) != (first.st_ino, first.st_mtime_ns)
    assert [p.name for p in state_path.parent.iterdir()] == ["state"]
    text = state_path.read_text()
    assert text.startswith("gpufence-simnvml 1\n") and text.endswith("end\n")
    assert f"host_pidns {pid_namespace_inode()}" in text

    with pytest.raises(ValueError, match="driver"):
        SimState(devices=(), driver="new")
    with pytest.raises(ValueError, match="unknown NVML error"):
        SimState(devices=(), init_error="BROKEN")
    with pytest.raises(ValueError, match="failure key"):
        SimState(devices=(), failures={"not a function": "NOT_SUPPORTED"})
    with pytest.raises(ValueError, match="sm_util"):
        SimProcess(1, 0, sm_util=101)
    with pytest.raises(ValueError, match="kind"):
        SimProcess(1, 0, kind="video")
    with pytest.raises(ValueError, match="hang key"):
        SimState(devices=(), hangs=("not a function",))
    with pytest.raises(ValueError, match="together"):
        SimProcess(1, 0, ns_inode=5)
    with pytest.raises(ValueError, match="uuid"):
        SimDevice("GPU 1", GiB)
    # Lists are accepted and frozen into tuples; failures accept the NVML_ERROR_ prefix.
    state = SimState(devices=[SimDevice("GPU-x", GiB, [SimProcess(1, 2)])], failures={"*": "NVML_ERROR_UNKNOWN"})
    assert isinstance(state.devices, tuple) and isinstance(state.devices[0].processes, tuple)


def test_for_pid_reads_the_namespace_of_a_process() -> None:
    proc = SimProcess.for_pid(os.getpid(), GiB, sm_util=7)
    assert proc.ns_inode == pid_namespace_inode()
    assert proc.ns_pid == os.getpid()  # the test runs in the namespace it reads
    assert (proc.pid, proc.used_memory_bytes, proc.sm_util, proc.kind) == (os.getpid(), GiB, 7, "compute")
    with pytest.raises(ProcessLookupError):
        SimProcess.for_pid(2**22 + 12345, 0)
