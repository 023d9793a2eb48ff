"""The sidecar's liveness probe and postStart hook: a heartbeat only the enforcer writes, checked by exec.

Why not HTTP: every container of a pod shares its network namespace, so a workload can take the
enforcer's port while the sidecar restarts (the enforcer then cannot bind it) or answer its own
``/healthz`` there. A port a workload can take is not a health check. So the kubelet execs this
probe inside the sidecar container instead, and it asks the enforcer itself:

* the enforcer writes ``heartbeat`` into its state directory (``--state-dir``, the sidecar's own
  ``gpufence-state`` volume) about once a second, from a thread of its own: whether it is live by the
  one health rule (``Health.liveness``: the poll loop ticks, no NVML call is hung), the detail,
  when it wrote (``CLOCK_BOOTTIME``, one clock for every process of the node) and how stale a
  heartbeat may get before the enforcer counts as stopped or stuck (derived from its poll
  interval), with its pid and start time;
* the probe fails when the file is missing or malformed, when the heartbeat says not live, when it
  is older than its bound (a SIGSTOPped, frozen or wedged enforcer writes nothing), or when the
  process it names is not a running enforcer of this container: gone, another process since (its
  start time differs), stopped (``T``/``t``: a heartbeat rewritten by someone else while the
  enforcer is held stopped does not pass), rooted elsewhere (its ``/proc/<pid>/root`` is not our
  ``/``), or in another cgroup than the probe itself (``/proc/<pid>/cgroup`` differs from
  ``/proc/self/cgroup``).

The cgroup is what a workload cannot copy: the kubelet's exec probe runs in the sidecar container's
cgroup, and a process of another container cannot enter it (moving a process needs write access to
the cgroup filesystem, which the runtime mounts read-only in an unprivileged container). The root
directory alone is not enough: a root process can ``chroot("/proc/<enforcer pid>/root")``, then
write a heartbeat naming itself and SIGSTOP the enforcer (issue 32, row 1); it stays in its own
cgroup, so the probe fails. A workload that could write the file still cannot make the probe pass
for a stopped enforcer, and one that holds the HTTP port changes nothing here. It runs every 10 s
for the life of the pod, so it imports nothing but ``os``, ``sys`` and ``time`` (no json, no re,
nothing of gpufence): the kubelet runs it as ``python3 -Ic`` (``gpufence.contract.PROBE_COMMAND``),
which calls :func:`run`.

The same check holds the workload back until the enforcer is up: the sidecar's ``postStart`` hook
(``gpufence.contract.POST_START_COMMAND``, :func:`wait`) repeats it every few milliseconds and
returns as soon as it passes. The kubelet starts the next container only after a native sidecar's
postStart hook returned, and kills and restarts the sidecar when the hook fails (here: no passing
heartbeat within ``WAIT_SECONDS``, or no enforcer left in the container), so the workload never
runs before enforcement. A startup probe did the same on the kubelet's one-second probe tick: the
enforcer was up in 0.5-0.7 s but seen up after a median 1.6 s.
"""

from __future__ import annotations

import os
import sys
import time

# Not ``typing.TYPE_CHECKING``: importing typing would cost every probe run more than the check.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

HEARTBEAT_FILE = "heartbeat"
_MAGIC = "gpufence-heartbeat"
_VERSION = "1"
# The same name as gpufence.contract.ENV_STATE_DIR (tests/unit/enforcer/test_probe.py): importing
# the contract would load json and re, doubling what each probe run costs.
_ENV_STATE_DIR = "GPUFENCE_STATE_DIR"
# Where the webhook mounts the enforcer's state volume (gpufence.contract.DEFAULT_STATE_DIR), so the
# sidecar needs no variable to name it.
_DEFAULT_STATE_DIR = "/var/run/gpufence"
_MAX_BYTES = 4096
_STOPPED_STATES = frozenset("TtXZx")
# How long the postStart hook waits for a passing heartbeat (the startup probe's budget before it:
# 60 tries a second apart), and how often it looks: each look is a few system calls.
WAIT_SECONDS = 60.0
WAIT_STEP_SECONDS = 0.02
# How often the hook looks whether the enforcer still runs (a scan of /proc).
ALIVE_CHECK_SECONDS = 0.5


def clock() -> float:
    """The heartbeat's clock: never set by NTP, the same in every container of the node."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def own_start_time() -> int:
    """This process's start time (clock ticks after boot, /proc/self/stat field 22)."""
    return _stat(os.getpid())[1]


def heartbeat_text(live: bool, detail: str, written: float, stale_after: float, pid: int, start_time: int) -> str:
    """The file's two lines: the fields, then the free-text detail (one line)."""
    detail = " ".join(detail.split())
    return (f"{_MAGIC} {_VERSION} {int(live)} {written:.3f} {stale_after:.3f} {pid} {start_time}\n"
            f"{detail}\n")


