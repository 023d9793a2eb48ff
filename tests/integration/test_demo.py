"""The README's main command, end to end: the demo must show the whole system working.

It runs the real webhook and enforcer as child processes against the simulated driver, so this
is the broadest test in the suite; it asserts the demo's own verdict lines and that it left no
process of its own behind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def test_demo_shows_enforcement_and_leaves_nothing_running() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = subprocess.run(
        [sys.executable, "-m", "gpufence.demo"], cwd=ROOT, capture_output=True, text=True, timeout=90,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for verdict in (
        "[ok] greedy went over its share and was terminated",
        "[ok] steady stayed in its share and kept running",
        "[ok] hog was throttled while over its compute share",
        "[ok] nothing was left stopped after the enforcer exited",
    ):
        assert verdict in out
    assert "re-review of the mutated pod (reinvocation): patch=False" in out
    assert 'gpufence.io/memory="lots"' in out
    leftovers = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not leftovers, f"the demo left processes running: {leftovers}"
