"""``gpufence-node`` / ``python -m gpufence.node``: the node guardian (a DaemonSet on GPU nodes).

Usage::

    gpufence-node [--node-name NAME] [--kubeconfig FILE | --pods-file FILE] [--policy-configmap NS/NAME]
                  [--mode enforce|audit]
                  [--poll-interval SECONDS] [--state-dir DIR] [--cgroup-root DIR] [--proc-root DIR]
                  [--metrics-port N] [--bind-address ADDR] [--unaccounted-grace SECONDS]
                  [--settle SECONDS] [--compute-window SECONDS] [--compute-period SECONDS]
                  [--simulate STATE_FILE | --nvml-library PATH] [--log-level LEVEL]

It runs in the host's PID namespace with the host's cgroupfs (``--cgroup-root``, default
``/sys/fs/cgroup``): NVML lists host PIDs, ``/proc/<pid>/cgroup`` names each one's pod and container,
the freezer and the signals reach every process of a container. The pods of its node come from the
API server (``--node-name``, default ``$NODE_NAME``, the downward API's ``spec.nodeName``) with its
own ServiceAccount (in-cluster) or ``--kubeconfig``; ``--pods-file`` reads them from a JSON file
instead (``{"pods": [...], "namespaces": [...], "resourceClaims": [...], "resourceSlices": [...],
"policy": <ConfigMap>}``, re-read when it changes: tests, the demo). The cluster policy is the webhook's
ConfigMap (``--policy-configmap``, default ``gpufence/gpufence-policy``): GPU processes of pods its
``device-access-namespaces`` lists are reported, never ended; ``other-namespace-gpu-processes`` and
``host-gpu-processes`` say what is done with GPU processes of other namespaces and of the host on a
GPU that holds an opted-in pod's share.

Exit status: 0 after SIGTERM/SIGINT (everything it froze thawed first), 1 on a fatal start error
(the simulated NVML cannot be built, no cluster configuration), 2 for usage errors.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Literal, cast

from gpufence import version_line
from gpufence.contract import DEFAULT_GRACE_PERIOD_SECONDS, MIN_POLL_INTERVAL_SECONDS, Mode
from gpufence.enforcer.decide.compute import INEFFECTIVE_SECONDS
from gpufence.enforcer.observe.nvml import NvmlClient
from gpufence.enforcer.observe.watchdog import DeadlineRunner
from gpufence.enforcer.report.decision_log import LEVELS, DecisionLog, forward_stdlib_logging
from gpufence.node.cgroupfs import DEFAULT_ROOT, CgroupFs
from gpufence.node.decide import NodeEngine, Own
from gpufence.node.kube import DEFAULT_POLICY_CONFIGMAP, PodsFile, PodSource, PodWatch, load_apis
from gpufence.node.loop import Guardian
from gpufence.node.report import NodeEvents, NodeMetrics
from gpufence.node.state import GuardianState
from gpufence.node.throttle import FreezerThrottle
from gpufence.webhook.flags import namespaced_name

PROG = "gpufence-node"
DEFAULT_STATE_DIR = "/var/lib/gpufence-node"
DEFAULT_METRICS_PORT = 9402
EXIT_USAGE = 2
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _namespaced_name(text: str) -> tuple[str, str]:
    try:
        return namespaced_name(text)  # the webhook's own rule for --policy-configmap
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="gpufence's node guardian: holds every admitted GPU share "
                                "from the host, and ends GPU processes that hold none.")
    p.add_argument("--version", action="version", version=version_line(PROG))
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node (default $NODE_NAME)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--kubeconfig", help="a kubeconfig (default: in-cluster, then ~/.kube/config)")
    source.add_argument("--pods-file", help="read the pods and namespaces from this JSON file, not the API server")
    p.add_argument("--policy-configmap", type=_namespaced_name, default="/".join(DEFAULT_POLICY_CONFIGMAP),
                   help="the cluster policy the webhook reads, NAMESPACE/NAME (default %(default)s): its "
                   "device-access-namespaces are the namespaces whose GPU processes without a share are reported, "
                   "not ended; other-namespace-gpu-processes and host-gpu-processes say whether GPU processes of "
                   "other namespaces and of the host may share a GPU with opted-in pods")
    p.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.ENFORCE.value,
                   help="audit: report every breach, signal and freeze nothing (default enforce)")
    p.add_argument("--poll-interval", type=_positive, default=0.5, help="seconds between polls (default 0.5)")
    p.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help=f"host directory for guardian.json "
                   f"(default {DEFAULT_STATE_DIR})")
    p.add_argument("--cgroup-root", default=DEFAULT_ROOT, help=f"the host's cgroupfs (default {DEFAULT_ROOT})")
    p.add_argument("--proc-root", default="/proc", help="the host's /proc (default /proc: run with hostPID)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help=f"Prometheus /metrics port (default {DEFAULT_METRICS_PORT}; 0: a free port; -1: none)")
    p.add_argument("--bind-address", default="0.0.0.0", help="address of the metrics port (default 0.0.0.0)")
    p.add_argument("--unaccounted-grace", type=float, default=DEFAULT_GRACE_PERIOD_SECONDS,
                   help="SIGTERM to SIGKILL for a container holding no admitted share (default "
                   f"{DEFAULT_GRACE_PERIOD_SECONDS:g} s)")
    p.add_argument("--settle", type=float, default=15.0, help="seconds a container the pod's status does not name "
                   "yet is given before it counts as unaccounted (default 15: the kubelet writes a new ID a moment "
                   "after the start, later on a loaded node)")
    p.add_argument("--compute-window", type=_positive, default=5.0, help="the compute controller's window (default 5)")
    p.add_argument("--compute-period", type=_positive, default=1.0, help="the freezer's duty-cycle period (default 1)")
    p.add_argument("--throttle-ineffective-after", type=_positive, default=INEFFECTIVE_SECONDS,
                   help="a container whose use stays over its share this long with the freezer at its minimum "
                   f"run fraction is terminated (throttle_ineffective; default {INEFFECTIVE_SECONDS:g})")
    p.add_argument("--nvml-timeout", type=_positive, default=5.0, help="deadline of one NVML call (default 5)")
    nvml = p.add_mutually_exclusive_group()
    nvml.add_argument("--simulate", metavar="STATE_FILE", help="use the simulated NVML (simnvml) with this state file")
    nvml.add_argument("--nvml-library", help="a specific libnvidia-ml.so.1")
    p.add_argument("--log-level", choices=list(LEVELS), default=os.environ.get("GPUFENCE_LOG_LEVEL", "info"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    log = DecisionLog(level=args.log_level)
    forward_stdlib_logging(log, args.log_level)
    usage = _usage_error(args)
    if usage:
        print(f"{PROG}: {usage}", file=sys.stderr)
        return EXIT_USAGE
    library = _nvml_library(args, log)
    pods = _pod_source(args, log)
    if library is False or pods is None:
        return 1
    metrics = NodeMetrics()
    state = GuardianState(args.state_dir)
    fs = CgroupFs(args.cgroup_root, args.proc_root)
    throttle = FreezerThrottle(fs, state, log, period=args.compute_period)
    events = NodeEvents.from_environment(log)
    guardian = Guardian(
        nvml=NvmlClient(library), runner=DeadlineRunner(args.nvml_timeout), fs=fs, pods=pods,
        engine=NodeEngine(mode=Mode(args.mode), poll_interval=args.poll_interval, settle_seconds=args.settle,
                          unaccounted_grace=args.unaccounted_grace, compute_window_seconds=args.compute_window,
                          compute_period_seconds=args.compute_period,
                          compute_ineffective_seconds=args.throttle_ineffective_after,
                          own=_own(args)),
        state=state, throttle=throttle, log=log, metrics=metrics, events=events, proc_root=args.proc_root,
    )
    return _run(args, guardian, throttle, pods, events, metrics, fs, log)


def _own(args: argparse.Namespace) -> Own:
    """gpufence's own, never acted on as a foreign GPU process: this process, the policy ConfigMap's
    namespace (the webhook's) and the guardian's own (its ServiceAccount's, where it runs in a pod)."""
    namespaces = {args.policy_configmap[0]}
    with contextlib.suppress(OSError):
        namespaces.add(Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip())
    return Own(pids=frozenset({os.getpid()}), namespaces=frozenset(n for n in namespaces if n))


def _usage_error(args: argparse.Namespace) -> str | None:
    if args.poll_interval < MIN_POLL_INTERVAL_SECONDS:
        return f"--poll-interval must be at least {MIN_POLL_INTERVAL_SECONDS:g} s, got {args.poll_interval}"
    if not args.pods_file and not args.node_name:
        return ("--node-name (or $NODE_NAME) is required to watch the pods of this node, "
                "e.g. --node-name gpu-node-1; or give --pods-file")
    return None


def _nvml_library(args: argparse.Namespace, log: DecisionLog) -> str | Literal[False] | None:
    """The NVML library to load (None: the system's), the simulated one under --simulate; False
    where the simulated one cannot be built (logged)."""
    if not args.simulate:
        return cast("str | None", args.nvml_library)
    from gpufence import simnvml

    try:
        library = str(simnvml.build_library())
    except (OSError, RuntimeError) as exc:
        log.error("simulate_failed", error=f"cannot build the simulated NVML library: {exc}")
        return False
    os.environ[simnvml.ENV_STATE] = str(Path(args.simulate).resolve())
    return library


def _pod_source(args: argparse.Namespace, log: DecisionLog) -> PodSource | None:
    if args.pods_file:
        return PodsFile(args.pods_file)
    try:
        core_api, custom_api = load_apis(args.kubeconfig)
        return PodWatch(core_api, args.node_name, custom_api, policy_configmap=args.policy_configmap)
    except Exception as exc:  # the client's ConfigException, an unreadable kubeconfig
        log.error("no_cluster_configuration", error=f"{type(exc).__name__}: {exc}")
        return None


def _run(args: argparse.Namespace, guardian: Guardian, throttle: FreezerThrottle, pods: PodSource,
         events: NodeEvents, metrics: NodeMetrics, fs: CgroupFs, log: DecisionLog) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    port = None
    if args.metrics_port >= 0:
        from prometheus_client import start_http_server

        server, _ = start_http_server(args.metrics_port, args.bind_address, registry=metrics.registry)
        port = server.server_port
    try:
        guardian.recover()
        throttle.start()
        pods.start()
        log.info("started", version=version_line(PROG), node=args.node_name, mode=args.mode,
                 poll_interval=args.poll_interval, state_dir=args.state_dir, cgroup_root=args.cgroup_root,
                 unified=str(fs.unified) if fs.unified else None, metrics_port=port,
                 pods_source=args.pods_file or "api-server", pid=os.getpid())
        guardian.run(stop)
    finally:
        throttle.stop()  # thaws everything it froze, whatever ended the loop
        pods.stop(timeout=2.0)
        events.close()
        guardian.nvml.close()
        log.info("shutdown", frozen=list(throttle.frozen))
    return 0
