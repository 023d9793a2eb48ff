"""AdmissionReview in, AdmissionReview out: the webhook's decision as a total pure function.

``review`` raises only ``InvalidReview`` (the envelope is not an ``admission.k8s.io/v1``
AdmissionReview with a request uid: HTTP 400). Any other input, however malformed its
``request.object``, yields a well-formed AdmissionReview: allowed (maybe with a JSON Patch and
warnings) or denied with ``status.code`` 400 and a message for the user.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, NamedTuple

from gpufence.contract import MIRROR_POD_ANNOTATION, POD_OPT_OUT_LABEL, SIDECAR_NAME, SIDECAR_PORT_NAME
from gpufence.webhook.core.container_env import with_void
from gpufence.webhook.core.denial import Denial, from_admin, quote
from gpufence.webhook.core.desired import desired_plain_pod, desired_pod
from gpufence.webhook.core.device_access import (
    admin_record_denial,
    device_access_denial,
    device_annotation_denial,
    with_admin_record,
)
from gpufence.webhook.core.dra import DraObjects, check_claim_ceilings, claim_memory, claim_warnings
from gpufence.webhook.core.driver_limits import KnownNodes, NodeLabels
from gpufence.webhook.core.facts import PodFacts, pod_facts
from gpufence.webhook.core.gpu_paths import PodGpuPaths, advised_resource
from gpufence.webhook.core.kai import kai_memory, nv_devices_denial, nv_memory
from gpufence.webhook.core.namespace_policy import NamespacePolicy, namespace_policy, opt_out_allowed, opt_out_denial
from gpufence.webhook.core.patch import diff, dumps, loads
from gpufence.webhook.core.podshape import nvidia_side_door, sidecar_resource_use
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo, NamespaceLookup
from gpufence.webhook.core.shares import ClaimMemory, SharePlan, resolve_shares, with_gpu_counts
from gpufence.webhook.core.sidecar import (
    HOST_PROC_VOLUME,
    PRELOAD_VOLUME,
    STATE_VOLUME,
    pod_volumes,
)

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
MAX_WARNINGS = 16
MAX_WARNING_LENGTH = 256  # the API server may truncate longer warnings

OUTCOME_MUTATED = "mutated"
OUTCOME_UNCHANGED = "unchanged"
OUTCOME_DENIED = "denied"
OUTCOME_SKIPPED = "skipped"


class InvalidReview(ValueError):
    """The body is not an AdmissionReview request; the message is safe to send to the client (HTTP 400)."""


@dataclass(frozen=True)
class ReviewResult:
    review: dict[str, Any]  # the AdmissionReview to answer with
    outcome: str  # "mutated" | "unchanged" | "denied" | "skipped"
    # The JSON Patch the review carries (base64 in ``review``), as bytes: for readers that would
    # otherwise decode it again (verify, the memo of verdicts).
    patch: bytes | None = None


def review(payload: Any, settings: InjectionSettings, namespaces: NamespaceLookup,
           claims: DraObjects | None = None, nodes: KnownNodes | None = None) -> ReviewResult:
    """``claims``: the DRA objects (webhook.cluster.dra_cache) that claims are resolved through, for the
    warnings of webhook.core.dra.claim_warnings; None where there are none (outside a cluster).
    ``nodes``: the nodes' labels (webhook.cluster.nodes), for the driver limits under ``auto``; None where
    none are known. Read once per review: one review sees one snapshot."""
    request = _request(payload)
    decision = _decide(request, settings, namespaces, claims, nodes.node_labels() if nodes is not None else None)
    return _result(request["uid"], decision.outcome, decision.warnings, patch=decision.patch,
                   denied=decision.denied)


# Where /validate denies for the mutating rules' own reason: the pod it judged is the final one, as
# every mutating step (gpufence's, others', the API server's own dropping of disabled fields) left it.
VERIFY_PREFIX = "gpufence re-checked the pod after every mutating admission step: "
OUTCOME_VERIFIED = "verified"
OUTCOME_REFUSED = "refused"


def verify(payload: Any, settings: InjectionSettings, namespaces: NamespaceLookup,
           claims: DraObjects | None = None, nodes: KnownNodes | None = None) -> ReviewResult:
    """The validating side of the same rules: is the pod the API server is about to store one that
    ``review`` leaves as it is?

    Validating admission runs after every mutating step, reinvocations included, so a pod that
    passes here is exactly what gpufence would have made of it, whatever another mutating webhook
    did after gpufence's. One implementation of the rules: this re-reviews the final pod and refuses
    it where the review would change it (naming what) or deny it. Warnings are not repeated: the
    mutating call already returned them.
    """
    request = _request(payload)
    uid = request["uid"]
    result = review(payload, settings, namespaces, claims, nodes)
    response = result.review["response"]
    if result.outcome == OUTCOME_DENIED:
        return _result(uid, OUTCOME_REFUSED, [], denied=VERIFY_PREFIX + response["status"]["message"])
    if result.outcome != OUTCOME_MUTATED:
        return _result(uid, OUTCOME_VERIFIED if result.outcome == OUTCOME_UNCHANGED else OUTCOME_SKIPPED, [])
    changed = sorted({op["path"] for op in loads(result.patch or b"[]")})
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return _result(uid, OUTCOME_REFUSED, [], denied=(
        "gpufence: the pod differs from what gpufence admits at "
        f"{shown}: something after gpufence's webhook changed it (another mutating webhook, or the API "
        "server dropping fields of a feature it has off, such as DRA's resourceClaims), or the "
        "webhook's policy or a node's gpufence.io/driver-memory-limits label changed meanwhile. "
        "Create the pod again; if this repeats, the cluster admin "
        "must order the other mutating webhook before gpufence's or stop it changing GPU pods "
        "(docs/runbook.md, \"Pods refused by verify.gpufence.io\")"))


def request_namespace(payload: Any) -> str | None:
    """The namespace an AdmissionReview request is for, where it names one (no validation)."""
    request = payload.get("request") if isinstance(payload, dict) else None
    namespace = request.get("namespace") if isinstance(request, dict) else None
    return namespace if isinstance(namespace, str) and namespace else None


def denial(payload: Any, message: str) -> ReviewResult:
    """A denial of ``payload``'s request decided at the edge (e.g. the namespace could not be read)."""
    return _result(_request(payload)["uid"], OUTCOME_DENIED, [], denied=message)


