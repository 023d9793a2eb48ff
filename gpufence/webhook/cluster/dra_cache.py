"""The DRA objects the webhook resolves claims through, from watch caches (a GET only for what they miss).

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

A watch lags behind the API server, most on a busy machine: a claim created a moment before its pod
may be missing at /mutate and present at /validate, and the two calls for one create would then
compute different pods, so verify.gpufence.io would refuse a pod gpufence made. Where the cache
misses an object the pod names (its claims and templates, and their DeviceClasses), or has not
synced, ``for_review`` reads those objects from the API server (bounded in number and time; the
server calls it in a worker thread), and the review sees the API server's answer in both calls.
A read that fails leaves the object unresolved, as before.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

from gpufence.logs import log_event
from gpufence.webhook.cluster.watch import ListWatch
from gpufence.webhook.core.dra import (
    CLAIM,
    DraObjects,
    Drivers,
    MemoryAsk,
    claim_object,
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
# The fresh reads of one review, all together: well inside the API server's webhook timeout
# (timeoutSeconds in k8s/ and the chart) beside a fresh namespace read (cluster.namespaces); what is
# not read in time stays unresolved.
FRESH_READS_SECONDS = 2.0
# At most this many objects read for one review, so a pod naming many missing claims costs bounded
# API calls; the rest stay unresolved.
MAX_FRESH_READS = 16


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
        self._api = api
        self.what = kind
        self.plural = plural
        self._summary = summary
        self.items: dict[tuple[str, str], Any] = {}
        self.not_served = False
        self.failure: str | None = None  # why the last list or watch failed, until a list succeeds

    def read(self, namespace: str, name: str, timeout: float) -> Any | None:
        """The summary of the object read now from the API server (a GET), or None where it does not exist.
        Raises the client's error for anything else (timeout, 403...)."""
        try:
            if namespace:
                obj = self._api.get_namespaced_custom_object(GROUP, VERSION, namespace, self.plural, name,
                                                             _request_timeout=timeout)
            else:
                obj = self._api.get_cluster_custom_object(GROUP, VERSION, self.plural, name,
                                                          _request_timeout=timeout)
        except Exception as exc:
            if getattr(exc, "status", None) == HTTP_NOT_FOUND:
                return None
            raise
        return self._summary(obj)

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

    # --- fresh reads for one review (blocking: the server calls for_review in a worker thread) ---
    def _named(self, spec: Any) -> list[tuple[ObjectWatch, str]]:
        """The claims and templates (their watch and name) that the pod spec's resourceClaims name."""
        listed = spec.get("resourceClaims") if isinstance(spec, dict) else None
        named = []
        for item in listed if isinstance(listed, list) else ():
            found = claim_object(item) if isinstance(item, dict) else None
            if found is not None and found[1]:
                named.append((self.claims if found[0] == CLAIM else self.templates, found[1]))
        return named

    def needs_fresh(self, namespace: str, spec: Any) -> bool:
        """Whether the review of a pod in ``namespace`` with ``spec`` would miss an object in the cache."""
        named = self._named(spec)
        if not named or any(w.not_served for w in self._watches):
            return False
        if not self.has_synced():
            return True
        for watch, name in named:
            summary: Summary | None = watch.items.get((namespace, name))
            if summary is None or any(("", c) not in self.classes.items for c in summary[0]):
                return True
        return False

    def for_review(self, namespace: str, spec: Any) -> DraObjects:
        """The cache, with what it misses of the objects the pod names read now from the API server."""
        if not self.needs_fresh(namespace, spec):
            return self
        deadline = time.monotonic() + FRESH_READS_SECONDS
        synced = self.has_synced()
        fresh: dict[tuple[str, str, str], Any] = {}
        complete = True

        def lookup(watch: ObjectWatch, ns: str, name: str) -> Any | None:
            nonlocal complete
            key = (watch.plural, ns, name)
            if key in fresh:
                return fresh[key]
            cached = watch.items.get((ns, name)) if synced else None
            if cached is not None:
                return cached
            left = deadline - time.monotonic()
            if len(fresh) >= MAX_FRESH_READS or left <= 0:
                complete = False
                return None
            try:
                fresh[key] = watch.read(ns, name, left)
            except Exception as exc:  # left unresolved, as a miss was before: the review says so in a warning
                complete = False
                log_event(log, "dra_read_failed", logging.WARNING, kind=watch.what, namespace=ns, name=name,
                          error=f"{type(exc).__name__}: {exc}"[:300])
                return None
            return fresh[key]

        for watch, name in self._named(spec):
            summary = lookup(watch, namespace, name)
            for class_name in summary[0] if summary is not None else ():
                lookup(self.classes, "", class_name)
        log_event(log, "dra_read_fresh", logging.DEBUG, namespace=namespace, objects=len(fresh))
        # Before the first lists, the cache can answer nothing: the view answers where it read everything.
        why = None if synced or complete else self.unavailable()
        return FreshDraObjects(self, fresh, why)

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


class FreshDraObjects:
    """``DraObjects`` for one review: the objects read fresh (None: not found) over the cache."""

    def __init__(self, cache: DraCache, fresh: Mapping[tuple[str, str, str], Any], unavailable: str | None) -> None:
        self._cache = cache
        self._fresh = fresh
        self._unavailable = unavailable

    def _summary(self, watch: ObjectWatch, namespace: str, name: str) -> Any | None:
        key = (watch.plural, namespace, name)
        return self._fresh[key] if key in self._fresh else watch.items.get((namespace, name))

    def unavailable(self) -> str | None:
        return self._unavailable

    def claim(self, namespace: str, name: str) -> tuple[str, ...] | None:
        found: Summary | None = self._summary(self._cache.claims, namespace, name)
        return None if found is None else found[0]

    def template(self, namespace: str, name: str) -> tuple[str, ...] | None:
        found: Summary | None = self._summary(self._cache.templates, namespace, name)
        return None if found is None else found[0]

    def memory_asks(self, kind: str, namespace: str, name: str) -> tuple[MemoryAsk, ...] | None:
        watch = self._cache.claims if kind == CLAIM else self._cache.templates
        found: Summary | None = self._summary(watch, namespace, name)
        return None if found is None else found[1]

    def device_class(self, name: str) -> tuple[Drivers] | None:
        found: tuple[Drivers] | None = self._summary(self._cache.classes, "", name)
        return found
