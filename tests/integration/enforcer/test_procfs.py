"""enforcer.observe.procfs against real child processes (and one hand-made proc tree for unreadable files).

Workloads are real Python children that open a file named like a GPU device node under a temp
directory, print "ready" and block on stdin: the test waits on that line, never on a sleep, and
ends the child by closing its stdin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from gpufence.enforcer.observe.procfs import (
    ENV_NVIDIA_DEVICE_PREFIX,
    NVIDIA_DEVICE_PREFIX_DEFAULT,
    ProcFacts,
    default_device_prefix,
    holds_device,
    pidns_inode,
    read_facts,
    read_nspid,
    read_start_time,
    read_stat,
)

_CHILD = """
import sys
device, hold, name = sys.argv[1], sys.argv[2], sys.argv[3]
held = [open(device, "rb")] if hold else []
if name:  # PR_SET_NAME: what /proc/<pid>/stat shows as comm
    import ctypes
    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)
print("ready", flush=True)
for line in sys.stdin:  # "open": open the device now; EOF: exit
    held.append(open(device, "rb"))
    print("opened", flush=True)
"""


@dataclass
class Child:
    proc: subprocess.Popen[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def open_device(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("open\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "opened\n"

    def exit_unreaped(self) -> None:
        """Let the child exit and wait until it has (a zombie: its PID is not yet free)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


@dataclass(frozen=True)
class GpuDir:
    device: Path  # the file a "GPU process" holds open
    prefix: str  # the device prefix that matches it


Spawn = Callable[..., Child]


@pytest.fixture
def gpu_dir(tmp_path: Path) -> GpuDir:
    (tmp_path / "dev").mkdir()
    device = tmp_path / "dev" / "nvidia0"
    device.write_bytes(b"")
    return GpuDir(device=device, prefix=str(tmp_path / "dev" / "nvidia"))


@pytest.fixture
def spawn(gpu_dir: GpuDir) -> Iterator[Spawn]:
    """spawn(container="train", device=True, name="") -> a ready Child; all are ended at teardown."""
    children: list[Child] = []

    def _spawn(container: str | None = "train", *, device: bool = True, name: str = "") -> Child:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        if container is not None:
            env["GPUFENCE_CONTAINER"] = container
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(gpu_dir.device), "1" if device else "", name],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        child = Child(proc)
        children.append(child)
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        return child

    yield _spawn
    for child in children:
        child.stop()


def test_facts_of_a_gpu_process(spawn: Spawn, gpu_dir: GpuDir) -> None:
    child = spawn("train")
    facts = read_facts(child.pid, "/proc", gpu_dir.prefix)
    assert facts == ProcFacts(
        pid=child.pid,
        start_time_ticks=read_start_time(child.pid),
        container="train",
        cgroup=Path(f"/proc/{child.pid}/cgroup").read_text().strip(),
        holds_nvidia_device=True,
    )
    assert facts.cgroup  # every Linux process is in some cgroup


def test_device_prefix_must_match_an_open_descriptor(spawn: Spawn, gpu_dir: GpuDir) -> None:
    holder, other = spawn("train"), spawn("train", device=False)
    assert holds_device(holder.pid, "/proc", gpu_dir.prefix)
    assert not holds_device(other.pid, "/proc", gpu_dir.prefix)
    # A prefix that the open path does not start with does not count (nvidia0 vs nvidia1).
    assert not holds_device(holder.pid, "/proc", gpu_dir.prefix + "1")
    assert not read_facts(other.pid, "/proc", gpu_dir.prefix).holds_nvidia_device


