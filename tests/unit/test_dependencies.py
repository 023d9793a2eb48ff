"""The runtime dependencies in pyproject.toml are exactly what gpufence imports: every third-party
import of the package (the demo included, function-level imports too) is a declared runtime
dependency, not a test extra, and no runtime dependency is left that nothing imports (psutil was
one: the enforcer reads /proc itself, docs/PERFORMANCE.md). The locks agree with pyproject.toml."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _names(lines: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for line in lines if line.strip() and not line.lstrip().startswith(("#", "-"))}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _imported_top_level() -> dict[str, set[str]]:
    """Top-level module -> the files of gpufence/ that import it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "gpufence").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                found.setdefault(module.split(".")[0], set()).add(str(path.relative_to(REPO)))
    return found


def _imported_distributions() -> dict[str, set[str]]:
    owners = importlib.metadata.packages_distributions()
    out: dict[str, set[str]] = {}
    for module, files in _imported_top_level().items():
        if module in sys.stdlib_module_names or module in ("gpufence", "__future__"):
            continue
        for dist in owners.get(module, [module]):
            out.setdefault(dist.lower().replace("_", "-"), set()).update(files)
    return out


def test_gpufence_imports_only_its_runtime_dependencies() -> None:
    runtime = _names(_project()["dependencies"])
    extra = {d: sorted(files) for d, files in _imported_distributions().items() if d not in runtime}
    assert not extra, f"imported but not runtime dependencies in pyproject.toml: {extra}"


def test_every_runtime_dependency_is_imported() -> None:
    unused = _names(_project()["dependencies"]) - set(_imported_distributions())
    assert not unused, f"runtime dependencies nothing in gpufence/ imports: {sorted(unused)}"


def test_the_locks_follow_pyproject() -> None:
    project = _project()
    runtime = _names(project["dependencies"])
    test = _names(project["optional-dependencies"]["test"])
    runtime_lock = _names((REPO / "requirements" / "runtime.lock").read_text().splitlines())
    test_lock = _names((REPO / "requirements" / "test.lock").read_text().splitlines())
    assert runtime <= runtime_lock
    assert runtime_lock <= test_lock and test <= test_lock
    for lock in ("runtime.lock", "test.lock", "enforcer.lock"):
        text = (REPO / "requirements" / lock).read_text()
        pins = re.findall(r"^[A-Za-z0-9._-]+==\S+ \\$", text, re.M)
        assert pins and len(pins) == len(re.findall(r"^[A-Za-z0-9._-]+==", text, re.M)), f"{lock}: every pin hashed"
