"""Which of NVML's GPU processes belong to this pod, and to which container.

NVML reports PIDs; the enforcer may only ever signal processes of its own pod, so every PID is
translated into the enforcer's own PID namespace and checked before it becomes a ``PodProcess``:

* ``PidMode.LOCAL`` — current drivers translate PIDs into the caller's namespace and list only
  processes visible there. A PID is accepted only if the local process holds an NVIDIA device
  open or mapped: a legacy driver reports *host* PIDs, which may collide with small local PIDs,
  and the colliding local process is almost never a GPU process. The device is recognised by what
  it is, not by its name (``procfs.DeviceIdentity``: NVIDIA's character-device numbers from
  ``/proc/devices``), so a renamed or linked node, a bind mount or an ``mknod`` alias is the device.
* ``PidMode.HOST_PROC`` — the host's /proc is mounted (legacy drivers). A host PID is accepted only
  if ``<host_proc>/<pid>/ns/pid`` is our PID namespace; its innermost ``NSpid`` is our PID. That
  settles it: a process NVML lists and the host's /proc places in our namespace is the pod's GPU
  process, whatever it holds open.

Container attribution: the cgroup, which a process cannot leave, is the container's identity;
``GPUFENCE_CONTAINER`` in the environment (which a process can set, drop or overwrite) only names
cgroups (``resolve_containers``).

Cost: facts that never change for a process's life (environ, cgroup, namespace, NSpid) are cached
per ``(pid, start time)``; a steady-state tick reads one ``stat`` file per NVML PID.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from gpufence.enforcer.facts import Attribution, DeviceSample, NvmlSample, PodProcess
from gpufence.enforcer.observe.container_identity import (
    assign,
    bind_names,
    cgroup_names,
    claims_by_cgroup,
    informative,
    resolve_containers,
)
from gpufence.enforcer.observe.procfs import (
    ENV_NVIDIA_DEVICES,
    NVIDIA_DEVICE_PREFIX_DEFAULT,
    DeviceIdentity,
    ProcFacts,
    default_device_prefix,
    holds_device,
    pidns_inode,
    processes_in_cgroup,
    read_claim,
    read_facts,
    read_nspid,
    read_start_time,
    read_stat,
)

__all__ = [
    "NVIDIA_DEVICE_PREFIX_DEFAULT",
    "Attribution",
    "Attributor",
    "PidMode",
    "PodProcess",
    "bind_names",
    "cgroup_names",
    "choose_mode",
    "resolve_containers",
]

# Cache entries for processes NVML has not reported for this many ticks are dropped (a process
# missing from one sample, e.g. a device error, need not be re-read); the cap bounds memory when
# a legacy driver lists every process on the host.
_CACHE_IDLE_TICKS = 8
# A cgroup whose GPU processes name no container is asked (all its processes' claims) this rarely.
_SIBLING_RESCAN_TICKS = 10
_CACHE_MAX_ENTRIES = 4096


class PidMode(StrEnum):
    LOCAL = "local"
    HOST_PROC = "host_proc"


@dataclass(frozen=True)
class _Known:
    """What one NVML PID resolved to, cached for its ``(nvml pid, start time)`` identity."""

    facts: ProcFacts | None  # None: foreign (not in our namespace / no such local process)
    ppid: int  # local parent at first sight; only used to hide the enforcer's own children


@dataclass
class _Entry:
    known: _Known
    last_seen: int


def choose_mode(host_proc_root: str | None) -> PidMode:
    """HOST_PROC when a host /proc is mounted and readable, else LOCAL."""
    if not host_proc_root:
        return PidMode.LOCAL
    try:
        has_pids = any(name.isdigit() for name in os.listdir(host_proc_root))
    except OSError:
        return PidMode.LOCAL
    # We must be able to resolve namespaces and NSpid there, not merely list it.
    readable = pidns_inode("self", host_proc_root) is not None and _nspid_self(host_proc_root)
    return PidMode.HOST_PROC if has_pids and readable else PidMode.LOCAL


def _nspid_self(proc_root: str) -> bool:
    try:
        with open(f"{proc_root}/self/status", "rb") as f:
            return b"NSpid:" in f.read()
    except OSError:
        return False


class Attributor:
    def __init__(
        self,
        mode: PidMode,
        *,
        proc_root: str = "/proc",
        host_proc_root: str | None = None,
        device_prefix: str | None = None,
        own_pid: int | None = None,
        devices: str | None = None,
    ) -> None:
        """``device_prefix`` None: ``GPUFENCE_NVIDIA_DEVICE_PREFIX`` or ``/dev/nvidia`` (read now);
        ``devices``: more ``MAJOR[:MINOR]`` to count as NVIDIA's (None: ``GPUFENCE_NVIDIA_DEVICES``);
        ``own_pid`` None: this process. Raises ValueError for HOST_PROC without ``host_proc_root``
        or for a malformed ``devices``."""
        if mode is PidMode.HOST_PROC and not host_proc_root:
            raise ValueError("PidMode.HOST_PROC needs host_proc_root")
        self._mode = mode
        self._proc_root = proc_root
        self._host_proc_root = host_proc_root
        prefix = device_prefix if device_prefix is not None else default_device_prefix()
        self.device = DeviceIdentity.of(prefix, devices if devices is not None else os.environ.get(ENV_NVIDIA_DEVICES))
        self._own_pid = own_pid if own_pid is not None else os.getpid()
        # Facts that never change while the enforcer runs: our namespace and our own cgroup.
        self._own_pidns = pidns_inode("self", proc_root)
        self._own_cgroup = _read_cgroup(proc_root)
        self._cache: dict[tuple[int, int], _Entry] = {}
        self._tick = 0
        self._bound: dict[str, str] = {}  # container name -> the cgroup that last held it alone
        self._siblings: dict[str, tuple[int, frozenset[str]]] = {}  # cgroup -> (tick read, claims)

    @property
    def mode(self) -> PidMode:
        return self._mode

    def attribute(self, sample: NvmlSample) -> Attribution:
        """This pod's GPU processes in ``sample``; never raises for vanished processes."""
        self._tick += 1
        facts_by_nvml_pid: dict[int, ProcFacts] = {}
        foreign: set[int] = set()
        uninspectable: set[int] = set()
        for nvml_pid in _nvml_pids(sample):
            known = self._resolve(nvml_pid)
            if known is not None and known.facts is not None and not known.facts.inspectable:
                # NVML lists it, in our PID namespace, and its descriptors are closed to us (a workload
                # with more rights than the sidecar): a reason to act, not to skip. It is the pod's GPU
                # process, charged to the pod's budget unless its cgroup names a container (issue 32).
                uninspectable.add(nvml_pid)
                facts_by_nvml_pid[nvml_pid] = known.facts
            elif known is None or known.facts is None or not known.facts.holds_nvidia_device:
                foreign.add(nvml_pid)
            elif not self._is_enforcer(known):
                facts_by_nvml_pid[nvml_pid] = known.facts
        claims = claims_by_cgroup(facts_by_nvml_pid.values(), self._own_cgroup)
        bound_cgroups = set(self._bound.values())
        for cgroup, found in claims.items():
            if not found and cgroup not in bound_cgroups:
                # No GPU process of this cgroup names it (env -i workers, setproctitle): its other
                # processes may (the launcher that started them).
                found.update(self._sibling_claims(cgroup))
        names = cgroup_names(claims, self._bound)
        self._bound = bind_names(names, self._bound)
        containers = assign(facts_by_nvml_pid.values(), self._own_cgroup, names)
        processes = [
            PodProcess(
                pid=facts.pid,
                nvml_pid=nvml_pid,
                start_time_ticks=facts.start_time_ticks,
                container=containers[facts.pid],
                device_index=device.index,
                device_uuid=device.uuid,
                used_memory_bytes=used,
                sm_util=device.sm_util_by_pid.get(nvml_pid),
                cgroup=facts.cgroup if informative(facts.cgroup, self._own_cgroup) else None,
                claim=facts.container,
            )
            for device in sample.devices
            if not device.lost  # its process list is stale or empty this round: skip, as nvml.py says
            for nvml_pid, used in _device_processes(device).items()
            if (facts := facts_by_nvml_pid.get(nvml_pid)) is not None
        ]
        self._evict()
        return Attribution(
            processes=tuple(processes), foreign_pids=tuple(sorted(foreign)), uninspectable=tuple(sorted(uninspectable))
        )

    # -- one PID ---------------------------------------------------------------------------------

    def _resolve(self, nvml_pid: int) -> _Known | None:
        """The cached or freshly read verdict for an NVML PID; None if it vanished this tick."""
        root = self._host_proc_root if self._mode is PidMode.HOST_PROC else self._proc_root
        assert root is not None
        stat = read_stat(nvml_pid, root) if nvml_pid > 0 else None
        if stat is None or stat.is_dead:
            return None  # gone, or a zombie NVML still lists: nothing to attribute or signal
        key = (nvml_pid, stat.start_time_ticks)
        entry = self._cache.get(key)
        if entry is None:
            known = self._read_known(nvml_pid, stat.start_time_ticks, stat.ppid)
            if known is None:
                return None
            entry = self._cache[key] = _Entry(known, self._tick)
        elif entry.known.facts is not None and not entry.known.facts.holds_nvidia_device:
            entry.known = self._recheck_device(entry.known)
        entry.last_seen = self._tick
        return entry.known

    def _read_known(self, nvml_pid: int, start: int, ppid: int) -> _Known | None:
        if self._mode is PidMode.LOCAL:
            facts = read_facts(nvml_pid, self._proc_root, self.device)
            if facts is None or facts.start_time_ticks != start:
                return None  # exited, or the PID was reused between the two reads
            return _Known(facts=facts, ppid=ppid)
        return self._read_known_host(nvml_pid, start)

    def _read_known_host(self, host_pid: int, start: int) -> _Known | None:
        host_root = self._host_proc_root
        assert host_root is not None
        ns = pidns_inode(host_pid, host_root)
        nspid = read_nspid(host_pid, host_root)
        # The namespace and NSpid must describe the process whose start time keyed the cache.
        if read_start_time(host_pid, host_root) != start:
            return None
        if ns is None or self._own_pidns is None or ns != self._own_pidns or not nspid:
            return _Known(facts=None, ppid=0)  # another pod's (or the host's) process
        local_pid = nspid[-1]
        local = read_stat(local_pid, self._proc_root)
        facts = read_facts(local_pid, self._proc_root, self.device)
        # Same process seen through both mounts: same start time (both read in our time namespace).
        if local is None or facts is None or facts.start_time_ticks != start:
            return None
        if facts.inspectable and not facts.holds_nvidia_device:
            # In our namespace by the host's own /proc, and NVML lists it: the pod's GPU process,
            # whatever it holds (a device held through something no identity covers).
            facts = _with_device(facts)
        return _Known(facts=facts, ppid=local.ppid)

    def _recheck_device(self, known: _Known) -> _Known:
        """A process not holding the device may open it later: re-scan its descriptors.

        Only the (rare) negative answer is re-checked; a positive one stays true for our purpose
        (NVML lists the process only while it has a context, which needs the device open).
        """
        facts = known.facts
        assert facts is not None
        if not holds_device(facts.pid, self._proc_root, self.device):
            return known
        if read_start_time(facts.pid, self._proc_root) != facts.start_time_ticks:
            return known  # PID reused during the scan: the descriptors were someone else's
        return _Known(facts=_with_device(facts), ppid=known.ppid)

    def _is_enforcer(self, known: _Known) -> bool:
        """The enforcer itself, or a child of it that is no workload (carries no container name).

        A child that carries GPUFENCE_CONTAINER was launched as a workload on purpose (tests, the
        demo); in a pod the sidecar's environment has no such variable to pass on.
        """
        facts = known.facts
        assert facts is not None
        if facts.pid == self._own_pid:
            return True
        return known.ppid == self._own_pid and facts.container is None

    def _sibling_claims(self, cgroup: str) -> frozenset[str]:
        """The names the processes of ``cgroup`` claim (all of them, GPU or not), re-read at most
        every ``_SIBLING_RESCAN_TICKS`` ticks: a scan reads every process's cgroup file."""
        cached = self._siblings.get(cgroup)
        if cached is not None and self._tick - cached[0] < _SIBLING_RESCAN_TICKS:
            return cached[1]
        found = set()
        for pid, start in processes_in_cgroup(cgroup, self._proc_root):
            claim = read_claim(pid, self._proc_root) if pid != self._own_pid else None
            if claim is not None and read_start_time(pid, self._proc_root) == start:
                found.add(claim)
        if len(self._siblings) >= _CACHE_MAX_ENTRIES:
            self._siblings.clear()
        self._siblings[cgroup] = (self._tick, frozenset(found))
        return frozenset(found)

    # -- cache -----------------------------------------------------------------------------------

    def _evict(self) -> None:
        oldest = self._tick - _CACHE_IDLE_TICKS
        stale = [key for key, entry in self._cache.items() if entry.last_seen < oldest]
        for key in stale:
            del self._cache[key]
        if len(self._cache) > _CACHE_MAX_ENTRIES:
            by_age = sorted(self._cache, key=lambda k: self._cache[k].last_seen)
            for key in by_age[: len(self._cache) - _CACHE_MAX_ENTRIES]:
                del self._cache[key]


