"""AdmissionReview in, AdmissionReview out: the webhook's decision as a total pure function.

``review`` raises only ``InvalidReview`` (the envelope is not an ``admission.k8s.io/v1``
AdmissionReview with a request uid: HTTP 400). Any other input, however malformed its
``request.object``, yields a well-formed AdmissionReview: allowed (maybe with a JSON Patch and
warnings) or denied with ``status.code`` 400 and a message for the user.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from webhook.mutate import MutationError, container_requests_gpu, injection_patch
from webhook.settings import (
    MIRROR_POD_ANNOTATION,
    POD_OPT_OUT_LABEL,
    SIDECAR_NAME,
    InjectionSettings,
    NamespaceLookup,
)
from webhook.shares import ShareError, quote, resolve_shares

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


class _Denied(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def review(payload: Any, settings: InjectionSettings, namespaces: NamespaceLookup) -> ReviewResult:
    request = _request(payload)
    uid = request["uid"]
    warnings: list[str] = []
    try:
        outcome, patch = _decide(request, settings, namespaces, warnings)
    except _Denied as denied:
        return _result(uid, OUTCOME_DENIED, warnings, denied=denied.message)
    except RecursionError:
        return _result(uid, OUTCOME_DENIED, warnings, denied="the pod is nested too deeply to be reviewed")
    return _result(uid, outcome, warnings, patch=patch)


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
    uid: str, outcome: str, warnings: list[str], *, patch: str | None = None, denied: str | None = None
) -> ReviewResult:
    response: dict[str, Any] = {"uid": uid, "allowed": denied is None}
    if denied is not None:
        response["status"] = {"code": 400, "reason": "BadRequest", "message": denied}
    elif patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(patch.encode()).decode("ascii")
    if warnings:
        shown = [w if len(w) <= MAX_WARNING_LENGTH else w[: MAX_WARNING_LENGTH - 3] + "..." for w in warnings]
        response["warnings"] = list(dict.fromkeys(shown))[:MAX_WARNINGS]
    return ReviewResult(review={"apiVersion": API_VERSION, "kind": KIND, "response": response}, outcome=outcome)


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


def _decide(
    request: dict[str, Any], settings: InjectionSettings, namespaces: NamespaceLookup, warnings: list[str]
) -> tuple[str, str | None]:
    if not _is_pod_request(request) or request.get("operation") != "CREATE":
        return OUTCOME_SKIPPED, None
    pod = request.get("object")
    if not isinstance(pod, dict):
        raise _Denied("request.object must be a Pod object")
    metadata = _dict(pod.get("metadata"))

    namespace = request.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        namespace = metadata.get("namespace")
    namespace_annotations: dict[str, Any] = {}
    info = namespaces.get(namespace) if isinstance(namespace, str) and namespace else None
    if info is None:
        # The API server's namespaceSelector already let only opted-in namespaces through.
        warnings.append(
            f"gpufence: namespace {quote(namespace or '')} is not in the webhook's cache yet, so its "
            "default shares (if any) were not applied"
        )
    elif not info.opted_in:
        return OUTCOME_SKIPPED, None
    else:
        namespace_annotations = dict(info.annotations)

    labels = _dict(metadata.get("labels"))
    annotations = _dict(metadata.get("annotations"))
    if labels.get(POD_OPT_OUT_LABEL) == "false" or MIRROR_POD_ANNOTATION in annotations:
        return OUTCOME_SKIPPED, None

    spec = _dict(pod.get("spec"))
    gpu_names: list[str] = []
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        if isinstance(containers, list):
            gpu_names.extend(
                c.get("name") for c in containers if container_requests_gpu(c, settings.gpu_resource_names)
            )
    if not gpu_names:
        return OUTCOME_SKIPPED, None

    all_names = _check_shape(pod)
    if SIDECAR_NAME in gpu_names:
        raise _Denied(f"the container name {SIDECAR_NAME} is reserved by gpufence; rename the container")
    try:
        plan = resolve_shares(annotations, namespace_annotations, settings, gpu_names, all_names)
        warnings.extend(plan.warnings)
        patch, mutation_warnings = injection_patch(pod, plan, settings)
    except (ShareError, MutationError) as exc:
        raise _Denied(str(exc)) from None
    warnings.extend(mutation_warnings)
    return (OUTCOME_MUTATED if patch else OUTCOME_UNCHANGED), patch


_DICT = frozenset({dict})
_STR = frozenset({str})
_STR_OR_NONE = frozenset({str, type(None)})


def _plain_env(env: Any) -> bool:
    """A fast, exact-type check of a container's env (JSON-decoded dicts with string names/values)."""
    return (
        type(env) is list
        and set(map(type, env)) <= _DICT
        and set(map(type, map(dict.get, env, repeat("name")))) <= _STR
        and set(map(type, map(dict.get, env, repeat("value")))) <= _STR_OR_NONE
    )


