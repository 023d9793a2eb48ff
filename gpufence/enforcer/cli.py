"""``gpufence-enforcer`` / ``python -m gpufence.enforcer``: the per-pod GPU share enforcer.

Usage::

    gpufence-enforcer [--config FILE] [--metrics-port N] [--bind-address ADDR] [--host-proc DIR]
                      [--state-dir DIR] [--nvidia-device-prefix PREFIX] [--log-level LEVEL]
                      [--simulate STATE_FILE | --nvml-library PATH]
                      [--compute-window SECONDS] [--compute-period SECONDS]
                      [--throttle-ineffective-after SECONDS]

The config comes from ``--config FILE`` (re-read when the file changes) or the ``GPUFENCE_CONFIG``
environment variable; a missing or invalid config is reported on stderr and exits with status 2
before anything else happens. Flags default to the environment variables of the sidecar contract
(docs/internals/architecture.md): ``GPUFENCE_METRICS_PORT`` (9401; 0 picks a free port, logged in the
``started`` line), ``GPUFENCE_HOST_PROC``, ``GPUFENCE_STATE_DIR``, ``GPUFENCE_NVIDIA_DEVICE_PREFIX``;
the pod identity from the service-account token the kubelet mounts, or ``GPUFENCE_POD_NAME`` /
``_NAMESPACE`` / ``_UID`` outside a pod (gpufence/enforcer/observe/pod_identity.py).

``--simulate STATE_FILE`` builds the simulated NVML library (``simnvml``), points it at the state
file and uses it instead of the driver: try policies on a laptop. Simulated processes do not hold
``/dev/nvidia*`` open, so pair it with ``--nvidia-device-prefix`` naming a file your test
processes open (the local PID mode accepts only processes holding a device file).

``--probe`` checks the heartbeat of the enforcer running with this state directory (the sidecar's
exec probe runs the same check without loading the enforcer: gpufence/enforcer/probe.py).

The HTTP port is not needed to enforce: an enforcer that cannot bind it (another container of the
pod holds it) logs ``http_failed`` once and enforces without ``/metrics``; the kubelet's probes read
the heartbeat file, not the port.

Exit status: 0 after SIGTERM/SIGINT, 1 on a fatal startup error (the simulated NVML cannot be built), 2 for usage
and configuration errors, 3 when the poll thread died (an exception the loop did not catch):
nothing is enforced without it, so the enforcer continues what it holds stopped and exits non-zero,
which the kubelet restarts under every restart policy but ``Never`` (docs/internals/enforcer-internals.md).
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpufence import version_line
from gpufence.contract import (
    DEFAULT_METRICS_PORT,
    DEFAULT_STATE_DIR,
    ENV_CONFIG,
    ENV_HOST_PROC,
    ENV_METRICS_PORT,
    ENV_POD_STATUS,
    ENV_STATE_DIR,
    ConfigError,
    EnforcerConfig,
)
from gpufence.enforcer.decide.compute import INEFFECTIVE_SECONDS
from gpufence.enforcer.observe.procfs import ENV_NVIDIA_DEVICE_PREFIX, ENV_NVIDIA_DEVICES
from gpufence.enforcer.probe import probe
from gpufence.enforcer.report.decision_log import LEVELS, DecisionLog, forward_stdlib_logging

if TYPE_CHECKING:
    from gpufence.enforcer.act.signals import SafeSignaller
    from gpufence.enforcer.act.stopped_state import StoppedState
    from gpufence.enforcer.act.throttle import ThrottleExecutor
    from gpufence.enforcer.loop import Enforcer
    from gpufence.enforcer.observe.attribution import Attributor
    from gpufence.enforcer.observe.pod_identity import PodIdentity
    from gpufence.enforcer.report.events import EventRecorder, PodRef
    from gpufence.enforcer.report.health import Health
    from gpufence.enforcer.report.metrics import EnforcerMetrics

PROG = "gpufence-enforcer"
ENV_LOG_LEVEL = "GPUFENCE_LOG_LEVEL"
EXIT_USAGE = 2
# The kubelet's default terminationMessagePath, which it bind-mounts into every container and shows
# as the container's last-state message (`kubectl describe`). The enforcer writes why it exited
# there itself, so the sidecar needs no `terminationMessagePolicy: FallbackToLogsOnError` (the
# tail of a JSON log is a poorer reason, and the field 50 more bytes in every GPU pod).
TERMINATION_LOG = "/dev/termination-log"
MAX_TERMINATION_MESSAGE = 4096  # the kubelet keeps no more


def write_termination_message(path: str | None, text: str) -> None:
    """``text`` into ``path`` when that file exists (the kubelet's; never created here, so a run
    on a host writes nothing into its /dev); errors are ignored: the exit must not fail on it."""
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, text.encode("utf-8", "replace")[:MAX_TERMINATION_MESSAGE])
    except OSError:
        pass
    finally:
        os.close(fd)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range 0-65535: {port}")
    return port


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value!r}")
    return number


def default_state_dir() -> str | None:
    """Where the webhook mounts the state volume (the sidecar carries no variable naming it), when
    that directory exists; None elsewhere (a host, the demo): the enforcer then keeps no records."""
    return DEFAULT_STATE_DIR if os.path.isdir(DEFAULT_STATE_DIR) else None


def build_parser() -> argparse.ArgumentParser:
    env = os.environ
    p = _Parser(prog=PROG, description="Enforce per-container GPU memory and compute shares in one pod.")
    p.add_argument("--version", action="version", version=version_line(PROG))
    p.add_argument("--config", metavar="FILE", help=f"config JSON file (default: ${ENV_CONFIG}); re-read on change")
    p.add_argument(
        "--metrics-port", type=_port, default=None,
        help=f"port of /metrics, /healthz, /readyz (default: ${ENV_METRICS_PORT} or {DEFAULT_METRICS_PORT}; 0: any)",
    )
    p.add_argument("--bind-address", default="0.0.0.0", help="address to serve HTTP on (default 0.0.0.0)")
    p.add_argument("--probe", action="store_true",
                   help="exit 0 if the enforcer running with this --state-dir is healthy (its heartbeat)")
    p.add_argument(
        "--host-proc", default=env.get(ENV_HOST_PROC) or None,
        help=f"host /proc mount for legacy drivers that report host PIDs (default: ${ENV_HOST_PROC})",
    )
    p.add_argument(
        "--state-dir", default=env.get(ENV_STATE_DIR) or default_state_dir(),
        help=f"directory for the records a restarted enforcer takes over: stopped processes, pending "
        f"SIGKILLs (default: ${ENV_STATE_DIR}, else {DEFAULT_STATE_DIR} where it exists)",
    )
    p.add_argument(
        "--nvidia-device-prefix", default=env.get(ENV_NVIDIA_DEVICE_PREFIX) or None,
        help=f"path prefix of NVIDIA device files (default: ${ENV_NVIDIA_DEVICE_PREFIX} or /dev/nvidia); what is "
        "under it at start is NVIDIA's device by its identity, whatever name a process opens it by",
    )
    p.add_argument(
        "--nvidia-devices", default=env.get(ENV_NVIDIA_DEVICES) or None, metavar="MAJOR[:MINOR],...",
        help="character devices to count as NVIDIA's besides the nvidia* majors of /proc/devices "
        f"(default: ${ENV_NVIDIA_DEVICES})",
    )
    p.add_argument(
        "--log-level", choices=sorted(LEVELS, key=LEVELS.__getitem__),
        default=env.get(ENV_LOG_LEVEL, "info"), help="decision log threshold (default info)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--simulate", metavar="STATE_FILE", help="use the simulated NVML (simnvml) with this state file",
    )
    source.add_argument("--nvml-library", metavar="PATH", help="load libnvidia-ml from this path")
    p.add_argument("--compute-window", type=_positive, default=5.0, help="SM utilisation window, seconds (default 5)")
    p.add_argument("--compute-period", type=_positive, default=1.0, help="duty-cycle period, seconds (default 1)")
    p.add_argument(
        "--throttle-ineffective-after", type=_positive, default=INEFFECTIVE_SECONDS, metavar="SECONDS",
        help="terminate a throttled container whose SM use stays over its share while it is held at the "
        f"minimum run fraction for this long (default {INEFFECTIVE_SECONDS:g})",
    )
    p.add_argument(
        "--termination-log", metavar="FILE", default=TERMINATION_LOG,
        help=f"where to write why the enforcer exited, when that file exists (default {TERMINATION_LOG}, "
        "the kubelet's; empty: nowhere)",
    )
    p.add_argument(
        "--nvml-timeout", type=_positive, default=5.0,
        help="deadline of one NVML call, seconds (default 5): a hung call is an error, and /healthz fails",
    )
    return p


def _metrics_port(args: argparse.Namespace) -> int:
    if args.metrics_port is not None:
        return args.metrics_port
    raw = os.environ.get(ENV_METRICS_PORT)
    if not raw:
        return DEFAULT_METRICS_PORT
    try:
        return _port(raw)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{ENV_METRICS_PORT}: {exc}") from None


def load_config(path: str | None) -> EnforcerConfig:
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
        return EnforcerConfig.from_json(text)
    env_text = os.environ.get(ENV_CONFIG)
    if env_text is None or not env_text.strip():
        raise ConfigError(f"no configuration: set {ENV_CONFIG} or pass --config FILE")
    return EnforcerConfig.from_json(env_text)


class _FileWatcher:
    """Returns the config when the file's (mtime, size) changed and it parses; None otherwise."""

    def __init__(self, path: str, log: DecisionLog) -> None:
        self._path = path
        self._log = log
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def __call__(self) -> EnforcerConfig | None:
        stamp = self._stamp()
        if stamp == self._seen or stamp is None:
            return None
        self._seen = stamp
        try:
            return load_config(self._path)
        except ConfigError as exc:
            self._log.error("config_invalid", path=self._path, error=str(exc), reason="keeping the previous config")
            return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe:
        return probe(args.state_dir)
    try:
        config = load_config(args.config)
        port = _metrics_port(args)
    except ConfigError as exc:
        # Before anything runs, on stderr (stdout is the decision log), in the shared log format.
        DecisionLog(level="error", stream=sys.stderr).error(
            "config_invalid", message=f"{PROG}: invalid configuration: {exc}", error=str(exc))
        write_termination_message(args.termination_log, f"config_invalid: {exc}")
        return EXIT_USAGE

    from gpufence.enforcer.observe.pod_identity import identify
    from gpufence.enforcer.report.kube_events_api import SERVICE_ACCOUNT_DIR

    identity = identify(SERVICE_ACCOUNT_DIR)
    log = DecisionLog(namespace=identity.namespace, pod=identity.name, level=args.log_level)
    forward_stdlib_logging(log, args.log_level)
    try:
        status = _run(args, config, port, log, identity)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # the traceback goes to stderr as before; the reason to the kubelet
        write_termination_message(args.termination_log, f"crashed: {type(exc).__name__}: {exc}")
        raise
    if status != 0:
        write_termination_message(args.termination_log, log.last_error or f"exited with status {status}")
    return status


