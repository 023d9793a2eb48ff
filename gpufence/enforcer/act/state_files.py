"""Files in the enforcer's state directory (``--state-dir``, the pod's ``gpufence-state`` volume).

They are how one enforcer process hands over to the next when the kubelet restarts the sidecar
within its pod: ``stopped.json`` (``stopped_state.py``: processes held stopped) and
``kill_deadlines.json`` (``kill_deadlines.py``: SIGKILLs due at the end of a grace period); the
heartbeat the sidecar's probe reads sits next to them (``health.py``, ``probe.py``). Each file is
rewritten whole: a temp file in the same directory, then a rename, so a reader (the next enforcer,
the probe) sees the old or the new content, never a torn one.

No fsync: the files must outlive the enforcer *process* (its page cache writes are the kernel's
from the moment ``write`` returns, and ``rename`` is atomic for every later reader), not the
kernel: a node that crashes takes every recorded process with it, and the webhook mounts the
directory as a tmpfs (a memory-backed emptyDir, which survives a restart of the sidecar within
its pod), where fsync does nothing anyway. The throttle rewrites ``stopped.json`` on every SIGSTOP
and SIGCONT, several times a second: a flush to a disk each time would buy nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically; raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: Path, doc: Any) -> None:
    """Replace ``path`` with ``doc`` (compact JSON) atomically; raises OSError."""
    write_text(path, json.dumps(doc, separators=(",", ":")))


def read_json(path: Path) -> Any:
    """The document in ``path``; None when there is no file. Raises OSError, ValueError."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