def _check_shape(pod: dict[str, Any]) -> list[str]:
    """Deny a GPU pod whose fields the injection reads or writes have the wrong JSON types.

    The API server decodes pods into typed objects before admission, so this only matters for
    hand-made requests; it keeps ``desired_pod`` free of type checks. Returns all container names.
    """

    def bad(where: str, what: str) -> _Denied:
        return _Denied(f"the pod is malformed: {where} must be {what}")

    # Messages name the offending field; they are formatted only on the way to a denial.
    def check_user(context: Any, where: str) -> None:
        if context is None:
            return
        if type(context) is not dict and not isinstance(context, dict):
            raise bad(where, "an object")
        for key in ("runAsUser", "runAsGroup"):
            value = context.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise bad(f"{where}.{key}", "an integer")
        value = context.get("runAsNonRoot")
        if value is not None and not isinstance(value, bool):
            raise bad(f"{where}.runAsNonRoot", "a boolean")

    metadata = pod.get("metadata")
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise bad("metadata", "an object")
    for key in ("annotations", "labels"):
        values = metadata.get(key)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise bad(f"metadata.{key}", "an object")
        if not set(map(type, values.values())) <= _STR:
            for name, value in values.items():
                if not isinstance(value, str):
                    raise bad(f"metadata.{key}[{quote(name)}]", "a string")
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise bad("spec", "an object")
    share = spec.get("shareProcessNamespace")
    if share is not None and not isinstance(share, bool):
        raise bad("spec.shareProcessNamespace", "a boolean")
    check_user(spec.get("securityContext"), "spec.securityContext")
    volumes = spec.get("volumes")
    if volumes is not None:
        if not isinstance(volumes, list):
            raise bad("spec.volumes", "a list")
        if not (type(volumes) is list and set(map(type, volumes)) <= _DICT):
            for i, volume in enumerate(volumes):
                if not isinstance(volume, dict):
                    raise bad(f"spec.volumes[{i}]", "an object")
    names: list[str] = []
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        if containers is None:
            continue
        if not isinstance(containers, list):
            raise bad(f"spec.{key}", "a list")
        for i, container in enumerate(containers):
            if not isinstance(container, dict):
                raise bad(f"spec.{key}[{i}]", "an object")
            name = container.get("name")
            if not isinstance(name, str) or not name:
                raise bad(f"spec.{key}[{i}].name", "a non-empty string")
            names.append(name)
            env = container.get("env")
            if env is not None and not _plain_env(env):  # the common case skips the loop below
                where = f"spec.{key}[{i}]"
                if not isinstance(env, list):
                    raise bad(f"{where}.env", "a list")
                for j, entry in enumerate(env):
                    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                        raise bad(f"{where}.env[{j}]", "an object with a string name")
                    value = entry.get("value")
                    if value is not None and not isinstance(value, str):
                        raise bad(f"{where}.env[{j}].value", "a string")
            mounts = container.get("volumeMounts")
            if mounts is not None and not (type(mounts) is list and set(map(type, mounts)) <= _DICT):
                where = f"spec.{key}[{i}]"
                if not isinstance(mounts, list):
                    raise bad(f"{where}.volumeMounts", "a list")
                for j, mount in enumerate(mounts):
                    if not isinstance(mount, dict):
                        raise bad(f"{where}.volumeMounts[{j}]", "an object")
            ports = container.get("ports")
            if ports is not None and not isinstance(ports, list):
                raise bad(f"spec.{key}[{i}].ports", "a list")
            if "securityContext" in container:
                context = container["securityContext"]
                if context is not None:
                    check_user(context, f"spec.{key}[{i}].securityContext")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise _Denied(f"the pod is malformed: container name {quote(name)} is used more than once")
        seen.add(name)
    return names


# -- the client side of the wire format (the demo, the benchmarks and the tests speak it) -----------


def pod_admission_review(
    pod: Any,
    *,
    uid: str,
    namespace: str = "default",
    operation: str = "CREATE",
    kind: str = "Pod",
    username: str = "system:serviceaccount:kube-system:replicaset-controller",
) -> dict[str, Any]:
    """An AdmissionReview request for ``pod`` shaped as the API server sends it (admission.k8s.io/v1)."""
    gvk = {"group": "", "version": "v1", "kind": kind}
    gvr = {"group": "", "version": "v1", "resource": kind.lower() + "s"}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": username, "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def decode_patch(response: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The JSON Patch of an AdmissionReview response, or None when it carries none."""
    if "patch" not in response:
        return None
    if response.get("patchType") != "JSONPatch":
        raise ValueError(f"unexpected patchType {response.get('patchType')!r}")
    return json.loads(base64.b64decode(response["patch"]))
