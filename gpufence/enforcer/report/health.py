"""The enforcer's health: one rule (:class:`Health`), told to the kubelet by a heartbeat file and to
people and Prometheus over HTTP (``/metrics``, ``/healthz``, ``/readyz``: gpufence/enforcer/report/http_server.py).

* liveness (``Health.liveness``) — fails when an NVML call has hung past its deadline (only a new
  process can use NVML again: the kubelet restarts the sidecar, which continues what this one
  stopped from the stopped-state file), when the poll loop has not completed a tick for a while
  (stuck), or once the poll thread died (until the process, which then exits non-zero, is gone).
  NVML merely unavailable (an error, not a hang) stays live: the poll loop retries by itself and a
  restart loop would not help.
* the heartbeat (``serve.write_heartbeats``) — about once a second a thread of its own writes that decision,
  with its detail, into ``heartbeat`` in the state directory; the sidecar's exec probe
  (``enforcer.probe``) passes only on a fresh one from a running enforcer of its own container. A
  stopped or frozen process writes nothing, so its heartbeat goes stale and the kubelet restarts it.
  The kubelet does not probe the HTTP port: any container of the pod can take that port.
* ``/healthz`` answers the same liveness (its first line), then one line per GPU container naming
  the mechanism that holds its memory share (``memory <container>: driver|mps|preload|polling``,
  what the ``memory_enforcement`` log line and the ``gpufence_container_memory_enforcement`` gauge
  say), so a person checking a pod sees at once whether the driver's limit is in force;
* ``/readyz`` 200 once NVML answered and the last successful poll is fresher than three poll
  intervals, else 503 with the reason; ``/metrics`` the
  enforcer's own Prometheus registry. The HTTP server is optional: an enforcer that cannot bind its
  port enforces all the same (``serving_failed``), and its heartbeat's detail says so.

Handlers and the heartbeat only read a few fields of :class:`Health` (a tiny thread-safe record
the poll loop updates), so they never wait on NVML.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpufence.enforcer.report.http_server import Route
from gpufence.enforcer.report.metrics import EnforcerMetrics

READY_STALENESS_INTERVALS = 3
# The poll loop is stuck when no tick completed for this many intervals plus the NVML deadline
# (a tick may legitimately wait that long for NVML).
LIVE_STALENESS_INTERVALS = 5
# The heartbeat thread rewrites the heartbeat this often. The probe fails a heartbeat older than
# three periods plus a margin for a CPU-throttled sidecar (at a 250-500m limit: a few 100 ms CFS
# periods) and for the probe's own start: a stopped enforcer is seen within 5 s, a live one never
# missed. The poll interval enters through the liveness the heartbeat carries (a poll loop stuck
# for five intervals plus the NVML deadline makes it say "not live"), not through a second bound.
HEARTBEAT_PERIOD_SECONDS = 1.0
HEARTBEAT_STALE_AFTER_SECONDS = 3 * HEARTBEAT_PERIOD_SECONDS + 2.0
# A gap this much longer than the period between two heartbeats means the whole process was held
# (SIGSTOP, a freezer, a node stalled): said once it runs again (``enforcer_was_paused``).
HEARTBEAT_PAUSE_SECONDS = 2.0


@dataclass
class _Snapshot:
    nvml_up: bool
    last_success: float | None
    interval: float


class Health:
    def __init__(self, interval: float, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._nvml_up = False
        self._last_success: float | None = None
        self._interval = interval
        self._started = clock()
        self._last_tick: float | None = None
        self._nvml_hung: Callable[[], float | None] = lambda: None
        self._nvml_timeout = 0.0
        self._poll_thread_died: str | None = None
        self._serving_failed: str | None = None
        self._memory_mechanisms: dict[str, str] = {}

    def memory_enforcement(self, container: str, mechanism: str) -> None:
        """The mechanism that now holds ``container``'s memory share (told by the driver-limit reporter)."""
        with self._lock:
            self._memory_mechanisms[container] = mechanism

    def memory_mechanisms(self) -> dict[str, str]:
        with self._lock:
            return dict(self._memory_mechanisms)

    def watch_nvml(self, hung_for: Callable[[], float | None], timeout: float = 0.0) -> None:
        """``hung_for()``: seconds an NVML call is overdue, None if none is (the deadline runner)."""
        with self._lock:
            self._nvml_hung = hung_for
            self._nvml_timeout = timeout

    def poll_thread_died(self, error: str) -> None:
        """Nothing is enforced any more: liveness fails from now on."""
        with self._lock:
            self._poll_thread_died = error

    def tick_completed(self) -> None:
        with self._lock:
            self._last_tick = self._clock()

    def liveness(self) -> tuple[bool, str]:
        with self._lock:
            hung_for, last, interval = self._nvml_hung, self._last_tick, self._interval
            since = self._started if last is None else last
            limit = LIVE_STALENESS_INTERVALS * interval + self._nvml_timeout
            died = self._poll_thread_died
        if died is not None:
            return False, f"the poll thread died ({died}): nothing is enforced; the enforcer exits"
        late = hung_for()
        if late is not None:
            return False, f"an NVML call is hung ({late:.1f}s past its deadline): restart to use NVML again"
        age = self._clock() - since
        if age > limit:
            return False, f"the poll loop has not completed a tick for {age:.1f}s (limit {limit:.1f}s)"
        return True, "ok"

    def serving_failed(self, detail: str) -> None:
        """The HTTP server is not running (its port taken...): enforcement goes on, the heartbeat says so."""
        with self._lock:
            self._serving_failed = detail

    def heartbeat(self) -> tuple[bool, str]:
        """What the heartbeat carries: liveness (the one rule), its reason and the degraded states."""
        live, reason = self.liveness()
        notes = [reason]
        ready, why = self.readiness()
        if not ready:
            notes.append(f"not ready: {why}")
        with self._lock:
            failed = self._serving_failed
        if failed is not None:
            notes.append(f"no /metrics, /healthz, /readyz: {failed}")
        return live, "; ".join(notes)

    def set_interval(self, interval: float) -> None:
        with self._lock:
            self._interval = interval

    def nvml(self, up: bool) -> None:
        with self._lock:
            self._nvml_up = up

    def poll_succeeded(self) -> None:
        with self._lock:
            self._last_success = self._clock()

    def readiness(self) -> tuple[bool, str]:
        with self._lock:
            snap = _Snapshot(self._nvml_up, self._last_success, self._interval)
        if not snap.nvml_up:
            return False, "NVML is not available"
        if snap.last_success is None:
            return False, "no successful poll yet"
        age = self._clock() - snap.last_success
        limit = READY_STALENESS_INTERVALS * snap.interval
        if age > limit:
            return False, f"last successful poll {age:.2f}s ago (limit {limit:.2f}s)"
        return True, "ok"


_TEXT = "text/plain; charset=utf-8"


def healthz_body(reason: str, mechanisms: dict[str, str]) -> str:
    """The liveness reason, then ``memory <container>: <mechanism>`` per container, by name."""
    return "".join([reason + "\n", *(f"memory {c}: {m}\n" for c, m in sorted(mechanisms.items()))])


def make_app(metrics: EnforcerMetrics, health: Health) -> dict[str, Route]:
    """The routes of the enforcer's HTTP endpoint (gpufence/enforcer/report/http_server.py)."""

    def metrics_page() -> tuple[int, str, bytes]:
        body, content_type = metrics.render()
        return 200, content_type, body

    def healthz() -> tuple[int, str, bytes]:
        live, reason = health.liveness()
        return (200 if live else 503), _TEXT, healthz_body(reason, health.memory_mechanisms()).encode()

    def readyz() -> tuple[int, str, bytes]:
        ready, reason = health.readiness()
        return (200 if ready else 503), _TEXT, (reason + "\n").encode()

    return {"/metrics": metrics_page, "/healthz": healthz, "/readyz": readyz}
