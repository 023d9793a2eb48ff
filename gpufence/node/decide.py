"""The guardian's decisions (pure): the census of the node's GPU processes, the enforcer's own rules
per admitted pod, and when the guardian acts on a breach.

* **Census** (:func:`classify`): each GPU process NVML lists, placed by its host cgroup
  (``census.placement``), is a container with an admitted share (``ADMITTED``), a container of an
  opted-in namespace with none (``UNACCOUNTED``: admitted without a GPU, a container the config does
  not name, a pod whose config does not parse, a process in the pod's own cgroup), a pod the API
  server has not shown yet (``PENDING``), a pod of another namespace (``OTHER``) or the host's
  (``HOST``). Where the admin allowed the pod device access at admission (:func:`admin_allowance`:
  its namespace is in the policy's ``device-access-namespaces``, or a member of ``admin-groups``
  created it with device access only they may grant, as the webhook's annotation records), what
  would be ``UNACCOUNTED`` is ``ADMIN_ALLOWED``: reported, never acted on. A container with an
  admitted share stays held to it.
* **Foreign processes** (:func:`foreign_verdict`): a process of another namespace's pod or of the
  host, on a GPU that holds an opted-in pod's admitted share this poll, is what the policy's
  ``other-namespace-gpu-processes`` / ``host-gpu-processes`` say (``contract.GpuSharing``): allowed
  (the default: reported once, as before the keys), reported as a breach, or (other namespaces
  only) its container terminated like an unaccounted one. A GPU without an opted-in share is none
  of gpufence's business; a pod the admin allowed device access, and gpufence's own, are never
  acted on.
* **The enforcer's rules**: one ``enforcer.decide.machine.Core`` per admitted pod, fed the pod's
  processes with the container names the pod's status gives their cgroups. Nothing of the rules is
  written here: memory over share, GPUs over request and ineffective throttles are the Core's
  orders, the compute throttle is its plan.
* **One breach, one termination** (:class:`Backstop`): the sidecar acts first on a breach of an
  admitted container (SIGTERM, SIGKILL after the pod's grace period). The guardian acts where the
  breach outlasts that: at the grace period plus a handover (the pod's poll and two of the
  guardian's), it SIGKILLs every process of the container's cgroup. A working sidecar has ended the
  breach by then, so the guardian does nothing and the sidecar's records are the only ones; a
  stopped, killed or evaded sidecar is replaced without a second grace period. Where no sidecar
  can act (an unaccounted container, a one-shot order the sidecar cannot see: a freezer throttle
  that does not hold), the guardian SIGTERMs at once and SIGKILLs after the grace period. A
  SIGTERM sent commits the SIGKILL (the container is being terminated, whatever it uses meanwhile).

Time is passed in (``CLOCK_BOOTTIME`` seconds at the edges, so a record outlives the guardian's
process); episodes can be restored from the state file (``Backstop.restore``), so a restarted
guardian neither grants a new grace period nor signals twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from gpufence.contract import DEFAULT_GRACE_PERIOD_SECONDS, EnforcerConfig, GpuSharing, Mode
from gpufence.enforcer.decide.compute import INEFFECTIVE_SECONDS
from gpufence.enforcer.decide.machine import Core, Decisions
from gpufence.enforcer.decide.rules import TerminateOrder
from gpufence.enforcer.observe.attribution import Attribution, PodProcess
from gpufence.node.census import Placement
from gpufence.node.pods import Admission, NodePod, PodIndex
from gpufence.node.reserved import ClaimOveruse, ContainerKey, claim_capped_config, claim_overuse


class Standing(StrEnum):
    ADMITTED = "admitted"
    UNACCOUNTED = "unaccounted"
    PENDING = "pending"
    OTHER = "other_namespace"
    HOST = "host"
    ADMIN_ALLOWED = "admin_allowed"  # no share, but the admin's policy allowed the pod device access


@dataclass(frozen=True)
class GpuProc:
    """One process NVML lists on one device, read on the host (``pid`` is a host PID)."""

    pid: int
    start_time_ticks: int
    device_index: int
    device_uuid: str
    used_memory_bytes: int | None
    sm_util: int | None
    placement: Placement


@dataclass(frozen=True)
class CensusEntry:
    process: GpuProc
    standing: Standing
    pod: NodePod | None
    container: str | None  # the container's name, where the pod's status names its ID
    why: str


def admin_allowance(pod: NodePod, index: PodIndex) -> str | None:
    """Why the admin's policy allowed ``pod`` device access without a device request (None: it did
    not). Only what no tenant writes counts: the policy ConfigMap's ``device-access-namespaces`` and
    the webhook's record of a creator in ``admin-groups`` whose pod used their exemption from the
    side-door rules (an annotation the webhook denies to anyone else at creation and the protect
    policy keeps from every update). The policy's
    ``non-gpu-resource-claims`` allows nothing: it says which claims hold no GPU, and a tenant may
    create a claim under a listed name (docs/gpu-paths.md), so a GPU there stays unaccounted."""
    if pod.namespace in index.device_access:
        return f"admin-allowed device access: namespace {pod.namespace} is in device-access-namespaces"
    if pod.admin_creator is not None:
        return f"admin-allowed device access: created with it by {pod.admin_creator}, a member of admin-groups"
    return None


def classify(proc: GpuProc, index: PodIndex) -> CensusEntry:
    """Where one GPU process stands (see the module's docstring); ``PENDING`` is promoted to
    ``UNACCOUNTED`` (or ``ADMIN_ALLOWED``) by :class:`NodeEngine` once it has lasted its settle time."""
    return _allowed(_classify(proc, index), index)


def _allowed(entry: CensusEntry, index: PodIndex) -> CensusEntry:
    if entry.standing is not Standing.UNACCOUNTED or entry.pod is None:
        return entry
    allowance = admin_allowance(entry.pod, index)
    if allowance is None:
        return entry
    return replace(entry, standing=Standing.ADMIN_ALLOWED, why=f"{allowance} ({entry.why})")


def _classify(proc: GpuProc, index: PodIndex) -> CensusEntry:
    place = proc.placement
    if not place.in_pod:
        return CensusEntry(proc, Standing.HOST, None, None, "in no pod's cgroup")
    pod = index.get(place.pod_uid)
    if pod is None:
        return CensusEntry(proc, Standing.PENDING, None, None, "a pod the API server has not shown on this node")
    name = pod.containers.get(place.container_id) if place.container_id is not None else None
    if pod.admission is Admission.ADMITTED:
        if name is not None and pod.share_of(name):
            return CensusEntry(proc, Standing.ADMITTED, pod, name, "an admitted share")
        if name is not None:
            return CensusEntry(proc, Standing.UNACCOUNTED, pod, name, "a container with no admitted GPU share")
        if place.container_id is None:
            return CensusEntry(proc, Standing.UNACCOUNTED, pod, None, "in the pod's cgroup, in no container")
        return CensusEntry(proc, Standing.PENDING, pod, None, "a container ID the pod's status does not name (yet)")
    if pod.namespace not in index.opted_in or pod.admission is Admission.OPTED_OUT:
        return CensusEntry(proc, Standing.OTHER, pod, name, "a pod gpufence does not govern")
    if pod.admission is Admission.INVALID:
        return CensusEntry(proc, Standing.UNACCOUNTED, pod, name, pod.problem or "an invalid config")
    return CensusEntry(proc, Standing.UNACCOUNTED, pod, name, "a pod admitted without a GPU share")


# -- foreign processes: other namespaces' pods and the host --------------------------------------


class Verdict(StrEnum):
    """What the policy says of one foreign GPU process (``other_namespace`` or ``host``)."""

    ALLOWED = "allowed"  # the policy's key is allow
    NOT_SHARED = "not_shared"  # its GPU holds no opted-in pod's admitted share
    OWN = "own"  # gpufence's own: the guardian's process, a pod of gpufence's namespaces
    ADMIN_ALLOWED = "admin_allowed"  # a pod the admin allowed device access (admin_allowance)
    REPORT = "report"  # reported as a breach, nothing signalled
    AUDIT = "audit"  # terminate, but the guardian runs in audit: reported
    TERMINATE = "terminate"  # its container is terminated through its cgroup


POLICY_KEYS = {Standing.OTHER: "other-namespace-gpu-processes", Standing.HOST: "host-gpu-processes"}


@dataclass(frozen=True)
class Own:
    """What is gpufence's own on the node, never acted on as foreign: the guardian's PIDs (it may run
    on the host, outside any pod) and gpufence's namespaces (the webhook's, the guardian's)."""

    pids: frozenset[int] = frozenset()
    namespaces: frozenset[str] = frozenset()


def foreign_verdict(entry: CensusEntry, index: PodIndex, shared_gpus: frozenset[str], mode: Mode,
                    own: Own = Own()) -> tuple[Verdict, str] | None:
    """What the policy says of a GPU process of another namespace's pod or of the host, and why;
    None for any other standing. ``shared_gpus``: the UUIDs of the GPUs that hold an opted-in pod's
    admitted share this poll. Host processes are never terminated: their cgroup may be a system
    service, a login session or the root, with no grace period or restart policy behind it, so the
    host key has no ``terminate`` (``contract.HOST_GPU_SHARING``) and one given here reports."""
    if entry.standing not in POLICY_KEYS:
        return None
    key = POLICY_KEYS[entry.standing]
    value = index.host if entry.standing is Standing.HOST else index.other_namespaces
    pod = entry.pod
    where = (f"a pod of namespace {pod.namespace}, which gpufence does not govern" if pod is not None
             else "a process of the host, in no pod")
    if entry.process.pid in own.pids or (pod is not None and pod.namespace in own.namespaces):
        return Verdict.OWN, f"{where}: gpufence's own, never acted on"
    if value is GpuSharing.ALLOW:
        return Verdict.ALLOWED, f"{where}; {key} is allow"
    if entry.process.device_uuid not in shared_gpus:
        return Verdict.NOT_SHARED, f"{where}, on a GPU that holds no opted-in pod's admitted share"
    on = f"{where}, on GPU {entry.process.device_uuid}, which holds an opted-in pod's admitted share"
    allowance = admin_allowance(pod, index) if pod is not None else None
    if allowance is not None:
        return Verdict.ADMIN_ALLOWED, f"{allowance} ({on}; {key} is {value.value})"
    if value is GpuSharing.TERMINATE and entry.standing is Standing.OTHER:
        if mode is Mode.AUDIT:
            return Verdict.AUDIT, f"{on}; {key} is terminate (audit: nothing done)"
        return Verdict.TERMINATE, f"{on}; {key} is terminate"
    return Verdict.REPORT, f"{on}; {key} is report"


# -- one breach, one termination ----------------------------------------------------------------


@dataclass(frozen=True)
class Breach:
    """A container the guardian may have to terminate, this poll."""

    cgroup: str  # the key: the container's cgroup path (``Placement.path``)
    placement: Placement
    reason: str  # memory_over_share, gpus_over_request, throttle_ineffective, unaccounted
    term_delay: float | None  # seconds from the start to the guardian's SIGTERM; None: the sidecar's
    kill_delay: float  # seconds from the start to the SIGKILL
    record: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Episode:
    cgroup: str
    placement: Placement
    reason: str
    started: float
    term_at: float | None
    kill_at: float
    termed: bool = False
    record: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


class Action(StrEnum):
    SIGTERM = "sigterm"
    SIGKILL = "sigkill"


@dataclass(frozen=True)
class Step:
    actions: tuple[tuple[Action, Episode], ...]
    started: tuple[Episode, ...]
    ended: tuple[Episode, ...]  # a breach that ended before the guardian acted (the sidecar did)


class Backstop:
    """The guardian's termination episodes, keyed by cgroup (pure; time passed in)."""

    def __init__(self) -> None:
        self._episodes: dict[str, Episode] = {}

    @property
    def episodes(self) -> Mapping[str, Episode]:
        return MappingProxyType(self._episodes)

    def restore(self, episodes: Iterable[Episode]) -> None:
        self._episodes = {e.cgroup: e for e in episodes}

    def step(self, now: float, breaches: Iterable[Breach], undetermined: frozenset[str] = frozenset()) -> Step:
        """``undetermined``: cgroups with GPU processes whose standing the guardian cannot tell yet
        (pending: before its first list of the pods, as after a restart). An episode of one is kept
        as it is, neither ended nor acted on: ending it would grant the breach a new grace period
        once the pods are listed."""
        current = {b.cgroup: b for b in breaches}
        started = []
        for key, breach in current.items():
            if key not in self._episodes:
                term_at = None if breach.term_delay is None else now + breach.term_delay
                episode = Episode(key, breach.placement, breach.reason, now, term_at, now + breach.kill_delay,
                                  record=breach.record)
                self._episodes[key] = episode
                started.append(episode)
        ended = []
        actions: list[tuple[Action, Episode]] = []
        for key, episode in list(self._episodes.items()):
            if key not in current and not episode.termed:
                if key not in undetermined:
                    ended.append(self._episodes.pop(key))
                continue
            if now >= episode.kill_at:
                actions.append((Action.SIGKILL, self._episodes.pop(key)))
            elif episode.term_at is not None and not episode.termed and now >= episode.term_at:
                episode = replace(episode, termed=True)
                self._episodes[key] = episode
                actions.append((Action.SIGTERM, episode))
        return Step(tuple(actions), tuple(started), tuple(ended))

    def next_due(self) -> float | None:
        """The earliest instant an episode is due (the loop wakes for it)."""
        due = [e.kill_at for e in self._episodes.values()]
        due += [e.term_at for e in self._episodes.values() if e.term_at is not None and not e.termed]
        return min(due) if due else None


# -- the engine ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThrottleTarget:
    fraction: float  # run fraction: the cgroup runs this share of each period, frozen for the rest
    placement: Placement
    pod: NodePod
    container: str


@dataclass(frozen=True)
class NodeDecisions:
    census: tuple[CensusEntry, ...]
    step: Step
    throttle: Mapping[str, ThrottleTarget]  # cgroup -> target
    pods: Mapping[str, Decisions]  # pod UID -> the enforcer core's decisions for the pod
    new_census: tuple[CensusEntry, ...]  # processes not seen before, or whose standing changed
    report_only: tuple[Breach, ...] = ()  # breaches in audit (the guardian's or the pod's mode)
    configs: Mapping[str, EnforcerConfig] = field(default_factory=lambda: MappingProxyType({}))  # pod UID ->
    # the config the guardian holds it to (the admitted shares, lowered to DRA allocations)
    # Foreign processes the policy says to report (key "report"), each once per episode: when it starts.
    reported: tuple[Breach, ...] = ()
    # Containers without a share left alone because the admin allowed their pod device access, each
    # once per episode (from its first GPU process to a poll with none): when it starts.
    allowed: tuple[CensusEntry, ...] = ()


class NodeEngine:
    """One poll's decisions for the whole node: ``step(now, processes, device_totals, index)``."""

    def __init__(
        self,
        *,
        mode: Mode = Mode.ENFORCE,
        poll_interval: float = 0.5,
        settle_seconds: float = 15.0,
        unaccounted_grace: float = DEFAULT_GRACE_PERIOD_SECONDS,
        compute_window_seconds: float = 5.0,
        compute_period_seconds: float = 1.0,
        compute_ineffective_seconds: float = INEFFECTIVE_SECONDS,
        own: Own = Own(),
    ) -> None:
        self.mode = mode
        self.poll_interval = poll_interval
        self.settle_seconds = settle_seconds
        self.unaccounted_grace = unaccounted_grace
        self._window = compute_window_seconds
        self._period = compute_period_seconds
        self._ineffective = compute_ineffective_seconds
        self.own = own
        self.backstop = Backstop()
        self._reporting: set[str] = set()  # report episodes going on (foreign processes)
        self._allowing: set[str] = set()  # admin-allowed episodes going on (containers)
        self._cores: dict[str, Core] = {}
        self._configs: dict[str, EnforcerConfig] = {}
        self._pending_since: dict[str, float] = {}
        self._seen: dict[tuple[int, int, int], Standing] = {}
        # Caches of what does not change between polls while its inputs are the same objects (the
        # loop hands over last poll's GpuProc where nothing changed; the pod index is replaced only
        # when a pod, namespace or claim changes): a quiet node costs the Cores' steps, little else.
        self._classified: dict[tuple[int, int, int], tuple[GpuProc, PodIndex, CensusEntry]] = {}
        self._capped: dict[str, tuple[NodePod, PodIndex, Mapping[str, frozenset[str]],
                                      tuple[EnforcerConfig, Mapping[str, int]]]] = {}
        self._attributions: dict[str, tuple[tuple[tuple[GpuProc, str | None], ...], Attribution]] = {}
        # Bumped whenever the census's processes or standings, or a pod's config, change: what the
        # driver-limit targets depend on besides the devices' sizes.
        self.generation = 0

    def step(
        self,
        now: float,
        processes: Iterable[GpuProc],
        device_totals: Mapping[int, int | None],
        index: PodIndex,
        mig_devices: frozenset[int] = frozenset(),
    ) -> NodeDecisions:
        census = tuple(self._settle(now, self._classify(p, index), index) for p in processes)
        new = self._new(census)
        breaches: list[Breach] = []
        report_only: list[Breach] = []
        by_pod: dict[str, list[CensusEntry]] = {}
        for entry in census:
            if entry.standing is Standing.ADMITTED and entry.pod is not None:
                by_pod.setdefault(entry.pod.uid, []).append(entry)
            elif entry.standing is Standing.UNACCOUNTED and entry.process.placement.path is not None:
                breach = self._unaccounted(entry)
                (breaches if self.mode is Mode.ENFORCE else report_only).append(breach)
        reported, allowed = self._foreign(census, index, breaches, report_only)
        for uid in set(self._cores) - set(by_pod):
            del self._cores[uid]  # the pod has no GPU process left (or is gone): its controller too
            self._configs.pop(uid, None)
            self._capped.pop(uid, None)
            self._attributions.pop(uid, None)
            self.generation += 1
        decisions: dict[str, Decisions] = {}
        throttle: dict[str, ThrottleTarget] = {}
        for uid, entries in by_pod.items():
            pod = entries[0].pod
            assert pod is not None and pod.config is not None
            core, lowered = self._core(pod, index, entries)
            result = core.step(now, self._attribution(uid, entries), device_totals, mig_devices)
            decisions[uid] = result
            enforce = self.mode is Mode.ENFORCE and pod.config.mode is Mode.ENFORCE
            for breach in self._pod_breaches(pod, entries, result, lowered):
                (breaches if enforce else report_only).append(breach)
            if enforce:
                throttle.update(_throttle_targets(pod, entries, result))
        for over, breach in self._claim_breaches(census, index):
            pod = index.pods[over.culprit[0]]
            enforce = self.mode is Mode.ENFORCE and pod.config is not None and pod.config.mode is Mode.ENFORCE
            (breaches if enforce else report_only).append(breach)
        # Unique keys: a container with processes on two devices is one breach (the first reason).
        unique = {b.cgroup: b for b in reversed(breaches)}
        pending = frozenset(e.process.placement.path for e in census
                            if e.standing is Standing.PENDING and e.process.placement.path is not None)
        step = self.backstop.step(now, unique.values(), pending)
        for episode in self.backstop.episodes.values():
            throttle.pop(episode.cgroup, None)  # terminated, not throttled (the act thaws it first)
        for _, episode in step.actions:
            throttle.pop(episode.cgroup, None)
        return NodeDecisions(census, step, MappingProxyType(throttle), MappingProxyType(decisions), new,
                             tuple({b.cgroup: b for b in report_only}.values()), MappingProxyType(dict(self._configs)),
                             reported, allowed)

    def next_due(self) -> float | None:
        return self.backstop.next_due()

    def wants_utilisation(self, now: float) -> bool:
        """Whether this poll reads SM utilisation: when any pod's Core wants a fresh reading. Every
        core is asked (each keeps its own timer; no core: the census needs no SM reading), on a clock
        that counts whole compute periods, so that the cores of pods started at different polls stay
        in step and one read, about once a period, serves them all (on their own clocks two groups
        of cores half a period apart would have the driver read at every poll)."""
        periods = math.floor(now / self._period) * self._period
        return any([core.wants_utilisation(periods) for core in self._cores.values()])

    # -- helpers ------------------------------------------------------------------------------

    def _classify(self, proc: GpuProc, index: PodIndex) -> CensusEntry:
        """``classify``, reused while the process's record and the pod index are the same objects."""
        key = (proc.pid, proc.start_time_ticks, proc.device_index)
        cached = self._classified.get(key)
        if cached is not None and cached[0] is proc and cached[1] is index:
            return cached[2]
        entry = classify(proc, index)
        self._classified[key] = (proc, index, entry)
        return entry

    def _core(self, pod: NodePod, index: PodIndex, entries: list[CensusEntry]) -> tuple[Core, Mapping[str, int]]:
        """The pod's Core on its config as the guardian holds it (lowered to its claims on the GPUs
        its containers are on), and what was lowered. A claim allocated or replaced after admission
        changes the share: a new Core on the new config (its compute window starts again)."""
        on: dict[str, set[str]] = {}
        for e in entries:
            if e.container is not None:
                on.setdefault(e.container, set()).add(e.process.device_uuid)
        config, lowered = self._capped_config(pod, index, {c: frozenset(u) for c, u in on.items()})
        core = self._cores.get(pod.uid)
        held = self._configs.get(pod.uid)
        if core is None or (held is not config and held != config):
            core = self._cores[pod.uid] = Core(config, compute_window_seconds=self._window,
                                               compute_period_seconds=self._period,
                                               compute_ineffective_seconds=self._ineffective)
            self._configs[pod.uid] = config
            self.generation += 1
        return core, lowered

    def _capped_config(self, pod: NodePod, index: PodIndex, on: Mapping[str, frozenset[str]],
                       ) -> tuple[EnforcerConfig, Mapping[str, int]]:
        """``claim_capped_config``, reused while the pod, the index and the GPUs are the same."""
        cached = self._capped.get(pod.uid)
        if cached is not None and cached[0] is pod and cached[1] is index and cached[2] == on:
            return cached[3]
        found = claim_capped_config(pod, index, on)
        self._capped[pod.uid] = (pod, index, on, found)
        return found

    def _attribution(self, uid: str, entries: list[CensusEntry]) -> Attribution:
        """The pod's processes as the Core takes them, reused while they are the same records."""
        key = tuple((e.process, e.container) for e in entries)
        cached = self._attributions.get(uid)
        if cached is not None and len(cached[0]) == len(key) and all(
                a[0] is b[0] and a[1] == b[1] for a, b in zip(cached[0], key, strict=True)):
            return cached[1]
        attribution = _attribution(entries)
        self._attributions[uid] = (key, attribution)
        return attribution

    def _settle(self, now: float, entry: CensusEntry, index: PodIndex) -> CensusEntry:
        """A pod or container the API server has not shown yet is given ``settle_seconds`` (the
        kubelet writes a new container's ID into the pod's status a moment after it starts); a
        known pod's unknown container is then unaccounted (or admin-allowed), an unknown pod stays
        pending."""
        path = entry.process.placement.path
        if entry.standing is not Standing.PENDING or path is None:
            if path is not None:
                self._pending_since.pop(path, None)
            return entry
        since = self._pending_since.setdefault(path, now)
        if entry.pod is not None and now - since >= self.settle_seconds:
            return _allowed(replace(entry, standing=Standing.UNACCOUNTED,
                                    why=f"{entry.why}, for {self.settle_seconds:g} s"), index)
        return entry

    def _new(self, census: tuple[CensusEntry, ...]) -> tuple[CensusEntry, ...]:
        fresh = []
        seen: dict[tuple[int, int, int], Standing] = {}
        for entry in census:
            p = entry.process
            key = (p.pid, p.start_time_ticks, p.device_index)
            seen[key] = entry.standing
            if self._seen.get(key) is not entry.standing:
                fresh.append(entry)
        if fresh or len(seen) != len(self._seen):
            self.generation += 1
            self._classified = {k: v for k, v in self._classified.items() if k in seen}
        self._seen = seen
        return tuple(fresh)

    def _foreign(self, census: tuple[CensusEntry, ...], index: PodIndex, breaches: list[Breach],
                 report_only: list[Breach]) -> tuple[tuple[Breach, ...], tuple[CensusEntry, ...]]:
        """The policy's verdict on each foreign process (:func:`foreign_verdict`): a container to
        terminate joins ``breaches`` (the unaccounted path: SIGTERM at once, SIGKILL after
        ``unaccounted_grace``), one in audit ``report_only``; the reports and the admin-allowed
        containers whose episode starts this poll are returned."""
        sharers: dict[str, dict[str, NodePod]] = {}
        for entry in census:
            if entry.standing is Standing.ADMITTED and entry.pod is not None:
                sharers.setdefault(entry.process.device_uuid, {})[entry.pod.uid] = entry.pod
        shared = frozenset(sharers)
        reports: dict[str, Breach] = {}
        allowing: dict[str, CensusEntry] = {}
        for entry in census:
            if entry.standing is Standing.ADMIN_ALLOWED:
                allowing.setdefault(_episode_key(entry), entry)
                continue
            found = foreign_verdict(entry, index, shared, self.mode, self.own)
            if found is None:
                continue
            verdict, why = found
            if verdict is Verdict.ADMIN_ALLOWED:
                allowing.setdefault(_episode_key(entry), replace(entry, why=why))
            elif verdict in (Verdict.TERMINATE, Verdict.AUDIT, Verdict.REPORT):
                breach = _foreign_breach(entry, why, tuple(sharers.get(entry.process.device_uuid, {}).values()),
                                         self.unaccounted_grace)
                if verdict is Verdict.TERMINATE and entry.process.placement.path is not None:
                    breaches.append(breach)
                elif verdict is Verdict.AUDIT:
                    report_only.append(breach)
                else:
                    reports.setdefault(_episode_key(entry), breach)
        started_reports = tuple(b for k, b in reports.items() if k not in self._reporting)
        started_allowed = tuple(e for k, e in allowing.items() if k not in self._allowing)
        self._reporting, self._allowing = set(reports), set(allowing)
        return started_reports, started_allowed

    def _unaccounted(self, entry: CensusEntry) -> Breach:
        place = entry.process.placement
        assert place.path is not None
        pod = entry.pod
        return Breach(
            cgroup=place.path, placement=place, reason="unaccounted", term_delay=0.0,
            kill_delay=self.unaccounted_grace,
            record=MappingProxyType({
                "namespace": pod.namespace if pod else None, "pod": pod.name if pod else None,
                "pod_uid": place.pod_uid, "container": entry.container, "container_id": place.container_id,
                "why": entry.why, "pid": entry.process.pid, "uuid": entry.process.device_uuid,
                "used_bytes": entry.process.used_memory_bytes,
            }),
        )

    def _claim_breaches(self, census: tuple[CensusEntry, ...], index: PodIndex) -> list[tuple[ClaimOveruse, Breach]]:
        """A shared claim over its capacity: the chosen container (``reserved.claim_overuse``) is the
        guardian's to terminate at once (no sidecar sees the other pods), SIGKILL after its pod's grace
        period. A claim with a member already being terminated waits for that one to end."""
        usage: dict[ContainerKey, int] = {}
        places: dict[ContainerKey, set[str]] = {}
        placement: dict[ContainerKey, Placement] = {}
        for entry in census:
            if entry.standing is Standing.ADMITTED and entry.pod is not None and entry.container is not None:
                key = (entry.pod.uid, entry.container)
                usage[key] = usage.get(key, 0) + (entry.process.used_memory_bytes or 0)
                if entry.process.placement.path is not None:
                    places.setdefault(key, set()).add(entry.process.placement.path)
                    placement.setdefault(key, entry.process.placement)
        found = []
        for over in claim_overuse(index, usage):
            if any(places.get(m, set()) & set(self.backstop.episodes) for m in over.usage):
                continue
            place = placement.get(over.culprit)
            pod = index.pods[over.culprit[0]]
            if place is None or place.path is None or pod.config is None:
                continue
            found.append((over, Breach(
                cgroup=place.path, placement=place, reason="claim_over_capacity", term_delay=0.0,
                kill_delay=pod.config.grace_period_seconds,
                record=MappingProxyType({
                    "namespace": pod.namespace, "pod": pod.name, "pod_uid": pod.uid, "container": over.culprit[1],
                    "container_id": place.container_id, "claim": over.claim, "claim_capacity_bytes": over.capacity,
                    "claim_used_bytes": over.total, "fair_part_bytes": over.fair,
                    "used_bytes": over.usage[over.culprit],
                    "sharing": {f"{index.pods[u].name}/{c}": b for (u, c), b in sorted(over.usage.items())},
                    "why": (f"ResourceClaim {over.claim}: {over.total} bytes used by {len(over.usage)} containers, "
                            f"{over.capacity} reserved; this one uses {over.usage[over.culprit]}, "
                            f"the furthest past its part ({over.fair})"),
                }),
            )))
        return found

    def _pod_breaches(self, pod: NodePod, entries: list[CensusEntry], result: Decisions,
                      lowered: Mapping[str, int]) -> list[Breach]:
        assert pod.config is not None
        handover = pod.config.poll_interval_seconds + 2 * self.poll_interval
        grace = pod.config.grace_period_seconds
        by_name: dict[str, list[Placement]] = {}
        for entry in entries:
            if entry.container is not None:
                by_name.setdefault(entry.container, []).append(entry.process.placement)
        breaches = []
        for order in result.orders:
            if order.container is None:
                continue  # the guardian names every process's container: it gives the Core none unattributed
            one_shot = order.ineffective_use is not None or bool(order.evaded_pids)
            # A share lowered to the claim's allocation is the guardian's alone: the sidecar holds
            # the admitted (larger) one and never acts on it.
            by_claim = _reason(order) == "memory_over_share" and order.container in lowered
            one_shot = one_shot or by_claim
            for place in {p.path: p for p in by_name.get(order.container, ())}.values():
                assert place.path is not None
                breaches.append(Breach(
                    cgroup=place.path, placement=place, reason=_reason(order),
                    term_delay=0.0 if one_shot else None,
                    kill_delay=grace if one_shot else grace + handover,
                    record=MappingProxyType({**_order_record(pod, order, place),
                                             **({"claim_bound_bytes": lowered[order.container]} if by_claim else {})}),
                ))
        return breaches


def _episode_key(entry: CensusEntry) -> str:
    """A container's episode is its cgroup's; a host process's its own (a host cgroup is no unit:
    a service, a session or the root)."""
    p = entry.process
    if entry.pod is not None and p.placement.path is not None:
        return p.placement.path
    return f"{p.placement.path or '?'}#{p.pid}:{p.start_time_ticks}"


def _foreign_breach(entry: CensusEntry, why: str, sharing: tuple[NodePod, ...], grace: float) -> Breach:
    """A foreign process's breach, named by its standing (``other_namespace``, ``host``); the record
    names the opted-in pods it shares the GPU with (for the log and the host's Events)."""
    place = entry.process.placement
    pod = entry.pod
    return Breach(
        cgroup=place.path or "", placement=place, reason=entry.standing.value, term_delay=0.0, kill_delay=grace,
        record=MappingProxyType({
            "namespace": pod.namespace if pod else None, "pod": pod.name if pod else None,
            "pod_uid": place.pod_uid, "container": entry.container, "container_id": place.container_id,
            "why": why, "pid": entry.process.pid, "uuid": entry.process.device_uuid,
            "used_bytes": entry.process.used_memory_bytes, "standing": entry.standing.value,
            "policy_key": POLICY_KEYS[entry.standing],
            "sharing_pods": [{"namespace": p.namespace, "pod": p.name, "pod_uid": p.uid} for p in sharing],
        }),
    )


def _reason(order: TerminateOrder) -> str:
    if order.ineffective_use is not None:
        return "throttle_ineffective"
    if order.evaded_pids:
        return "throttle_evaded"
    if order.gpus_requested is not None:
        return "gpus_over_request"
    return "memory_over_share"


def _order_record(pod: NodePod, order: TerminateOrder, place: Placement) -> dict[str, Any]:
    return {
        "namespace": pod.namespace, "pod": pod.name, "pod_uid": pod.uid, "container": order.container,
        "container_id": place.container_id, "uuid": order.device_uuid, "gpu": order.device_index,
        "used_bytes": order.used_bytes, "limit_bytes": order.limit_bytes,
        "gpus_requested": order.gpus_requested,
        "sm_utilization": order.ineffective_use, "compute_share": order.compute_share,
    }


def _attribution(entries: list[CensusEntry]) -> Attribution:
    processes = tuple(
        PodProcess(
            pid=e.process.pid, nvml_pid=e.process.pid, start_time_ticks=e.process.start_time_ticks,
            container=e.container, device_index=e.process.device_index, device_uuid=e.process.device_uuid,
            used_memory_bytes=e.process.used_memory_bytes, sm_util=e.process.sm_util,
            cgroup=e.process.placement.path,
        )
        for e in entries
    )
    return Attribution(processes, ())


def _throttle_targets(pod: NodePod, entries: list[CensusEntry], result: Decisions) -> dict[str, ThrottleTarget]:
    targets = {}
    for entry in entries:
        name = entry.container
        place = entry.process.placement
        if name is not None and name in result.plan and place.path is not None:
            targets[place.path] = ThrottleTarget(result.plan[name], place, pod, name)
    return targets
