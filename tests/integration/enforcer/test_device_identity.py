"""A GPU is a device, not a path (issue 32, row 2): a root workload held the GPU through a renamed or
symlinked node, a bind mount or an ``mknod`` alias with NVIDIA's major and minor, and the path-prefix
check took it for another pod's process (9 GiB at 100 % SM on a 2 GiB / 20 % share, no record).

Here, with real processes and a real character device: the test makes its own "NVIDIA device" with
``mknod`` (the numbers of ``/dev/zero``, 1:5, which any process can open and which the test tells the
enforcer are NVIDIA's, as ``/proc/devices`` tells it on a GPU node), and every alias of it is charged;
a device with other numbers (``/dev/null``'s) is not. The simulated driver's plain file counts by its
identity, under any name, also when only mapped."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufence.enforcer.observe.attribution import Attributor, PidMode
from gpufence.enforcer.observe.nvml import DeviceSample, GpuProcess, NvmlSample
from gpufence.enforcer.observe.procfs import DeviceIdentity, nvidia_majors
from tests.support.enforcer_harness import WORKLOAD, GpuSandbox, Workload
from tests.support.prerequisites import needs

GIB = 1 << 30
ZERO = (1, 5)  # /dev/zero's numbers: the test's stand-in for an NVIDIA device
NULL = (1, 3)  # another device: never NVIDIA's here
NOBODY = 2**22 + 1  # an own_pid no test process has

# Holds PATH open ("open"), or maps it and closes the descriptor ("map": only the mapping is left).
# (libc's mmap: Python's mmap module keeps a descriptor of its own.)
_HOLDER = """
import ctypes, mmap, os, sys
path, how = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDONLY)
if how == "map":
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    address = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    os.close(fd)
print("ready", flush=True)
sys.stdin.read()
"""

root_only = needs(os.geteuid() == 0, reason="needs root to mknod a character device and bind-mount it")


def _mknod(path: Path, numbers: tuple[int, int]) -> Path:
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(*numbers))
    return path


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def _hold(holders: list[subprocess.Popen[str]], path: Path, how: str = "open",
          wrap: tuple[str, ...] = ()) -> int:
    proc = subprocess.Popen([*wrap, sys.executable, "-c", _HOLDER, str(path), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    holders.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc.pid


def _sample(pids: list[int]) -> NvmlSample:
    return NvmlSample(devices=(DeviceSample(
        index=0, uuid="GPU-0", total_memory_bytes=16 * GIB,
        processes=tuple(GpuProcess(pid, 0, "GPU-0", GIB) for pid in pids), sm_util_by_pid={},
    ),), errors=())


def test_nvidias_majors_are_read_from_proc_devices(tmp_path: Path) -> None:
    devices = tmp_path / "devices"
    devices.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n226 drm\n507 nvidia-uvm\n"
                       "508 nvidia-caps\n510 nvidia-nvlink\n\nBlock devices:\n  7 loop\n259 nvidia-not-a-char\n")
    assert nvidia_majors(str(devices)) == [195, 195, 507, 508, 510]
    assert nvidia_majors(str(tmp_path / "missing")) == []
    identity = DeviceIdentity.of(str(tmp_path / "dev" / "nvidia"), "240, 241:7", proc_devices=str(devices))
    assert identity.majors == {195, 507, 508, 510, 240} and identity.devices == {(241, 7)}
    with pytest.raises(ValueError, match="MAJOR or MAJOR:MINOR"):
        DeviceIdentity.of("/dev/nvidia", "nvidia0")


@root_only
@pytest.mark.parametrize("registered", ["under the prefix", "configured"])
def test_every_alias_of_an_nvidia_device_is_the_device(tmp_path: Path, holders, registered: str) -> None:
    """Renamed, symlinked, bind-mounted (in the holder's own mount namespace) and mknod-made: the same
    character device, so the same GPU process. The device is NVIDIA's either because it sat under the
    prefix when the enforcer started (as /dev/nvidia0 does on a node) or because it was configured."""
    dev, elsewhere = tmp_path / "dev", tmp_path / "elsewhere"
    dev.mkdir()
    elsewhere.mkdir()
    if registered == "under the prefix":
        _mknod(dev / "nvidia0", ZERO)
        _mknod(dev / "nvidia1", ZERO)
        attributor = Attributor(PidMode.LOCAL, device_prefix=str(dev / "nvidia"), own_pid=NOBODY, devices="")
        renamed_from = dev / "nvidia1"
    else:
        attributor = Attributor(PidMode.LOCAL, device_prefix=str(dev / "nvidia"), own_pid=NOBODY,
                                devices=f"{ZERO[0]}:{ZERO[1]}")
        renamed_from = _mknod(elsewhere / "was-nvidia1", ZERO)
        _mknod(dev / "nvidia0", ZERO)  # made after start: counts by its numbers, not by its name
    # The aliases, all outside the prefix.
    renamed = elsewhere / "renamed"
    os.rename(renamed_from, renamed)
    link = elsewhere / "link"
    link.symlink_to(dev / "nvidia0")
    alias = _mknod(elsewhere / "xgpu0", ZERO)
    bound = elsewhere / "bound"
    bound.touch()
    bind = ("unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount --bind "{alias}" "{bound}" && exec "$0" "$@"')
    other = _mknod(elsewhere / "not-a-gpu", NULL)
    pids = {
        "renamed": _hold(holders, renamed),
        "symlink": _hold(holders, link),
        "mknod": _hold(holders, alias),
        "bind mount": _hold(holders, bound, wrap=bind),
    }
    control = _hold(holders, other)
    seen = os.readlink(f"/proc/{pids['bind mount']}/fd/3")
    assert not seen.startswith(str(dev)), seen  # no name under the prefix: only the device says it
    for _ in range(2):  # the second tick from the cache
        result = attributor.attribute(_sample([*pids.values(), control]))
        charged = {p.pid for p in result.processes}
        assert {name: pid in charged for name, pid in pids.items()} == dict.fromkeys(pids, True)
        assert result.foreign_pids == (control,)


def test_the_simulators_device_counts_under_any_name_also_when_only_mapped(tmp_path: Path, holders) -> None:
    """The simulated driver's "device" is a plain file: what was under the prefix at start is known by
    its (device, inode), so a hard link to it is the device, also mapped with its descriptor closed
    (``/proc/<pid>/maps``). Another file of the same size is not."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_bytes(b"\0" * 4096)
    attributor = Attributor(PidMode.LOCAL, device_prefix=str(dev / "nvidia"), own_pid=NOBODY, devices="")
    hidden = tmp_path / "hidden"
    os.link(dev / "nvidia0", hidden)
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"\0" * 4096)
    opened = _hold(holders, hidden)
    mapped = _hold(holders, hidden, "map")
    control = _hold(holders, decoy, "map")
    assert not any(os.readlink(f"/proc/{mapped}/fd/{fd}").startswith(str(tmp_path))
                   for fd in os.listdir(f"/proc/{mapped}/fd")), "the mapping's descriptor is closed"
    result = attributor.attribute(_sample([opened, mapped, control]))
    assert {p.pid for p in result.processes} == {opened, mapped}
    assert result.foreign_pids == (control,)


