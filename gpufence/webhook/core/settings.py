"""Typed inputs of the pure mutation core.

``InjectionSettings`` is everything the operator configures with flags (built by ``webhook.flags``);
``NamespaceInfo`` is what the core needs to know of the pod's namespace (served by
``webhook.cluster.namespaces`` from a watch cache, or a fixed answer outside a cluster). Neither does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from gpufence import IMAGE
from gpufence.contract import (
    DEFAULT_GRACE_PERIOD_SECONDS,
    DEFAULT_HOST_PROC_MOUNT,
    DEFAULT_METRICS_PORT,
    DEFAULT_POLL_INTERVAL_SECONDS,
    INJECTION_ENABLED,
    INJECTION_LABEL,
)

# The image of this very version (gpufence/__init__.py): webhook and sidecar come from one build.
DEFAULT_SIDECAR_IMAGE = IMAGE
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
# The device plugin's names for a GPU: whole GPUs, renamed time-sliced ones (renameByDefault:
# nvidia.com/gpu.shared) and MIG slices (mixed strategy: nvidia.com/mig-1g.10gb). A trailing "*"
# is a prefix (webhook.core.gpu_paths).
DEFAULT_GPU_RESOURCES = (DEFAULT_GPU_RESOURCE, "nvidia.com/gpu.*", "nvidia.com/mig-*")
# The DRA driver of NVIDIA's GPUs and MIG devices (kubernetes-sigs/dra-driver-nvidia-gpu): a
# DeviceClass whose selectors pin it selects GPUs (webhook.core.dra).
DEFAULT_DRA_GPU_DRIVERS = ("gpu.nvidia.com",)
# Who may touch the enforcer of a running pod (change the sidecar, exec or attach into it, add an
# ephemeral container the gpufence-protect policy would refuse): the cluster's superusers and the
# group gpufence documents for its operators (docs/install.md).
# KAI-Scheduler's default scheduler name (its chart's), which its fraction pods name.
DEFAULT_KAI_SCHEDULER = "kai-scheduler"
DEFAULT_ADMIN_GROUPS = ("system:masters", "gpufence:admins")


@dataclass(frozen=True)
class NamespaceInfo:
    name: str
    labels: MappingProxyType[str, str] | dict[str, str] = field(default_factory=dict)
    annotations: MappingProxyType[str, str] | dict[str, str] = field(default_factory=dict)

    @property
    def opted_in(self) -> bool:
        return self.labels.get(INJECTION_LABEL) == INJECTION_ENABLED


class NamespaceLookup(Protocol):
    """Answers from memory (a watch cache); never an API call per admission."""

    def get(self, name: str) -> NamespaceInfo | None:
        """The namespace, or None when it is not (yet) known."""
        ...


@runtime_checkable
class FreshReader(Protocol):
    """A ``NamespaceLookup`` that can also read one namespace from the API server now (and keep it).

    For the rare admission whose namespace the cache does not show as opted in although the API
    server sent it (webhook.server): never on the common path."""

    def get(self, name: str) -> NamespaceInfo | None: ...

    def read_fresh(self, name: str) -> NamespaceInfo | None:
        """The namespace as the API server has it now (None: it does not exist); raises on failure."""
        ...


class AllNamespacesOptedIn:
    """Used outside a cluster: every namespace is opted in and has no defaults."""

    def get(self, name: str) -> NamespaceInfo | None:
        return NamespaceInfo(name=name, labels={INJECTION_LABEL: INJECTION_ENABLED})


@dataclass(frozen=True)
class InjectionSettings:
    """Operator configuration of the injection (one field per webhook flag)."""

    sidecar_image: str = DEFAULT_SIDECAR_IMAGE
    sidecar_image_pull_policy: str = "IfNotPresent"
    # Resource names (or prefixes ending in "*") that make a container a GPU container (limits or
    # requests), which gets a share and the sidecar (webhook.core.gpu_paths).
    gpu_resource_names: tuple[str, ...] = DEFAULT_GPU_RESOURCES
    # Of those, or besides them, the devices the admin declares never shared between pods (e.g. a
    # MIG profile that is not time-sliced): no share, no sidecar, never NVIDIA_VISIBLE_DEVICES=void.
    exclusive_gpu_resource_names: tuple[str, ...] = ()
    # Names of ResourceClaims / ResourceClaimTemplates that hold no GPU; a DRA claim that is not
    # listed makes the container that uses it a GPU container.
    non_gpu_resource_claims: tuple[str, ...] = ()
    # The names KAI-Scheduler runs under: a pod of one of them with KAI's gpu-fraction or gpu-memory
    # annotation has a GPU container by KAI's path (webhook.core.kai).
    kai_scheduler_names: tuple[str, ...] = (DEFAULT_KAI_SCHEDULER,)
    # DRA drivers whose devices are GPUs: a claim whose DeviceClass selects only other drivers holds
    # no GPU (webhook.core.dra). Class names are the admin's and never matched.
    dra_gpu_drivers: tuple[str, ...] = DEFAULT_DRA_GPU_DRIVERS
    # Native sidecar (initContainers[0], restartPolicy Always; Kubernetes >= 1.29) or a plain container.
    native_sidecar: bool = True
    metrics_port: int = DEFAULT_METRICS_PORT
    # Canonical quantities (webhook.flags canonicalises the flags): the API server stores them so.
    # Limits by default, so that a namespace whose ResourceQuota covers limits.cpu / limits.memory
    # admits the mutated pod; None: no CPU limit.
    # The limit sets how fast the enforcer starts, and the workload waits for it (the postStart
    # hook): against a real H200's driver it was up 0.53-0.61 s after exec at 500m, 1.07-1.25 s at
    # 250m (docs/gpu-validation.md). At rest it used 0.23-0.64 % of a core there (the most with a
    # compute share); the request is what the scheduler reserves.
    sidecar_cpu_request: str = "10m"
    sidecar_cpu_limit: str | None = "500m"
    # The request covers the sidecar's resident memory as measured in its own memory cgroup on the
    # node test bed (tests/e2e/node/test_node_footprint.py; current figure in docs/PERFORMANCE.md);
    # the limit keeps headroom for a start-up that loads more (a 128Mi limit once OOM-killed an
    # enforcer that loaded the Kubernetes client for Events).
    sidecar_memory_request: str = "64Mi"
    sidecar_memory_limit: str = "256Mi"
    # Webhook-level fallbacks when neither the pod nor its namespace sets a share.
    default_memory: str | None = None
    default_compute: str | None = None
    default_grace_period_seconds: float = DEFAULT_GRACE_PERIOD_SECONDS
    # Cluster-wide policy where the Namespace says nothing (gpufence/webhook/core/namespace_policy.py); safe defaults.
    max_memory: str | None = None
    max_compute: str | None = None
    default_mode: str = "enforce"
    allow_audit: bool = False
    allow_opt_out: bool = False
    poll_interval_seconds: float = DEFAULT_POLL_INTERVAL_SECONDS
    # Containers that request no GPU get NVIDIA_VISIBLE_DEVICES=void (the toolkit's side door).
    void_non_gpu_containers: bool = True
    # NVML access for the sidecar through the NVIDIA container toolkit, without a GPU slot.
    nvidia_visible_devices: str = "all"
    nvidia_driver_capabilities: str = "utility"
    # Legacy drivers report host PIDs: mount the host's /proc read-only in the sidecar.
    mount_host_proc: bool = False
    host_proc_mount_path: str = DEFAULT_HOST_PROC_MOUNT
    # The driver's per-container GPU memory limit (NVIDIA_GPU_MEMORY_LIMIT / _REQUEST, applied by the
    # container toolkit's hook; webhook.core.driver_limits): "on" for every GPU pod, "off" never, "auto"
    # for pods that can only be scheduled onto nodes labelled gpufence.io/driver-memory-limits=true.
    driver_memory_limits: str = "auto"
    # CUDA MPS per-client limits derived from the shares.
    mps_limits: bool = False
    # LD_PRELOAD in-process limiter (HAMi-core's libvgpu.so), mounted from the node.
    preload_library_host_path: str | None = None
    preload_library_mount_dir: str = "/usr/local/gpufence/preload"
    # Framework caps (gpufence/webhook/core/frameworks.py). The memory of one GPU per GPU resource name, for
    # homogeneous pools: (resource name, bytes) pairs, so that byte shares become fractions.
    gpu_memory: tuple[tuple[str, int], ...] = ()
    # PyTorch's allocator cap (PYTORCH_CUDA_ALLOC_CONF per_process_memory_fraction, PyTorch >= 2.10;
    # older releases refuse to initialise CUDA with it): off unless the operator or namespace opts in.
    pytorch_memory_fraction: bool = False
    # Taken off the share before it becomes a framework's fraction (where the GPU's memory is
    # known): the CUDA context and library workspaces, outside the allocator, count in NVML.
    framework_memory_headroom_bytes: int = 512 << 20
    # Read by the gpufence-protect ValidatingAdmissionPolicy (k8s/base/protect-policy.yaml) through the
    # policy ConfigMap; the webhook only validates the key. Its members pass that policy.
    admin_groups: tuple[str, ...] = DEFAULT_ADMIN_GROUPS
    # Namespaces whose pods may reach the node's devices without a device request (privileged
    # containers, hostPath of /dev, /proc, the driver's paths: webhook.core.device_access); elsewhere in
    # opted-in namespaces only members of admin_groups may create such pods.
    device_access_namespaces: tuple[str, ...] = ()
    # Not the webhook's to apply: the node guardian reads them from the policy ConfigMap (one source
    # of each setting). Whether GPU processes of pods gpufence does not govern (other namespaces,
    # opted-out pods), and of the host, may share a GPU with an opted-in pod's admitted share
    # (contract.GpuSharing; "allow" keeps what nodes did before the keys).
    other_namespace_gpu_processes: str = "allow"
    host_gpu_processes: str = "allow"
