"""The README's commands run: every ```sh block marked runnable (an HTML comment ``<!-- runnable``
on the line before it) is executed as bash from the repository root, so a renamed module, console
script or flag breaks this suite instead of a user's first try.

A block's ``# -> {...}`` lines are what it documents: each must appear as a JSON log line with those
fields (``...`` stands for fields not shown). A block that runs until stopped (the enforcer) is
stopped, with everything it started, once every documented line has appeared; one that ends by
itself must exit 0. Two substitutions keep a run private and on this checkout: ``/tmp/gf`` becomes
the test's own directory (tests run in parallel; a user's /tmp/gf is left alone) and ``.venv/bin/``
the interpreter's directory running this suite (the venv ``make`` creates, as the README assumes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MARKER = "<!-- runnable"
TIMEOUT_SECONDS = 90.0  # building the simulated driver the first time, on a loaded 2-core machine


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    script: str
    expected: tuple[dict[str, Any], ...]  # the fields of each documented "# ->" line


def _documented(comment: str) -> dict[str, Any]:
    """The fields of ``{"event": "x", "n": 1, ... "action": "audit"}``: every ``"key": value`` shown."""
    body = comment.strip()
    assert body.startswith("{") and body.endswith("}"), f"a documented line is a JSON object: {comment!r}"
    fields: dict[str, Any] = {}
    for piece in body[1:-1].split("..."):
        piece = piece.strip().strip(",").strip()
        if piece:
            fields.update(json.loads("{" + piece + "}"))
    return fields


def runnable_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not line.startswith(MARKER):
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        assert fence.strip() == "```sh", f"README.md:{i + 1}: {MARKER} must come right before a ```sh block"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        body = lines[i + 2:end]
        expected = tuple(_documented(b.split("# ->", 1)[1]) for b in body if b.lstrip().startswith("# ->"))
        blocks.append(Block(i + 2, "\n".join(body) + "\n", expected))
    return blocks


def _matches(line: str, fields: dict[str, Any]) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and all(record.get(k) == v for k, v in fields.items())


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the block's whole process group, SIGKILL if it lingers, and SIGKILL to what the
    shell left running (a background job)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def run_block(block: Block, workdir: Path) -> tuple[int | None, list[str]]:
    """Run ``block`` until its shell exits or every documented line has appeared; the shell's exit
    status (None when it was stopped) and the output lines. The shell's exit is awaited through a
    pidfd: a background job of the block may hold the output open long after."""
    script = block.script.replace("/tmp/gf", str(workdir)).replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    assert process.stdout is not None
    out = process.stdout.fileno()
    os.set_blocking(out, False)
    exited = os.pidfd_open(process.pid)
    lines: list[str] = []
    pending = list(block.expected)
    buffered = b""

    def take() -> bool:
        """Read what the pipe holds now into ``lines``; False at its end."""
        nonlocal buffered, pending
        while True:
            try:
                chunk = os.read(out, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                if buffered:
                    lines.append(buffered.decode(errors="replace"))
                    buffered = b""
                return False
            buffered += chunk
            *complete, buffered = buffered.split(b"\n")
            for raw in complete:
                line = raw.decode(errors="replace")
                lines.append(line)
                pending = [fields for fields in pending if not _matches(line, fields)]

    deadline = time.monotonic() + TIMEOUT_SECONDS
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(out, selectors.EVENT_READ)
            selector.register(exited, selectors.EVENT_READ)
            while not (block.expected and not pending):
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"README.md:{block.line}: {len(pending)} documented line(s) not seen within "
                                f"{TIMEOUT_SECONDS:g}s: {pending}\n" + "\n".join(lines[-30:]))
                ready = {key.fd for key, _ in selector.select(timeout=left)}
                if out in ready and not take():
                    selector.unregister(out)
                if exited in ready:
                    take()
                    return process.wait(timeout=10), lines
            return None, lines
    finally:
        os.close(exited)
        _stop(process)
        process.stdout.close()


BLOCKS = runnable_blocks(README.read_text())


def test_the_readme_marks_its_laptop_try_out_runnable() -> None:
    assert any("gpufence-enforcer --simulate" in b.script for b in BLOCKS), "the laptop block lost its marker"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b.line}" for b in BLOCKS])
def test_a_runnable_readme_block_does_what_it_says(block: Block, tmp_path: Path) -> None:
    status, lines = run_block(block, tmp_path)
    output = "\n".join(lines[-30:])
    if status is not None:
        assert status == 0, f"README.md:{block.line} exited {status}:\n{output}"
    for fields in block.expected:
        assert any(_matches(line, fields) for line in lines), f"README.md:{block.line}: no line with {fields}"


def test_every_readme_shell_block_is_run_or_says_why_not() -> None:
    """A new block cannot go untested silently: it is marked runnable (and run above) or carries the
    reason it is not (``<!-- not-runnable: REASON -->`` on the line before it)."""
    lines = README.read_text().splitlines()
    unmarked = [f"README.md:{i + 1}" for i, line in enumerate(lines) if line.strip() == "```sh"
                and not lines[i - 1].startswith((MARKER, "<!-- not-runnable: "))]
    assert not unmarked, f"a ```sh block neither marked runnable nor not-runnable with a reason: {unmarked}"


def test_the_make_targets_the_readme_names_exist() -> None:
    """The set-up block is not run here (``make test`` is this suite); a renamed target still breaks it."""
    named = set(re.findall(r"^make (\S+)", README.read_text(), re.MULTILINE))
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), re.MULTILINE))
    assert named and named <= targets, f"the README names make targets the Makefile lacks: {named - targets}"


def test_a_documented_line_lists_the_fields_it_shows() -> None:
    shown = '{"event": "memory_over_share", "container": "train", "used_bytes": 9663676416, ... "action": "audit"}'
    assert _documented(shown) == {"event": "memory_over_share", "container": "train", "used_bytes": 9663676416,
                                  "action": "audit"}