@root_only
def test_a_workload_holding_an_mknod_alias_of_the_gpu_is_charged_by_the_enforcer(gpu: GpuSandbox, make_config,
                                                                                   tmp_path: Path) -> None:
    """The attack end to end against the real enforcer: a process holds ``/dev/xgpu0``-like alias
    with NVIDIA's numbers (here: the test's), uses 9 GiB on a 2 GiB share, and is terminated with its
    container (it was taken for another pod's before)."""
    alias = _mknod(tmp_path / "xgpu0", ZERO)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFENCE_")}
    env["GPUFENCE_CONTAINER"] = "train"
    proc = subprocess.Popen([sys.executable, str(WORKLOAD), str(alias)], env=env, stdout=subprocess.PIPE, text=True)
    hog = Workload(proc, "train")
    gpu.workloads.append(hog)
    gpu.write(gpu.device_with(gpu.proc(hog, 9 * GIB, sm=100)))
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 2 * GIB}}, grace=30),
                            "--nvidia-devices", f"{ZERO[0]}:{ZERO[1]}")
    devices = enforcer.wait_event("nvidia_devices", 10)
    assert devices["devices"] == ["1:5"], devices
    over = enforcer.wait_event("memory_over_share", 10, container="train")
    assert over["victims"] == [hog.pid] and over["used_bytes"] == 9 * GIB
    hog.wait_line("got SIGTERM", 5)
    assert enforcer.wait_event("sigterm", 5, pid=hog.pid)["reason"] == "memory_over_share"
    assert enforcer.stop() == 0


