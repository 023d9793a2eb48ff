"""The names and labels of the enforcer's Prometheus metrics, shared by the enforcer (which exports
them, gpufence/enforcer/report/metrics.py) and the monitor (which reads them, gpufence/monitor/), so neither
imports the other. Standard library only.

Label names are joinable with DCGM-exporter: ``namespace``, ``pod``, ``container``, ``UUID``, ``gpu``.
Prometheus adds the target's labels (the PodMonitor's relabelling: ``namespace``, ``pod``,
``container``, ``endpoint``, ``job`` and ``node``, the pod's node); the enforcer's own win.
"""

from __future__ import annotations

# Per container and device: namespace, pod, container, UUID, gpu.
CONTAINER_MEMORY_USED = "gpufence_container_gpu_memory_used_bytes"
CONTAINER_MEMORY_LIMIT = "gpufence_container_gpu_memory_limit_bytes"
CONTAINER_LIMIT_FROM_PERCENT = "gpufence_container_gpu_memory_limit_from_percent"
CONTAINER_SM_UTILIZATION = "gpufence_container_sm_utilization_ratio"
# Per container: namespace, pod, container.
CONTAINER_COMPUTE_SHARE = "gpufence_container_compute_share_ratio"
CONTAINER_THROTTLED = "gpufence_container_throttled"
CONTAINER_MEMORY_ENFORCEMENT = "gpufence_container_memory_enforcement"  # + mechanism
ENFORCEMENT_ACTIONS = "gpufence_enforcement_actions_total"  # + action, resource
# Per pod and device: namespace, pod, UUID, gpu.
POD_MEMORY_USED = "gpufence_pod_gpu_memory_used_bytes"
POD_MEMORY_UNATTRIBUTED = "gpufence_pod_gpu_memory_unattributed_bytes"
POD_MEMORY_BUDGET = "gpufence_pod_gpu_memory_budget_bytes"
POD_UNATTRIBUTED_PROCESSES = "gpufence_pod_unattributed_processes"
DEVICE_MIG_UNENFORCED = "gpufence_device_mig_unenforced"
# Per enforcer (the sidecar's target labels namespace, pod).
UNINSPECTABLE_PROCESSES = "gpufence_uninspectable_processes"
POLL_DURATION = "gpufence_poll_duration_seconds"
POLL_INTERVAL = "gpufence_poll_interval_seconds"
LAST_SUCCESSFUL_POLL = "gpufence_last_successful_poll_timestamp_seconds"
NVML_UP = "gpufence_nvml_up"
NVML_ERRORS = "gpufence_nvml_errors_total"
POLL_ERRORS = "gpufence_poll_errors_total"
ENFORCER_PAUSED = "gpufence_enforcer_paused_seconds_total"

DEVICE_LABELS = ("namespace", "pod", "container", "UUID", "gpu")
CONTAINER_LABELS = ("namespace", "pod", "container")
POD_DEVICE_LABELS = ("namespace", "pod", "UUID", "gpu")

# The label the PodMonitor's relabelling adds with the pod's node (__meta_kubernetes_pod_node_name).
NODE_LABEL = "node"

ENFORCER_METRICS = (
    CONTAINER_MEMORY_USED, CONTAINER_MEMORY_LIMIT, CONTAINER_LIMIT_FROM_PERCENT, CONTAINER_SM_UTILIZATION,
    CONTAINER_COMPUTE_SHARE, CONTAINER_THROTTLED, CONTAINER_MEMORY_ENFORCEMENT, ENFORCEMENT_ACTIONS,
    POD_MEMORY_USED, POD_MEMORY_UNATTRIBUTED, POD_MEMORY_BUDGET, POD_UNATTRIBUTED_PROCESSES, DEVICE_MIG_UNENFORCED,
    UNINSPECTABLE_PROCESSES, POLL_DURATION, POLL_INTERVAL, LAST_SUCCESSFUL_POLL, NVML_UP, NVML_ERRORS, POLL_ERRORS,
    ENFORCER_PAUSED,
)

# The node guardian (gpufence-node, gpufence/node/), one series set per node (Prometheus adds the
# guardian pod's labels; ``node`` comes from its PodMonitor's relabelling).
NODE_GPU_PROCESSES = "gpufence_node_gpu_processes"  # + standing
# Standings of NODE_GPU_PROCESSES (the census's, gpufence.node.decide.Standing) that ``gpufence top``
# reads: the opted-in containers' processes, and those gpufence does not govern (pods of namespaces
# that did not opt in, processes in no pod).
STANDING_ADMITTED = "admitted"
STANDING_OTHER_NAMESPACE = "other_namespace"
STANDING_HOST = "host"
NODE_UNACCOUNTED_PROCESSES = "gpufence_node_unaccounted_processes"  # + namespace, pod, container
NODE_UNACCOUNTED_MEMORY = "gpufence_node_unaccounted_memory_bytes"  # + namespace, pod, container
# GPU processes without a share where the admin allowed the pod device access (reported, not acted on).
NODE_ADMIN_ALLOWED_PROCESSES = "gpufence_node_admin_allowed_processes"  # + namespace, pod, container
NODE_ADMIN_ALLOWED_MEMORY = "gpufence_node_admin_allowed_memory_bytes"  # + namespace, pod, container
NODE_ACTIONS = "gpufence_node_actions_total"  # + action, reason
NODE_THROTTLED = "gpufence_node_container_throttled"  # + namespace, pod, container
NODE_POLL_DURATION = "gpufence_node_poll_duration_seconds"
NODE_LAST_SUCCESSFUL_POLL = "gpufence_node_last_successful_poll_timestamp_seconds"
NODE_NVML_UP = "gpufence_node_nvml_up"
NODE_PODS_SYNCED = "gpufence_node_pods_synced"
NODE_POLL_ERRORS = "gpufence_node_poll_errors_total"

NODE_METRICS = (
    NODE_GPU_PROCESSES, NODE_UNACCOUNTED_PROCESSES, NODE_UNACCOUNTED_MEMORY, NODE_ADMIN_ALLOWED_PROCESSES,
    NODE_ADMIN_ALLOWED_MEMORY, NODE_ACTIONS, NODE_THROTTLED, NODE_POLL_DURATION, NODE_LAST_SUCCESSFUL_POLL,
    NODE_NVML_UP, NODE_PODS_SYNCED, NODE_POLL_ERRORS,
)
