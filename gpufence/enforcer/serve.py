"""The enforcer process's life once it is wired (``cli._run``): HTTP, heartbeat, poll thread, signals.

In order: serve ``/metrics``, ``/healthz``, ``/readyz`` (optional: a taken port only costs the
endpoint), open NVML, log ``started``, then write the heartbeat the kubelet's probes read (so the
startup probe, which lets the workload containers start, passes only after ``started``), start the
throttle and the poll thread, and wait for a signal or the poll thread's death.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


async def serve(
    args: argparse.Namespace, enforcer, metrics, health, log: DecisionLog, port: int, pod,
    device_prefix: str, throttle,
) -> int:
    from gpufence.enforcer.health import make_app, write_heartbeats
    from gpufence.enforcer.http_server import start_server
    from gpufence.enforcer.procfs import own_privileges, privilege_limits

    privileges = own_privileges()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        loop.add_signal_handler(sig, on_signal, sig)

    runner, bound_port = None, None
    try:
        runner, bound_port = await start_server(make_app(metrics, health), args.bind_address, port)
    except OSError as exc:
        # Any container of the pod can hold the port (the network namespace is shared): that must
        # not end enforcement. Once, here; the heartbeat's detail repeats it.
        detail = f"cannot serve on {args.bind_address}:{port}: {exc.strerror or exc}"
        health.serving_failed(detail)
        log.error("http_failed", error=detail,
                  reason="enforcing without /metrics, /healthz and /readyz; the sidecar's probes read the heartbeat")
    await asyncio.to_thread(enforcer.open_nvml)
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
    # The first heartbeat only now: the startup probe passes on it, and the kubelet then starts the
    # workload containers, so they start after the `started` record, never before NVML was tried.
    heartbeats = None
    if args.state_dir:
        heartbeats = asyncio.create_task(write_heartbeats(health, args.state_dir, log))
    else:
        log.warning("heartbeat_disabled", reason="no --state-dir: the sidecar's probe (--probe) cannot pass")
    throttle.start()
    thread_stop = threading.Event()

    died: list[str] = []

    def poll() -> None:
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
        with contextlib.suppress(RuntimeError):  # the event loop is already closing
            loop.call_soon_threadsafe(stop.set)

    poller = threading.Thread(target=poll, name="gpufence-poll", daemon=True)
    poller.start()
    try:
        await stop.wait()
    finally:
        thread_stop.set()
        # Continue everything first: the poll thread may be stuck in an NVML call for a while
        # (a later throttle update is ignored once the executor is closed).
        throttle.close("shutdown")
        await asyncio.to_thread(poller.join, 10)
        if heartbeats is not None:
            heartbeats.cancel()
        if runner is not None:
            await runner.cleanup()
        status = EXIT_POLL_THREAD_DIED if died else 0
        log.info("shutdown", signal=received[0] if received else None, exit_status=status)
    return status