def _client_factory(args: argparse.Namespace, log: DecisionLog) -> Callable[[], object] | None:
    from gpufence.enforcer.observe.nvml import NvmlClient

    if args.simulate:
        try:
            from gpufence import simnvml

            library = simnvml.build_library()
        except Exception as exc:
            log.error("simulate_failed", error=f"cannot build the simulated NVML library: {exc}")
            return None
        os.environ[simnvml.ENV_STATE] = str(Path(args.simulate).resolve())
        log.info("simulated_nvml", library=str(library), state_file=str(Path(args.simulate).resolve()))
        return lambda: NvmlClient(library_path=str(library))
    if args.nvml_library:
        return lambda: NvmlClient(library_path=args.nvml_library)
    return lambda: NvmlClient()


def _run(
    args: argparse.Namespace, config: EnforcerConfig, port: int, log: DecisionLog,
    identity: PodIdentity,
) -> int:
    from gpufence.enforcer.act.signals import SafeSignaller
    from gpufence.enforcer.act.stopped_state import StoppedState
    from gpufence.enforcer.act.throttle import ThrottleExecutor
    from gpufence.enforcer.observe.procfs import NVIDIA_DEVICE_PREFIX_DEFAULT
    from gpufence.enforcer.serve import serve

    own_pid = os.getpid()
    signaller = SafeSignaller(log, own_pid=own_pid)
    stopped = StoppedState(args.state_dir, log)
    throttle = ThrottleExecutor(signaller, stopped, log, period_seconds=args.compute_period)
    # Whatever happens from here on, nothing we stopped stays stopped.
    atexit.register(throttle.close, "atexit")

    factory = _client_factory(args, log)
    if factory is None:
        return 1
    device_prefix = args.nvidia_device_prefix or NVIDIA_DEVICE_PREFIX_DEFAULT
    attributor = _attributor(args, log, device_prefix, own_pid)
    if attributor is None:
        return 2
    reporting = _reporting(config, identity, log)
    enforcer = _enforcer(args, config, log, attributor, factory, signaller, throttle, stopped, reporting)
    # 1. Continue whatever a previous incarnation left stopped, before anything else; then take
    #    over its SIGKILL deadlines (no restart grants a new grace period).
    enforcer.recover_stopped()
    enforcer.recover_kill_deadlines()
    if stopped.path is None:
        log.warning(
            "stopped_state_disabled",
            reason="no --state-dir: if the enforcer is killed while throttling, stopped processes stay stopped",
        )
    try:
        return serve(args, enforcer, reporting.metrics, reporting.health, log, port, reporting.pod, device_prefix,
                     throttle)
    finally:
        enforcer.close()


