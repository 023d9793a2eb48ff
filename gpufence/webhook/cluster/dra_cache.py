"""The DRA objects the webhook resolves claims through, from watch caches (never a GET per admission).

Three list-then-watch loops (webhook.cluster.watch) over ``resource.k8s.io/v1``: DeviceClasses (cluster
scope), ResourceClaims and ResourceClaimTemplates (all namespaces). Each keeps only what
webhook.core.dra reads: a class's drivers, a claim's or template's device class names and the memory
its requests ask of shareable GPUs (consumable capacity). Readers get
answers from dicts that the threads replace or update (single dict operations are atomic under the
GIL, as in webhook.cluster.namespaces).

An API server that does not serve ``resource.k8s.io/v1`` (before 1.34, or with the group off)
answers the lists 404: the loops keep retrying (their backoff doubles to 30 s), quietly (one line
when the API is first found missing), and every claim stays unresolved, which the webhook handles as it
handles a claim it cannot resolve. The caches never gate /readyz: a pod is never refused for the
state of this cache (docs/gpu-paths.md).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

from gpufence.logs import log_event
from gpufence.webhook.cluster.watch import ListWatch
from gpufence.webhook.core.dra import (
    CLAIM,
    Drivers,
    MemoryAsk,
    class_drivers,
    object_key,
    resource_claim_classes,
    resource_claim_memory_asks,
    template_classes,
    template_memory_asks,
)

log = logging.getLogger(__name__)

GROUP, VERSION = "resource.k8s.io", "v1"
HTTP_NOT_FOUND = 404


def _drivers(obj: Mapping[str, Any]) -> tuple[Drivers]:
    return (class_drivers(obj),)


# A claim's or template's summary: its device classes and its memory capacity requests.
Summary = tuple[tuple[str, ...], tuple[MemoryAsk, ...]]


def _claim(obj: Mapping[str, Any]) -> Summary:
    return resource_claim_classes(obj), resource_claim_memory_asks(obj)


def _template(obj: Mapping[str, Any]) -> Summary:
    return template_classes(obj), template_memory_asks(obj)


class ObjectWatch(ListWatch):
    """One kind's list-then-watch, keeping ``summary(obj)`` by (namespace, name)."""

    def __init__(self, api: Any, plural: str, summary: Any, *, kind: str, **options: Any) -> None:
        # api: kubernetes.client.CustomObjectsApi; cluster-wide lists cover every namespace.
        super().__init__(functools.partial(api.list_cluster_custom_object, GROUP, VERSION, plural), **options)
        self.what = kind
        self.plural = plural
        self._summary = summary
        self.items: dict[tuple[str, str], Any] = {}
        self.not_served = False
        self.failure: str | None = None  # why the last list or watch failed, until a list succeeds

    def _replace(self, items: list[Mapping[str, Any]]) -> None:
        self.items = {object_key(obj): self._summary(obj) for obj in items}
        self.not_served = False
        self.failure = None

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind == "DELETED":
            self.items.pop(object_key(obj), None)
        else:
            self.items[object_key(obj)] = self._summary(obj)

    def _failed(self, error: Exception) -> None:
        status = getattr(error, "status", None)
        self.failure = f"HTTP {status} {getattr(error, 'reason', '')}".strip() if status else type(error).__name__
        if getattr(error, "status", None) == HTTP_NOT_FOUND:
            if not self.not_served:
                log_event(log, "dra_api_not_served", logging.INFO, kind=self.what, api=f"{GROUP}/{VERSION}",
                          message="DRA claims are not resolved; containers that use claims are GPU containers")
            self.not_served = True

    def _log_level(self, error: Exception) -> int:
        # Not served is the state of the cluster, said once by _failed, not a failure of each retry.
        not_found = getattr(error, "status", None) == HTTP_NOT_FOUND
        return logging.DEBUG if not_found else super()._log_level(error)


class DraCache:
    """DeviceClasses, ResourceClaims and ResourceClaimTemplates, implementing ``webhook.core.dra.DraObjects``."""

    def __init__(self, api: Any, **options: Any) -> None:
        self.classes = ObjectWatch(api, "deviceclasses", _drivers, kind="DeviceClass", **options)
        self.claims = ObjectWatch(api, "resourceclaims", _claim, kind="ResourceClaim", **options)
        self.templates = ObjectWatch(api, "resourceclaimtemplates", _template, kind="ResourceClaimTemplate",
                                      **options)
        self._watches = (self.classes, self.claims, self.templates)

    # --- BackgroundLookup (started and stopped with the server; never part of /readyz) --------
    def start(self) -> None:
        for watch in self._watches:
            watch.start()

    def stop(self, timeout: float | None = None) -> None:
        for watch in self._watches:
            watch.stop(timeout)

    def has_synced(self) -> bool:
        return all(w.has_synced() for w in self._watches)

    # --- DraObjects ------------------------------------------------------------------------
    def unavailable(self) -> str | None:
        if any(w.not_served for w in self._watches):
            return f"the API server does not serve {GROUP}/{VERSION}"
        if not self.has_synced():
            # A 403 here is an install whose ClusterRole predates these rules: say so, not "not synced".
            failed = next((w for w in self._watches if not w.has_synced() and w.failure), None)
            if failed is not None:
                return f"the webhook cannot list {failed.plural} ({failed.failure})"
            return "the webhook's DRA cache has not synced yet"
        return None

    def claim(self, namespace: str, name: str) -> tuple[str, ...] | None:
        found: Summary | None = self.claims.items.get((namespace, name))
        return None if found is None else found[0]

    def template(self, namespace: str, name: str) -> tuple[str, ...] | None:
        found: Summary | None = self.templates.items.get((namespace, name))
        return None if found is None else found[0]

    def memory_asks(self, kind: str, namespace: str, name: str) -> tuple[MemoryAsk, ...] | None:
        found: Summary | None = (self.claims if kind == CLAIM else self.templates).items.get((namespace, name))
        return None if found is None else found[1]

    def device_class(self, name: str) -> tuple[Drivers] | None:
        return self.classes.items.get(("", name))
