"""Long functions in gpufence/: `make lint` fails on any function over MAX_LINES lines.

A function's length is from its ``def`` line to its last line (docstring, comments and blank lines
included; a nested function counts in its own right and in the function around it). A long
function is split into named steps that read top to bottom, each a function that returns its
values.

ALLOWED was a ratchet for the webhook's core while it was rebuilt as a pipeline (issue 40); it is
empty now and may stay so: nothing outside ``gpufence/webhook/core/`` may be listed, no new name may
join it, and a listed function that is no longer over the limit (or no longer exists) fails the
check until its entry is removed, so the list stays true.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ROOT / "gpufence"
MAX_LINES = 60
RATCHETED = "gpufence/webhook/core/"

# path::qualified name. Only shrinks (it is empty: every function of the core is split).
ALLOWED: frozenset[str] = frozenset()


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(qualified name, lines) of every function in ``tree``, nested ones and methods included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            assert node.end_lineno is not None
            yield name, node.end_lineno - node.lineno + 1
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def long_functions(root: Path = ROOT, checked: Path = CHECKED, limit: int = MAX_LINES) -> dict[str, int]:
    """``path::name`` -> lines, for every function over ``limit`` lines under ``checked``."""
    found = {}
    for path in sorted(checked.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        for name, lines in functions(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if lines > limit:
                found[f"{relative}::{name}"] = lines
    return found


def problems(found: dict[str, int], allowed: frozenset[str] = ALLOWED) -> list[str]:
    """What is wrong, in words (empty: the check passes)."""
    wrong = [f"{key}: {lines} lines (at most {MAX_LINES}): split it into named steps"
             for key, lines in sorted(found.items()) if key not in allowed]
    wrong += [f"{key}: allowed, but not under {RATCHETED}: nothing else may be listed"
              for key in sorted(allowed) if not key.startswith(RATCHETED)]
    wrong += [f"{key}: listed in ALLOWED but no longer over {MAX_LINES} lines (or gone): remove its entry"
              for key in sorted(allowed - set(found))]
    return wrong


def main() -> int:
    wrong = problems(long_functions())
    for line in wrong:
        print(line, file=sys.stderr)
    if wrong:
        print(f"{len(wrong)} function-length problem(s) in gpufence/ (scripts/function_length.py)", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
