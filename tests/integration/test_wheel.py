"""What ``pip install .`` installs: one top-level package, ``gpufence``, and the three console scripts
(the repository's own tooling under scripts/, tests/ and bench/ stays out of users' environments)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    # Built from a copy of the tree: setuptools keeps build/ in the source directory, and a stale
    # build/lib (a module since moved) would end up in the wheel and in every later one.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", ".gpufence-cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--wheel-dir", str(tmp_path), str(source)],
                   check=True, timeout=300, capture_output=True)  # fmt: skip
    (wheel,) = tmp_path.glob("gpufence-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"gpufence"}
    assert "gpufence/simnvml/fake_nvml.c" in names  # the demo and --simulate compile it
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    for line in ("gpufence-webhook = gpufence.webhook.cli:main", "gpufence-enforcer = gpufence.enforcer.cli:main",
                 "gpufence-certs = gpufence.certs.cli:main", "gpufence-node = gpufence.node.cli:main"):
        assert line in scripts