def _nvml_pids(sample: NvmlSample) -> list[int]:
    """Distinct NVML PIDs over all devices, in first-seen order (one /proc lookup per PID)."""
    return list(dict.fromkeys(p.pid for device in sample.devices if not device.lost for p in device.processes))


def _device_processes(device: DeviceSample) -> Mapping[int, int | None]:
    """pid -> used memory on one device. NVML may list a process twice (compute and graphics
    lists): it is one process with one allocation, so keep the larger known value, not the sum."""
    used_by_pid: dict[int, int | None] = {}
    for p in device.processes:
        if p.pid not in used_by_pid:
            used_by_pid[p.pid] = p.used_memory_bytes
            continue
        previous = used_by_pid[p.pid]
        if previous is None or (p.used_memory_bytes is not None and p.used_memory_bytes > previous):
            used_by_pid[p.pid] = p.used_memory_bytes
    return used_by_pid


def _with_device(facts: ProcFacts) -> ProcFacts:
    return ProcFacts(
        pid=facts.pid,
        start_time_ticks=facts.start_time_ticks,
        container=facts.container,
        cgroup=facts.cgroup,
        holds_nvidia_device=True,
    )


def _read_cgroup(proc_root: str) -> str | None:
    try:
        with open(f"{proc_root}/self/cgroup", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None
