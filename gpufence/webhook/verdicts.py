"""Verdicts already given: a bounded memo of ``core.admission.review`` and ``verify`` at the edge.

Controllers create many pods from one template: a ReplicaSet's, a Job's pods reach ``/mutate`` as
the same request but for its ``uid``, and ``/validate`` as the same pod but for the name, uid and
timestamps the API server gave it. The review is a pure function of what it reads, so an answer
can be given again to a request that carries nothing new. The key is everything the verdict reads:

* the request itself in canonical JSON (``core.patch.canonical``: sorted keys, JSON types kept):
  the operation, kind, resource and subresource, the user, their groups and extra, the pod and the
  old pod, dry run. Left out, and only these: ``request.uid`` (put back in the answer),
  ``request.name`` and the pod's ``metadata.name``, ``uid``, ``creationTimestamp`` and
  ``managedFields``, which no rule reads (``test_verdicts.py`` reviews every golden under other
  values of them and compares the answers);
* the pod's token volume by its place, not its name: the ServiceAccount admission plugin names it
  ``kube-api-access-`` and five random characters for each pod, and the sidecar mounts it by that
  name. No rule reads the name but to copy it (``core.desired``), so where it appears only as a
  whole JSON string, in the request and in the answer, the key holds a placeholder instead and a
  hit writes the request's own name back into the patch (``test_verdicts.py`` checks this on
  every golden with a token volume);
* the namespace as the review sees it: its labels and annotations, copied into the key;
* whether the DRA cache can resolve claims now (``DraObjects.unavailable``);
* which judge (``review`` for /mutate, ``verify`` for /validate);
* the policy in force and the nodes' labels, by identity: both are replaced whole when they change
  (``cluster.policy.ClusterPolicy.current``, ``cluster.nodes.NodeCache``), and a change empties the
  memo.

The review reads the namespace and the nodes only through the snapshots the key was built from;
one that asks for another namespace, or reads any DRA object (a pod with resource claims: the
claim cache changes without telling), is answered but not remembered; with nothing to resolve a
review reads none. Entries are few and small
(the key is the request's JSON, the value the answer), the least recently used goes first.
"""

from __future__ import annotations

import base64
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpufence.webhook.core.admission import ReviewResult
from gpufence.webhook.core.dra import DraObjects, MemoryAsk
from gpufence.webhook.core.driver_limits import KnownNodes, NodeLabels
from gpufence.webhook.core.patch import canonical
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo, NamespaceLookup

Judge = Callable[[Any, InjectionSettings, NamespaceLookup, "DraObjects | None", "KnownNodes | None"], ReviewResult]

DEFAULT_ENTRIES = 512
# A request this large is reviewed every time: its key would cost more memory than it saves time.
MAX_KEY_BYTES = 32 * 1024
# Fields of the pod's metadata that the API server sets per object and that no rule reads.
PER_OBJECT_METADATA = ("name", "uid", "creationTimestamp", "managedFields")

# The ServiceAccount admission plugin's name for a pod's token volume (its generateName, five characters).
TOKEN_VOLUME = re.compile(r"kube-api-access-[a-z0-9]{5}")
# In keys and remembered patches, where the pod's own token volume's name was: no valid name.
_PLACEHOLDER = b'"kube-api-access-?????"'

_NamespaceKey = tuple[str, tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] | None
_Key = tuple[Judge, bytes, _NamespaceKey, str | None]


@dataclass(frozen=True)
class _Entry:
    outcome: str
    envelope: dict[str, Any]  # the AdmissionReview answered, whose response's uid is replaced
    response: dict[str, Any]
    patch: bytes | None = None  # the patch's JSON with the placeholder for the token volume's name
    raw_patch: bytes | None = None  # the patch's JSON where it names no token volume (else None)


def _token_volume(pod: Any) -> str | None:
    """The name of the pod's one volume named as the ServiceAccount plugin names its token volume."""
    spec = pod.get("spec") if isinstance(pod, dict) else None
    volumes = spec.get("volumes") if isinstance(spec, dict) else None
    found = [v["name"] for v in volumes if isinstance(v, dict) and isinstance(v.get("name"), str)
             and TOKEN_VOLUME.fullmatch(v["name"])] if isinstance(volumes, list) else []
    return found[0] if len(found) == 1 else None


def _only_whole(data: bytes, name: bytes) -> bool:
    """Whether ``name`` appears in the JSON ``data`` only as whole strings."""
    return data.count(name) == data.count(b'"' + name + b'"')


class _Namespace:
    """The one namespace the key holds; any other asked for marks the verdict as not to be kept."""

    def __init__(self, name: str | None, info: NamespaceInfo | None, lookup: NamespaceLookup) -> None:
        self.name, self.info, self.lookup = name, info, lookup
        self.strayed = False

    def get(self, name: str) -> NamespaceInfo | None:
        if name == self.name:
            return self.info
        self.strayed = True
        return self.lookup.get(name)


class _Claims:
    """The DRA cache, noting whether the review read any of its objects; whether it can resolve
    anything at all is read once, into the key."""

    def __init__(self, objects: DraObjects, unavailable: str | None) -> None:
        self.objects = objects
        self.why_unavailable = unavailable
        self.read = False

    def unavailable(self) -> str | None:
        return self.why_unavailable

    def claim(self, namespace: str, name: str) -> tuple[str, ...] | None:
        self.read = True
        return self.objects.claim(namespace, name)

    def template(self, namespace: str, name: str) -> tuple[str, ...] | None:
        self.read = True
        return self.objects.template(namespace, name)

    def device_class(self, name: str) -> Any:
        self.read = True
        return self.objects.device_class(name)

    def memory_asks(self, kind: str, namespace: str, name: str) -> tuple[MemoryAsk, ...] | None:
        self.read = True
        return self.objects.memory_asks(kind, namespace, name)


