"""scripts/function_length.py, the `make lint` check that no function in gpufence/ is over 60 lines
but the webhook core's listed ones (a ratchet: the list may only shrink)."""

from __future__ import annotations

import ast

from scripts.function_length import MAX_LINES, functions, problems


def _source(lines: int) -> str:
    body = "\n".join(f"    x{i} = {i}" for i in range(lines - 1))
    return f"def long():\n{body}\n"


def test_functions_are_measured_def_to_last_line_nested_and_methods_included() -> None:
    source = "class C:\n    def m(self):\n        def inner():\n            pass\n        return 1\n" + _source(3)
    assert dict(functions(ast.parse(source))) == {"C.m": 4, "C.m.inner": 2, "long": 3}


def test_a_long_function_outside_the_list_fails_and_a_stale_entry_fails() -> None:
    assert problems({"gpufence/x.py::f": MAX_LINES + 1}, frozenset()) == [
        f"gpufence/x.py::f: {MAX_LINES + 1} lines (at most {MAX_LINES}): split it into named steps"
    ]
    stale = "gpufence/webhook/core/desired.py::desired_pod"
    assert problems({}, frozenset({stale})) == [
        f"{stale}: listed in ALLOWED but no longer over {MAX_LINES} lines (or gone): remove its entry"
    ]
    outside = "gpufence/enforcer/loop.py::Enforcer.tick"
    assert any("nothing else may be listed" in p for p in problems({outside: 99}, frozenset({outside})))
    assert problems({stale: 99}, frozenset({stale})) == []