def test_device_prefix_defaults_to_the_environment(
    spawn: Spawn, gpu_dir: GpuDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    child = spawn("train")
    monkeypatch.delenv(ENV_NVIDIA_DEVICE_PREFIX, raising=False)
    assert default_device_prefix() == NVIDIA_DEVICE_PREFIX_DEFAULT == "/dev/nvidia"
    assert not read_facts(child.pid).holds_nvidia_device  # this test machine's child holds no /dev/nvidia*
    monkeypatch.setenv(ENV_NVIDIA_DEVICE_PREFIX, gpu_dir.prefix)
    assert read_facts(child.pid).holds_nvidia_device


@pytest.mark.parametrize("container", [None, ""])
def test_process_without_a_container_name(spawn: Spawn, gpu_dir: GpuDir, container: str | None) -> None:
    child = spawn(container)
    facts = read_facts(child.pid, "/proc", gpu_dir.prefix)
    assert facts is not None
    assert facts.container is None
    assert facts.holds_nvidia_device


def test_vanished_process_reads_as_none(spawn: Spawn, gpu_dir: GpuDir) -> None:
    child = spawn("train")
    pid = child.pid
    child.stop()  # exited and reaped: the PID names nothing (until reused, which a test cannot force)
    assert read_facts(pid, "/proc", gpu_dir.prefix) is None
    assert read_start_time(pid) is None
    assert read_stat(pid) is None
    assert read_nspid(pid, "/proc") is None
    assert pidns_inode(pid, "/proc") is None
    assert not holds_device(pid, "/proc", gpu_dir.prefix)


def test_zombie_holds_no_device_and_has_no_environment(spawn: Spawn, gpu_dir: GpuDir) -> None:
    child = spawn("train")
    start = read_start_time(child.pid)
    child.exit_unreaped()
    facts = read_facts(child.pid, "/proc", gpu_dir.prefix)
    # A zombie keeps its identity but has released its memory and descriptors: not a GPU process.
    assert facts is not None
    assert facts.start_time_ticks == start
    assert facts.container is None
    assert not facts.holds_nvidia_device


def test_start_time_identifies_a_process(spawn: Spawn) -> None:
    first = spawn("train")
    second = spawn("train")
    start = read_start_time(first.pid)
    assert start is not None
    assert read_start_time(first.pid) == start  # stable
    assert read_start_time(second.pid) >= start  # ticks since boot: later process, later (or same) tick
    assert read_start_time(os.getpid()) < start  # this test process is seconds older than its child
    # Cross-check against psutil's independent parser: boot time + ticks / CLK_TCK is the creation time.
    created = psutil.boot_time() + start / os.sysconf("SC_CLK_TCK")
    assert created == pytest.approx(psutil.Process(first.pid).create_time(), abs=0.02)


def test_stat_parsing_survives_a_hostile_command_name(spawn: Spawn) -> None:
    # comm is free text in parentheses; spaces and ')' inside it must not shift the fields.
    child = spawn("train", name="x) 1 2 (y")
    assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "x) 1 2 (y"
    stat = read_stat(child.pid)
    assert stat is not None
    assert stat.ppid == os.getpid()
    assert stat.start_time_ticks == read_start_time(child.pid)
    created = psutil.boot_time() + stat.start_time_ticks / os.sysconf("SC_CLK_TCK")
    assert created == pytest.approx(psutil.Process(child.pid).create_time(), abs=0.02)


def test_namespace_facts_in_our_own_namespace(spawn: Spawn) -> None:
    child = spawn("train")
    # Same PID namespace as the test: NSpid has exactly one entry, the PID itself.
    assert read_nspid(child.pid, "/proc") == (child.pid,)
    assert pidns_inode(child.pid, "/proc") == pidns_inode("self", "/proc") == os.stat("/proc/self/ns/pid").st_ino


def test_unreadable_files_give_none_not_an_exception(tmp_path: Path) -> None:
    # A proc root where only stat exists (environ, cgroup, fd unreadable, as without ptrace rights).
    comm_and_fields = "(worker) S 1 " + " ".join(["0"] * 17) + " 4242 0 0"  # fields 3, 4, 5-21, 22 (starttime)
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "stat").write_text(f"77 {comm_and_fields}\n")
    assert read_start_time(77, str(tmp_path)) == 4242
    assert read_facts(77, str(tmp_path), "/dev/nvidia") == ProcFacts(
        pid=77, start_time_ticks=4242, container=None, cgroup=None, holds_nvidia_device=False
    )
    assert read_nspid(77, str(tmp_path)) is None  # no status file (kernels before 4.1 lack the line too)
    (tmp_path / "78").mkdir()
    (tmp_path / "78" / "stat").write_text("78 (truncated) S 1\n")
    assert read_facts(78, str(tmp_path), "/dev/nvidia") is None
    assert read_facts(0) is None
    assert read_facts(-5) is None
