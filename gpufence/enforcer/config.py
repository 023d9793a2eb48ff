"""The enforcer's configuration: the JSON document the webhook writes into ``GPUFENCE_CONFIG``.

The enforcer consumes this document, so it owns the schema; the webhook imports these types
to produce it. Keeping both sides on one set of frozen dataclasses means a field cannot be
renamed on one side only.

Wire format (version 1), keys in camelCase as in Kubernetes objects::

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

SCHEMA_VERSION = 1

# Environment variables shared by the webhook (which sets them) and the enforcer (which reads them).
ENV_CONFIG = "GPUFENCE_CONFIG"
ENV_CONTAINER = "GPUFENCE_CONTAINER"
ENV_MEMORY_LIMIT = "GPUFENCE_MEMORY_LIMIT"
ENV_POD_NAME = "GPUFENCE_POD_NAME"
ENV_POD_NAMESPACE = "GPUFENCE_POD_NAMESPACE"
ENV_POD_UID = "GPUFENCE_POD_UID"
# The webhook's gpufence.io/status annotation (downward API): its share-aware warnings become Events.
ENV_POD_STATUS = "GPUFENCE_POD_STATUS"
ENV_METRICS_PORT = "GPUFENCE_METRICS_PORT"
ENV_HOST_PROC = "GPUFENCE_HOST_PROC"
ENV_STATE_DIR = "GPUFENCE_STATE_DIR"

DEFAULT_GRACE_PERIOD_SECONDS = 10.0
DEFAULT_POLL_INTERVAL_SECONDS = 0.5
DEFAULT_METRICS_PORT = 9401
# Where the webhook mounts the host's /proc when the legacy-driver flag is on.
DEFAULT_HOST_PROC_MOUNT = "/host/proc"
# An emptyDir the webhook mounts so the enforcer can remember which processes it stopped
# (the root filesystem is read-only); a restarted enforcer continues them first.
DEFAULT_STATE_DIR = "/var/run/gpufence"

MAX_GRACE_PERIOD_SECONDS = 3600.0
MIN_POLL_INTERVAL_SECONDS = 0.05
MAX_POLL_INTERVAL_SECONDS = 60.0


class ConfigError(ValueError):
    """The configuration document is malformed; the message names the field and the value."""


class Mode(StrEnum):
    ENFORCE = "enforce"
    AUDIT = "audit"


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
            raise ConfigError(f"memoryBytes must be a positive integer, got {self.bytes!r}")
        if self.percent is not None and not (0 < self.percent <= 100):
            raise ConfigError(f"memoryPercent must be in (0, 100], got {self.percent!r}")

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
            raise ConfigError(f"computePercent must be in (0, 100], got {self.compute_percent!r}")
        if self.gpus is not None and (isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1):
            raise ConfigError(f"gpus must be a positive integer, got {self.gpus!r}")


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
                f"gracePeriodSeconds must be in [0, {MAX_GRACE_PERIOD_SECONDS:g}], "
                f"got {self.grace_period_seconds!r}"
            )
        if not (MIN_POLL_INTERVAL_SECONDS <= self.poll_interval_seconds <= MAX_POLL_INTERVAL_SECONDS):
            raise ConfigError(
                f"pollIntervalSeconds must be in [{MIN_POLL_INTERVAL_SECONDS:g}, "
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
        containers: dict[str, Any] = {}
        for name in sorted(self.containers):
            share = self.containers[name]
            entry: dict[str, Any] = {}
            if share.memory is not None:
                if share.memory.bytes is not None:
                    entry["memoryBytes"] = share.memory.bytes
                if share.memory.percent is not None:
                    entry["memoryPercent"] = _plain_number(share.memory.percent)
            if share.compute_percent is not None:
                entry["computePercent"] = _plain_number(share.compute_percent)
            if share.gpus is not None:
                entry["gpus"] = share.gpus
            containers[name] = entry
        return {
            "version": SCHEMA_VERSION,
            "mode": self.mode.value,
            "gracePeriodSeconds": _plain_number(self.grace_period_seconds),
            "pollIntervalSeconds": _plain_number(self.poll_interval_seconds),
            "containers": containers,
        }

    def to_json(self) -> str:
        """Compact, key-sorted JSON: equal configs give byte-identical env values (idempotent patches)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, doc: Any) -> EnforcerConfig:
        if not isinstance(doc, dict):
            raise ConfigError(f"config must be a JSON object, got {type(doc).__name__}")
        version = doc.get("version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ConfigError(f"version: unsupported value {version!r}, expected {SCHEMA_VERSION}")
        unknown = set(doc) - {"version", "mode", "gracePeriodSeconds", "pollIntervalSeconds", "containers"}
        if unknown:
            raise ConfigError(f"unknown field(s): {', '.join(sorted(unknown))}")
        mode_value = doc.get("mode", Mode.ENFORCE.value)
        try:
            mode = Mode(mode_value)
        except ValueError:
            raise ConfigError(f"mode: unsupported value {mode_value!r}, expected 'enforce' or 'audit'") from None
        containers_doc = doc.get("containers", {})
        if not isinstance(containers_doc, dict):
            raise ConfigError("containers must be an object mapping container name to share")
        containers = {str(name): _container_from_dict(str(name), entry) for name, entry in containers_doc.items()}
        return cls(
            containers=containers,
            mode=mode,
            grace_period_seconds=_number(doc, "gracePeriodSeconds", DEFAULT_GRACE_PERIOD_SECONDS),
            poll_interval_seconds=_number(doc, "pollIntervalSeconds", DEFAULT_POLL_INTERVAL_SECONDS),
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
        raise ConfigError(f"containers.{name} must be an object")
    unknown = set(entry) - {"memoryBytes", "memoryPercent", "computePercent", "gpus"}
    if unknown:
        raise ConfigError(f"containers.{name}: unknown field(s): {', '.join(sorted(unknown))}")
    memory: MemoryShare | None = None
    try:
        num_bytes = percent = None
        if "memoryBytes" in entry:
            num_bytes = entry["memoryBytes"]
            if isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
                raise ConfigError(f"memoryBytes must be an integer, got {num_bytes!r}")
        if "memoryPercent" in entry:
            percent = _number(entry, "memoryPercent", None)
        if num_bytes is not None or percent is not None:
            memory = MemoryShare(bytes=num_bytes, percent=percent)
        compute = _number(entry, "computePercent", None) if "computePercent" in entry else None
        return ContainerShare(memory=memory, compute_percent=compute, gpus=entry.get("gpus"))
    except ConfigError as exc:
        raise ConfigError(f"containers.{name}: {exc}") from None


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
