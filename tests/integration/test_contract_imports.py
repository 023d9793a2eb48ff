"""The import boundary of the contract, in real interpreters: importing every module of one side
loads nothing of the other, and the contract loads the standard library only (the sidecar imports it
at start). The static check of the same boundary is tests/unit/test_contract.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.unit.test_contract import ROOT, _within


def _loaded_modules(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, check=True, timeout=60).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize(("side", "other"), [("webhook", "enforcer"), ("enforcer", "webhook")])
def test_loading_every_module_of_one_side_loads_nothing_of_the_other(side: str, other: str) -> None:
    """Also through the modules each imports in turn (the contract, gpufence.logs, ...)."""
    code = (f"import pkgutil, importlib, gpufence.{side} as p\n"
            "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
            "    if not m.name.endswith('__main__'): importlib.import_module(m.name)")
    loaded = _loaded_modules(code)
    assert f"gpufence.{side}.cli" in loaded
    assert [m for m in loaded if _within(m, f"gpufence.{other}")] == []


def test_the_contract_loads_the_standard_library_only() -> None:
    """The enforcer imports it at start, and the webhook on every worker: it must stay light."""
    loaded = _loaded_modules("import gpufence.contract")
    added = set(loaded) - set(_loaded_modules("pass"))  # not what site-packages' start-up hooks load
    assert sorted({m.split(".")[0] for m in added} - set(sys.stdlib_module_names) - {"gpufence"}) == []
    assert [m for m in loaded if _within(m, "gpufence")] == ["gpufence", "gpufence.contract"]
