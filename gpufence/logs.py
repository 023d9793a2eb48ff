"""One log format for gpufence-webhook, gpufence-enforcer and gpufence-certs: one JSON object a line.

Every line has::

    time     RFC 3339, UTC, milliseconds, "Z"        2026-12-03T09:30:15.123Z
    level    debug | info | warning | error
    event    a snake_case name of what happened       pod_mutated, sigterm, secret_created, log
    message  human text, where there is one           (always for event "log")

then the event's own fields (``namespace``, ``pod``, ``uid``, ``container``, ``reason`` ...), and
``exception`` with a traceback where one was caught. Keys whose value is None are left out.
Records from libraries (aiohttp, kubernetes, urllib3) become ``event: "log"`` with ``logger`` and
``message``. A collector can therefore parse all three programs with one rule and select on
``event``.

The enforcer writes its lines itself (``enforcer.report.decision_log.DecisionLog``, with :func:`encode`); the
webhook and the certs tool use :mod:`logging` with :class:`JsonFormatter` and :func:`log_event`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

# LogRecord attributes that carry an event and its fields (set by log_event through ``extra``).
_EVENT = "gpufence_event"
_FIELDS = "gpufence_fields"
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName", _EVENT, _FIELDS,
}


def utc_timestamp(seconds: float | None = None) -> str:
    """RFC 3339 in UTC with millisecond precision and ``Z``."""
    seconds = time.time() if seconds is None else seconds
    whole = int(seconds)
    millis = int((seconds - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def level_name(levelno: int) -> str:
    # CRITICAL is reported as error: four levels in all three programs.
    if levelno >= logging.ERROR:
        return "error"
    if levelno >= logging.WARNING:
        return "warning"
    if levelno >= logging.INFO:
        return "info"
    return "debug"


def _default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    # Enums (StrEnum) as their value, anything else unusual (paths, datetimes) as its str().
    return value.value if hasattr(value, "value") else str(value)


def encode(record: dict[str, Any]) -> str:
    """One line of JSON (no newline); never raises on an odd value."""
    try:
        return json.dumps(record, default=_default, separators=(",", ":"))
    except (TypeError, ValueError):  # e.g. a circular structure
        return json.dumps({k: str(v) for k, v in record.items()}, separators=(",", ":"))


def entry(event: str, level: str, fields: dict[str, Any], *, created: float | None = None) -> dict[str, Any]:
    """The line's object: the fixed keys first, then the fields that are not None."""
    record: dict[str, Any] = {"time": utc_timestamp(created), "level": level, "event": event}
    for key, value in fields.items():
        if value is not None and key not in record:
            record[key] = value
    return record


class JsonFormatter(logging.Formatter):
    """:mod:`logging` records as gpufence log lines."""

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, _EVENT, None)
        if event is not None:
            fields = dict(getattr(record, _FIELDS, None) or {})
        else:
            # A library's (or a plain logger call's) record: its text, its logger, its extras.
            fields = {"message": record.getMessage(), "logger": record.name}
            fields.update({k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS})
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return encode(entry(event or "log", level_name(record.levelno), fields, created=record.created))


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``event`` with ``fields``; costs one ``isEnabledFor`` check when the level is off."""
    if logger.isEnabledFor(level):
        exc_info = fields.pop("exc_info", None)
        # The record's own text (what caplog and other handlers show) is the human message if any.
        text = fields.get("message") or event
        logger.log(level, "%s", text, extra={_EVENT: event, _FIELDS: fields}, exc_info=exc_info)


def setup_logging(level: str, stream: TextIO | None = None, *, libraries_level: str | None = None) -> None:
    """Every :mod:`logging` record to ``stream`` (stderr) as JSON lines at ``level`` and above.

    ``libraries_level`` raises the threshold of third-party loggers (aiohttp, kubernetes, urllib3
    are chatty at INFO) while gpufence's own loggers (the root's level) stay at ``level``.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=LEVELS[level], handlers=[handler], force=True)
    if libraries_level is not None:
        for name in ("aiohttp", "kubernetes", "urllib3", "asyncio"):
            logging.getLogger(name).setLevel(max(LEVELS[libraries_level], LEVELS[level]))
