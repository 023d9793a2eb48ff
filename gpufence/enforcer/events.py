"""Kubernetes Events on the pod for kills and throttle starts: best effort, never blocking.

``record`` puts the event on a bounded queue and returns at once (a full queue drops the event and
counts it); a daemon thread posts core/v1 Events with the ``kubernetes`` client. Outside a cluster
(no ``KUBERNETES_SERVICE_HOST`` or no service-account credentials) the recorder is off and says so
in one log line. A 403 (the pod's service account may not create events) is logged once and turns
the recorder off; other API errors are logged (at most once a minute) and the event is dropped.

The sidecar runs under the pod's own service account, so Events need a Role granting ``create`` on
``events`` in the pod's namespace bound to that account; without it the enforcer works the same.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gpufence.enforcer.logs import DecisionLog

COMPONENT = "gpufence-enforcer"
_STOP = object()


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    uid: str | None


class EventRecorder:
    def __init__(
        self,
        log: DecisionLog,
        pod: PodRef,
        api_client: Any | None = None,
        *,
        queue_size: int = 64,
        host: str | None = None,
    ) -> None:
        self._log = log
        self._pod = pod
        self._api_client = api_client
        self._host = host or os.uname().nodename
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.enabled = api_client is not None
        self.dropped = 0
        self.posted = 0
        self._forbidden_logged = False
        self._last_error_log = 0.0
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="gpufence-events", daemon=True)
            self._thread.start()

    @classmethod
    def from_environment(cls, log: DecisionLog, pod: PodRef) -> EventRecorder:
        if not os.environ.get("KUBERNETES_SERVICE_HOST"):
            log.info("events_disabled", reason="not running in a Kubernetes cluster")
            return cls(log, pod, None)
        if not pod.name or not pod.namespace:
            log.info("events_disabled", reason="pod name or namespace unknown")
            return cls(log, pod, None)
        try:
            from kubernetes import client, config

            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
            api_client = client.ApiClient(configuration)
        except Exception as exc:
            log.info("events_disabled", reason=f"no in-cluster credentials: {exc}")
            return cls(log, pod, None)
        log.info("events_enabled", api=configuration.host)
        return cls(log, pod, api_client)

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

    def _run(self) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api = client.CoreV1Api(self._api_client)
        while True:
            item = self._queue.get()
            try:
                if item[0] is _STOP:
                    return
                if not self.enabled:
                    continue
                reason, message, event_type, action, when = item
                body = client.CoreV1Event(
                    metadata=client.V1ObjectMeta(generate_name=f"{self._pod.name}.gpufence."),
                    involved_object=client.V1ObjectReference(
                        api_version="v1", kind="Pod", name=self._pod.name,
                        namespace=self._pod.namespace, uid=self._pod.uid or None,
                    ),
                    reason=reason,
                    message=message[:1024],
                    type=event_type,
                    action=action or None,
                    source=client.V1EventSource(component=COMPONENT, host=self._host),
                    reporting_component=COMPONENT,
                    reporting_instance=self._host,
                    first_timestamp=when,
                    last_timestamp=when,
                    count=1,
                )
                try:
                    api.create_namespaced_event(self._pod.namespace, body, _request_timeout=5)
                    self.posted += 1
                except ApiException as exc:
                    if exc.status == 403:
                        self.enabled = False
                        if not self._forbidden_logged:
                            self._forbidden_logged = True
                            self._log.warning(
                                "events_forbidden",
                                reason="the pod's service account may not create events; events off",
                            )
                    else:
                        self._error(f"HTTP {exc.status}: {exc.reason}")
                except Exception as exc:
                    self._error(f"{type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()

    def _error(self, error: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= 60:
            self._last_error_log = now
            self._log.warning("event_post_failed", error=error)
