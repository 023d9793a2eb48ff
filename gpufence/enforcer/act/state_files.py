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
import threading
from pathlib import Path
from typing import Any

# Not following a link someone else left at the temp name; truncating what a failed write left.
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically; raises OSError.

    The heartbeat is rewritten every second for the life of the pod: the temp file's name is fixed
    per file and thread (no random name, no buffered file object, no directory check before each
    write), and a thread never has two writes under way.
    """
    tmp = f"{path.parent}/.{path.name}.{threading.get_ident()}.tmp"
    data = text.encode()
    try:
        fd = os.open(tmp, _TEMP_FLAGS, 0o600)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, _TEMP_FLAGS, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
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
