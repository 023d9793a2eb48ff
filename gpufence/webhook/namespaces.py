"""Namespace labels and annotations for the core, from a watch cache (never an API call per admission).

``NamespaceCache`` lists Namespaces, then watches them (webhook.watch, a background thread). ``get``
reads a dict that the thread replaces or updates; single dict operations are atomic under the GIL,
so no lock is needed on the admission path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from gpufence.logs import log_event
from gpufence.webhook.settings import AllNamespacesOptedIn, NamespaceInfo, NamespaceLookup
from gpufence.webhook.watch import BackgroundLookup, ListWatch, WatchError

__all__ = ["BackgroundLookup", "NamespaceCache", "WatchError", "load_core_api", "load_namespace_lookup"]

log = logging.getLogger(__name__)


def namespace_info(obj: Mapping[str, Any]) -> NamespaceInfo:
    meta = obj.get("metadata") or {}
    return NamespaceInfo(
        name=meta["name"],
        labels=MappingProxyType(dict(meta.get("labels") or {})),
        annotations=MappingProxyType(dict(meta.get("annotations") or {})),
    )


class NamespaceCache(ListWatch):
    """List-then-watch cache of Namespaces, implementing ``NamespaceLookup``."""

    what = "namespace"

    def __init__(self, api: Any, *, watch_timeout_seconds: int = 300, request_timeout: float = 30.0,
                 min_backoff: float = 0.5, max_backoff: float = 30.0) -> None:
        # api: kubernetes.client.CoreV1Api
        super().__init__(api.list_namespace, watch_timeout_seconds=watch_timeout_seconds,
                         request_timeout=request_timeout, min_backoff=min_backoff, max_backoff=max_backoff)
        self._items: dict[str, NamespaceInfo] = {}

    # --- NamespaceLookup -------------------------------------------------------------------
    def get(self, name: str) -> NamespaceInfo | None:
        return self._items.get(name)

    # --- ListWatch -------------------------------------------------------------------------
    def _replace(self, items: list[Mapping[str, Any]]) -> None:
        # A new dict rather than clear+update, so a concurrent get never sees it empty.
        self._items = {info.name: info for info in map(namespace_info, items)}
        log_event(log, "namespaces_listed", count=len(self._items))

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind == "DELETED":
            self._items.pop(obj["metadata"]["name"], None)
        else:
            info = namespace_info(obj)
            self._items[info.name] = info


def load_core_api(kubeconfig: str | None = None) -> Any | None:
    """A ``CoreV1Api`` from the in-cluster configuration or a kubeconfig, or None where neither exists."""
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
        return None
    log_event(log, "watching_namespaces", source=source, host=configuration.host)
    return client.CoreV1Api(client.ApiClient(configuration))


def load_namespace_lookup(kubeconfig: str | None = None) -> NamespaceLookup:
    """A watch cache when a cluster is reachable (in-cluster config or kubeconfig), else everything opted in."""
    api = load_core_api(kubeconfig)
    return AllNamespacesOptedIn() if api is None else NamespaceCache(api)
