"""The monitor reads the enforcer's metric names from gpufence.metric_names: loading all of it loads
neither the webhook nor the enforcer (in a real interpreter, as tests/integration/test_contract_imports.py)."""

from __future__ import annotations

from tests.integration.test_contract_imports import _loaded_modules
from tests.unit.test_contract import _within


def test_the_monitor_loads_neither_the_webhook_nor_the_enforcer() -> None:
    code = ("import pkgutil, importlib, gpufence.monitor as p\n"
            "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
            "    if not m.name.endswith('__main__'): importlib.import_module(m.name)")
    loaded = _loaded_modules(code)
    assert "gpufence.monitor.cli" in loaded
    assert [m for m in loaded if _within(m, "gpufence.webhook") or _within(m, "gpufence.enforcer")] == []


def test_the_metric_names_load_the_standard_library_only() -> None:
    loaded = _loaded_modules("import gpufence.metric_names")
    assert [m for m in loaded if _within(m, "gpufence")] == ["gpufence", "gpufence.metric_names"]
