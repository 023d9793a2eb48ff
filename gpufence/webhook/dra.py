"""What a pod's DRA claims hold, resolved through their DeviceClasses (pure; the objects come from
the watch cache in webhook.dra_cache).

A pod names claims (``spec.resourceClaims[]``: ``resourceClaimName`` or ``resourceClaimTemplateName``);
a claim's requests name device classes (``devices.requests[].exactly.deviceClassName`` and
``firstAvailable[].deviceClassName``; a template holds the claim's spec under ``spec.spec``); a
DeviceClass selects devices with CEL expressions, and the one thing they can say that tells a GPU
from a NIC is the driver: ``device.driver == "gpu.nvidia.com"``. The GPU drivers are policy
(``dra-gpu-driver-name``, default ``gpu.nvidia.com``, which publishes NVIDIA's GPUs and MIG
devices); class names are the admin's to choose and are never matched.

The CEL reading is deliberately small (``selector_drivers``): it finds which drivers an expression
pins, and anything it cannot read pins nothing, so a class it does not understand "may hold a GPU".
A claim is a GPU claim when any class it may use may hold a GPU, not a GPU claim only when every
class provably selects devices of other drivers, and unresolved when an object is missing from the
cache (template or claim not created yet, class unknown, cache not synced, API not served).

What the webhook does with the answer is in webhook.admission and docs/gpu-paths.md: the caches can
lag behind a claim just created, so the answer informs (warnings) and never makes a pod
sidecar-free that the admin's list (``non-gpu-resource-claims``) takes for a GPU pod.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from gpufence.contract import SIDECAR_NAME

# The drivers a selector allows, or None where it allows any (pins no driver, or cannot be read).
Drivers = frozenset[str] | None

_STRING = r"""(?:"([^"\\]*)"|'([^'\\]*)')"""  # a plain CEL string literal: no escapes, not raw
_LITERAL = re.compile(_STRING)
_DRIVER = r"device\s*\.\s*driver"
_EQUALS = re.compile(rf"{_DRIVER}\s*==\s*{_STRING}|{_STRING}\s*==\s*{_DRIVER}")
_IN_LIST = re.compile(rf"{_DRIVER}\s+in\s+\[\s*((?:{_STRING}\s*,\s*)*{_STRING})\s*,?\s*\]")


def driver_name(text: str) -> str:
    """A policy value of ``dra-gpu-driver-name``: a DRA driver name (a DNS subdomain). Raises ValueError."""
    value = text.strip()
    if len(value) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*",
                                            value, re.ASCII):
        raise ValueError('use the name of a DRA driver as its devices report it, such as "gpu.nvidia.com"')
    return value


