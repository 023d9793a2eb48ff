"""Where the guardian learns the pods on its node and the opted-in namespaces.

* :class:`PodWatch`: list, then watch, the pods with ``fieldSelector=spec.nodeName=<node>`` (the
  webhook's ``ListWatch`` loop: relist after a 410 or any error, with backoff), with the webhook's
  Namespace cache beside it (labels and annotations, which only the namespace's admin writes).
  Beside them, every ResourceClaim (``resource.k8s.io/v1``, all namespaces: the webhook's DRA watch,
  ``webhook.cluster.dra_cache.ObjectWatch``) reduced to its allocation (``gpufence.claims``); where
  the API is not served the claims stay unknown and bound nothing. The claims never gate the sync:
  a cluster without DRA would never sync otherwise. And the node's ResourceSlices
  (``spec.nodeName``), reduced to each device's NVML UUID, so a reservation bounds its own GPU.
  And the cluster policy, ConfigMap ``gpufence/gpufence-policy``, through the webhook's own watch
  and parser (``webhook.cluster.policy``): one source of each setting, read as the webhook reads
  it. The guardian takes ``device-access-namespaces``, ``other-namespace-gpu-processes`` and
  ``host-gpu-processes`` from it; until a valid version is read, or where none can be, it takes no
  device-access namespace (the stricter answer) and the sharing keys' defaults, keeping the last
  valid version meanwhile.
  Read-only RBAC: ``get``/``list``/``watch`` on pods, namespaces, resourceclaims and resourceslices,
  and on that one ConfigMap (a Role with ``resourceNames``).
* :class:`PodsFile`: the same from a JSON file (``{"pods": [...], "namespaces": [...],
  "resourceClaims": [...], "resourceSlices": [...], "policy": <the ConfigMap>}``, Kubernetes
  objects), re-read when it changes: for running the guardian outside a cluster (tests, the demo).

Both answer :meth:`index` with a ``pods.PodIndex``: what the API server says, never a request.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from gpufence.claims import ClaimAllocation, SliceDevices, claim_allocation, device_uuids, slice_device_uuids
from gpufence.contract import GpuSharing
from gpufence.node.pods import NodePod, PodIndex, node_pod
from gpufence.webhook.cluster.dra_cache import GROUP, VERSION, ObjectWatch
from gpufence.webhook.cluster.namespaces import NamespaceCache, namespace_info
from gpufence.webhook.cluster.policy import DEFAULT_NAME, DEFAULT_NAMESPACE, ClusterPolicy, PolicyWatch
from gpufence.webhook.cluster.watch import ListWatch

DEFAULT_POLICY_CONFIGMAP = (DEFAULT_NAMESPACE, DEFAULT_NAME)
# What the guardian reads of the cluster policy: device-access-namespaces, other-namespace-gpu-processes
# and host-gpu-processes.
_Policy = tuple[tuple[str, ...], GpuSharing, GpuSharing]
_NO_POLICY: _Policy = ((), GpuSharing.ALLOW, GpuSharing.ALLOW)
# What a PodIndex was built from: its pods, claims and slices (compared by identity), the opted-in
# namespaces and the policy's keys the guardian reads.
_IndexKey = tuple[tuple[NodePod, ...], frozenset[str], tuple[ClaimAllocation, ...], tuple[SliceDevices, ...],
                  _Policy]


class SliceWatch(ObjectWatch):
    """The ResourceSlices of one node (``fieldSelector=spec.nodeName=<node>``), each reduced to its
    devices' NVML UUIDs (``claims.slice_device_uuids``)."""

    def __init__(self, api: Any, node_name: str, **kwargs: Any) -> None:
        super().__init__(api, "resourceslices", slice_device_uuids, kind="ResourceSlice", **kwargs)
        self._list_call = functools.partial(api.list_cluster_custom_object, GROUP, VERSION, "resourceslices",
                                            field_selector=f"spec.nodeName={node_name}")


class PodSource(Protocol):
    def start(self) -> None: ...
    def stop(self, timeout: float | None = None) -> None: ...
    def has_synced(self) -> bool: ...
    def index(self) -> PodIndex: ...


