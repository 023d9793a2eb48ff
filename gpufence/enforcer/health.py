"""HTTP endpoints of the enforcer: ``/metrics``, ``/healthz``, ``/readyz`` (aiohttp).

* ``/healthz`` — liveness. 503 when an NVML call has hung past its deadline (only a new process
  can use NVML again: the kubelet restarts the sidecar, which continues what this one stopped from
  the stopped-state file), when the poll loop has not completed a tick for a while (stuck), or once
  the poll thread died (until the process, which then exits non-zero, is gone); otherwise 200.
  NVML merely unavailable (an error, not a hang) stays 200: the poll loop retries by itself and a
  restart loop would not help.
* ``/readyz`` — 200 once NVML answered and the last successful poll is fresher than three poll
  intervals, else 503 with the reason.
* ``/metrics`` — the enforcer's own Prometheus registry.

Handlers only read a few fields of :class:`Health` (a tiny thread-safe record the poll loop
updates), so they never wait on NVML.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from gpufence.enforcer.metrics import EnforcerMetrics

READY_STALENESS_INTERVALS = 3
# The poll loop is stuck when no tick completed for this many intervals plus the NVML deadline
# (a tick may legitimately wait that long for NVML).
LIVE_STALENESS_INTERVALS = 5


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


METRICS_KEY = web.AppKey("metrics", EnforcerMetrics)
HEALTH_KEY = web.AppKey("health", Health)


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _healthz(request: web.Request) -> web.Response:
    live, reason = request.app[HEALTH_KEY].liveness()
    return web.Response(text=reason + "\n", status=200 if live else 503)


async def _readyz(request: web.Request) -> web.Response:
    ready, reason = request.app[HEALTH_KEY].readiness()
    return web.Response(text=reason + "\n", status=200 if ready else 503)


def make_app(metrics: EnforcerMetrics, health: Health) -> web.Application:
    app = web.Application()
    app[METRICS_KEY] = metrics
    app[HEALTH_KEY] = health
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    return app


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start serving; returns the runner (for cleanup) and the bound port (useful with port 0)."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = port
    for addr in runner.addresses:
        if isinstance(addr, tuple) and len(addr) >= 2:
            bound = int(addr[1])
            break
    return runner, bound
