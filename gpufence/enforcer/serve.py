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

from gpufence import __version__
from gpufence.enforcer.decision_log import DecisionLog
from gpufence.enforcer.probe import own_start_time

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
    from gpufence.enforcer.health import make_app, write_heartbeats
    from gpufence.enforcer.http_server import start_server
    from gpufence.enforcer.procfs import own_privileges, privilege_limits

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
