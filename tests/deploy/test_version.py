"""One version: gpufence/__init__.py, and every place that must repeat it (scripts/set_version.py)."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpufence import IMAGE, IMAGE_REPOSITORY, __version__, version_line
from gpufence.webhook.core.settings import DEFAULT_SIDECAR_IMAGE
from scripts import set_version

ROOT = Path(__file__).resolve().parents[2]
CLIS = {
    "gpufence-webhook": "gpufence.webhook",
    "gpufence-enforcer": "gpufence.enforcer",
    "gpufence-certs": "gpufence.certs",
    "gpufence": "gpufence.monitor",
    "gpufence-node": "gpufence.node",
}


def test_every_copy_of_the_version_agrees() -> None:
    found = set_version.found()
    assert found, "no version sites"
    empty = [where for where, versions in found.items() if not versions]
    assert empty == [], "sites where no version was found (moved or renamed?)"
    wrong = {where: versions for where, versions in found.items() if versions != {__version__}}
    assert wrong == {}, f"not {__version__}; run python -m scripts.set_version {__version__}"


def test_installed_metadata_is_the_source_version() -> None:
    assert importlib.metadata.version("gpufence") == __version__, "stale install: run make venv"


def test_default_sidecar_image_is_this_version() -> None:
    assert DEFAULT_SIDECAR_IMAGE == IMAGE == f"{IMAGE_REPOSITORY}:{__version__}"


def test_console_scripts_are_the_clis() -> None:
    scripts = {ep.name: ep.value for ep in importlib.metadata.distribution("gpufence").entry_points
               if ep.group == "console_scripts"}  # fmt: skip
    # kubectl-gpufence: the monitor's CLI as a kubectl plugin (`kubectl gpufence top`).
    assert scripts == {**{name: f"{module}.cli:main" for name, module in CLIS.items()},
                       "kubectl-gpufence": "gpufence.monitor.cli:kubectl_main"}


@pytest.mark.parametrize("prog", CLIS)
def test_version_flag(prog: str) -> None:
    """The installed console script when the venv has it, else the module: both read the source."""
    script = Path(sys.executable).parent / prog
    argv = [str(script)] if script.exists() else [sys.executable, "-m", CLIS[prog]]
    # --version must not need what a normal start needs (TLS files, a config, a subcommand).
    result = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=60, check=False,
                            env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == version_line(prog) == f"{prog} {__version__}"


def test_set_version_rewrites_every_site(tmp_path: Path) -> None:
    for site in set_version.SITES:
        for path in site.files(ROOT):
            target = tmp_path / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    changed = set_version.rewrite("9.8.7-rc.1", tmp_path)
    assert changed
    found = set_version.found(tmp_path)
    assert set(found) == set(set_version.found())  # the same sites, now ...
    assert all(versions == {"9.8.7-rc.1"} for versions in found.values()), found  # ... all the new version
    with pytest.raises(ValueError, match="not a version"):
        set_version.rewrite("v1.2", tmp_path)


def test_dockerfile_copies_every_package() -> None:
    """The image's wheel is built from what the Dockerfile copies: a package it misses (gpufence/, which
    holds the version) would fail the build or the programs' imports only when the image is built."""
    import re
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", (ROOT / "Dockerfile").read_text(), re.MULTILINE))
    assert packages == copied