def _split_top(expression: str, operator: str) -> list[str] | None:
    """``expression`` split on ``operator`` outside strings and brackets; None where it cannot be read
    (unbalanced, or a ``?``: the ternary binds more loosely than ``||`` and ``&&``)."""
    parts: list[str] = []
    depth, quote, start, i = 0, "", 0, 0
    while i < len(expression):
        ch = expression[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == "?":
            return None
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth < 0:
                return None
        elif depth == 0 and expression.startswith(operator, i):
            parts.append(expression[start:i])
            start = i = i + len(operator)
            continue
        i += 1
    if quote or depth:
        return None
    return [*parts, expression[start:]]


def _unwrap(expression: str) -> str:
    """Without the parentheses around the whole expression, where they pair with each other."""
    text = expression.strip()
    while text.startswith("(") and text.endswith(")") and _split_top(text[1:-1], "\x00") is not None:
        text = text[1:-1].strip()
    return text


def _term_drivers(term: str) -> Drivers:
    """The drivers one term pins: ``device.driver == "x"`` (either side), ``device.driver in ["x", "y"]``."""
    if match := _EQUALS.fullmatch(term):
        return frozenset(g for g in match.groups() if g is not None)
    if match := _IN_LIST.fullmatch(term):
        return frozenset(a + b for a, b in _LITERAL.findall(match.group(1)))
    return None


def selector_drivers(expression: str, _depth: int = 0) -> Drivers:
    """The drivers whose devices a CEL selector can match, or None where it may match any driver's.

    Read: ``a || b`` (the union; None if either side may match any driver), ``a && b`` (what the
    conjuncts that pin drivers allow together: a conjunct this cannot read only narrows the match
    further, so leaving it out errs towards "any"), parentheses, and the two pinning forms
    ``device.driver == "x"`` (or ``"x" == device.driver``; single or double quotes) and
    ``device.driver in ["x", "y"]``. Anything else (negations, ``!=``, functions, the ternary,
    escapes, raw or triple-quoted strings) pins nothing, and an expression with a ``//`` comment
    is not read at all (a comment could hide an operator from this reading).
    """
    text = _unwrap(expression)
    if _depth > 32 or not text or "//" in text:
        return None
    disjuncts = _split_top(text, "||")
    if disjuncts is None:
        return None
    if len(disjuncts) > 1:
        union: set[str] = set()
        for part in disjuncts:
            drivers = selector_drivers(part, _depth + 1)
            if drivers is None:
                return None
            union |= drivers
        return frozenset(union)
    conjuncts = _split_top(text, "&&")
    if conjuncts is None:
        return None
    if len(conjuncts) == 1:
        return _term_drivers(text)
    pinned: Drivers = None
    for part in conjuncts:
        drivers = selector_drivers(part, _depth + 1)
        if drivers is not None:
            pinned = drivers if pinned is None else pinned & drivers
    return pinned


def class_drivers(device_class: Mapping[str, Any]) -> Drivers:
    """The drivers a DeviceClass's devices can come from (its selectors all apply), or None: any."""
    spec = device_class.get("spec") if isinstance(device_class.get("spec"), dict) else {}
    pinned: Drivers = None
    for selector in spec.get("selectors") or ():
        cel = selector.get("cel") if isinstance(selector, dict) else None
        expression = cel.get("expression") if isinstance(cel, dict) else None
        drivers = selector_drivers(expression) if isinstance(expression, str) else None
        if drivers is not None:
            pinned = drivers if pinned is None else pinned & drivers
    return pinned


def claim_classes(claim_spec: Any) -> tuple[str, ...]:
    """The device classes a ResourceClaim spec's requests may use (``exactly`` and every
    ``firstAvailable`` alternative), in order, without repeats."""
    devices = claim_spec.get("devices") if isinstance(claim_spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    names: list[str] = []
    for request in requests if isinstance(requests, list) else ():
        if not isinstance(request, dict):
            continue
        exactly = request.get("exactly")
        options = [exactly] if isinstance(exactly, dict) else []
        options += [o for o in request.get("firstAvailable") or () if isinstance(o, dict)]
        names += [o["deviceClassName"] for o in options if isinstance(o.get("deviceClassName"), str)]
    return tuple(dict.fromkeys(names))


def template_classes(template: Mapping[str, Any]) -> tuple[str, ...]:
    """The device classes of a ResourceClaimTemplate (its claim's spec is ``spec.spec``)."""
    spec = template.get("spec")
    return claim_classes(spec.get("spec") if isinstance(spec, dict) else None)


def resource_claim_classes(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """The device classes of a ResourceClaim."""
    return claim_classes(claim.get("spec"))


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an object; the namespace is "" for a DeviceClass."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class DraObjects(Protocol):
    """What the watch cache knows: None for an object it does not hold (or while not synced)."""

    def unavailable(self) -> str | None:
        """Why nothing can be resolved now (API not served, cache not synced), or None."""
        ...

    def claim(self, namespace: str, name: str) -> tuple[str, ...] | None:
        """The device classes of ResourceClaim ``namespace/name``."""
        ...

    def template(self, namespace: str, name: str) -> tuple[str, ...] | None:
        """The device classes of ResourceClaimTemplate ``namespace/name``."""
        ...

    def device_class(self, name: str) -> tuple[Drivers] | None:
        """The drivers of DeviceClass ``name``, in a 1-tuple (its drivers may be None: any)."""
        ...


@dataclass(frozen=True)
class DraSnapshot:
    """DraObjects from lists of objects as the API server returns them (tools and tests; the webhook
    keeps the same summaries in its watch cache, webhook.dra_cache)."""

    classes: Mapping[str, tuple[Drivers]]
    claims: Mapping[tuple[str, str], tuple[str, ...]]
    templates: Mapping[tuple[str, str], tuple[str, ...]]
    why_unavailable: str | None = None

    @classmethod
    def of(cls, classes: Iterable[Mapping[str, Any]] = (), claims: Iterable[Mapping[str, Any]] = (),
           templates: Iterable[Mapping[str, Any]] = ()) -> DraSnapshot:
        return cls(classes={object_key(c)[1]: (class_drivers(c),) for c in classes},
                   claims={object_key(c): resource_claim_classes(c) for c in claims},
                   templates={object_key(t): template_classes(t) for t in templates})

    def unavailable(self) -> str | None:
        return self.why_unavailable

    def claim(self, namespace: str, name: str) -> tuple[str, ...] | None:
        return self.claims.get((namespace, name))

    def template(self, namespace: str, name: str) -> tuple[str, ...] | None:
        return self.templates.get((namespace, name))

    def device_class(self, name: str) -> tuple[Drivers] | None:
        return self.classes.get(name)


Verdict = Literal["gpu", "not-gpu", "unresolved"]


@dataclass(frozen=True)
class ClaimResolution:
    """What one pod claim holds. ``source``: 'ResourceClaimTemplate "x"'; ``detail``: the classes
    and drivers behind a verdict, or why it is unresolved (for warnings)."""

    pod_claim: str
    object_name: str
    source: str
    verdict: Verdict
    detail: str


def _q(name: str) -> str:
    return f'"{name}"'


def resolve_claim(namespace: str, pod_claim: Mapping[str, Any], objects: DraObjects,
                  gpu_drivers: Iterable[str]) -> ClaimResolution | None:
    """What the pod claim ``pod_claim`` (an item of ``spec.resourceClaims``) holds; None where it names
    no object (the API server refuses such a pod)."""
    name = pod_claim.get("name")
    if isinstance(pod_claim.get("resourceClaimName"), str):
        kind, object_name = "ResourceClaim", pod_claim["resourceClaimName"]
    elif isinstance(pod_claim.get("resourceClaimTemplateName"), str):
        kind, object_name = "ResourceClaimTemplate", pod_claim["resourceClaimTemplateName"]
    else:
        return None
    source = f"{kind} {_q(object_name)}"

    def verdict(v: Verdict, detail: str) -> ClaimResolution:
        return ClaimResolution(str(name), object_name, source, v, detail)

    why = objects.unavailable()
    if why is not None:
        return verdict("unresolved", why)
    lookup = objects.claim if kind == "ResourceClaim" else objects.template
    classes = lookup(namespace, object_name)
    if classes is None:
        return verdict("unresolved", f"the webhook does not know {source} in namespace {_q(namespace)}")
    gpu = frozenset(gpu_drivers)
    others: list[str] = []
    for class_name in classes:
        known = objects.device_class(class_name)
        if known is None:
            return verdict("unresolved", f"the webhook does not know DeviceClass {_q(class_name)}")
        (drivers,) = known
        if drivers is None:
            return verdict("gpu", f"DeviceClass {_q(class_name)} does not pin a driver, so it may select GPUs")
        if drivers & gpu:
            return verdict("gpu", f"DeviceClass {_q(class_name)} selects devices of driver "
                           f"{_q(sorted(drivers & gpu)[0])}")
        others.append(f"{_q(class_name)} ({', '.join(sorted(drivers)) or 'no driver'})")
    return verdict("not-gpu", f"DeviceClass {', '.join(others)}" if others else "it requests no device")


def resolve_pod_claims(namespace: str, spec: Any, objects: DraObjects,
                       gpu_drivers: Iterable[str]) -> dict[str, ClaimResolution]:
    """Each pod claim's resolution, by pod claim name (``spec.resourceClaims[].name``)."""
    claims = spec.get("resourceClaims") if isinstance(spec, dict) else None
    drivers = tuple(gpu_drivers)
    resolved: dict[str, ClaimResolution] = {}
    for claim in claims if isinstance(claims, list) else ():
        if isinstance(claim, dict) and isinstance(claim.get("name"), str):
            resolution = resolve_claim(namespace, claim, objects, drivers)
            if resolution is not None:
                resolved[claim["name"]] = resolution
    return resolved


def used_claims(spec: Any) -> set[str]:
    """The pod claims that some container other than our sidecar names in ``resources.claims``."""
    used: set[str] = set()
    for key in ("initContainers", "containers"):
        containers = spec.get(key) if isinstance(spec, dict) else None
        for c in containers if isinstance(containers, list) else ():
            if not isinstance(c, dict) or c.get("name") == SIDECAR_NAME:
                continue
            resources = c.get("resources")
            claims = resources.get("claims") if isinstance(resources, dict) else None
            for claim in claims if isinstance(claims, list) else ():
                if isinstance(claim, dict) and isinstance(claim.get("name"), str):
                    used.add(claim["name"])
    return used


def claim_warnings(namespace: str, spec: Any, objects: DraObjects, gpu_drivers: Iterable[str],
                   listed: Iterable[str]) -> list[str]:
    """What the resolution tells the pod's author where it differs from what the pod gets.

    The pod gets what the admin's list decides (webhook.gpu_paths: a claim not listed in
    ``non-gpu-resource-claims`` is a GPU claim), so these say: a claim that could not be resolved
    (taken for a GPU); a claim that holds no GPU but is not listed (it still gets the enforcer, and
    the admin can list it); a listed claim whose class selects GPUs (it runs without the enforcer
    on the admin's word).
    """
    names = frozenset(listed)
    used = used_claims(spec)
    warnings = []
    for name, r in resolve_pod_claims(namespace, spec, objects, gpu_drivers).items():
        if name not in used:
            continue
        claim = f"gpufence: claim {_q(name)} ({r.source})"
        if r.object_name in names:
            if r.verdict == "gpu":
                warnings.append(f"{claim} is listed in non-gpu-resource-claims, so it runs without the enforcer, "
                                f"but {r.detail}")
        elif r.verdict == "unresolved":
            warnings.append(f"{claim} is taken for a GPU (share and enforcer): it could not be resolved: {r.detail}")
        elif r.verdict == "not-gpu":
            # Within the API server's 256 characters for names of usual length: what, then why, then the fix.
            warnings.append(f"{claim} holds no GPU ({r.detail}) but gets the enforcer: only the policy's list "
                            f"exempts a claim; an admin can list {_q(r.object_name)} in non-gpu-resource-claims")
    return warnings
