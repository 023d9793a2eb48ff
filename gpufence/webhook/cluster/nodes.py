"""The nodes' names and labels, from a watch cache (never an API call per admission).

Under ``driver-memory-limits=auto`` the webhook writes the driver's memory limit into a pod that
can only land on nodes labelled ``gpufence.io/driver-memory-limits=true`` (webhook.core.driver_limits),
however the pod names them: ``nodeName``, a hostname selector, ``matchFields``, other labels. That
needs every node's name and labels. ``NodeCache`` lists Nodes, then watches them (webhook.cluster.watch),
asking the API server for metadata only (``PartialObjectMetadata``): a Node's status (its images,
conditions, addresses) is most of its size and none of this cache's business. It keeps the name and
the labels, nothing else.

Readers get a snapshot: the thread publishes a new dict for each change and never changes one it
published, so a review iterating over the nodes never sees one change under it. A MODIFIED event
that leaves the labels as they were (a Node's status is written every few minutes) publishes
nothing.

The cache never gates /readyz: until it has listed the nodes (or where it cannot: an install whose
ClusterRole predates ``list``/``watch`` on nodes answers 403), ``node_labels`` is None and a pod
gets the variables only by the label rule that needs no cache (its nodeSelector or node affinity
naming the label). The mutating and the validating call each read the snapshot of their moment: a
node whose label changes between the two (or two replicas a watch event apart) makes the validating
call refuse the pod, naming the difference, and the author creates it again; never a pod admitted
with variables its nodes may not apply without a review that saw them all labelled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from gpufence.contract import DRIVER_LIMITS_NODE_LABEL
from gpufence.logs import log_event
from gpufence.webhook.cluster.watch import ListWatch
from gpufence.webhook.core.driver_limits import NodeLabels

log = logging.getLogger(__name__)

# Metadata only, JSON as the fallback (an API server that cannot convert sends whole Nodes, which
# parse the same: their metadata is where this cache reads).
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1, application/json"
METADATA_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1, application/json"


def _metadata_only(list_node: Callable[..., Any]) -> Callable[..., Any]:
    """``list_node`` asking for metadata only, as a list or as a watch."""
    def call(**kwargs: Any) -> Any:
        accept = METADATA_WATCH if kwargs.get("watch") else METADATA_LIST
        return list_node(_headers={"Accept": accept}, **kwargs)
    return call


def _entry(obj: Mapping[str, Any]) -> tuple[str, Mapping[str, str]]:
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    return str(meta["name"]), MappingProxyType({str(k): str(v) for k, v in labels.items()})


class NodeCache(ListWatch):
    """List-then-watch cache of the nodes' labels, implementing ``driver_limits.KnownNodes``."""

    what = "node"

    def __init__(self, api: Any, **options: Any) -> None:
        # api: kubernetes.client.CoreV1Api
        super().__init__(_metadata_only(api.list_node), **options)
        self._nodes: dict[str, Mapping[str, str]] = {}
        self.failure: str | None = None  # why the last list or watch failed, until a list succeeds

    # --- KnownNodes --------------------------------------------------------------------------
    def node_labels(self) -> NodeLabels | None:
        return self._nodes if self.has_synced() else None

    # --- ListWatch -----------------------------------------------------------------------------
    def _replace(self, items: list[Mapping[str, Any]]) -> None:
        self._nodes = dict(map(_entry, items))
        self.failure = None
        log_event(log, "nodes_listed", count=len(self._nodes),
                  driver_limit_nodes=sum(1 for labels in self._nodes.values()
                                         if labels.get(DRIVER_LIMITS_NODE_LABEL) == "true"))

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        name, labels = _entry(obj)
        if kind == "DELETED":
            if name in self._nodes:
                self._nodes = {k: v for k, v in self._nodes.items() if k != name}
        elif self._nodes.get(name) != labels:
            self._nodes = {**self._nodes, name: labels}

    def _failed(self, error: Exception) -> None:
        status = getattr(error, "status", None)
        self.failure = f"HTTP {status} {getattr(error, 'reason', '')}".strip() if status else type(error).__name__