def _in_own_dev(prefix_dir: Path, device: Path, alias: Path, kind: str) -> tuple[str, ...]:
    """A wrapper running the command in a mount namespace of its own, as a container with
    ``SYS_ADMIN`` would: a fresh ``prefix_dir`` (a tmpfs) holds its ``nvidia0``, which only this
    namespace sees, and the same device is bind-mounted at ``alias``, the one name it opens.
    ``kind``: "file" binds the simulated driver's plain file ``device`` there; "char" makes a
    character device with ``device``'s numbers (a node's /dev/nvidia0)."""
    make = (f'touch "{prefix_dir}/nvidia0" && mount --bind "{device}" "{prefix_dir}/nvidia0"' if kind == "file"
            else f'mknod -m 666 "{prefix_dir}/nvidia0" c {ZERO[0]} {ZERO[1]}')
    script = (f'mount -t tmpfs gpufence-test "{prefix_dir}" && {make} && '
              f'mount --bind "{prefix_dir}/nvidia0" "{alias}" && exec "$0" "$@"')
    return ("unshare", "-m", "--propagation", "private", "sh", "-c", script)


@root_only
@pytest.mark.parametrize("kind", ["file", "char"])
def test_a_device_only_the_workloads_mount_namespace_has_is_known_by_its_alias(tmp_path: Path, holders,
                                                                             kind: str) -> None:
    """Issue 38 row 5, as on the node: the sidecar's ``/dev`` has no ``nvidia0`` (the runtime gave it
    none; the simulated driver's device is a plain file with no major), the workload's container has
    one, bind-mounts it at ``xgpu0`` and holds it only there. The enforcer learns the device from the
    workload's own root (``/proc/<pid>/root``), so the alias is charged; a process holding another
    file is not."""
    prefix_dir, elsewhere = tmp_path / "dev", tmp_path / "elsewhere"
    prefix_dir.mkdir()
    elsewhere.mkdir()
    device = elsewhere / "driver-device"  # the simulated driver's file, under no prefix
    device.write_bytes(b"\0" * 4096)
    alias = elsewhere / "xgpu0"
    alias.touch()
    attributor = Attributor(PidMode.LOCAL, device_prefix=str(prefix_dir / "nvidia"), own_pid=NOBODY, devices="")
    assert attributor.device.files == frozenset() and attributor.device.devices == frozenset()
    holder = _hold(holders, alias, wrap=_in_own_dev(prefix_dir, device, alias, kind))
    decoy = elsewhere / "decoy"
    decoy.write_bytes(b"\0" * 4096)
    control = _hold(holders, decoy)
    assert os.readlink(f"/proc/{holder}/fd/3") == str(alias)  # the alias is all its descriptor says
    assert os.listdir(prefix_dir) == []  # and the enforcer's own view of the prefix is empty
    for _ in range(2):  # the second tick from the cache
        result = attributor.attribute(_sample([holder, control]))
        assert {p.pid for p in result.processes} == {holder}
        assert result.foreign_pids == (control,)


@root_only
def test_a_workload_holding_its_bind_mounted_gpu_only_at_an_alias_is_terminated(gpu: GpuSandbox, make_config,
                                                                                 tmp_path: Path) -> None:
    """The node's attack end to end against the real enforcer (issue 38 row 5): the enforcer's device
    prefix names a directory that is empty where it runs; the workload's mount namespace has the
    simulated device there and at ``xgpu0``, and it holds only ``xgpu0``, using 9 GiB on a 2 GiB
    share. It is terminated with its container (it was taken for another pod's before)."""
    prefix_dir = tmp_path / "sidecar-dev"
    prefix_dir.mkdir()
    alias = tmp_path / "xgpu0"
    alias.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFENCE_")}
    env["GPUFENCE_CONTAINER"] = "train"
    wrap = _in_own_dev(prefix_dir, gpu.device, alias, "file")
    proc = subprocess.Popen([*wrap, sys.executable, str(WORKLOAD), str(alias)], env=env, stdout=subprocess.PIPE,
                            text=True)
    hog = Workload(proc, "train")
    gpu.workloads.append(hog)
    gpu.write(gpu.device_with(gpu.proc(hog, 9 * GIB, sm=100)))
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 2 * GIB}}, grace=30),
                            "--nvidia-device-prefix", str(prefix_dir / "nvidia"))
    devices = enforcer.wait_event("nvidia_devices", 10)
    assert devices["files"] == 0 and devices["prefix"] == str(prefix_dir / "nvidia"), devices
    over = enforcer.wait_event("memory_over_share", 10, container="train")
    assert over["victims"] == [hog.pid] and over["used_bytes"] == 9 * GIB
    hog.wait_line("got SIGTERM", 10)
    assert hog.proc.wait(10) == 0
    assert enforcer.wait_event("sigterm", 5, pid=hog.pid)["reason"] == "memory_over_share"
    assert enforcer.stop() == 0
