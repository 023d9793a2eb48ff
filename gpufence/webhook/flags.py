"""``gpufence-webhook``'s flag table and the value converters of its flags.

Each converter takes the text of a flag, an env var or a key of the policy ConfigMap
(webhook.cluster.policy) and returns the value, or raises ValueError with a short reason: one
implementation of each rule, wherever the value comes from. The table (``SERVER_FLAGS``,
``POLICY_FLAGS``) is read by the command line (webhook.cli) and by the policy ConfigMap's parser
(webhook.cluster.policy), neither of which imports the other.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpufence.contract import (
    HOST_GPU_SHARING,
    MAX_GRACE_PERIOD_SECONDS,
    MAX_POLL_INTERVAL_SECONDS,
    MIN_POLL_INTERVAL_SECONDS,
    GpuSharing,
)
from gpufence.quantity import QuantityError, canonical_quantity, parse_bytes
from gpufence.webhook.core.dra import driver_name
from gpufence.webhook.core.gpu_paths import claim_name, resource_pattern
from gpufence.webhook.core.kai import scheduler_name
from gpufence.webhook.core.settings import (
    DEFAULT_ADMIN_GROUPS,
    DEFAULT_DRA_GPU_DRIVERS,
    DEFAULT_GPU_RESOURCES,
    DEFAULT_KAI_SCHEDULER,
    InjectionSettings,
)
from gpufence.webhook.core.shares import parse_compute_share, parse_memory_share

# How often the serving certificate's files are checked for a change (webhook.tls, --cert-reload-interval).
DEFAULT_RELOAD_INTERVAL_SECONDS = 1.0


def port(text: str) -> int:
    if not text.strip().isdigit():
        raise ValueError("not a port number")
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be between 0 and 65535")
    return value


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError('use "true" or "false"')


_DURATION_RE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?P<unit>ms|s|m|h)?", re.ASCII)
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration(low: float, high: float) -> Callable[[str], float]:
    """Seconds as "2.5", "500ms", "10s" or "1m", within [low, high]."""

    def convert(text: str) -> float:
        match = _DURATION_RE.fullmatch(text.strip()) if len(text) <= 32 else None
        if match is None:
            raise ValueError('use seconds such as "10", "500ms", "10s" or "1m"')
        seconds = float(match["num"]) * _UNIT_SECONDS[match["unit"]]
        if not low <= seconds <= high:
            raise ValueError(f"must be between {low:g}s and {high:g}s")
        return seconds

    convert.__name__ = "duration"
    return convert


def choice(*allowed: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in allowed:
            raise ValueError("use one of " + ", ".join(allowed))
        return text

    convert.__name__ = "choice"
    return convert


def host_gpu_sharing(text: str) -> str:
    """``host-gpu-processes``: ``allow`` or ``report``; ``terminate`` is refused with the reason."""
    if text == GpuSharing.TERMINATE.value:
        raise ValueError("a host process is never terminated (it may be a system service, a login session "
                         "or the node's own daemon): use allow or report")
    return choice(*HOST_GPU_SHARING)(text)


def non_empty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def resource_quantity(text: str) -> str:
    """A container resource quantity, written back canonically (the API server's form), so that a
    reinvocation after the API server canonicalised the pod sees the same value and patches nothing."""
    canonical = canonical_quantity(text.strip())
    if canonical == "0":
        raise ValueError("must be greater than zero")
    return canonical


def optional_resource_quantity(text: str) -> str | None:
    """``resource_quantity``, or None for "none" (no such limit)."""
    return None if text.strip().lower() == "none" else resource_quantity(text)


def memory_share(text: str) -> str:
    # The core's own parser: the same rules as annotations.
    parse_memory_share(text)
    return text


def compute_share(text: str) -> str:
    parse_compute_share(text)
    return text


def gpu_memory(text: str) -> tuple[str, int]:
    """RESOURCE=QUANTITY, e.g. "nvidia.com/gpu=80Gi": the memory of one GPU of that resource."""
    name, sep, amount = text.strip().partition("=")
    if not sep or not name.strip() or not amount.strip():
        raise ValueError('use RESOURCE=QUANTITY such as "nvidia.com/gpu=80Gi"')
    try:
        num_bytes = parse_bytes(amount.strip())
    except QuantityError:
        raise ValueError(f'{amount.strip()!r} is not a quantity such as "80Gi"') from None
    if num_bytes < 1 << 30:
        raise ValueError("a GPU's memory must be at least 1Gi")
    return name.strip(), num_bytes


def headroom(text: str) -> int:
    try:
        num_bytes = parse_bytes(text.strip())
    except QuantityError:
        raise ValueError('use a quantity such as "512Mi" or "0"') from None
    if num_bytes < 0:
        raise ValueError("must not be negative")
    return num_bytes


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def namespace_name(text: str) -> str:
    """A Namespace's name (a DNS label), e.g. "gpu-operator"."""
    if not _DNS_LABEL.fullmatch(text.strip()):
        raise ValueError('use a namespace name in lower case such as "gpu-operator"')
    return text.strip()


def namespaced_name(text: str) -> tuple[str, str]:
    """NAMESPACE/NAME of an object, e.g. "gpufence/gpufence-policy": Kubernetes' rules for both names."""
    namespace, sep, name = text.strip().partition("/")
    if not sep or not _DNS_LABEL.fullmatch(namespace) or not _DNS_SUBDOMAIN.fullmatch(name):
        raise ValueError('use NAMESPACE/NAME in lower case such as "gpufence/gpufence-policy"')
    return namespace, name


ENV_PREFIX = "GPUFENCE_WEBHOOK_"
_defaults = InjectionSettings()


# --- the flag table ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    name: str  # without the leading dashes
    convert: Callable[[str], Any]
    default: Any
    help: str
    repeat: bool = False
    # The flag's name before it said what it sets (--poll-interval for --sidecar-poll-interval):
    # still accepted, as a flag and as an env var, with a "deprecated_flag" warning, for one release.
    deprecated: str | None = None
    # An accepted value, quoted in the errors of the policy ConfigMap; the default where unset.
    example: str | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def deprecated_env(self) -> str | None:
        return ENV_PREFIX + self.deprecated.replace("-", "_").upper() if self.deprecated else None

    @property
    def shown_default(self) -> str:
        """The default as one would write it: durations as "5s" or "500ms", not 5.0 or 0.5."""
        if self.default is None:
            return "none"
        if getattr(self.convert, "__name__", "") == "duration":
            seconds = float(self.default)
            return f"{seconds * 1000:g}ms" if 0 < seconds < 1 else f"{seconds:g}s"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        return str(self.default)

    @property
    def example_value(self) -> str:
        return self.example or self.shown_default


# The server: only ever flags (or env vars), never keys of the policy ConfigMap.
SERVER_FLAGS: tuple[Flag, ...] = (
    Flag("port", port, 8443, "HTTPS port to serve on (0 picks a free one)"),
    Flag("bind-address", non_empty, "0.0.0.0", "address to listen on"),
    Flag("tls-cert-file", non_empty, None, "serving certificate (PEM), reloaded when it changes"),
    Flag("tls-private-key-file", non_empty, None, "private key of the serving certificate (PEM)"),
    Flag("cert-reload-interval", duration(0.01, 3600), DEFAULT_RELOAD_INTERVAL_SECONDS,
         "how often to check the certificate files for a change"),
    Flag("kubeconfig", non_empty, None,
         "kubeconfig for the namespace and policy watches (default: in-cluster, then ~/.kube/config; "
         "neither: all namespaces opted in outside a cluster, and a refusal to start in one)"),
    Flag("log-level", choice("debug", "info", "warning", "error"), "info", "log level"),
    Flag("event-loop", choice("auto", "uvloop", "asyncio"), "auto",
         "the event loop: uvloop (libuv; less CPU per request), asyncio (the standard library's), or auto: "
         "uvloop where it can be imported, else asyncio"),
    Flag("shutdown-delay", duration(0, 60), 5.0,
         "after SIGTERM, keep serving this long with /readyz failing so endpoints drop the replica first"),
    Flag("policy-configmap", namespaced_name, None,
         "read the policy flags below from this ConfigMap (NAMESPACE/NAME, keys the flag names without "
         "\"--\"), the one source of the policy, and apply its changes without a restart; refuses to start "
         "with any policy flag given as well (default none: the policy flags apply)"),
)

# The policy: InjectionSettings, one flag per field. With --policy-configmap they are that ConfigMap's
# keys (webhook.cluster.policy), parsed by the same converters.
POLICY_FLAGS: tuple[Flag, ...] = (
    Flag("sidecar-image", non_empty, _defaults.sidecar_image, "enforcer sidecar image"),
    Flag("sidecar-image-pull-policy", choice("Always", "IfNotPresent", "Never"), _defaults.sidecar_image_pull_policy,
         "imagePullPolicy of the sidecar"),
    Flag("gpu-resource-name", resource_pattern, None,
         "extended resource that makes a container a GPU container, which gets a share and the sidecar; a "
         'trailing "*" makes it a prefix (repeatable; default ' + ",".join(DEFAULT_GPU_RESOURCES) + ")",
         repeat=True, example=",".join(DEFAULT_GPU_RESOURCES)),
    Flag("exclusive-gpu-resource-name", resource_pattern, None,
         "extended resource (or prefix ending in \"*\") of a device never shared between pods, e.g. a MIG "
         "profile that is not time-sliced: its containers get no share and no sidecar, and keep their device "
         "(repeatable; default none)", repeat=True, example="nvidia.com/mig-3g.40gb"),
    Flag("non-gpu-resource-claims", claim_name, None,
         "names of ResourceClaims or ResourceClaimTemplates that hold no GPU; a container using any other DRA "
         "claim is a GPU container (repeatable; default none)", repeat=True, example="nic-claim"),
    Flag("kai-scheduler-name", scheduler_name, None,
         "scheduler names of KAI-Scheduler: a pod of one of them with KAI's gpu-fraction or gpu-memory "
         "annotation has a GPU container by KAI's path, whose share is KAI's request (repeatable; default "
         + DEFAULT_KAI_SCHEDULER + ")", repeat=True, example=DEFAULT_KAI_SCHEDULER),
    Flag("dra-gpu-driver-name", driver_name, None,
         "DRA driver whose devices are GPUs: the webhook resolves each claim through its DeviceClass, whose "
         "selectors name the driver (device.driver == \"gpu.nvidia.com\"), and warns where a claim that holds no "
         "GPU is not in non-gpu-resource-claims (repeatable; default " + ",".join(DEFAULT_DRA_GPU_DRIVERS) + ")",
         repeat=True, example=",".join(DEFAULT_DRA_GPU_DRIVERS)),
    Flag("sidecar-mode", choice("native", "container"), "native" if _defaults.native_sidecar else "container",
         "native sidecar (init container with restartPolicy Always, Kubernetes >= 1.29) or a plain container"),
    Flag("sidecar-metrics-port", port, _defaults.metrics_port, "port of the sidecar's /metrics",
         deprecated="metrics-port"),
    Flag("sidecar-cpu-request", resource_quantity, _defaults.sidecar_cpu_request, "CPU request of the sidecar"),
    Flag("sidecar-cpu-limit", optional_resource_quantity, _defaults.sidecar_cpu_limit,
         'CPU limit of the sidecar ("none": no CPU limit; a ResourceQuota on limits.cpu then rejects GPU pods)'),
    Flag("sidecar-memory-request", resource_quantity, _defaults.sidecar_memory_request,
         "memory request of the sidecar"),
    Flag("sidecar-memory-limit", resource_quantity, _defaults.sidecar_memory_limit, "memory limit of the sidecar"),
    Flag("default-memory", memory_share, _defaults.default_memory,
         'memory share when neither pod nor namespace sets one ("8Gi" or "25%")', example="25%"),
    Flag("default-compute", compute_share, _defaults.default_compute,
         'compute share when neither pod nor namespace sets one ("50" or "50%")', example="50"),
    Flag("max-memory", memory_share, _defaults.max_memory,
         "ceiling on each GPU container's memory share where the namespace sets none (\"8Gi\" or \"25%\")",
         example="25%"),
    Flag("max-compute", compute_share, _defaults.max_compute,
         "ceiling on each GPU container's compute share where the namespace sets none (\"25\")", example="25"),
    Flag("default-mode", choice("enforce", "audit"), _defaults.default_mode,
         "mode of namespaces that do not set gpufence.io/mode"),
    Flag("allow-audit", boolean, _defaults.allow_audit,
         "let pods choose audit mode where the namespace does not set gpufence.io/allow-audit"),
    Flag("allow-opt-out", boolean, _defaults.allow_opt_out,
         "honour the pod label gpufence.io/inject=false where the namespace does not set gpufence.io/allow-opt-out"),
    Flag("default-grace-period", duration(0, MAX_GRACE_PERIOD_SECONDS), _defaults.default_grace_period_seconds,
         "SIGTERM to SIGKILL delay for a container over its memory share"),
    Flag("sidecar-poll-interval", duration(MIN_POLL_INTERVAL_SECONDS, MAX_POLL_INTERVAL_SECONDS),
         _defaults.poll_interval_seconds, "how often the enforcer polls NVML", deprecated="poll-interval"),
    Flag("sidecar-nvidia-visible-devices", non_empty, _defaults.nvidia_visible_devices,
         "NVIDIA_VISIBLE_DEVICES of the sidecar", deprecated="nvidia-visible-devices"),
    Flag("sidecar-nvidia-driver-capabilities", non_empty, _defaults.nvidia_driver_capabilities,
         "NVIDIA_DRIVER_CAPABILITIES of the sidecar", deprecated="nvidia-driver-capabilities"),
    Flag("sidecar-mount-host-proc", boolean, _defaults.mount_host_proc,
         "mount the host's /proc read-only in the sidecar (drivers that report host PIDs)",
         deprecated="mount-host-proc"),
    Flag("sidecar-host-proc-mount-path", non_empty, _defaults.host_proc_mount_path,
         "where the host's /proc is mounted in the sidecar", deprecated="host-proc-mount-path"),
    Flag("void-non-gpu-containers", boolean, _defaults.void_non_gpu_containers,
         "give containers that request no GPU NVIDIA_VISIBLE_DEVICES=void, so no image ENV or envFrom "
         "can hand them GPUs through the NVIDIA container toolkit"),
    Flag("driver-memory-limits", choice("on", "off", "auto"), _defaults.driver_memory_limits,
         "write the driver's per-container GPU memory limit (NVIDIA_GPU_MEMORY_LIMIT and _REQUEST, applied by the "
         "NVIDIA container toolkit's apply-cuda-memory-limits hook) from each byte share: on (every GPU pod), off, "
         "or auto (pods that can only be scheduled onto nodes labelled gpufence.io/driver-memory-limits=true, "
         "where driver, toolkit and cgroup v2 can apply it)"),
    Flag("mps-limits", boolean, _defaults.mps_limits, "set CUDA MPS per-client limits from the shares"),
    Flag("preload-library", non_empty, _defaults.preload_library_host_path,
         "host path of an LD_PRELOAD GPU limiter (e.g. HAMi-core libvgpu.so) to inject",
         example="/usr/local/lib/libvgpu.so"),
    Flag("preload-library-mount-dir", non_empty, _defaults.preload_library_mount_dir,
         "where the preload library's directory is mounted in GPU containers"),
    Flag("gpu-memory", gpu_memory, None,
         'memory of one GPU of a resource, for homogeneous pools ("nvidia.com/gpu=80Gi"; repeatable): turns '
         "byte shares into the frameworks' memory fractions and percentage shares into the driver's memory limit",
         repeat=True, example="nvidia.com/gpu=80Gi"),
    Flag("pytorch-memory-fraction", boolean, _defaults.pytorch_memory_fraction,
         "cap PyTorch's allocator (PYTORCH_CUDA_ALLOC_CONF per_process_memory_fraction; PyTorch >= 2.10 only) "
         "where the namespace does not set gpufence.io/pytorch-memory-fraction"),
    Flag("framework-memory-headroom", headroom, _defaults.framework_memory_headroom_bytes,
         "taken off a share before it becomes a framework's memory fraction, for the CUDA context (bytes or a "
         'quantity such as "512Mi")'),
    Flag("admin-groups", non_empty, None,
         "groups whose members may change the gpufence-enforcer sidecar of a running pod, exec or attach into "
         "it and add ephemeral containers without NVIDIA_VISIBLE_DEVICES=void (repeatable; default "
         f"{','.join(DEFAULT_ADMIN_GROUPS)}); enforced by the gpufence-protect admission policy, which reads "
         "the policy ConfigMap: the webhook only checks the value",
         repeat=True, example=",".join(DEFAULT_ADMIN_GROUPS)),
    Flag("device-access-namespaces", namespace_name, None,
         "opted-in namespaces whose pods may reach the node's devices without a device request: privileged "
         "containers, hostPath volumes of devices or at, under or above /dev (but /dev/shm, /dev/hugepages and "
         "/dev/mqueue exactly, admitted everywhere), /proc, /sys, /run/nvidia or the driver's library directories, "
         "mounts under /var/run/nvidia-container-devices; elsewhere only members of admin-groups may create such pods "
         "(repeatable; default none)", repeat=True, example="gpu-operator"),
    Flag("other-namespace-gpu-processes", choice(*GpuSharing), _defaults.other_namespace_gpu_processes,
         "GPU processes of pods gpufence does not govern (namespaces not opted in, opted-out pods) on a GPU that "
         "holds an opted-in pod's admitted share: allow, report (log line, metric, Event on their pod) or "
         "terminate (their container, through its cgroup, where the node guardian enforces); read by the node "
         "guardian, never by admission", example=GpuSharing.TERMINATE.value),
    Flag("host-gpu-processes", host_gpu_sharing, _defaults.host_gpu_processes,
         "GPU processes of the host (in no pod) on a GPU that holds an opted-in pod's admitted share: allow, or "
         "report (log line, metric, Event on the opted-in pods sharing the GPU); never terminated: a host "
         "process may be a system service; read by the node guardian, never by admission",
         example=GpuSharing.REPORT.value),
)
FLAGS: tuple[Flag, ...] = SERVER_FLAGS + POLICY_FLAGS


def policy_settings(values: Mapping[str, Any]) -> InjectionSettings:
    """InjectionSettings from converted policy values by flag dest (``max_memory``); the rest default."""
    return settings_from_args(argparse.Namespace(**{f.dest: values.get(f.dest, f.default) for f in POLICY_FLAGS}))


def settings_from_args(args: argparse.Namespace) -> InjectionSettings:
    return InjectionSettings(
        sidecar_image=args.sidecar_image,
        sidecar_image_pull_policy=args.sidecar_image_pull_policy,
        gpu_resource_names=args.gpu_resource_name or DEFAULT_GPU_RESOURCES,
        exclusive_gpu_resource_names=tuple(args.exclusive_gpu_resource_name or ()),
        non_gpu_resource_claims=tuple(args.non_gpu_resource_claims or ()),
        kai_scheduler_names=tuple(args.kai_scheduler_name or (DEFAULT_KAI_SCHEDULER,)),
        dra_gpu_drivers=tuple(args.dra_gpu_driver_name or DEFAULT_DRA_GPU_DRIVERS),
        native_sidecar=args.sidecar_mode == "native",
        metrics_port=args.sidecar_metrics_port,
        sidecar_cpu_request=args.sidecar_cpu_request,
        sidecar_cpu_limit=args.sidecar_cpu_limit,
        sidecar_memory_request=args.sidecar_memory_request,
        sidecar_memory_limit=args.sidecar_memory_limit,
        default_memory=args.default_memory,
        default_compute=args.default_compute,
        default_grace_period_seconds=args.default_grace_period,
        max_memory=args.max_memory,
        max_compute=args.max_compute,
        default_mode=args.default_mode,
        allow_audit=args.allow_audit,
        allow_opt_out=args.allow_opt_out,
        poll_interval_seconds=args.sidecar_poll_interval,
        nvidia_visible_devices=args.sidecar_nvidia_visible_devices,
        nvidia_driver_capabilities=args.sidecar_nvidia_driver_capabilities,
        mount_host_proc=args.sidecar_mount_host_proc,
        host_proc_mount_path=args.sidecar_host_proc_mount_path,
        void_non_gpu_containers=args.void_non_gpu_containers,
        driver_memory_limits=args.driver_memory_limits,
        mps_limits=args.mps_limits,
        preload_library_host_path=args.preload_library,
        preload_library_mount_dir=args.preload_library_mount_dir,
        gpu_memory=tuple(args.gpu_memory or ()),
        pytorch_memory_fraction=args.pytorch_memory_fraction,
        framework_memory_headroom_bytes=args.framework_memory_headroom,
        admin_groups=args.admin_groups or DEFAULT_ADMIN_GROUPS,
        device_access_namespaces=tuple(args.device_access_namespaces or ()),
        other_namespace_gpu_processes=args.other_namespace_gpu_processes,
        host_gpu_processes=args.host_gpu_processes,
    )
