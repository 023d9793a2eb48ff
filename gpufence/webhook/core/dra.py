"""What a pod's DRA claims hold, resolved through their DeviceClasses (pure; the objects come from
the watch cache in webhook.cluster.dra_cache).

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

What the webhook does with the answer is in webhook.core.admission and docs/gpu-paths.md: the caches can
lag behind a claim just created, so the answer informs (warnings) and never makes a pod
sidecar-free that the admin's list (``non-gpu-resource-claims``) takes for a GPU pod.

Consumable capacity (KEP-5075, ``DRAConsumableCapacity``, beta and on by default since 1.36): a
request may ask ``capacity.requests.memory`` of a device published with
``allowMultipleAllocations: true``, and the scheduler places claims on one GPU while their amounts
fit. ``claim_memory`` makes that amount the container's memory share (``shares.resolve_shares``:
the pod's annotation may lower it, never raise it), within the namespace's ceilings
(``check_claim_ceilings``). The share is the request as written: the device's ``requestPolicy``
may round the amount the scheduler records (``consumedCapacity``) up, never down, so the share
never exceeds what was reserved (docs/gpu-paths.md, "DRA consumable capacity").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from gpufence.contract import SIDECAR_NAME, MemoryShare
from gpufence.quantity import QuantityError, parse_bytes
from gpufence.webhook.core.denial import Denial, quote
from gpufence.webhook.core.namespace_policy import NamespacePolicy, memory_above
from gpufence.webhook.core.shares import ClaimMemory

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
    spec = device_class.get("spec")
    if not isinstance(spec, dict):
        spec = {}
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


# The capacity a device request asks of a shareable GPU (KEP-5075, DRAConsumableCapacity):
# ``exactly.capacity.requests.memory`` or a ``firstAvailable[]`` subrequest's ``capacity.requests.memory``.
MEMORY_CAPACITY = "memory"


@dataclass(frozen=True)
class MemoryAsk:
    """One device request (or ``firstAvailable`` subrequest) of a claim spec that asks the
    ``memory`` capacity: what the scheduler reserves on a device published with
    ``allowMultipleAllocations: true`` (its ``requestPolicy`` may round the amount up, never down)."""

    request: str  # "gpu", or "gpu/small" for a subrequest
    device_class: str
    text: str  # the quantity as written
    bytes: int


def claim_memory_asks(claim_spec: Any) -> tuple[MemoryAsk, ...]:
    """The requests of a ResourceClaim spec that ask ``capacity.requests.memory``, in order
    (garbage and quantities that are not positive are left out: the API server refuses them)."""
    devices = claim_spec.get("devices") if isinstance(claim_spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    asks: list[MemoryAsk] = []
    for request in requests if isinstance(requests, list) else ():
        if not isinstance(request, dict):
            continue
        name = str(request.get("name") or "")
        exactly = request.get("exactly")
        options = [(name, exactly)] if isinstance(exactly, dict) else []
        options += [(f"{name}/{o.get('name') or ''}", o) for o in request.get("firstAvailable") or ()
                    if isinstance(o, dict)]
        for label, option in options:
            capacity = option.get("capacity")
            wanted = capacity.get("requests") if isinstance(capacity, dict) else None
            memory = wanted.get(MEMORY_CAPACITY) if isinstance(wanted, dict) else None
            device_class = option.get("deviceClassName")
            if not isinstance(device_class, str) or not isinstance(memory, (str, int)) or isinstance(memory, bool):
                continue
            try:
                asks.append(MemoryAsk(label, device_class, str(memory), parse_bytes(str(memory))))
            except QuantityError:
                continue
    return tuple(asks)


def template_classes(template: Mapping[str, Any]) -> tuple[str, ...]:
    """The device classes of a ResourceClaimTemplate (its claim's spec is ``spec.spec``)."""
    spec = template.get("spec")
    return claim_classes(spec.get("spec") if isinstance(spec, dict) else None)


def resource_claim_classes(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """The device classes of a ResourceClaim."""
    return claim_classes(claim.get("spec"))


def template_memory_asks(template: Mapping[str, Any]) -> tuple[MemoryAsk, ...]:
    """The memory capacity requests of a ResourceClaimTemplate's claim spec (``spec.spec``)."""
    spec = template.get("spec")
    return claim_memory_asks(spec.get("spec") if isinstance(spec, dict) else None)


def resource_claim_memory_asks(claim: Mapping[str, Any]) -> tuple[MemoryAsk, ...]:
    """The memory capacity requests of a ResourceClaim's spec."""
    return claim_memory_asks(claim.get("spec"))


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an object; the namespace is "" for a DeviceClass."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
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

    def memory_asks(self, kind: str, namespace: str, name: str) -> tuple[MemoryAsk, ...] | None:
        """The memory capacity requests of the ResourceClaim or ResourceClaimTemplate (``kind``)
        ``namespace/name``."""
        ...


@dataclass(frozen=True)
class DraSnapshot:
    """DraObjects from lists of objects as the API server returns them (tools and tests; the webhook
    keeps the same summaries in its watch cache, webhook.cluster.dra_cache)."""

    classes: Mapping[str, tuple[Drivers]]
    claims: Mapping[tuple[str, str], tuple[str, ...]]
    templates: Mapping[tuple[str, str], tuple[str, ...]]
    why_unavailable: str | None = None
    claim_asks: Mapping[tuple[str, str], tuple[MemoryAsk, ...]] = field(default_factory=dict)
    template_asks: Mapping[tuple[str, str], tuple[MemoryAsk, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, classes: Iterable[Mapping[str, Any]] = (), claims: Iterable[Mapping[str, Any]] = (),
           templates: Iterable[Mapping[str, Any]] = ()) -> DraSnapshot:
        claims, templates = list(claims), list(templates)
        return cls(classes={object_key(c)[1]: (class_drivers(c),) for c in classes},
                   claims={object_key(c): resource_claim_classes(c) for c in claims},
                   templates={object_key(t): template_classes(t) for t in templates},
                   claim_asks={object_key(c): resource_claim_memory_asks(c) for c in claims},
                   template_asks={object_key(t): template_memory_asks(t) for t in templates})

    def unavailable(self) -> str | None:
        return self.why_unavailable

    def claim(self, namespace: str, name: str) -> tuple[str, ...] | None:
        return self.claims.get((namespace, name))

    def template(self, namespace: str, name: str) -> tuple[str, ...] | None:
        return self.templates.get((namespace, name))

    def device_class(self, name: str) -> tuple[Drivers] | None:
        return self.classes.get(name)

    def memory_asks(self, kind: str, namespace: str, name: str) -> tuple[MemoryAsk, ...] | None:
        asks = self.claim_asks if kind == CLAIM else self.template_asks
        known = self.claims if kind == CLAIM else self.templates
        return asks.get((namespace, name), ()) if (namespace, name) in known else None


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


CLAIM, TEMPLATE = "ResourceClaim", "ResourceClaimTemplate"


def claim_object(pod_claim: Mapping[str, Any]) -> tuple[str, str] | None:
    """The kind and name of the object an item of ``spec.resourceClaims`` names, or None."""
    if isinstance(pod_claim.get("resourceClaimName"), str):
        return CLAIM, pod_claim["resourceClaimName"]
    if isinstance(pod_claim.get("resourceClaimTemplateName"), str):
        return TEMPLATE, pod_claim["resourceClaimTemplateName"]
    return None


def resolve_claim(namespace: str, pod_claim: Mapping[str, Any], objects: DraObjects,
                  gpu_drivers: Iterable[str]) -> ClaimResolution | None:
    """What the pod claim ``pod_claim`` (an item of ``spec.resourceClaims``) holds; None where it names
    no object (the API server refuses such a pod)."""
    name = pod_claim.get("name")
    found = claim_object(pod_claim)
    if found is None:
        return None
    kind, object_name = found
    source = f"{kind} {_q(object_name)}"

    def verdict(v: Verdict, detail: str) -> ClaimResolution:
        return ClaimResolution(str(name), object_name, source, v, detail)

    why = objects.unavailable()
    if why is not None:
        return verdict("unresolved", why)
    lookup = objects.claim if kind == CLAIM else objects.template
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

    The pod gets what the admin's list decides (webhook.core.gpu_paths: a claim not listed in
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


def claim_memory(namespace: str, spec: Any, objects: DraObjects, gpu_drivers: Iterable[str],
                 claims_by_container: Mapping[str, Sequence[str]]) -> tuple[dict[str, ClaimMemory], list[str]]:
    """The memory share that each GPU container's claims reserved on a shareable GPU (consumable
    capacity, KEP-5075), and the warnings about it.

    ``claims_by_container``: the GPU claims (pod claim names) each GPU container uses
    (``gpu_paths.PodGpuPaths.gpu_claims_by_container``). A request counts where it asks
    ``capacity.requests.memory`` of a class that may select a GPU driver's devices; the claim or
    template and that class must be in the cache (else the claim is unresolved, which
    ``claim_warnings`` says, and the container's share comes from gpufence's annotations and
    defaults as before: a pod is never refused for the state of the cache).

    The share never exceeds what the scheduler reserves for the container:

    * several requests (or ``firstAvailable`` alternatives, of which the scheduler picks one after
      admission): the smallest amount, since a share holds on each GPU the container uses;
    * a claim that several containers of the pod use: the amount divided between them (the
      reservation is the claim's, once, whichever containers use it).
    """
    if objects.unavailable() is not None:
        return {}, []
    listed = spec.get("resourceClaims") if isinstance(spec, dict) else None
    pod_claims = {c["name"]: c for c in listed if isinstance(c, dict) and isinstance(c.get("name"), str)} \
        if isinstance(listed, list) else {}
    users: dict[str, int] = {}
    for names in claims_by_container.values():
        for name in set(names):
            users[name] = users.get(name, 0) + 1
    asked = _ClaimAsks(namespace, pod_claims, objects, frozenset(gpu_drivers), users)
    shares: dict[str, ClaimMemory] = {}
    warnings: list[str] = []
    divided: set[str] = set()
    for container, names in claims_by_container.items():
        found, shared = asked.amounts(names)
        divided |= shared
        found = [f for f in found if f[0] > 0]
        if not found:
            continue
        amount, origin, accepted = min(found, key=lambda f: f[0])
        if len({f[0] for f in found}) > 1:
            warnings.append(f"gpufence: container {quote(container)}: its claims ask different amounts of GPU "
                            f"memory, so the smallest ({quote(accepted)}) is its share on each GPU")
        shares[container] = ClaimMemory(MemoryShare(bytes=amount), origin, accepted)
    for name in sorted(divided):
        warnings.append(f"gpufence: claim {_q(name)} is used by {users[name]} containers, so its GPU memory is "
                        "divided between them as their shares; give each container its own claim for another split")
    return shares, warnings


@dataclass(frozen=True)
class _ClaimAsks:
    """What one pod's claims ask of GPU memory, through the cache."""

    namespace: str
    pod_claims: Mapping[str, Any]  # the pod's claims by name
    objects: DraObjects
    gpu: frozenset[str]  # the GPU drivers
    users: Mapping[str, int]  # how many containers use each claim

    def amounts(self, names: Sequence[str]) -> tuple[list[tuple[int, str, str]], set[str]]:
        """(bytes, origin, the amount as an accepted value) of each request of claims ``names`` that
        asks memory of a GPU class, divided by the claim's users; the claims so divided."""
        found: list[tuple[int, str, str]] = []
        divided: set[str] = set()
        for name in dict.fromkeys(names):
            obj = claim_object(self.pod_claims.get(name) or {})
            if obj is None:
                continue
            kind, object_name = obj
            for ask in self.objects.memory_asks(kind, self.namespace, object_name) or ():
                known = self.objects.device_class(ask.device_class)
                if known is None or not (known[0] is None or known[0] & self.gpu):
                    continue  # an unknown class (said as unresolved) or another driver's devices
                shared = self.users.get(name, 1)
                origin = (f"claim {_q(name)} ({kind} {_q(object_name)}) request {_q(ask.request)} "
                          f"capacity.requests.memory={quote(ask.text)}")
                if shared > 1:
                    divided.add(name)
                    origin += f" shared by {shared} containers"
                found.append((ask.bytes // shared, origin, ask.text if shared == 1 else str(ask.bytes // shared)))
        return found, divided


def check_claim_ceilings(shares: Mapping[str, ClaimMemory], policy: NamespacePolicy) -> None:
    """Raises Denial where a claim's memory lies above the namespace's memory ceiling in bytes,
    naming the claim, its amount, the ceiling and an amount the ceiling accepts. (A percentage
    ceiling cannot be compared with bytes at admission: both apply, ``NamespacePolicy.bound``.)"""
    ceiling = policy.max_memory
    if ceiling is None or ceiling.share.bytes is None:
        return
    for container, claimed in shares.items():
        if memory_above(claimed.share, ceiling.share):
            raise Denial(
                f"container {quote(container)}: {claimed.origin} is above the memory ceiling of namespace "
                f"{quote(policy.namespace)} ({ceiling.origin}): ask the claim for at most that, e.g. "
                f"capacity.requests.memory: {quote(ceiling.text)}"
            )
