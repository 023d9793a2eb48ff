"""The contract between the webhook and the enforcer, in one place.

The webhook writes it (and checks the final pod against it on ``/validate``), the enforcer reads
it. Neither gpufence.webhook nor gpufence.enforcer imports the other: both import this module,
which imports the standard library only (the sidecar loads it at start).

It holds the enforcer config (the JSON document the webhook writes into ``GPUFENCE_CONFIG``: its
types, field names, bounds and defaults, the encoder the webhook uses and the parser the enforcer
uses), the environment variables the webhook sets for the enforcer and the GPU containers, the
labels and annotations both sides read, and the ``gpufence.io/status`` annotation.

Config wire format (version 1), keys in camelCase as in Kubernetes objects::

    {
      "version": 1,
      "mode": "enforce",                 # or "audit": measure and log, never signal
      "gracePeriodSeconds": 10,          # SIGTERM -> SIGKILL delay
      "pollIntervalSeconds": 0.5,
      "containers": {
        "train": {"memoryBytes": 8589934592, "computePercent": 50, "gpus": 1},
        "eval":  {"memoryPercent": 25}
      }
    }

The webhook writes a top-level field only where it differs from its default (the values above:
version 1, enforce, 10 s, 0.5 s), so a typical pod carries ``{"containers":{...}}`` alone; the
reader takes the default for an absent field.

A container appears when it asks for a GPU. ``memoryBytes`` or ``memoryPercent`` is its memory
share; both present means the smaller of the two on each device (a pod's share and a namespace
ceiling in different units, which cannot be compared at admission because the device's memory is
not known there); both absent means no memory limit; ``computePercent`` absent means no compute
limit. ``gpus``: how many GPUs the container requested; processes of the container on more GPUs
than that (NVIDIA_VISIBLE_DEVICES taken from a ConfigMap through envFrom, which admission cannot
see) get the container terminated; absent means no such check.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

# --- labels and annotations ------------------------------------------------------------------

INJECTION_LABEL = "gpufence.io/injection"
INJECTION_ENABLED = "enabled"
POD_OPT_OUT_LABEL = "gpufence.io/inject"
MIRROR_POD_ANNOTATION = "kubernetes.io/config.mirror"
# The node label an admin sets ("true") where the driver (>= R615), the container toolkit
# (>= 1.20.1, its apply-cuda-memory-limits hook) and cgroup v2 can apply a per-container driver
# memory limit. Under driver-memory-limits=auto the webhook writes the limit only into pods that
# can be scheduled onto such nodes alone: elsewhere the hook would fail the container's start.
DRIVER_LIMITS_NODE_LABEL = "gpufence.io/driver-memory-limits"

ANNOTATION_PREFIX = "gpufence.io/"
ANNOTATION_MEMORY = "gpufence.io/memory"
ANNOTATION_COMPUTE = "gpufence.io/compute"
ANNOTATION_MODE = "gpufence.io/mode"
ANNOTATION_GRACE_PERIOD = "gpufence.io/grace-period"
ANNOTATION_STATUS = "gpufence.io/status"
# The creator's user name, written by the webhook at creation where a member of admin-groups creates a
# pod that only they may (device access without a device request, an annotation that hands out
# devices); denied to anyone else, and the protect policy keeps it from every update. The node
# guardian reports, and does not end, GPU processes of such a pod that hold no share.
ANNOTATION_ADMIN_DEVICE_ACCESS = "gpufence.io/admin-device-access"
NAMESPACE_DEFAULT_MEMORY = "gpufence.io/default-memory"
NAMESPACE_DEFAULT_COMPUTE = "gpufence.io/default-compute"
# Admin-owned policy on the Namespace (gpufence/webhook/core/namespace_policy.py); the mode uses ANNOTATION_MODE's key.
NAMESPACE_MAX_MEMORY = "gpufence.io/max-memory"
NAMESPACE_MAX_COMPUTE = "gpufence.io/max-compute"
NAMESPACE_ALLOW_AUDIT = "gpufence.io/allow-audit"
NAMESPACE_ALLOW_OPT_OUT = "gpufence.io/allow-opt-out"
# "true"/"false": inject PyTorch's allocator cap in this namespace (else --pytorch-memory-fraction).
NAMESPACE_PYTORCH_MEMORY_FRACTION = "gpufence.io/pytorch-memory-fraction"

# --- the sidecar -------------------------------------------------------------------------------

SIDECAR_NAME = "gpufence-enforcer"
# The sidecar's metrics port name, which the enforcer PodMonitor selects. Kubernetes limits port
# names to 15 characters (IANA_SVC_NAME), so not "gpufence-metrics" (16).
SIDECAR_PORT_NAME = "gpufence-metric"
# The enforcer's console script (pyproject.toml), the sidecar's whole command.
ENFORCER_COMMAND = "gpufence-enforcer"
# The sidecar's liveness probe (gpufence/enforcer/probe.py): an exec of the image's
# interpreter that checks the heartbeat the enforcer writes into its state directory. Isolated (-I)
# and importing only the probe module: about a tenth of the CPU time of the console script, which
# loads the whole enforcer, for a command the kubelet runs every 10 s for the life of the pod. Not a
# console script of its own either: pip's wrapper imports ``re`` and runs without -I, half as much
# CPU again per run (bench/injected_bytes.py --probe-cost), to save 70 bytes per probe.
PROBE_COMMAND = ("python3", "-Ic", "from gpufence.enforcer.probe import run;run()")
# The sidecar's postStart hook: the same check, repeated until it passes (or 60 s have gone by),
# which holds the workload containers back until the enforcer is up.
POST_START_COMMAND = ("python3", "-Ic", "from gpufence.enforcer.probe import wait;wait()")

# Environment variables the webhook sets and the enforcer reads.
ENV_CONFIG = "GPUFENCE_CONFIG"
# The pod's identity for an enforcer run outside a pod (the demo, tests, a host); in a pod the
# enforcer reads it from its service-account token, and the webhook never sets these on the sidecar.
ENV_POD_NAME = "GPUFENCE_POD_NAME"
ENV_POD_NAMESPACE = "GPUFENCE_POD_NAMESPACE"
ENV_POD_UID = "GPUFENCE_POD_UID"
# The gpufence.io/status annotation (downward API), set only when the status records warnings:
# the enforcer posts them as Events.
ENV_POD_STATUS = "GPUFENCE_POD_STATUS"
# Set only when not DEFAULT_METRICS_PORT (0 where the pod's network may hold the port).
ENV_METRICS_PORT = "GPUFENCE_METRICS_PORT"
ENV_HOST_PROC = "GPUFENCE_HOST_PROC"
# Never set by the webhook, which mounts the state volume at DEFAULT_STATE_DIR, the enforcer's and
# the probe's default; a variable for running the enforcer elsewhere (tests, the demo).
ENV_STATE_DIR = "GPUFENCE_STATE_DIR"
# Set on each GPU container: its name (the enforcer reads it from /proc/<pid>/environ) and its memory share.
ENV_CONTAINER = "GPUFENCE_CONTAINER"
ENV_MEMORY_LIMIT = "GPUFENCE_MEMORY_LIMIT"
# The hard limits a GPU container's environment can ask for, which the enforcer reads back to say
# which mechanism holds a container's share: the driver's per-cgroup limit (the container toolkit's
# apply-cuda-memory-limits hook applies it), CUDA MPS's per-client limit, and a preload limiter's.
ENV_DRIVER_MEMORY_LIMIT = "NVIDIA_GPU_MEMORY_LIMIT"
# The hook's soft limit (the cgroup is first in line for eviction past it), which it requires next
# to the hard one and refuses above it: the webhook writes it equal to the limit.
ENV_DRIVER_MEMORY_REQUEST = "NVIDIA_GPU_MEMORY_REQUEST"
ENV_MPS_MEMORY_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_PRELOAD_MEMORY_LIMIT = "CUDA_DEVICE_MEMORY_LIMIT"
ENV_LD_PRELOAD = "LD_PRELOAD"

DEFAULT_METRICS_PORT = 9401
# Where the webhook mounts the host's /proc when the legacy-driver flag is on.
DEFAULT_HOST_PROC_MOUNT = "/host/proc"
# An emptyDir the webhook mounts so the enforcer can remember which processes it stopped
# (the root filesystem is read-only); a restarted enforcer continues them first.
DEFAULT_STATE_DIR = "/var/run/gpufence"

# --- the enforcer config (GPUFENCE_CONFIG) ------------------------------------------------------

SCHEMA_VERSION = 1

# The document's fields, and those of each container's entry: the only place they are spelled.
FIELD_VERSION = "version"
FIELD_MODE = "mode"
FIELD_GRACE_PERIOD_SECONDS = "gracePeriodSeconds"
FIELD_POLL_INTERVAL_SECONDS = "pollIntervalSeconds"
FIELD_CONTAINERS = "containers"
CONFIG_FIELDS = (FIELD_VERSION, FIELD_MODE, FIELD_GRACE_PERIOD_SECONDS, FIELD_POLL_INTERVAL_SECONDS, FIELD_CONTAINERS)
FIELD_MEMORY_BYTES = "memoryBytes"
FIELD_MEMORY_PERCENT = "memoryPercent"
FIELD_COMPUTE_PERCENT = "computePercent"
FIELD_GPUS = "gpus"
SHARE_FIELDS = (FIELD_MEMORY_BYTES, FIELD_MEMORY_PERCENT, FIELD_COMPUTE_PERCENT, FIELD_GPUS)

DEFAULT_GRACE_PERIOD_SECONDS = 10.0
DEFAULT_POLL_INTERVAL_SECONDS = 0.5
MAX_GRACE_PERIOD_SECONDS = 3600.0
MIN_POLL_INTERVAL_SECONDS = 0.05
MAX_POLL_INTERVAL_SECONDS = 60.0


class ConfigError(ValueError):
    """The configuration document is malformed; the message names the field and the value."""


class Mode(StrEnum):
    ENFORCE = "enforce"
    AUDIT = "audit"


class GpuSharing(StrEnum):
    """Whether GPU processes outside the pods gpufence governs may share a GPU with an opted-in pod's
    admitted share: the policy keys ``other-namespace-gpu-processes`` and ``host-gpu-processes``
    (webhook.flags), read by the node guardian (gpufence.node.decide.foreign_verdict)."""

    ALLOW = "allow"  # the default: reported once as a GPU process, nothing more (as before the keys)
    REPORT = "report"  # a breach each time it starts: log line, metric, Event; nothing is signalled
    TERMINATE = "terminate"  # the foreign container is ended through its cgroup (in enforce)


# A host process is in no container: its cgroup may be a system service, a login session or the root,
# and no grace period or restart policy covers it, so the guardian never signals one (docs/policy.md).
HOST_GPU_SHARING = (GpuSharing.ALLOW, GpuSharing.REPORT)


class LimitUnit(StrEnum):
    """Which part of a memory share is the limit on a device."""

    BYTES = "bytes"
    PERCENT = "percent"


@dataclass(frozen=True)
class MemoryShare:
    """A memory share: an absolute byte count, a percentage of the device's total memory, or both,
    in which case the smaller of the two applies on each device."""

    bytes: int | None = None
    percent: float | None = None

    def __post_init__(self) -> None:
        if self.bytes is None and self.percent is None:
            raise ConfigError("a memory share needs bytes, a percent or both")
        if self.bytes is not None and self.bytes <= 0:
            raise ConfigError(f"{FIELD_MEMORY_BYTES} must be a positive integer, got {self.bytes!r}")
        if self.percent is not None and not (0 < self.percent <= 100):
            raise ConfigError(f"{FIELD_MEMORY_PERCENT} must be in (0, 100], got {self.percent!r}")

    @property
    def two_units(self) -> bool:
        return self.bytes is not None and self.percent is not None

    def limit_on(self, device_total_bytes: int | None) -> tuple[int, LimitUnit] | None:
        """The limit on a device of the given size and the unit it comes from; None when it depends
        on a total that is unknown (or nonsensical). A percentage is floored to whole bytes; with
        both units the smaller wins (bytes on a tie), and an unknown total leaves the bytes."""
        known = device_total_bytes is not None and device_total_bytes > 0
        from_percent = None
        if self.percent is not None and known:
            assert device_total_bytes is not None
            from_percent = int(device_total_bytes * self.percent / 100)
        if self.bytes is not None and (from_percent is None or self.bytes <= from_percent):
            return self.bytes, LimitUnit.BYTES
        if from_percent is not None:
            return from_percent, LimitUnit.PERCENT
        return None

    def limit_bytes(self, device_total_bytes: int) -> int:
        """The limit on a device of the given (known, positive) size."""
        found = self.limit_on(device_total_bytes)
        assert found is not None
        return found[0]

    def describe(self) -> str:
        """``8589934592``, ``25%``, or ``min(8589934592,25%)`` for a share in two units."""
        if self.bytes is not None and self.percent is not None:
            return f"min({self.bytes},{self.percent:g}%)"
        return f"{self.bytes}" if self.bytes is not None else f"{self.percent:g}%"


@dataclass(frozen=True)
class ContainerShare:
    memory: MemoryShare | None = None
    compute_percent: float | None = None
    gpus: int | None = None  # the GPUs the container requested (its device plugin resources)

    def __post_init__(self) -> None:
        if self.compute_percent is not None and not (0 < self.compute_percent <= 100):
            raise ConfigError(f"{FIELD_COMPUTE_PERCENT} must be in (0, 100], got {self.compute_percent!r}")
        if self.gpus is not None and (isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1):
            raise ConfigError(f"{FIELD_GPUS} must be a positive integer, got {self.gpus!r}")


@dataclass(frozen=True)
class EnforcerConfig:
    containers: Mapping[str, ContainerShare] = field(default_factory=dict)
    mode: Mode = Mode.ENFORCE
    grace_period_seconds: float = DEFAULT_GRACE_PERIOD_SECONDS
    poll_interval_seconds: float = DEFAULT_POLL_INTERVAL_SECONDS

    def __post_init__(self) -> None:
        # Freeze the mapping so a config shared between threads cannot change under them.
        object.__setattr__(self, "containers", MappingProxyType(dict(self.containers)))
        if not (0 <= self.grace_period_seconds <= MAX_GRACE_PERIOD_SECONDS):
            raise ConfigError(
                f"{FIELD_GRACE_PERIOD_SECONDS} must be in [0, {MAX_GRACE_PERIOD_SECONDS:g}], "
                f"got {self.grace_period_seconds!r}"
            )
        if not (MIN_POLL_INTERVAL_SECONDS <= self.poll_interval_seconds <= MAX_POLL_INTERVAL_SECONDS):
            raise ConfigError(
                f"{FIELD_POLL_INTERVAL_SECONDS} must be in [{MIN_POLL_INTERVAL_SECONDS:g}, "
                f"{MAX_POLL_INTERVAL_SECONDS:g}], got {self.poll_interval_seconds!r}"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EnforcerConfig):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.to_json())

    # -- wire format -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field, defaults included (``to_json`` leaves the defaults out)."""
        containers: dict[str, Any] = {}
        for name in sorted(self.containers):
            share = self.containers[name]
            entry: dict[str, Any] = {}
            if share.memory is not None:
                if share.memory.bytes is not None:
                    entry[FIELD_MEMORY_BYTES] = share.memory.bytes
                if share.memory.percent is not None:
                    entry[FIELD_MEMORY_PERCENT] = _plain_number(share.memory.percent)
            if share.compute_percent is not None:
                entry[FIELD_COMPUTE_PERCENT] = _plain_number(share.compute_percent)
            if share.gpus is not None:
                entry[FIELD_GPUS] = share.gpus
            containers[name] = entry
        return {
            FIELD_VERSION: SCHEMA_VERSION,
            FIELD_MODE: self.mode.value,
            FIELD_GRACE_PERIOD_SECONDS: _plain_number(self.grace_period_seconds),
            FIELD_POLL_INTERVAL_SECONDS: _plain_number(self.poll_interval_seconds),
            FIELD_CONTAINERS: containers,
        }

    def to_json(self) -> str:
        """Compact, key-sorted JSON without the top-level fields at their defaults: equal configs give
        byte-identical env values (idempotent patches), and a pod carries what is particular to it."""
        doc = {key: value for key, value in self.to_dict().items() if _WRITTEN_DEFAULTS.get(key, _NONE) != value}
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, doc: Any) -> EnforcerConfig:
        if not isinstance(doc, dict):
            raise ConfigError(f"config must be a JSON object, got {type(doc).__name__}")
        version = doc.get(FIELD_VERSION, SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ConfigError(f"{FIELD_VERSION}: unsupported value {version!r}, expected {SCHEMA_VERSION}")
        unknown = set(doc) - set(CONFIG_FIELDS)
        if unknown:
            raise ConfigError(f"unknown field(s): {', '.join(sorted(unknown))}")
        mode_value = doc.get(FIELD_MODE, Mode.ENFORCE.value)
        try:
            mode = Mode(mode_value)
        except ValueError:
            expected = " or ".join(repr(m.value) for m in Mode)
            raise ConfigError(f"{FIELD_MODE}: unsupported value {mode_value!r}, expected {expected}") from None
        containers_doc = doc.get(FIELD_CONTAINERS, {})
        if not isinstance(containers_doc, dict):
            raise ConfigError(f"{FIELD_CONTAINERS} must be an object mapping container name to share")
        containers = {str(name): _container_from_dict(str(name), entry) for name, entry in containers_doc.items()}
        return cls(
            containers=containers,
            mode=mode,
            grace_period_seconds=_number(doc, FIELD_GRACE_PERIOD_SECONDS, DEFAULT_GRACE_PERIOD_SECONDS),
            poll_interval_seconds=_number(doc, FIELD_POLL_INTERVAL_SECONDS, DEFAULT_POLL_INTERVAL_SECONDS),
        )

    @classmethod
    def from_json(cls, text: str) -> EnforcerConfig:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from None
        return cls.from_dict(doc)


def _container_from_dict(name: str, entry: Any) -> ContainerShare:
    if not isinstance(entry, dict):
        raise ConfigError(f"{FIELD_CONTAINERS}.{name} must be an object")
    unknown = set(entry) - set(SHARE_FIELDS)
    if unknown:
        raise ConfigError(f"{FIELD_CONTAINERS}.{name}: unknown field(s): {', '.join(sorted(unknown))}")
    memory: MemoryShare | None = None
    try:
        num_bytes = percent = None
        if FIELD_MEMORY_BYTES in entry:
            num_bytes = entry[FIELD_MEMORY_BYTES]
            if isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
                raise ConfigError(f"{FIELD_MEMORY_BYTES} must be an integer, got {num_bytes!r}")
        if FIELD_MEMORY_PERCENT in entry:
            percent = _number(entry, FIELD_MEMORY_PERCENT, None)
        if num_bytes is not None or percent is not None:
            memory = MemoryShare(bytes=num_bytes, percent=percent)
        compute = _number(entry, FIELD_COMPUTE_PERCENT, None) if FIELD_COMPUTE_PERCENT in entry else None
        return ContainerShare(memory=memory, compute_percent=compute, gpus=entry.get(FIELD_GPUS))
    except ConfigError as exc:
        raise ConfigError(f"{FIELD_CONTAINERS}.{name}: {exc}") from None


def _number(doc: dict[str, Any], key: str, default: float | None) -> Any:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def _plain_number(value: float | None) -> int | float | None:
    """Write 10.0 as 10 so the JSON reads as a person would write it."""
    if value is not None and float(value).is_integer():
        return int(value)
    return value


_NONE = object()
# The top-level fields to_json leaves out at these values (from_dict's defaults, as written).
_WRITTEN_DEFAULTS: dict[str, Any] = {
    FIELD_VERSION: SCHEMA_VERSION,
    FIELD_MODE: Mode.ENFORCE.value,
    FIELD_GRACE_PERIOD_SECONDS: _plain_number(DEFAULT_GRACE_PERIOD_SECONDS),
    FIELD_POLL_INTERVAL_SECONDS: _plain_number(DEFAULT_POLL_INTERVAL_SECONDS),
}


# --- the gpufence.io/status annotation ---------------------------------------------------------

# What the webhook did, as one compact key-sorted JSON object: the GPU containers, the mode, the
# version, and when there are any the share-aware warnings (which the enforcer, reading the
# annotation through ENV_POD_STATUS, posts as Events). Nothing the pod shows elsewhere: no
# sidecar name (always gpufence-enforcer) and no framework caps (each GPU container's env
# carries them), which every GPU pod would carry twice in its metadata for nothing.
STATUS_CONTAINERS = "containers"
STATUS_MODE = "mode"
STATUS_VERSION = "version"
STATUS_WARNINGS = "warnings"
# The webhook records at most this many warnings; the enforcer reads no more.
MAX_STATUS_WARNINGS = 8


def status_document(containers: Sequence[str], mode: Mode, version: str,
                    warnings: Sequence[str] = ()) -> dict[str, Any]:
    """The status annotation's object (the webhook encodes it compact and key-sorted); ``warnings``
    appear only when not empty."""
    status: dict[str, Any] = {STATUS_CONTAINERS: list(containers), STATUS_MODE: mode.value, STATUS_VERSION: version}
    if warnings:
        status[STATUS_WARNINGS] = list(warnings)
    return status
