"""The enforcer's JSON decision log: one object per line on stdout.

Every line carries ``time`` (RFC 3339, UTC, millisecond precision), ``level`` and ``event``, plus
the pod's identity (``namespace``, ``pod``) and whatever the caller adds (``container``, ``pid``,
``uuid``, ``used_bytes``, ``limit_bytes``, ``sm_utilization``, ``compute_share``, ``action``,
``mode`` ... see docs/internals/architecture.md). Keys whose value is ``None`` are left out.

Lines are written whole under a lock and flushed at once, so the log can be read line by line
from a pipe (the tests do) and interleaves safely between the poll loop, the throttle thread and
the HTTP server. Messages from libraries that use :mod:`logging` are forwarded as ``event="log"``.
The line format is the one all three programs share (gpufence/logs.py).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, TextIO

from gpufence.logs import LEVELS, encode, entry


class DecisionLog:
    """Thread-safe JSON-lines writer. ``emit`` never raises (a closed stdout must not kill the loop)."""

    def __init__(
        self,
        *,
        namespace: str | None = None,
        pod: str | None = None,
        level: str = "info",
        stream: TextIO | None = None,
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
        self._threshold = LEVELS[level]
        self._stream = stream if stream is not None else sys.stdout
        self._lock = threading.Lock()
        self._base = {k: v for k, v in (("namespace", namespace), ("pod", pod)) if v is not None}
        # The last error record, "event: error", for the container's termination message.
        self.last_error: str | None = None

    def enabled(self, level: str) -> bool:
        return LEVELS[level] >= self._threshold

    def emit(self, event: str, *, level: str = "info", **fields: Any) -> None:
        if level == "error":
            detail = fields.get("error") or fields.get("reason")
            self.last_error = f"{event}: {detail}" if detail else event
        if LEVELS[level] < self._threshold:
            return
        merged = dict(self._base)
        merged.update((key, value) for key, value in fields.items() if value is not None)
        line = encode(entry(event, level, merged))
        with self._lock:
            try:
                self._stream.write(line + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                pass

    def debug(self, event: str, **fields: Any) -> None:
        self.emit(event, level="debug", **fields)

    def info(self, event: str, **fields: Any) -> None:
        self.emit(event, level="info", **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self.emit(event, level="warning", **fields)

    def error(self, event: str, **fields: Any) -> None:
        self.emit(event, level="error", **fields)


class _ForwardHandler(logging.Handler):
    def __init__(self, log: DecisionLog) -> None:
        super().__init__()
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        level = "debug"
        if record.levelno >= logging.ERROR:
            level = "error"
        elif record.levelno >= logging.WARNING:
            level = "warning"
        elif record.levelno >= logging.INFO:
            level = "info"
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        self._log.emit("log", level=level, logger=record.name, message=message)


def forward_stdlib_logging(log: DecisionLog, level: str) -> None:
    """Route :mod:`logging` records (aiohttp, kubernetes, urllib3) into the JSON log."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_ForwardHandler(log))
    # Libraries are chatty at INFO (aiohttp access log); keep them at WARNING unless debugging.
    root.setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
