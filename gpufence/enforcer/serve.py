"""The enforcer process's life once it is wired (``cli._run``): HTTP, heartbeat, poll thread, signals.

In order: serve ``/metrics``, ``/healthz``, ``/readyz`` on a thread of their own (optional: a taken
port only costs the endpoint), open NVML, log ``started``, then write the heartbeat the kubelet's
probes read (so the postStart hook, which lets the workload containers start, returns only after
``started``), start the throttle and the poll thread, and wait for a signal or the poll thread's
death. No event loop: threads and ``signal.signal``, which keeps asyncio out of the start-up.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gpufence import __version__
from gpufence.enforcer.act.state_files import write_text
from gpufence.enforcer.probe import HEARTBEAT_FILE, heartbeat_text, own_start_time
from gpufence.enforcer.probe import clock as probe_clock
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.health import (
    HEARTBEAT_PAUSE_SECONDS,
    HEARTBEAT_PERIOD_SECONDS,
    HEARTBEAT_STALE_AFTER_SECONDS,
    Health,
    make_app,
)

EXIT_POLL_THREAD_DIED = 3  # the exit status cli.py documents


def _seconds_since_process_start() -> float | None:
    """From this process's start (the container's, in the sidecar) to now, on the kernel's clock."""
    try:
        ticks = own_start_time()
    except (OSError, IndexError, ValueError):
        return None
    return round(time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"), 3)


def serve(
    args: argparse.Namespace, enforcer, metrics, health, log: DecisionLog, port: int, pod,
    device_prefix: str, throttle,
) -> int:
    """Runs on the main thread (signal handlers need it) until a signal or the poll thread's death."""
    from gpufence.enforcer.observe.procfs import own_privileges, privilege_limits
    from gpufence.enforcer.report.http_server import start_server

    privileges = own_privileges()
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, on_signal)

    server, bound_port = None, None
    try:
        server, bound_port = start_server(make_app(metrics, health), args.bind_address, port)
    except OSError as exc:
        # Any container of the pod can hold the port (the network namespace is shared): that must
        # not end enforcement. Once, here; the heartbeat's detail repeats it.
        detail = f"cannot serve on {args.bind_address}:{port}: {exc.strerror or exc}"
        health.serving_failed(detail)
        log.error("http_failed", error=detail,
                  reason="enforcing without /metrics, /healthz and /readyz; the sidecar's probes read the heartbeat")
    enforcer.open_nvml()  # the HTTP server answers meanwhile, on its own thread
    log.info(
        "started", version=__version__, startup_seconds=_seconds_since_process_start(),
        startup_cpu_seconds=round(time.process_time(), 3),
        pid_mode=enforcer.pid_mode, driver_version=enforcer.driver_version, metrics_port=bound_port,
        bind_address=args.bind_address, mode=enforcer.config.mode, enforcer_pid=os.getpid(),
        state_dir=args.state_dir, host_proc=args.host_proc, device_prefix=device_prefix,
        config=enforcer.config.to_dict(), privileges=privileges,
    )
    for limit in privilege_limits(privileges):
        log.warning("privilege_limit", limit=limit)
    # The first heartbeat only now: the postStart hook returns on it, and the kubelet then starts
    # the workload containers, so they start after the `started` record, never before NVML was tried.
    thread_stop = threading.Event()
    heartbeats = None
    if args.state_dir:
        heartbeats = threading.Thread(target=write_heartbeats, args=(health, args.state_dir, log, thread_stop),
                                      kwargs={"on_pause": enforcer.report_paused},
                                      name="gpufence-heartbeat", daemon=True)
        heartbeats.start()
    else:
        log.warning("heartbeat_disabled", reason="no --state-dir: the sidecar's probe (--probe) cannot pass")
    throttle.start()

    died: list[str] = []

    def poll() -> None:
        trace: str | None
        try:
            enforcer.run(thread_stop)
        except BaseException as exc:  # the loop catches every Exception of a tick; not all of them
            # format_exception_only survives an exception whose str() raises.
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            trace = traceback.format_exc(limit=8)
        else:
            if thread_stop.is_set():
                return
            error, trace = "the poll loop returned", None
        died.append(error)
        # Nothing is enforced from here on: /healthz fails, and the process exits non-zero so the
        # kubelet restarts it (a plain container under OnFailure restarts only on failure).
        health.poll_thread_died(error)
        log.error(
            "poll_thread_died", error=error, traceback=trace, exit_status=EXIT_POLL_THREAD_DIED,
            reason="nothing is enforced without the poll thread: exiting for the kubelet to restart the sidecar",
        )
        stop.set()

    poller = threading.Thread(target=poll, name="gpufence-poll", daemon=True)
    poller.start()
    try:
        while not stop.wait(1.0):  # a bounded wait: the signal handlers run between its rounds at worst
            pass
    finally:
        thread_stop.set()
        # Continue everything first: the poll thread may be stuck in an NVML call for a while
        # (a later throttle update is ignored once the executor is closed).
        throttle.close("shutdown")
        poller.join(10)
        if heartbeats is not None:
            heartbeats.join(2)
        if server is not None:
            server.close()
        status = EXIT_POLL_THREAD_DIED if died else 0
        log.info("shutdown", signal=received[0] if received else None, exit_status=status)
    return status


class _Log(Protocol):
    def error(self, event: str, **fields: object) -> None: ...
    def info(self, event: str, **fields: object) -> None: ...


def write_heartbeats(health: Health, state_dir: str, log: _Log, stop: threading.Event, clock=probe_clock,
                     on_pause: Callable[[float], None] | None = None) -> None:
    """Rewrite ``<state_dir>/heartbeat`` every ``HEARTBEAT_PERIOD_SECONDS`` until ``stop`` is set
    (a thread of its own).

    A write that fails (the state volume full...) is logged once and retried: the probe then sees a
    stale heartbeat and the kubelet restarts the sidecar, as it should for an enforcer that cannot
    record what it stopped either.

    A gap between two heartbeats longer than the period by ``HEARTBEAT_PAUSE_SECONDS`` means the
    enforcer was held from outside (SIGSTOP by a workload, a freezer): it cannot see that while it
    is held, but says so as soon as it runs again (``enforcer_was_paused``, with the seconds lost,
    and ``on_pause(seconds)``: the loop's Event and metric).
    """
    path = Path(state_dir) / HEARTBEAT_FILE
    pid, started = os.getpid(), own_start_time()
    failing = False
    last: float | None = None
    while True:
        live, detail = health.heartbeat()
        now = clock()
        if last is not None and now - last > HEARTBEAT_PERIOD_SECONDS + HEARTBEAT_PAUSE_SECONDS:
            lost = now - last - HEARTBEAT_PERIOD_SECONDS
            log.error("enforcer_was_paused", seconds=round(lost, 3),
                      reason="the enforcer did not run for that long (stopped by another process, frozen or "
                      "starved): nothing was enforced meanwhile")
            if on_pause is not None:
                on_pause(lost)
        last = now
        text = heartbeat_text(live, detail, now, HEARTBEAT_STALE_AFTER_SECONDS, pid, started)
        try:
            write_text(path, text)
        except OSError as exc:
            if not failing:
                log.error("heartbeat_failed", path=str(path), error=str(exc),
                          reason="the sidecar's probe fails on a stale heartbeat: the kubelet restarts it")
            failing = True
        else:
            if failing:
                log.info("heartbeat_resumed", path=str(path))
            failing = False
        if stop.wait(HEARTBEAT_PERIOD_SECONDS):
            return
