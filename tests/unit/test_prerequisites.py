"""tests/support/prerequisites.py: a missing prerequisite skips, or fails under CI=true; the skips
by design stay skips and are all listed in BY_DESIGN."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.prerequisites import BY_DESIGN, missing, require, skip_by_design

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)


@pytest.fixture
def ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")


def test_a_missing_prerequisite_skips_with_its_reason(local: None) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"^promtool not installed$"):
        missing("promtool not installed")


def test_under_ci_it_fails_with_the_same_reason(ci: None) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"^promtool not installed \(CI=true: .*does not skip\)$"):
        missing("promtool not installed")


@pytest.mark.parametrize("value", ["false", "", "0"])
def test_other_values_of_ci_skip(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception):
        missing("promtool not installed")


def test_require_passes_when_the_condition_holds(ci: None) -> None:
    require(True, "never said")
    with pytest.raises(pytest.fail.Exception, match="needs root"):
        require(False, "needs root")


def test_a_skip_by_design_stays_a_skip_under_ci(ci: None) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"^no torch here \[by design in CI: torch\]$"):
        skip_by_design("torch", "no torch here")


def test_a_skip_by_design_must_be_listed(local: None) -> None:
    with pytest.raises(KeyError, match=r"skip_by_design\('gpus'\): not in BY_DESIGN .*e\.g\. 'gpu'"):
        skip_by_design("gpus", "no GPU")


def test_every_listed_skip_by_design_is_used_and_no_other() -> None:
    """BY_DESIGN is the one list: each entry is what some test skips for (tests/gpu, not collected
    by pytest, is listed for the record)."""
    calls = re.compile(r"skip_by_design\(\s*\"([^\"]+)\"")
    used = {key for path in TESTS.rglob("*.py") if path.name != Path(__file__).name
            for key in calls.findall(path.read_text())}  # fmt: skip
    assert used | {"gpu"} == set(BY_DESIGN)
