"""The sidecar loads only what it needs: its third-party imports come from requirements/enforcer.txt,
the list whose lock (requirements/enforcer.lock) the Dockerfile's sidecar-only image installs
(without the webhook's dependencies)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# Every enforcer module (and the simulated driver it builds with --simulate), imported in a fresh
# interpreter; prints the distributions the non-standard-library modules came from.
_IMPORT_ALL = """
import importlib, importlib.metadata, json, pkgutil, sys
import gpufence.enforcer, gpufence.simnvml
for info in pkgutil.walk_packages(gpufence.enforcer.__path__, "gpufence.enforcer."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
owners = importlib.metadata.packages_distributions()
third = {m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names) - {"gpufence", "__main__"}
print(json.dumps(sorted({d for m in third if not m.startswith("_") for d in owners.get(m, [m])})))
"""


def _names(lines: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for line in lines if line.strip() and not line.lstrip().startswith(("#", "-"))}


def test_the_enforcer_imports_only_its_listed_dependencies() -> None:
    listed = _names((REPO / "requirements" / "enforcer.txt").read_text().splitlines())
    out = subprocess.run([sys.executable, "-I", "-c", _IMPORT_ALL], capture_output=True, text=True, check=True)
    used = {name.lower().replace("_", "-") for name in json.loads(out.stdout)}
    assert used == listed, f"imported {sorted(used)}, requirements/enforcer.txt lists {sorted(listed)}"


def test_the_listed_dependencies_are_pinned_project_dependencies() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    listed = _names((REPO / "requirements" / "enforcer.txt").read_text().splitlines())
    assert listed <= _names(project)
    runtime = _names((REPO / "requirements" / "runtime.lock").read_text().splitlines())
    locked = _names((REPO / "requirements" / "enforcer.lock").read_text().splitlines())
    assert listed <= locked <= runtime
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "-r /src/requirements/enforcer.lock" in dockerfile and "AS enforcer" in dockerfile
