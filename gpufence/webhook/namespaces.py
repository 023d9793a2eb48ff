"""Namespace labels and annotations for the core, from a watch cache (never an API call per admission).

``NamespaceCache`` lists Namespaces, then watches from the list's resourceVersion in a background
thread (the ``kubernetes`` client is blocking). A 410 Gone or any other error starts over with a
fresh list after a jittered exponential backoff (reset by a watch that ends normally). ``get``
reads a dict that the thread replaces or updates; single dict operations are atomic under the
GIL, so no lock is needed on the admission path.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from gpufence.logs import log_event
from gpufence.webhook.settings import AllNamespacesOptedIn, NamespaceInfo, NamespaceLookup

log = logging.getLogger(__name__)

HTTP_GONE = 410


class WatchError(Exception):
    """An ERROR event in a watch stream."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def _lines(resp: Any) -> Iterator[bytes]:
    """Non-empty lines of a streamed response (one JSON event each)."""
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line.strip())
    if buffer.strip():
        yield buffer


@runtime_checkable
class BackgroundLookup(Protocol):
    """A lookup fed by a background task: the server starts it, stops it and gates /readyz on it."""

    def start(self) -> None: ...
    def stop(self, timeout: float | None = None) -> None: ...
    def has_synced(self) -> bool: ...


def namespace_info(obj: Mapping[str, Any]) -> NamespaceInfo:
    meta = obj.get("metadata") or {}
    return NamespaceInfo(
        name=meta["name"],
        labels=MappingProxyType(dict(meta.get("labels") or {})),
        annotations=MappingProxyType(dict(meta.get("annotations") or {})),
    )


class NamespaceCache:
    """List-then-watch cache of Namespaces, implementing ``NamespaceLookup``."""

    def __init__(self, api: Any, *, watch_timeout_seconds: int = 300, request_timeout: float = 30.0,
                 min_backoff: float = 0.5, max_backoff: float = 30.0) -> None:
        self._api = api  # kubernetes.client.CoreV1Api
        self._watch_timeout = watch_timeout_seconds
        self._request_timeout = request_timeout
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._items: dict[str, NamespaceInfo] = {}
        self._synced = threading.Event()
        self._stopping = threading.Event()
        self._changed = threading.Condition()
        self._response: Any = None  # the open watch (urllib3 response)
        self._thread: threading.Thread | None = None

    # --- NamespaceLookup -------------------------------------------------------------------
    def get(self, name: str) -> NamespaceInfo | None:
        return self._items.get(name)

    # --- lifecycle -------------------------------------------------------------------------
    def has_synced(self) -> bool:
        return self._synced.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="namespace-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # already closed or released: nothing to unblock
                response.shutdown()  # unblocks the watch thread's read
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_for(self, predicate: Callable[[NamespaceCache], bool], timeout: float) -> bool:
        """Block until ``predicate(self)`` holds after some update (for tests and tools)."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    # --- the watch loop --------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self._min_backoff
        resource_version: str | None = None
        while not self._stopping.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list()
                resource_version = self._watch_from(resource_version)
                backoff = self._min_backoff
            except Exception as exc:
                resource_version = None  # start over with a fresh list; meanwhile get() serves the old one
                if self._stopping.is_set():
                    break
                delay = backoff * random.uniform(0.8, 1.2)  # jitter: replicas should not relist in step
                expired = getattr(exc, "status", None) == HTTP_GONE  # routine after etcd compaction
                log.log(logging.INFO if expired else logging.WARNING, "namespace watch ended; relisting",
                        extra={"error": f"{type(exc).__name__}: {exc}", "retry_in_seconds": round(delay, 2)})
                self._stopping.wait(delay)
                backoff = min(backoff * 2, self._max_backoff)

    def _list(self) -> str:
        resp = self._api.list_namespace(_preload_content=False, _request_timeout=self._request_timeout)
        body = json.loads(resp.data)
        items = {info.name: info for info in map(namespace_info, body.get("items") or [])}
        # Swap in a new dict rather than clear+update, so a concurrent get never sees it empty.
        self._publish(lambda: setattr(self, "_items", items))
        self._synced.set()
        log_event(log, "namespaces_listed", count=len(items))
        return str(body["metadata"]["resourceVersion"])

    def _watch_from(self, resource_version: str) -> str:
        """Apply events until the server ends the watch; return the last resourceVersion seen."""
        # Bookmarks keep the resourceVersion fresh so a reconnect rarely needs a relist; the
        # client read timeout outlives the server-side one to catch a dead connection.
        resp = self._api.list_namespace(
            watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout, _preload_content=False,
            _request_timeout=(self._request_timeout, self._watch_timeout + 30),
        )
        self._response = resp  # published before the check below, so stop() cannot miss it
        try:
            if self._stopping.is_set():
                return resource_version
            for line in _lines(resp):
                event = json.loads(line)
                if event.get("type") == "ERROR":  # a Status object, e.g. 410 Expired
                    status = event.get("object") or {}
                    raise WatchError(status.get("code"), status.get("message", ""))
                resource_version = self._apply(event, resource_version)
        finally:
            self._response = None
            resp.release_conn()
        return resource_version

    def _apply(self, event: Mapping[str, Any], resource_version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or resource_version)
        if kind in ("ADDED", "MODIFIED"):
            info = namespace_info(obj)
            self._publish(lambda: self._items.__setitem__(info.name, info))
        elif kind == "DELETED":
            name = obj["metadata"]["name"]
            self._publish(lambda: self._items.pop(name, None))
        return new_rv

    def _publish(self, change: Callable[[], object]) -> None:
        with self._changed:
            change()
            self._changed.notify_all()


def load_namespace_lookup(kubeconfig: str | None = None) -> NamespaceLookup:
    """A watch cache when a cluster is reachable (in-cluster config or kubeconfig), else everything opted in."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
            source = kubeconfig
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
                source = "in-cluster"
            except ConfigException:
                config.load_kube_config(client_configuration=configuration)
                source = "kubeconfig"
    except (ConfigException, OSError) as exc:
        if kubeconfig:
            raise  # an explicit kubeconfig that does not load is an error, not a fallback
        log_event(log, "no_kubernetes_configuration", logging.WARNING, reason=str(exc),
                  message="namespace defaults are off and every namespace is treated as opted in")
        return AllNamespacesOptedIn()
    log_event(log, "watching_namespaces", source=source, host=configuration.host)
    return NamespaceCache(client.CoreV1Api(client.ApiClient(configuration)))
