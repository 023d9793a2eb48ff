"""CI=true turns a missing prerequisite from a skip into a failure with the same reason.

pytest runs in a child process as uid/gid 65534 (nobody), where root is missing: once on the node
tests (the prerequisite checked by a fixture, before any control plane) and once on a test with the
``needs`` mark (checked by the setup hook in tests/conftest.py). Without CI=true the same runs skip
and pass; with it they fail and say why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.prerequisites import needs

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534

pytestmark = [
    needs(os.geteuid() == 0, reason="needs root to run pytest as another user (setpriv --reuid)"),
    needs(shutil.which("setpriv") is not None, reason="needs setpriv (util-linux)"),
]

CASES = {
    "node-fixture": ("tests/e2e/node", "no node: the node (containerd, runc, kubelet) needs root"),
    "needs-mark": ("tests/integration/enforcer/test_signals.py::test_a_failed_sigcont_stays_recorded_and_is_retried",
                   "needs root to take CAP_KILL away and give it back"),
}


def pytest_as_nobody(target: str, home: Path, *, ci: bool) -> subprocess.CompletedProcess[str]:
    home.mkdir(mode=0o777, exist_ok=True)
    home.chmod(0o777)
    # A clean environment: CI comes only from the argument, and PATH has no Go, so that a control
    # plane that started anyway would fail at once (with another reason) rather than build for minutes.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1",
           "GPUFENCE_CACHE": str(home / "cache")}  # fmt: skip
    if ci:
        env["CI"] = "true"
    # DAC_READ_SEARCH (ambient, so the interpreter keeps it) lets the child read an interpreter under
    # root's home (pyenv) and the test tree; the prerequisites look at the uid, which stays 65534.
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
            f"--basetemp={home / 'pytest'}", target]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)


def summary(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("case", CASES)
def test_missing_root_fails_the_run_under_ci_with_the_reason(case: str, tmp_path: Path) -> None:
    target, reason = CASES[case]
    result = pytest_as_nobody(target, tmp_path / "home", ci=True)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert re.fullmatch(r"(\d+ failed, )?\d+ errors? in [\d.]+s|\d+ failed in [\d.]+s", summary(result)), output
    assert f"{reason} (CI=true: a missing prerequisite fails the run, it does not skip)" in output, output


@pytest.mark.parametrize("case", CASES)
def test_missing_root_skips_without_ci(case: str, tmp_path: Path) -> None:
    target, reason = CASES[case]
    result = pytest_as_nobody(target, tmp_path / "home", ci=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.fullmatch(r"\d+ skipped in [\d.]+s", summary(result)), output
    assert "SKIPPED [" in output and reason in output, output
