"""Value converters of ``gpufence-webhook``'s flags: each takes the text of a flag, an env var or a
key of the policy ConfigMap (webhook.cluster_policy) and returns the value, or raises ValueError
with a short reason. One implementation of each rule, wherever the value comes from.
"""

from __future__ import annotations

import re
from collections.abc import Callable


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


def non_empty(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


def resource_quantity(text: str) -> str:
    """A container resource quantity, written back canonically (the API server's form), so that a
    reinvocation after the API server canonicalised the pod sees the same value and patches nothing."""
    from gpufence.webhook.quantity import canonical_quantity

    canonical = canonical_quantity(text.strip())
    if canonical == "0":
        raise ValueError("must be greater than zero")
    return canonical


def optional_resource_quantity(text: str) -> str | None:
    """``resource_quantity``, or None for "none" (no such limit)."""
    return None if text.strip().lower() == "none" else resource_quantity(text)


def memory_share(text: str) -> str:
    from gpufence.webhook.shares import parse_memory_share  # the core's own parser: the same rules as annotations

    parse_memory_share(text)
    return text


def compute_share(text: str) -> str:
    from gpufence.webhook.shares import parse_compute_share

    parse_compute_share(text)
    return text


def gpu_memory(text: str) -> tuple[str, int]:
    """RESOURCE=QUANTITY, e.g. "nvidia.com/gpu=80Gi": the memory of one GPU of that resource."""
    from gpufence.webhook.quantity import QuantityError, parse_bytes

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
    from gpufence.webhook.quantity import QuantityError, parse_bytes

    try:
        num_bytes = parse_bytes(text.strip())
    except QuantityError:
        raise ValueError('use a quantity such as "512Mi" or "0"') from None
    if num_bytes < 0:
        raise ValueError("must not be negative")
    return num_bytes


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def namespaced_name(text: str) -> tuple[str, str]:
    """NAMESPACE/NAME of an object, e.g. "gpufence/gpufence-policy": Kubernetes' rules for both names."""
    namespace, sep, name = text.strip().partition("/")
    if not sep or not _DNS_LABEL.fullmatch(namespace) or not _DNS_SUBDOMAIN.fullmatch(name):
        raise ValueError('use NAMESPACE/NAME in lower case such as "gpufence/gpufence-policy"')
    return namespace, name
