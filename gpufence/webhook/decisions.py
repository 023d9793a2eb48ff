"""The webhook's decision log: what it did to which pod, and why, one JSON line per review.

``pod_mutated`` and ``pod_denied`` are logged at info, so an operator can answer "why was my pod
denied" or "did it get the sidecar" from ``kubectl logs``; ``pod_unchanged`` (a reinvocation that
found the sidecar already there) and ``pod_skipped`` (not a GPU pod, opted out, not a CREATE) at
debug, because they are most of the traffic. ``review_failed`` (error) names the pod whose review
raised. Each line carries ``namespace``, ``pod`` (empty at admission for pods a controller creates,
hence ``generate_name``), the request ``uid`` (the API server's audit log has the same uid),
``decision``, ``reason`` for a denial, the admission ``warnings`` and the requesting ``user``.

Kept out of ``webhook.core.admission`` so the review stays a pure function: the server calls these
after a review, and a line is built only when its level is enabled.
"""

from __future__ import annotations

import logging
from typing import Any

from gpufence.logs import log_event
from gpufence.webhook.core.admission import ReviewResult

log = logging.getLogger("webhook.decisions")

_EVENTS = {
    "mutated": ("pod_mutated", logging.INFO),
    "denied": ("pod_denied", logging.INFO),
    "unchanged": ("pod_unchanged", logging.DEBUG),
    "skipped": ("pod_skipped", logging.DEBUG),
    "verified": ("pod_verified", logging.DEBUG),
    # The final pod differs from what gpufence admits: another mutating step interfered.
    "refused": ("pod_refused", logging.WARNING),
}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _identity(payload: Any) -> dict[str, Any]:
    """namespace, pod, generate_name, uid, user of a review request, from whatever is present."""
    request = _dict(_dict(payload).get("request"))
    metadata = _dict(_dict(request.get("object")).get("metadata"))
    name = request.get("name") or metadata.get("name") or None
    return {
        "namespace": request.get("namespace") or metadata.get("namespace") or None,
        "pod": name,
        "generate_name": None if name else metadata.get("generateName") or None,
        "uid": request.get("uid"),
        "user": _dict(request.get("userInfo")).get("username"),
        "dry_run": True if request.get("dryRun") else None,
    }


def log_decision(payload: Any, result: ReviewResult) -> None:
    event, level = _EVENTS.get(result.outcome, ("pod_reviewed", logging.INFO))
    if not log.isEnabledFor(level):
        return  # the common case for skipped pods: no line is built
    response = result.review["response"]
    log_event(
        log, event, level, **_identity(payload), decision=result.outcome,
        reason=_dict(response.get("status")).get("message"), warnings=response.get("warnings"),
    )


def log_review_failed(payload: Any, exc: BaseException) -> None:
    # The traceback is logged once, by the server's error middleware; this line names the pod.
    log_event(log, "review_failed", logging.ERROR, **_identity(payload), decision="error",
              error=f"{type(exc).__name__}: {exc}")
