"""Tests stand on gpufence/ and tests/support/, never on bench/: a benchmark may change what it
measures or how it prints it without a test changing meaning, and what a test and a bench share
(a model, a table of reasons) lives in tests/support/ or gpufence/, imported by both."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def bench_imports(source: str) -> list[str]:
    """The imports of ``bench`` (or a module under it) in ``source``, as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "bench"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "bench":
            found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
    return found


def test_the_check_sees_every_form_of_import() -> None:
    source = (
        "import bench\nimport bench.common as c\nfrom bench.injected_bytes import PURPOSE\n"
        "def f():\n    from bench import soak\n"
        "import benchmark\nfrom tests.support import bench_like\nfrom . import bench_like\n"
    )
    assert bench_imports(source) == [
        "bench", "bench.common", "from bench.injected_bytes import PURPOSE", "from bench import soak"
    ]


def test_no_test_module_imports_bench() -> None:
    offenders = {
        str(path.relative_to(TESTS.parent)): found
        for path in sorted(TESTS.rglob("*.py"))
        if (found := bench_imports(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}, f"move what these need into tests/support/ or gpufence/: {offenders}"