def _request(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise InvalidReview("the body must be a JSON object (an AdmissionReview)")
    if payload.get("apiVersion") != API_VERSION:
        raise InvalidReview(f"apiVersion must be {API_VERSION}")
    if payload.get("kind") != KIND:
        raise InvalidReview(f"kind must be {KIND}")
    request = payload.get("request")
    if not isinstance(request, dict):
        raise InvalidReview("the AdmissionReview has no request")
    if not isinstance(request.get("uid"), str):
        raise InvalidReview("request.uid must be a string")
    return request


def _result(
    uid: str, outcome: str, warnings: Sequence[str], *, patch: bytes | None = None, denied: str | None = None
) -> ReviewResult:
    response: dict[str, Any] = {"uid": uid, "allowed": denied is None}
    if denied is not None:
        response["status"] = {"code": 400, "reason": "BadRequest", "message": denied}
    elif patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(patch).decode("ascii")
    if warnings:
        shown = [w if len(w) <= MAX_WARNING_LENGTH else w[: MAX_WARNING_LENGTH - 3] + "..." for w in warnings]
        response["warnings"] = list(dict.fromkeys(shown))[:MAX_WARNINGS]
    return ReviewResult(review={"apiVersion": API_VERSION, "kind": KIND, "response": response}, outcome=outcome,
                        patch=patch if denied is None and patch else None)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _is_pod_request(request: dict[str, Any]) -> bool:
    if request.get("subResource"):
        return False  # pods/ephemeralcontainers, pods/binding... are not pod creations
    kind = request.get("kind")
    if isinstance(kind, dict):
        return kind.get("group", "") == "" and kind.get("version") == "v1" and kind.get("kind") == "Pod"
    resource = request.get("resource")
    if isinstance(resource, dict):
        return (
            resource.get("group", "") == "" and resource.get("version") == "v1" and resource.get("resource") == "pods"
        )
    return False


# The user a kubelet authenticates as; NodeRestriction lets a node create mirror pods only.
NODE_USER_PREFIX = "system:node:"


def _by_a_node(request: dict[str, Any]) -> bool:
    """Whether a node sent the request: only then is a pod's mirror annotation a static pod's.
    Anyone may write the annotation; the webhook configurations' matchConditions draw the same line."""
    username = _dict(request.get("userInfo")).get("username")
    return isinstance(username, str) and username.startswith(NODE_USER_PREFIX)


# --- ephemeral containers ---------------------------------------------------------------------------
# Ephemeral containers (``kubectl debug``) added to pods of opted-in namespaces (pure).
#
# An ephemeral container cannot request resources, so the device plugin never gives it a GPU; the
# NVIDIA container toolkit's variable is its only way to one (CUDA images set
# ``NVIDIA_VISIBLE_DEVICES=all`` in their ENV, and the toolkit honours it by default). The API server
# adds one with an UPDATE of the ``pods/ephemeralcontainers`` subresource whose object is the whole
# pod; each ephemeral container that ``oldObject`` does not have gets what every container without a
# GPU gets at creation (``container_env.with_void``), whatever the setting
# ``void_non_gpu_containers`` says: a debug container never needs the toolkit's GPUs, and an admin who
# wants them sets the variable explicitly (kept as it is). Existing ephemeral containers are never
# touched: the API server refuses any change to them.
#
# What to refuse (an ephemeral container with NVIDIA_* of its own, one that targets the sidecar or
# mounts its volumes, one without the void because this webhook was unavailable) is the
# gpufence-protect policy's (k8s/base/protect-policy.yaml): it holds with the webhook down, and it
# knows the admin groups. This part only adds.
EPHEMERAL_SUBRESOURCE = "ephemeralcontainers"
_EPHEMERAL_KEY = "ephemeralContainers"


def _ephemeral_containers(pod: Any, where: str) -> list[dict[str, Any]]:
    """``spec.ephemeralContainers`` of ``pod``, shape-checked where the injection reads it."""
    if not isinstance(pod, dict):
        raise Denial(f"the pod is malformed: {where} must be a Pod object")
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise Denial(f"the pod is malformed: {where}.spec must be an object")
    containers = spec.get(_EPHEMERAL_KEY)
    if containers is None:
        return []
    if not isinstance(containers, list):
        raise Denial(f"the pod is malformed: {where}.spec.{_EPHEMERAL_KEY} must be a list")
    for i, container in enumerate(containers):
        at = f"{where}.spec.{_EPHEMERAL_KEY}[{i}]"
        if not isinstance(container, dict) or not isinstance(container.get("name"), str):
            raise Denial(f"the pod is malformed: {at} must be an object with a string name")
        env = container.get("env")
        if env is not None and not (isinstance(env, list) and all(isinstance(e, dict) for e in env)):
            raise Denial(f"the pod is malformed: {at}.env must be a list of objects")
    return containers


def new_ephemeral_names(pod: Any, old_pod: Any) -> list[str]:
    """The names of the ephemeral containers ``pod`` has and ``old_pod`` has not, in pod order."""
    old = {c["name"] for c in _ephemeral_containers(old_pod, "oldObject")} if old_pod is not None else set()
    return [c["name"] for c in _ephemeral_containers(pod, "object") if c["name"] not in old]


def desired_ephemeral_pod(pod: dict[str, Any], old_pod: Any) -> dict[str, Any]:
    """``pod`` with each new ephemeral container voided (copy-on-write; ``pod`` itself when none
    needs it). Raises ``Denial`` for a malformed pod."""
    new = set(new_ephemeral_names(pod, old_pod))
    if not new:
        return pod
    # An ephemeral container has no resources (the API server refuses them), so it never gets a device.
    containers = [with_void(c) if c["name"] in new else c for c in pod["spec"][_EPHEMERAL_KEY]]
    return {**pod, "spec": {**pod["spec"], _EPHEMERAL_KEY: containers}}


def ephemeral_patch(pod: dict[str, Any], old_pod: Any) -> bytes | None:
    """The JSON Patch (None when none is needed) for an UPDATE of ``pods/ephemeralcontainers``."""
    ops = diff(pod, desired_ephemeral_pod(pod, old_pod))
    return dumps(ops) if ops else None


def _is_ephemeral_request(request: dict[str, Any]) -> bool:
    """An UPDATE of pods/ephemeralcontainers (``kubectl debug``): its object is the whole pod."""
    resource = _dict(request.get("resource"))
    return (request.get("subResource") == EPHEMERAL_SUBRESOURCE and request.get("operation") == "UPDATE"
            and resource.get("group", "") == "" and resource.get("resource") == "pods")


def _ephemeral(request: dict[str, Any], namespaces: NamespaceLookup) -> tuple[str, bytes | None]:
    namespace = request.get("namespace")
    info = namespaces.get(namespace) if isinstance(namespace, str) and namespace else None
    if info is not None and not info.opted_in:
        return OUTCOME_SKIPPED, None
    # Not in the cache yet: the API server's namespaceSelector let only opted-in namespaces through.
    pod = request.get("object")
    if not isinstance(pod, dict):
        raise Denial("request.object must be a Pod object")
    patch = ephemeral_patch(pod, request.get("oldObject"))
    return (OUTCOME_MUTATED if patch else OUTCOME_UNCHANGED), patch


class Decision(NamedTuple):
    """What the review decided: the outcome, the patch (None: none), the warnings for the pod's
    creator, and the denial's message where it is one."""

    outcome: str
    patch: bytes | None = None
    warnings: tuple[str, ...] = ()
    denied: str | None = None


def _decide(request: dict[str, Any], settings: InjectionSettings, namespaces: NamespaceLookup,
            claims: DraObjects | None = None, nodes: NodeLabels | None = None) -> Decision:
    """The review as a pipeline: which request, the pod's facts, the rules that refuse, then (a GPU
    pod) the shares and the patch. A denial carries the warnings said before it."""
    said: list[str] = []
    try:
        if _is_ephemeral_request(request):
            return Decision(*_ephemeral(request, namespaces))
        pod = _created_pod(request)
        if pod is None:
            return Decision(OUTCOME_SKIPPED)
        namespace, info = _namespace(request, pod, namespaces)
        if info is not None and not info.opted_in:
            return Decision(OUTCOME_SKIPPED)
        if info is None:
            # The API server's namespaceSelector already let only opted-in namespaces through.
            said.append(f"gpufence: namespace {quote(namespace)} is not in the webhook's cache yet, so its "
                        "default shares and policy (if any) were not applied; the webhook's flags were")
        if _static_mirror(request, pod):
            return Decision(OUTCOME_SKIPPED)  # a static pod's mirror: the kubelet would not run a changed one
        facts = pod_facts(request, pod, namespace, info, settings)
        # What the claims hold, said where it differs from what the pod gets: the pod gets what the
        # admin's list decides, not a cache that may lag (docs/gpu-paths.md, "DRA").
        claim_notes = claim_warnings(namespace, facts.spec, claims, settings.dra_gpu_drivers,
                                     settings.non_gpu_resource_claims) if claims is not None and namespace else []
        said += claim_notes
        _check_side_doors(facts, settings)
        # The admin's record is applied first; the rest of the patch is computed on the recorded pod.
        record, facts = _admin_record(request, facts, settings)
        early = _without_injection(facts, settings)
        if early is not None:
            return Decision(*_after(record, *early), warnings=tuple(said))
        _check_reserved(facts, settings)
        policy = namespace_policy(namespace, facts.namespace_annotations, settings)
        claimed, capacity_notes = _claimed_memory(facts, claims, settings, policy)
        said += capacity_notes
        plan = _share_plan(facts, settings, policy, claimed)
        said += plan.warnings
        # In the status annotation too, so the enforcer posts them as Events on the pod: a pod a
        # controller creates never shows its author the admission warnings.
        plan = replace(plan, warnings=(*plan.warnings, *claim_notes, *capacity_notes))
        patch, mutation_warnings = injection_patch(facts.pod, plan, settings, facts.pod_security,
                                                   facts.namespace_annotations, nodes, facts.paths)
        return Decision(*_after(record, OUTCOME_UNCHANGED, patch), (*said, *mutation_warnings))
    except Denial as denied:  # every rule's refusal
        return Decision(OUTCOME_DENIED, warnings=tuple(said), denied=str(denied))
    except RecursionError:
        return Decision(OUTCOME_DENIED, warnings=tuple(said), denied="the pod is nested too deeply to be reviewed")
    except UnicodeEncodeError:
        # Only in process: a string with a lone surrogate, which JSON over HTTP cannot carry (the
        # server's decoder refuses it with a 400) and a patch cannot hold.
        return Decision(OUTCOME_DENIED, warnings=tuple(said), denied="the pod holds a string that is not valid Unicode")


def _created_pod(request: dict[str, Any]) -> dict[str, Any] | None:
    """The pod a CREATE of a pod makes (None: another request, skipped); Denial where it is no object."""
    if not _is_pod_request(request) or request.get("operation") != "CREATE":
        return None
    pod = request.get("object")
    if not isinstance(pod, dict):
        raise Denial("request.object must be a Pod object")
    return pod


def _namespace(request: dict[str, Any], pod: dict[str, Any],
               namespaces: NamespaceLookup) -> tuple[str, NamespaceInfo | None]:
    """The pod's namespace ("" where none is named) and what the cache knows of it (None: nothing)."""
    namespace = request.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        namespace = _dict(pod.get("metadata")).get("namespace")
    if not isinstance(namespace, str):
        namespace = ""
    return namespace, namespaces.get(namespace) if namespace else None


def _static_mirror(request: dict[str, Any], pod: dict[str, Any]) -> bool:
    """A static pod's mirror, which a node sends: the kubelet would not run a changed one."""
    return MIRROR_POD_ANNOTATION in _dict(_dict(pod.get("metadata")).get("annotations")) and _by_a_node(request)


def _check_side_doors(facts: PodFacts, settings: InjectionSettings) -> None:
    """Denial for the first way to a device outside a device request, GPU pod or not, opted out or not,
    and for an admin record (``gpufence.io/admin-device-access``) a non-admin wrote."""
    denial = (
        nvidia_side_door(facts.spec, SIDECAR_NAME if facts.gpu_names else None, advised_resource(settings),
                         facts.kai_container)
        or _admin_only(facts, settings, facts.groups)
        # Who created it with what only admin-groups may have, for the node guardian: no one else may say so.
        or admin_record_denial(facts.pod, facts.groups, settings.admin_groups)
    )
    if denial is not None:
        raise Denial(denial)


def _admin_only(facts: PodFacts, settings: InjectionSettings, groups: object) -> str | None:
    """The first rule that refuses the pod to a requester in ``groups`` unless they are in admin-groups
    (None: none does). With ``groups`` None: whether the pod needs an admin at all."""
    advised = advised_resource(settings)
    return (
        # KAI's binder writes a container's gpus.devices after allocation; its author, at CREATE, must not.
        nv_devices_denial(facts.pod, groups, settings.admin_groups)
        # Annotations a node component turns into devices (NVIDIA's NRI plugin, CDI, ...): the admin's.
        or device_annotation_denial(facts.pod, groups, settings.admin_groups, advised)
        # Devices without a device request (privileged, hostPath of /dev and the driver's paths), unless
        # the admin allows it (docs/install.md, Pod Security).
        or device_access_denial(facts.spec, facts.namespace, groups, settings.admin_groups,
                                settings.device_access_namespaces,
                                pod_volumes(settings) if facts.gpu_names else (), advised)
    )


def _admin_record(request: dict[str, Any], facts: PodFacts,
                  settings: InjectionSettings) -> tuple[list[dict[str, Any]], PodFacts]:
    """For an admin's pod that used the exemption (``_admin_only`` refuses it to anyone else), the
    patch that records who created it (``with_admin_record``, for the node guardian) and the facts of
    the recorded pod, on which the rest of the patch is computed; else no operation and ``facts``."""
    if not from_admin(facts.groups, settings.admin_groups) or _admin_only(facts, settings, None) is None:
        return [], facts
    recorded = with_admin_record(facts.pod, _dict(request.get("userInfo")).get("username"))
    annotations = MappingProxyType(_dict(_dict(recorded.get("metadata")).get("annotations")))
    return diff(facts.pod, recorded), facts._replace(pod=recorded, annotations=annotations)


def _without_injection(facts: PodFacts, settings: InjectionSettings) -> tuple[str, bytes | None] | None:
    """The outcome of a pod that gets no sidecar (no GPU container, or opted out where the namespace
    allows it), None for a GPU pod to inject; Denial where the pod opts out and may not."""
    opted_out = facts.labels.get(POD_OPT_OUT_LABEL) == "false"
    # The namespace's admin decides whether a pod may opt out, not the pod.
    allowed = opted_out and opt_out_allowed(facts.namespace_annotations, settings)
    if not facts.gpu_names:
        if not settings.void_non_gpu_containers or allowed:
            return OUTCOME_SKIPPED, None
        patch = plain_pod_patch(facts.pod, settings, facts.paths)
        return (OUTCOME_MUTATED if patch else OUTCOME_UNCHANGED), patch
    if allowed:
        return OUTCOME_SKIPPED, None
    if opted_out:
        raise Denial(opt_out_denial(facts.namespace))
    return None


def _check_reserved(facts: PodFacts, settings: InjectionSettings) -> None:
    """Denial where a GPU pod takes what is the enforcer's: its name, volumes or port."""
    if SIDECAR_NAME in facts.gpu_names:
        raise Denial(f"the container name {SIDECAR_NAME} is reserved by gpufence; rename the container")
    taken = sidecar_resource_use(facts.spec, SIDECAR_NAME, settings.metrics_port, SIDECAR_PORT_NAME,
                                 (STATE_VOLUME, HOST_PROC_VOLUME), (PRELOAD_VOLUME,))
    if taken is not None:
        raise Denial(taken)


def _after(first: list[dict[str, Any]], outcome: str, patch: bytes | None) -> tuple[str, bytes | None]:
    """The outcome of ``patch`` (operations on the pod after ``first``) with ``first`` applied before
    it: ``outcome`` where neither changes anything."""
    if not first:  # the common case: the patch as it is, not parsed again
        return (OUTCOME_MUTATED, patch) if patch else (outcome, None)
    ops = first + (loads(patch) if patch else [])
    return (OUTCOME_MUTATED, dumps(ops)) if ops else (outcome, None)


def _claimed_memory(facts: PodFacts, claims: DraObjects | None, settings: InjectionSettings,
                    policy: NamespacePolicy) -> tuple[dict[str, ClaimMemory], list[str]]:
    """Consumable capacity: what a claim reserved on a shareable GPU is the container's share, within
    the namespace's ceiling (Denial above it); and the warnings about it."""
    if claims is None or not facts.namespace:
        return {}, []
    claimed, notes = claim_memory(facts.namespace, facts.spec, claims, settings.dra_gpu_drivers,
                                  facts.paths.gpu_claims_by_container())
    check_claim_ceilings(claimed, policy)
    return claimed, notes


def _share_plan(facts: PodFacts, settings: InjectionSettings, policy: NamespacePolicy,
                claimed: dict[str, ClaimMemory]) -> SharePlan:
    """Every GPU container's share, with KAI's requests (its NvFractions limit over its legacy
    fraction for one container) and the GPU counts; Denial for an invalid or too large one."""
    scheduler_memory = {**kai_memory(facts.kai, policy), **nv_memory(list(facts.nv), policy)}
    plan = resolve_shares(facts.annotations, facts.namespace_annotations, settings, facts.gpu_names,
                          facts.container_names, policy, scheduler_memory=scheduler_memory, claim_memory=claimed)
    plan = replace(plan, runtime_limited=frozenset(f.container for f in facts.nv), kai_fraction=facts.kai_container)
    return with_gpu_counts(plan, facts.paths.gpu_counts())


def injection_patch(
    pod: dict[str, Any], plan: SharePlan, settings: InjectionSettings, pod_security: str | None = None,
    namespace_annotations: Mapping[str, object] | None = None, nodes: NodeLabels | None = None,
    paths: PodGpuPaths | None = None,
) -> tuple[bytes | None, list[str]]:
    """The JSON Patch (compact UTF-8 JSON; None when the pod needs none) and the warnings.

    Raises ``Denial`` (a denial). The pod must have passed ``podshape.check_shape``.
    """
    new_pod, warnings = desired_pod(pod, plan, settings, pod_security, namespace_annotations, nodes, paths)
    ops = diff(pod, new_pod)
    return (dumps(ops) if ops else None), warnings


def plain_pod_patch(pod: dict[str, Any], settings: InjectionSettings,
                    paths: PodGpuPaths | None = None) -> bytes | None:
    """The same for a pod that requests no GPU: only ``NVIDIA_VISIBLE_DEVICES=void`` where missing."""
    ops = diff(pod, desired_plain_pod(pod, settings, paths))
    return dumps(ops) if ops else None