@dataclass(frozen=True)
class _Nodes:
    labels: NodeLabels | None

    def node_labels(self) -> NodeLabels | None:
        return self.labels


def _namespace_name(request: dict[str, Any]) -> str | None:
    """The namespace the review looks up: the request's, else the pod's (core.admission._namespace)."""
    name = request.get("namespace")
    if isinstance(name, str) and name:
        return name
    pod = request.get("object")
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    name = metadata.get("namespace") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) and name else None


def _namespace_key(info: NamespaceInfo | None) -> _NamespaceKey:
    if info is None:
        return None
    return info.name, tuple(sorted(info.labels.items())), tuple(sorted(info.annotations.items()))


def _without_per_object(pod: Any) -> Any:
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    if not isinstance(metadata, dict) or not any(k in metadata for k in PER_OBJECT_METADATA):
        return pod
    kept = {k: v for k, v in metadata.items() if k not in PER_OBJECT_METADATA}
    return {**pod, "metadata": kept}


def request_key(payload: Any) -> bytes | None:
    """The canonical JSON of the request without what no rule reads; None where it has none (then
    the review answers it, or refuses the envelope, uncached)."""
    request = payload.get("request") if isinstance(payload, dict) else None
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        return None
    kept = {k: v for k, v in request.items() if k not in ("uid", "name")}
    if "object" in kept:
        kept["object"] = _without_per_object(kept["object"])
    return canonical({**payload, "request": kept})


class VerdictCache:
    def __init__(self, entries: int = DEFAULT_ENTRIES, max_key_bytes: int = MAX_KEY_BYTES) -> None:
        self.entries = entries
        self.max_key_bytes = max_key_bytes
        self._memo: OrderedDict[_Key, _Entry] = OrderedDict()
        self._settings: InjectionSettings | None = None
        self._nodes: NodeLabels | None = None
        # Lookups by judge (``review`` for /mutate, ``verify`` for /validate) and result (hit, miss).
        self.lookups: dict[tuple[str, str], int] = {}

    @property
    def hits(self) -> int:
        return sum(n for (_, result), n in self.lookups.items() if result == "hit")

    @property
    def misses(self) -> int:
        return sum(n for (_, result), n in self.lookups.items() if result == "miss")

    def _count(self, judge: Judge, result: str) -> None:
        key = (getattr(judge, "__name__", "judge"), result)
        self.lookups[key] = self.lookups.get(key, 0) + 1

    def __len__(self) -> int:
        return len(self._memo)

    def judge(self, judge: Judge, payload: Any, settings: InjectionSettings, namespaces: NamespaceLookup,
              claims: DraObjects | None = None, nodes: KnownNodes | None = None) -> ReviewResult:
        """``judge(payload, ...)``, or the answer it gave to the same request under the same state."""
        labels = nodes.node_labels() if nodes is not None else None
        snapshot = _Nodes(labels) if nodes is not None else None
        key_bytes = request_key(payload)
        if key_bytes is None or len(key_bytes) > self.max_key_bytes or self.entries <= 0:
            return judge(payload, settings, namespaces, claims, snapshot)
        if settings is not self._settings or labels is not self._nodes:
            # Another policy or other nodes: nothing remembered holds. The references are kept, so
            # an identity compared here is never one reused by a new object.
            self._memo.clear()
            self._settings, self._nodes = settings, labels
        request = payload["request"]
        token = _token_volume(request.get("object"))
        token_json = token.encode() if token is not None else b""
        if token is not None and _only_whole(key_bytes, token_json) and _PLACEHOLDER not in key_bytes:
            key_bytes = key_bytes.replace(b'"' + token_json + b'"', _PLACEHOLDER)
        else:
            token = None
        name = _namespace_name(request)
        namespace = _Namespace(name, namespaces.get(name) if name is not None else None, namespaces)
        recorded = _Claims(claims, claims.unavailable()) if claims is not None else None
        key = (judge, key_bytes, _namespace_key(namespace.info),
               recorded.why_unavailable if recorded is not None else None)
        entry = self._memo.get(key)
        if entry is not None:
            self._memo.move_to_end(key)
            self._count(judge, "hit")
            response = {"uid": request["uid"], **entry.response}
            patch = entry.raw_patch
            if entry.patch is not None:
                patch = entry.patch.replace(_PLACEHOLDER, b'"' + token_json + b'"')
                response["patch"] = base64.b64encode(patch).decode("ascii")
            return ReviewResult(review={**entry.envelope, "response": response}, outcome=entry.outcome, patch=patch)
        self._count(judge, "miss")
        result = judge(payload, settings, namespace, recorded, snapshot)
        if namespace.strayed or (recorded is not None and recorded.read):
            return result
        response = {k: v for k, v in result.review["response"].items() if k != "uid"}
        envelope = {k: v for k, v in result.review.items() if k != "response"}
        template: bytes | None = None
        if token is not None:
            # The answer may name the token volume only where the patch copies it: nowhere else.
            patch = result.patch or b""
            rest = canonical({k: v for k, v in response.items() if k != "patch"}) or token_json
            if token_json in rest or not _only_whole(patch, token_json) or _PLACEHOLDER in patch:
                return result
            if "patch" in response:
                template = patch.replace(b'"' + token_json + b'"', _PLACEHOLDER)
        self._memo[key] = _Entry(result.outcome, envelope, response, template,
                                 result.patch if template is None else None)
        if len(self._memo) > self.entries:
            self._memo.popitem(last=False)
        return result