def _attributor(args: argparse.Namespace, log: DecisionLog, device_prefix: str, own_pid: int) -> Attributor | None:
    """The attributor for the PID mode the host's /proc allows; None (said on stderr) for a
    malformed ``--nvidia-devices``."""
    from gpufence.enforcer.observe.attribution import Attributor, choose_mode

    try:
        attributor = Attributor(
            choose_mode(args.host_proc), proc_root="/proc", host_proc_root=args.host_proc,
            device_prefix=device_prefix, own_pid=own_pid, devices=args.nvidia_devices,
        )
    except ValueError as exc:
        print(f"gpufence-enforcer: --nvidia-devices: {exc}", file=sys.stderr)
        return None
    log.info("nvidia_devices", **attributor.device.summary(),
             reason="a process holding or mapping one of these devices, by any name, is a GPU process")
    return attributor


@dataclass(frozen=True)
class _Reporting:
    metrics: EnforcerMetrics
    health: Health
    events: EventRecorder
    pod: PodRef


def _reporting(config: EnforcerConfig, identity: PodIdentity, log: DecisionLog) -> _Reporting:
    """Metrics, health and Events for this pod; the webhook's warnings posted as Events once."""
    from gpufence.enforcer.decide.compute import UNATTRIBUTED
    from gpufence.enforcer.report.events import EventRecorder, PodRef, report_admission_warnings
    from gpufence.enforcer.report.health import Health
    from gpufence.enforcer.report.metrics import EnforcerMetrics

    metrics = EnforcerMetrics(identity.namespace or "", identity.name or "")
    # The containers are fixed by the pod spec, so the initial config names all of them; "" is the
    # label of what is done to unattributed processes (the pod's budgets), at zero like the rest.
    metrics.declare_containers([*config.containers, UNATTRIBUTED])
    pod = PodRef(identity.namespace or "", identity.name or "", identity.uid)
    log.info("pod_identity", source=identity.source, uid=identity.uid)
    events = EventRecorder.from_environment(log, pod)
    report_admission_warnings(log, events, os.environ.get(ENV_POD_STATUS))
    return _Reporting(metrics, Health(config.poll_interval_seconds), events, pod)


def _enforcer(
    args: argparse.Namespace, config: EnforcerConfig, log: DecisionLog, attributor: Attributor,
    factory: Callable[[], object], signaller: SafeSignaller, throttle: ThrottleExecutor, stopped: StoppedState,
    reporting: _Reporting,
) -> Enforcer:
    from gpufence.enforcer.act.kill_deadlines import KillDeadlines
    from gpufence.enforcer.loop import Enforcer

    return Enforcer(
        config,
        pid_mode=attributor.mode,
        attributor=attributor,
        client_factory=factory,  # type: ignore[arg-type]
        signaller=signaller,
        throttle=throttle,
        stopped=stopped,
        log=log,
        metrics=reporting.metrics,
        health=reporting.health,
        events=reporting.events,
        kill_deadlines=KillDeadlines(args.state_dir, log),
        config_source=_FileWatcher(args.config, log) if args.config else None,
        compute_window_seconds=args.compute_window,
        compute_period_seconds=args.compute_period,
        compute_ineffective_seconds=args.throttle_ineffective_after,
        nvml_timeout_seconds=args.nvml_timeout,
    )
