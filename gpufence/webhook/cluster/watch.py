"""List, then watch, one kind of object from the API server in a background thread.

The loop behind the webhook's namespace cache (webhook.cluster.namespaces) and its cluster policy
(webhook.cluster.policy): list, then watch from the list's resourceVersion (the ``kubernetes``
client is blocking, hence a thread). A 410 Gone or any other error starts over with a fresh list
after a jittered exponential backoff (reset by a watch that ends normally). A subclass says what
to list and what a list or an event means; readers see what it publishes, never a request.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

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


class ListWatch:
    """The list-then-watch loop; subclasses implement ``_replace`` (a list) and ``_apply`` (an event).

    ``list_call`` is a ``kubernetes`` client list method with its object's arguments bound (e.g.
    ``CoreV1Api.list_namespace``); the loop adds the list and watch options.
    """

    what = "objects"  # for the log lines: "<what> watch ended; relisting"

    def __init__(self, list_call: Callable[..., Any], *, watch_timeout_seconds: int = 300,
                 request_timeout: float = 30.0, min_backoff: float = 0.5, max_backoff: float = 30.0) -> None:
        self._list_call = list_call
        self._watch_timeout = watch_timeout_seconds
        self._request_timeout = request_timeout
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._synced = threading.Event()
        self._stopping = threading.Event()
        self._changed = threading.Condition()
        self._response: Any = None  # the open watch (urllib3 response)
        self._thread: threading.Thread | None = None

    # --- what a subclass says ----------------------------------------------------------------
    def _replace(self, items: list[Mapping[str, Any]]) -> None:
        """The list's items: everything there is (called under ``_publish``)."""
        raise NotImplementedError

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One ADDED, MODIFIED or DELETED event (called under ``_publish``)."""
        raise NotImplementedError

    def _failed(self, error: Exception) -> None:
        """The list or the watch failed with ``error`` (called under ``_publish``); the loop retries."""

    def _log_level(self, error: Exception) -> int:
        """The level of the "watch ended; relisting" line for ``error``: info for a 410 Gone, which is
        routine after etcd compaction, warning for anything else unless a subclass knows better."""
        return logging.INFO if getattr(error, "status", None) == HTTP_GONE else logging.WARNING

    # --- lifecycle -----------------------------------------------------------------------------
    def has_synced(self) -> bool:
        return self._synced.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.what}-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # already closed or released: nothing to unblock
                response.shutdown()  # unblocks the watch thread's read
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float) -> bool:
        """Block until ``predicate(self)`` holds after some update (for tests and tools)."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout)

    # --- the loop ------------------------------------------------------------------------------
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
                resource_version = None  # start over with a fresh list; meanwhile readers see the old state
                if self._stopping.is_set():
                    break
                self._publish(functools.partial(self._failed, exc))
                delay = backoff * random.uniform(0.8, 1.2)  # jitter: replicas should not relist in step
                logging.getLogger(type(self).__module__).log(
                    self._log_level(exc), f"{self.what} watch ended; relisting",
                    extra={"error": f"{type(exc).__name__}: {exc}", "retry_in_seconds": round(delay, 2)})
                self._stopping.wait(delay)
                backoff = min(backoff * 2, self._max_backoff)

    def _list(self) -> str:
        resp = self._list_call(_preload_content=False, _request_timeout=self._request_timeout)
        body = json.loads(resp.data)
        items = list(body.get("items") or [])
        self._publish(lambda: self._replace(items))
        self._synced.set()
        return str(body["metadata"]["resourceVersion"])

    def _watch_from(self, resource_version: str) -> str:
        """Apply events until the server ends the watch; return the last resourceVersion seen."""
        # Bookmarks keep the resourceVersion fresh so a reconnect rarely needs a relist; the
        # client read timeout outlives the server-side one to catch a dead connection.
        resp = self._list_call(
            watch=True, resource_version=resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout, _preload_content=False,
            _request_timeout=(self._request_timeout, self._watch_timeout + 30),
        )
        self._response = resp  # published before the check below, so stop() cannot miss it
        ended = False  # the server ended the stream: its connection can serve another request
        try:
            if self._stopping.is_set():
                return resource_version
            for line in _lines(resp):
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # a Status object, e.g. 410 Expired
                    raise WatchError(obj.get("code"), obj.get("message", ""))
                resource_version = str((obj.get("metadata") or {}).get("resourceVersion") or resource_version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._publish(lambda: self._apply(kind, obj))  # noqa: B023 - called at once
            ended = not self._stopping.is_set()
        finally:
            self._response = None
            if not ended:
                # A stream left open must not go back to the client's pool: the next request on that
                # connection (a GET of this client, from another thread) would read its events.
                resp.close()
            resp.release_conn()
        return resource_version

    def _publish(self, change: Callable[[], object]) -> None:
        with self._changed:
            change()
            self._changed.notify_all()
