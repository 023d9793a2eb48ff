"""The enforcer process's life once it is wired (``cli._run``): HTTP, heartbeat, poll thread, signals.

In order: serve ``/metrics``, ``/healthz``, ``/readyz`` on a thread of their own (optional: a taken
port only costs the endpoint), open NVML, log ``started``, then write the heartbeat the kubelet's
probes read (so the postStart hook, which lets the workload containers start, returns only after
``started``), start the throttle and the poll thread, and wait for a signal or the poll thread's
death. No event loop: threads and ``signal.signal``, which keeps asyncio out of the start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

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

if TYPE_CHECKING:
    from gpufence.enforcer.report.http_server import HttpServer

EXIT_POLL_THREAD_DIED = 3  # the exit status cli.py documents


def _seconds_since_process_start() -> float | None:
    """From this process's start (the container's, in the sidecar) to now, on the kernel's clock."""
    try:
        ticks = own_start_time()
    except (OSError, IndexError, ValueError):
        return None
    return round(time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"), 3)


class _Exit:
    """Why the process ends: the first signal received, or the poll thread's death."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal: str | None = None
        self.poll_thread_died = False

    def on_signal(self, signum: int, _frame: object) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
        self.event.set()

    @property
    def status(self) -> int:
        return EXIT_POLL_THREAD_DIED if self.poll_thread_died else 0


def serve(
    args: argparse.Namespace, enforcer, metrics, health, log: DecisionLog, port: int, pod,
    device_prefix: str, throttle,
) -> int:
    """Runs on the main thread (signal handlers need it) until a signal or the poll thread's death."""
    from gpufence.enforcer.observe.procfs import own_privileges

    privileges = own_privileges()
    ending = _Exit()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, ending.on_signal)
    server, bound_port = _start_http(args, metrics, health, log, port)
    enforcer.open_nvml()  # the HTTP server answers meanwhile, on its own thread
    _log_started(args, enforcer, log, bound_port, device_prefix, privileges)
    # The first heartbeat only now: the postStart hook returns on it, and the kubelet then starts
    # the workload containers, so they start after the `started` record, never before NVML was tried.
    thread_stop = threading.Event()
    heartbeats = _start_heartbeats(args, enforcer, health, log, thread_stop)
    throttle.start()
    poller = threading.Thread(target=_poll, args=(enforcer, health, log, thread_stop, ending), name="gpufence-poll",
                              daemon=True)
    poller.start()
    name_os_threads()
    try:
        while not ending.event.wait(1.0):  # a bounded wait: the signal handlers run between its rounds at worst
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
        log.info("shutdown", signal=ending.signal, exit_status=ending.status)
    return ending.status


def name_os_threads(task_dir: str = "/proc/self/task") -> None:
    """Each thread's kernel name (``comm``: what ``top -H``, ``ps -L`` and ``make bench-node`` show)
    becomes its Python name without the ``gpufence-`` prefix (``poll``, ``heartbeat``, ``nvml``,
    ``http``, ``throttle``, ``events``), so the CPU each one uses can be told apart from outside."""
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.native_id is None:
            continue
        with contextlib.suppress(OSError), open(f"{task_dir}/{thread.native_id}/comm", "w") as f:
            f.write(thread.name.removeprefix("gpufence-")[:15])  # the kernel keeps 15 bytes


def _start_http(
    args: argparse.Namespace, metrics, health, log: DecisionLog, port: int
) -> tuple[HttpServer, int] | tuple[None, None]:
    """``/metrics``, ``/healthz``, ``/readyz`` on a thread of their own: (server, port), or (None,
    None) when the port cannot be had (said once; enforcement goes on without them)."""
    from gpufence.enforcer.report.http_server import start_server

    try:
        return start_server(make_app(metrics, health), args.bind_address, port)
    except OSError as exc:
        # Any container of the pod can hold the port (the network namespace is shared): that must
        # not end enforcement. Once, here; the heartbeat's detail repeats it.
        detail = f"cannot serve on {args.bind_address}:{port}: {exc.strerror or exc}"
        health.serving_failed(detail)
        log.error("http_failed", error=detail,
                  reason="enforcing without /metrics, /healthz and /readyz; the sidecar's probes read the heartbeat")
        return None, None


def _log_started(args: argparse.Namespace, enforcer, log: DecisionLog, bound_port: int | None, device_prefix: str,
                 privileges: dict[str, object]) -> None:
    """The ``started`` record, then a ``privilege_limit`` warning for each thing the kernel will refuse."""
    from gpufence.enforcer.observe.procfs import privilege_limits

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


def _start_heartbeats(args: argparse.Namespace, enforcer, health: Health, log: DecisionLog,
                      stop: threading.Event) -> threading.Thread | None:
    """The heartbeat thread, writing into ``--state-dir``; None (said once) without one."""
    if not args.state_dir:
        log.warning("heartbeat_disabled", reason="no --state-dir: the sidecar's probe (--probe) cannot pass")
        return None
    thread = threading.Thread(target=write_heartbeats, args=(health, args.state_dir, log, stop),
                              kwargs={"on_pause": enforcer.report_paused}, name="gpufence-heartbeat", daemon=True)
    thread.start()
    return thread


def _poll(enforcer, health: Health, log: DecisionLog, stop: threading.Event, ending: _Exit) -> None:
    """The poll thread: the loop until ``stop``; its death ends the process (``ending``) non-zero."""
    trace: str | None
    try:
        enforcer.run(stop)
    except BaseException as exc:  # the loop catches every Exception of a tick; not all of them
        # format_exception_only survives an exception whose str() raises.
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        trace = traceback.format_exc(limit=8)
    else:
        if stop.is_set():
            return
        error, trace = "the poll loop returned", None
    ending.poll_thread_died = True
    # Nothing is enforced from here on: /healthz fails, and the process exits non-zero so the
    # kubelet restarts it (a plain container under OnFailure restarts only on failure).
    health.poll_thread_died(error)
    log.error(
        "poll_thread_died", error=error, traceback=trace, exit_status=EXIT_POLL_THREAD_DIED,
        reason="nothing is enforced without the poll thread: exiting for the kubelet to restart the sidecar",
    )
    ending.event.set()


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
