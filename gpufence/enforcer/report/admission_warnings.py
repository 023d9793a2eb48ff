"""The webhook's share-aware warnings, as Events on the pod (the enforcer's side: the webhook
records them in ``gpufence.io/status``).

Admission warnings reach only whoever created the pod (for a Deployment, the ReplicaSet
controller), so the webhook also records them in the ``gpufence.io/status`` annotation; the
sidecar gets that annotation through the downward API (``GPUFENCE_POD_STATUS``) and posts each
warning once, at start, as a Warning Event (reason ``GpuShareSettings``) and a log line.
"""

from __future__ import annotations

import json
from typing import Protocol

from gpufence.contract import MAX_STATUS_WARNINGS, STATUS_WARNINGS
from gpufence.enforcer.report.decision_log import DecisionLog

REASON = "GpuShareSettings"
_MAX_LENGTH = 1024


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
    return [w[:_MAX_LENGTH] for w in found if isinstance(w, str) and w][:MAX_STATUS_WARNINGS]


def report(log: DecisionLog, events: _Recorder, status_text: str | None) -> int:
    """Logs and records each warning; returns how many."""
    found = warnings_from_status(status_text)
    for warning in found:
        log.warning("admission_warning", detail=warning)
        events.record(REASON, warning)
    return len(found)