class PodWatch(ListWatch):
    """The pods on one node, by UID, from a list-then-watch with a field selector."""

    what = "pod"

    def __init__(self, api: Any, node_name: str, custom_api: Any = None,
                 policy_configmap: tuple[str, str] = DEFAULT_POLICY_CONFIGMAP, **kwargs: Any) -> None:
        # api: kubernetes.client.CoreV1Api; custom_api: CustomObjectsApi (the claims; None: no claims)
        listing = functools.partial(api.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node_name}")
        super().__init__(listing, **kwargs)
        self._objects: dict[str, Mapping[str, Any]] = {}
        self._parsed: dict[str, tuple[Mapping[str, Any], Any, NodePod | None]] = {}
        self._last: tuple[_IndexKey, PodIndex] | None = None
        self.namespaces = NamespaceCache(api, **kwargs)
        self.claims = (None if custom_api is None else
                       ObjectWatch(custom_api, "resourceclaims", claim_allocation, kind="ResourceClaim", **kwargs))
        # The node's ResourceSlices: which NVML UUID each allocated device is (read-only, this node's).
        self.slices = None if custom_api is None else SliceWatch(custom_api, node_name, **kwargs)
        self.policy = ClusterPolicy(source="/".join(policy_configmap))
        self.policy_watch = PolicyWatch(api, *policy_configmap, self.policy, **kwargs)

    def start(self) -> None:
        self.namespaces.start()
        self.policy_watch.start()
        for watch in (self.claims, self.slices):
            if watch is not None:
                watch.start()
        super().start()

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        self.namespaces.stop(timeout)
        self.policy_watch.stop(timeout)
        for watch in (self.claims, self.slices):
            if watch is not None:
                watch.stop(timeout)

    def has_synced(self) -> bool:
        # The policy's first read too (whatever it found: see index()).
        return super().has_synced() and self.namespaces.has_synced() and self.policy_watch.has_synced()

    def index(self) -> PodIndex:
        """The pods, namespaces and claims as last seen. Each pod object is read (its sidecar's
        config parsed) once per version of it and of its namespace, and the same ``PodIndex`` is
        returned while nothing changed: the engine reuses what it derived from it, poll after poll."""
        if not self.policy_watch.has_synced():
            # No pod before the policy's first read: a pod the admin allowed device access would be
            # taken for unaccounted meanwhile. Its processes stay pending, and pods_synced says why.
            return PodIndex.of((), ())
        objects = list(self._objects.values())
        pods = []
        opted_in = set()
        parsed: dict[str, tuple[Mapping[str, Any], Any, NodePod | None]] = {}
        for obj in objects:
            namespace = (obj.get("metadata") or {}).get("namespace") or ""
            info = self.namespaces.get(namespace)
            uid = _uid(obj)
            seen = self._parsed.get(uid)
            if seen is not None and seen[0] is obj and seen[1] is info:
                found = seen[2]
            else:
                found = node_pod(obj, info.annotations if info else {})
            parsed[uid] = (obj, info, found)
            if found is not None:
                pods.append(found)
            if info is not None and info.opted_in:
                opted_in.add(namespace)
        self._parsed = parsed
        claims: list[ClaimAllocation] = list(self.claims.items.values()) if self.claims is not None else []
        slices: list[SliceDevices] = list(self.slices.items.values()) if self.slices is not None else []
        # The policy's keys are in the key: a policy change makes a new index.
        key = (tuple(pods), frozenset(opted_in), tuple(claims), tuple(slices), _policy(self.policy))
        last = self._last
        if last is not None and last[0][1] == key[1] and last[0][4] == key[4] and all(
                len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
                for a, b in ((last[0][0], key[0]), (last[0][2], key[2]), (last[0][3], key[3]))):
            return last[1]
        access, others, host = key[4]
        index = PodIndex.of(pods, opted_in, claims, device_uuids=device_uuids(slices), device_access=access,
                            other_namespaces=others, host=host)
        self._last = (key, index)
        return index

    def _replace(self, items: list[Mapping[str, Any]]) -> None:
        self._objects = {_uid(obj): obj for obj in items if _uid(obj)}

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        uid = _uid(obj)
        if not uid:
            return
        objects = dict(self._objects)  # a new dict: index() never sees one half-changed
        if kind == "DELETED":
            objects.pop(uid, None)
        else:
            objects[uid] = obj
        self._objects = objects


class PodsFile:
    """The pods and namespaces of a JSON file, re-read whenever its modification time changes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: int | None = None
        self._index = PodIndex.of((), ())
        self.policy = ClusterPolicy(source=f"{path}:policy")

    def start(self) -> None:
        self.index()

    def stop(self, timeout: float | None = None) -> None:
        pass

    def has_synced(self) -> bool:
        return self._stamp is not None

    def index(self) -> PodIndex:
        try:
            stamp = self.path.stat().st_mtime_ns
        except OSError:
            return self._index
        if stamp != self._stamp:
            try:
                doc = json.loads(self.path.read_text())
            except (OSError, ValueError):
                return self._index  # being rewritten: the last good one holds
            if isinstance(doc, dict) and isinstance(doc.get("policy"), dict):
                self.policy.offer(doc["policy"])  # an invalid one is logged and the last valid one kept
            self._index = pods_file_index(doc, _policy(self.policy))
            self._stamp = stamp
        return self._index


def _policy(policy: ClusterPolicy) -> _Policy:
    settings = policy.current
    if settings is None:
        return _NO_POLICY
    return (settings.device_access_namespaces, GpuSharing(settings.other_namespace_gpu_processes),
            GpuSharing(settings.host_gpu_processes))


def pods_file_index(doc: Any, policy: _Policy = _NO_POLICY) -> PodIndex:
    namespaces = [namespace_info(n) for n in (doc.get("namespaces") or []) if isinstance(n, dict)]
    annotations = {n.name: n.annotations for n in namespaces}
    pods: list[NodePod] = []
    for obj in doc.get("pods") or []:
        if isinstance(obj, dict):
            ns = (obj.get("metadata") or {}).get("namespace") or ""
            found = node_pod(obj, annotations.get(ns, {}))
            if found is not None:
                pods.append(found)
    claims = [claim_allocation(c) for c in (doc.get("resourceClaims") or []) if isinstance(c, dict)]
    slices = [slice_device_uuids(c) for c in (doc.get("resourceSlices") or []) if isinstance(c, dict)]
    access, others, host = policy
    return PodIndex.of(pods, (n.name for n in namespaces if n.opted_in), claims,
                       device_uuids=device_uuids(slices), device_access=access, other_namespaces=others, host=host)


def load_apis(kubeconfig: str | None) -> tuple[Any, Any]:
    """A ``CoreV1Api`` and a ``CustomObjectsApi`` on one client: the in-cluster configuration (the
    guardian's own ServiceAccount), else the kubeconfig given or found. Raises the client's
    ConfigException when none loads."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException:
            config.load_kube_config(client_configuration=configuration)
    api_client = client.ApiClient(configuration)
    return client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)


def _uid(obj: Mapping[str, Any]) -> str:
    uid = (obj.get("metadata") or {}).get("uid")
    return uid if isinstance(uid, str) else ""
