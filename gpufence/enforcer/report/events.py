"""Kubernetes Events on the pod for kills and throttle starts: best effort, never blocking.

``record`` puts the event on a bounded queue and returns at once (a full queue drops the event and
counts it in ``dropped``); a daemon thread posts core/v1 Events with the small standard-library
client in :mod:`gpufence.enforcer.report.kube_events_api` (the ``kubernetes`` package is not loaded: the
sidecar runs in every GPU pod). Outside a cluster (no ``KUBERNETES_SERVICE_HOST`` or no
service-account credentials) the recorder is off and says so in one log line. A 403 (the pod's
service account may not create events) is logged once and turns the recorder off. A 429 or 5xx is
retried after its ``Retry-After`` (or a short backoff) for at most ``max_retry_wait`` seconds per
event, then the event is dropped; failures are logged at most once a minute and counted in
``failed``.

The sidecar runs under the pod's own service account, so Events need a Role granting ``create`` on
``events`` in the pod's namespace bound to that account; without it the enforcer works the same.

What an Event proves: little by itself. Anyone who may create Events in the namespace (a tenant
with ``edit``, or anyone holding a token of the pod's service account) can post one with this
``source``, ``reportingComponent`` and reason. Each enforcer therefore signs its Events with a
``reportingInstance`` of its own: the pod's UID and a random token drawn at start, which it writes
in its ``events_enabled`` log line. An Event whose instance names no incarnation's log line, or
whose decision has no line in that log, is not the enforcer's. The decision log and the metrics
stay the record (docs/threat-model.md).

The webhook's share-aware warnings become Events too (``report_admission_warnings``): admission
warnings reach only whoever created the pod (for a Deployment, the ReplicaSet controller), so the
webhook also records them in the ``gpufence.io/status`` annotation; the sidecar gets that annotation
through the downward API (``GPUFENCE_POD_STATUS``) and posts each warning once, at start, as a
Warning Event (reason ``GpuShareSettings``) and a log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from gpufence.contract import MAX_STATUS_WARNINGS, STATUS_WARNINGS
from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.kube_events_api import SERVICE_ACCOUNT_DIR, ApiError, CredentialsUnavailable, EventsApi

COMPONENT = "gpufence-enforcer"
MAX_RETRY_WAIT = 10.0  # seconds one event may wait for a busy API server before it is dropped
FIRST_BACKOFF = 0.5  # without Retry-After: 0.5, 1, 2, 4, 8 s
MAX_BACKOFF = 8.0
ERROR_LOG_INTERVAL = 60.0
_STOP = object()


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    uid: str | None


class EventRecorder:
    """``api``: an :class:`EventsApi`, or a ``kubernetes`` ``ApiClient`` (its configuration is used), or None (off)."""

    def __init__(
        self,
        log: DecisionLog,
        pod: PodRef,
        api: EventsApi | Any | None = None,
        *,
        queue_size: int = 64,
        host: str | None = None,
        max_retry_wait: float = MAX_RETRY_WAIT,
        instance: str | None = None,
    ) -> None:
        self._log = log
        self._pod = pod
        if api is not None and not isinstance(api, EventsApi):
            api = EventsApi.from_kubernetes_configuration(api.configuration)
        self._api: EventsApi | None = api
        self._host = host or os.uname().nodename
        # This incarnation's reportingInstance: the pod (UID, else name) and a token drawn now,
        # logged once (``events_enabled``) so an Event can be matched to the enforcer that posted it.
        self.instance = instance or f"{pod.uid or pod.name}.{secrets.token_hex(8)}"
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._max_retry_wait = max_retry_wait
        self.enabled = api is not None
        self.dropped = 0  # the queue was full
        self.failed = 0  # the API server did not take it (after retries, or an error not worth retrying)
        self.posted = 0
        self._forbidden_logged = False
        self._last_error_log = -ERROR_LOG_INTERVAL
        self._not_before = 0.0  # monotonic time before which the API server asked us not to post
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="gpufence-events", daemon=True)
            self._thread.start()

    @classmethod
    def from_environment(
        cls, log: DecisionLog, pod: PodRef, *, service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    ) -> EventRecorder:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            log.info("events_disabled", reason="not running in a Kubernetes cluster")
            return cls(log, pod, None)
        if not pod.name or not pod.namespace:
            log.info("events_disabled", reason="pod name or namespace unknown")
            return cls(log, pod, None)
        try:
            api = EventsApi.in_cluster(host, os.environ.get("KUBERNETES_SERVICE_PORT") or "443", service_account_dir)
        except (CredentialsUnavailable, ValueError) as exc:
            log.info("events_disabled", reason=f"no in-cluster credentials: {exc}")
            return cls(log, pod, None)
        recorder = cls(log, pod, api)
        log.info("events_enabled", api=api.base_url, reporting_instance=recorder.instance,
                 reason="each Event this enforcer posts carries this reportingInstance; one that does not, "
                 "or names no decision in this log, is not this enforcer's")
        return recorder

    # -- producer side (the poll loop) ---------------------------------------------------------

    def record(self, reason: str, message: str, *, event_type: str = "Warning", action: str = "") -> None:
        if not self.enabled:
            return
        try:
            self._queue.put_nowait((reason, message, event_type, action, datetime.now(UTC)))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        if self._thread is None:
            return
        self._stopping.set()  # ends a Retry-After wait at once
        with contextlib.suppress(queue.Full):
            self._queue.put((_STOP,), timeout=timeout)
        self._thread.join(timeout=timeout)
        self._thread = None

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the queue is drained (for tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._queue.unfinished_tasks == 0

    # -- consumer thread -----------------------------------------------------------------------

    def event_body(self, reason: str, message: str, event_type: str, action: str, when: datetime) -> dict[str, Any]:
        """The core/v1 Event, with the fields (and timestamp format) the ``kubernetes`` client used to send."""
        involved: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Pod", "name": self._pod.name, "namespace": self._pod.namespace,
        }
        if self._pod.uid:
            involved["uid"] = self._pod.uid
        stamp = when.isoformat()
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{self._pod.name}.gpufence."},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": event_type,
            "source": {"component": COMPONENT, "host": self._host},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        if action:
            body["action"] = action
        return body

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item[0] is _STOP:
                    return
                if self.enabled and not self._stopping.is_set():
                    self._deliver(self.event_body(*item))
            finally:
                self._queue.task_done()

    def _deliver(self, body: dict[str, Any]) -> None:
        from http.client import HTTPException  # on the first Event, not at start (kube_events_api)

        assert self._api is not None
        deadline = time.monotonic() + self._max_retry_wait
        backoff = FIRST_BACKOFF
        last_error = ""
        while True:
            now = time.monotonic()
            pause = max(0.0, self._not_before - now)
            if (pause > 0 or last_error) and now + pause > deadline:
                self._fail(f"{last_error or 'the API server asked to wait'}; event dropped after "
                           f"waiting up to {self._max_retry_wait:g}s")
                return
            if pause > 0 and self._stopping.wait(pause):
                return
            try:
                self._api.create_event(self._pod.namespace, body)
            except ApiError as exc:
                if exc.status == 403:
                    self._forbidden(str(exc))
                    return
                if exc.status != 429 and exc.status < 500:
                    self._fail(str(exc))
                    return
                wait = exc.retry_after if exc.retry_after is not None else backoff
                backoff = min(backoff * 2, MAX_BACKOFF)
                self._not_before = time.monotonic() + wait
                last_error = str(exc)
                continue
            except CredentialsUnavailable as exc:
                self._fail(str(exc))
                return
            except (OSError, HTTPException) as exc:  # refused, reset, timeout, TLS verification
                self._fail(f"{type(exc).__name__}: {exc}")
                return
            self.posted += 1
            return

    def _forbidden(self, error: str) -> None:
        self.enabled = False
        if not self._forbidden_logged:
            self._forbidden_logged = True
            self._log.warning("events_forbidden", reason="the pod's service account may not create events; events off",
                              error=error)

    def _fail(self, error: str) -> None:
        self.failed += 1
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL:
            self._last_error_log = now
            self._log.warning("event_post_failed", error=error, failed=self.failed)


# --- the webhook's warnings, as Events on the pod -------------------------------------------------

ADMISSION_WARNING_REASON = "GpuShareSettings"
_MAX_WARNING_LENGTH = 1024


class _Recorder(Protocol):
    def record(self, reason: str, message: str, *, event_type: str = "Warning", action: str = "") -> None: ...


def warnings_from_status(text: str | None) -> list[str]:
    """The ``warnings`` of a status annotation; [] for none, or for a value that is not one."""
    if not text:
        return []
    try:
        status = json.loads(text)
    except ValueError:
        return []
    found = status.get(STATUS_WARNINGS) if isinstance(status, dict) else None
    if not isinstance(found, list):
        return []
    return [w[:_MAX_WARNING_LENGTH] for w in found if isinstance(w, str) and w][:MAX_STATUS_WARNINGS]


def report_admission_warnings(log: DecisionLog, events: _Recorder, status_text: str | None) -> int:
    """Logs and records each warning of the pod's status annotation; returns how many."""
    found = warnings_from_status(status_text)
    for warning in found:
        log.warning("admission_warning", detail=warning)
        events.record(ADMISSION_WARNING_REASON, warning)
    return len(found)
