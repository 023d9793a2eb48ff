"""Namespace labels and annotations for the core, from a watch cache (never an API call per admission).

``NamespaceCache`` lists Namespaces, then watches them (webhook.cluster.watch, a background thread). ``get``
reads a dict that the thread replaces or updates; single dict operations are atomic under the GIL,
so no lock is needed on the admission path.

Without a client configuration there is no cache to read, and two cases differ. Outside a cluster (no
``KUBERNETES_SERVICE_HOST``, no kubeconfig: local runs, the demo, the tests) every namespace is
treated as opted in, with a warning. In a cluster the same fallback would inject sidecars into
namespaces that never opted in, so ``load_core_api`` raises ``ClusterConfigurationError`` and the
webhook refuses to start (exit 1, one ``startup_failed`` line naming the missing file or variable
and the fix) rather than serving not-ready. Why refusing: the service-account files are mounted
before the container starts, so a process that finds them missing would wait for something that
never comes; a crash-looping pod with that line in its log is the louder signal; it is what an
unloadable ``--kubeconfig`` and ``--policy-configmap`` without a cluster already do; and a process
that does not run cannot mutate a pod through any path, while a not-ready one still answers
whoever reaches it. Both are safe for admissions: the API server refuses what the webhook did not
judge (failurePolicy Fail).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from gpufence.logs import log_event
from gpufence.webhook.cluster.watch import BackgroundLookup, ListWatch, WatchError
from gpufence.webhook.core.settings import AllNamespacesOptedIn, NamespaceInfo, NamespaceLookup

__all__ = ["BackgroundLookup", "ClusterConfigurationError", "NamespaceCache", "WatchError", "load_core_api",
           "load_namespace_lookup"]

log = logging.getLogger(__name__)

# The API server waits 5 s for the webhook (its configuration's timeoutSeconds).
FRESH_READ_TIMEOUT_SECONDS = 2.0


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
        self._api = api

    # --- NamespaceLookup -------------------------------------------------------------------
    def get(self, name: str) -> NamespaceInfo | None:
        return self._items.get(name)

    def read_fresh(self, name: str) -> NamespaceInfo | None:
        """The namespace read now (webhook.core.settings.FreshReader), kept until the watch says otherwise.

        Bounded well inside the API server's webhook timeout, so a slow read ends as this webhook's
        own denial rather than the API server's timeout."""
        from kubernetes.client.exceptions import ApiException

        try:
            obj = self._api.read_namespace(name, _request_timeout=FRESH_READ_TIMEOUT_SECONDS)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        info = namespace_info(self._api.api_client.sanitize_for_serialization(obj))
        self._items[info.name] = info
        log_event(log, "namespace_read_fresh", namespace=name, opted_in=info.opted_in)
        return info

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


class ClusterConfigurationError(ValueError):
    """In a cluster, no client configuration loads; ``missing`` names the file or variable at fault."""

    def __init__(self, message: str, missing: str) -> None:
        super().__init__(message)
        self.missing = missing


def in_cluster() -> bool:
    """Whether this process runs in a pod: the kubelet sets the API server's Service address."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def _readable_file(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.R_OK) and os.path.getsize(path) > 0


def _in_cluster_failure(in_cluster_error: Exception, kubeconfig_error: Exception) -> ClusterConfigurationError:
    """The error of a pod whose in-cluster configuration does not load: what is missing, and the fix."""
    from kubernetes.config.incluster_config import SERVICE_CERT_FILENAME, SERVICE_TOKEN_FILENAME

    if not os.environ.get("KUBERNETES_SERVICE_PORT"):
        missing = "KUBERNETES_SERVICE_PORT"
    else:
        # The first of the service-account files that is absent, unreadable or empty (the loader's order).
        missing = next((path for path in (SERVICE_TOKEN_FILENAME, SERVICE_CERT_FILENAME)
                        if not _readable_file(path)), "the in-cluster configuration")
    return ClusterConfigurationError(
        f"running in a cluster (KUBERNETES_SERVICE_HOST is set) but its client configuration does not load: "
        f"{missing} is missing, unreadable or empty ({str(in_cluster_error).rstrip('.')}; no kubeconfig "
        f"either: {str(kubeconfig_error).rstrip('.')}). Without it the webhook cannot read which namespaces "
        "opted in and would treat every namespace as opted in, so it does not start. Fix: mount the service "
        "account's token (automountServiceAccountToken: true on the pod or on ServiceAccount gpufence-webhook, "
        "as the shipped manifests do), or give --kubeconfig; outside a cluster, unset KUBERNETES_SERVICE_HOST",
        missing)


def load_core_api(kubeconfig: str | None = None) -> Any | None:
    """A ``CoreV1Api`` from the in-cluster configuration or a kubeconfig, or None where neither exists.

    None only outside a cluster; in one, raises ``ClusterConfigurationError`` (see the module docstring).
    """
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    if kubeconfig:
        # An explicit kubeconfig that does not load is an error, not a fallback.
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        source = kubeconfig
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
            source = "in-cluster"
        except (ConfigException, OSError) as in_cluster_error:
            try:
                config.load_kube_config(client_configuration=configuration)
                source = "kubeconfig"
            except (ConfigException, OSError) as exc:
                if in_cluster():
                    raise _in_cluster_failure(in_cluster_error, exc) from None
                log_event(log, "no_kubernetes_configuration", logging.WARNING, reason=str(exc),
                          message="namespace defaults are off and every namespace is treated as opted in")
                return None
    log_event(log, "watching_namespaces", source=source, host=configuration.host)
    return client.CoreV1Api(client.ApiClient(configuration))


def load_namespace_lookup(kubeconfig: str | None = None) -> NamespaceLookup:
    """A watch cache when a cluster is reachable (in-cluster config or kubeconfig), else everything opted in.

    In a cluster without a loadable configuration, raises ``ClusterConfigurationError`` instead.
    """
    api = load_core_api(kubeconfig)
    return AllNamespacesOptedIn() if api is None else NamespaceCache(api)