def _stat(pid: int) -> tuple[str, int]:
    """(state letter, start time) of ``pid``; OSError when there is none (or we may not look)."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    # comm, in parentheses, may itself hold spaces and parentheses: split after the last ')'.
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def _cgroup(pid: int | str) -> str:
    """``pid``'s ``/proc/<pid>/cgroup`` (world-readable; ``"self"``: this process's): the container a
    process runs in, which no process of another container can enter or copy."""
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


def _root(pid: int | str) -> tuple[int, int]:
    """The (device, inode) of ``pid``'s root directory: the same for every process of one container
    (``"self"``: this process's), another for a process of another container of the pod."""
    st = os.stat(f"/proc/{pid}/root")
    return st.st_dev, st.st_ino


def check(state_dir: str, now: float | None = None) -> tuple[bool, str]:
    """(passes, why) for the heartbeat in ``state_dir``."""
    path = os.path.join(state_dir, HEARTBEAT_FILE)
    try:
        # Non-blocking and not following a link: whatever sits there, the probe does not hang on it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            raw = os.read(fd, _MAX_BYTES)
        finally:
            os.close(fd)
    except OSError as exc:
        return False, f"no heartbeat at {path} ({exc.strerror or exc}): the enforcer has not started"
    try:
        head, _, rest = raw.decode().partition("\n")
        magic, version, live, written, stale_after, pid, start_time = head.split()
        if (magic, version) != (_MAGIC, _VERSION) or live not in ("0", "1"):
            raise ValueError(head[:80])
        written_at, bound = float(written), float(stale_after)
        enforcer, started = int(pid), int(start_time)
    except (UnicodeDecodeError, ValueError) as exc:
        return False, f"malformed heartbeat {path}: {exc}"
    detail = rest.strip()[:300]
    if enforcer == os.getpid() or enforcer <= 0:
        return False, f"the heartbeat names pid {enforcer}, not an enforcer"
    try:
        state, actual_start = _stat(enforcer)
        ours = _root("self")
        theirs = _root(enforcer)
        same_cgroup = _cgroup(enforcer) == _cgroup("self")
    except (OSError, IndexError, ValueError) as exc:
        return False, f"the enforcer (pid {enforcer}) of the heartbeat is gone or unreadable ({exc})"
    if actual_start != started:
        return False, f"pid {enforcer} is not the process that wrote the heartbeat (it started later)"
    if theirs != ours:
        return False, f"pid {enforcer} of the heartbeat runs in another container"
    if state in _STOPPED_STATES:
        return False, f"the enforcer (pid {enforcer}) is stopped or dead (state {state})"
    if live != "1":
        return False, f"the enforcer is not live: {detail}"
    age = (clock() if now is None else now) - written_at
    if age > bound:
        return False, f"the heartbeat is {age:.1f}s old (bound {bound:.1f}s): the enforcer is stuck; {detail}"
    if age < -1.0:
        return False, f"the heartbeat is dated {-age:.1f}s in the future"
    if not same_cgroup:
        # Last, so that a stale or not-live heartbeat says so; any failure fails the probe alike.
        return False, f"pid {enforcer} of the heartbeat runs in another container (another cgroup than the probe's)"
    return True, detail or "ok"


def probe(state_dir: str | None) -> int:
    """0 when the heartbeat passes, else 1; the reason on stdout (the kubelet puts it in the Event)."""
    if not state_dir:
        print(f"gpufence probe: no state directory (--state-dir or {_ENV_STATE_DIR}) to find the heartbeat in")
        return 1
    ok, why = check(state_dir)
    print(f"gpufence probe: {why}")
    return 0 if ok else 1


def _state_dir() -> str:
    """The state directory: the first argument, else the environment's, else the sidecar's mount."""
    return sys.argv[1] if len(sys.argv) > 1 else os.environ.get(_ENV_STATE_DIR) or _DEFAULT_STATE_DIR


def main() -> int:
    """:func:`probe` of the state directory :func:`_state_dir` names."""
    return probe(_state_dir())


def run() -> None:
    """The kubelet's entry point (``PROBE_COMMAND``): exits with :func:`main`'s status."""
    raise SystemExit(main())


def container_has_another_process() -> bool:
    """Whether a process other than this one (and its parent) runs in this container: one whose
    ``/proc/<pid>/root`` is our ``/``. The pod shares one PID namespace, so the enforcer's exit does
    not end the hook; this is how the hook tells that the enforcer is gone. Unreadable entries
    count as alive: the hook must never give up on an enforcer it merely cannot see."""
    ours = _root("self")
    me, parent = os.getpid(), os.getppid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (me, parent):
            continue
        try:
            theirs = _root(entry)
        except FileNotFoundError:
            continue  # exited while we looked
        except OSError:
            return True
        if theirs == ours:
            return True
    return False


def wait_until_up(state_dir: str, timeout: float = WAIT_SECONDS, step: float = WAIT_STEP_SECONDS,
                  alive: Callable[[], bool] = container_has_another_process) -> int:
    """0 as soon as the heartbeat in ``state_dir`` passes, 1 when it has not within ``timeout``
    seconds or the container holds no other process (the enforcer exited: the kubelet, which waits
    for this hook before it acts on anything else in the pod, then restarts it at once instead of
    after the timeout); the reason on stdout (the kubelet puts a failed hook's output in its Event)."""
    started = time.monotonic()
    deadline, next_look = started + timeout, started + ALIVE_CHECK_SECONDS
    while True:
        ok, why = check(state_dir)
        if ok:
            return 0
        now = time.monotonic()
        if now >= deadline:
            print(f"gpufence postStart: the enforcer was not up within {timeout:g}s: {why}")
            return 1
        if now >= next_look:
            if not alive():
                print(f"gpufence postStart: the enforcer exited before it was up: {why}")
                return 1
            next_look = now + ALIVE_CHECK_SECONDS
        time.sleep(step)


def wait() -> None:
    """The kubelet's postStart entry point (``POST_START_COMMAND``): :func:`wait_until_up`'s status
    for the state directory :func:`_state_dir` names."""
    raise SystemExit(wait_until_up(_state_dir()))
