"""The benchmarks still run: each one's entry point is started as its own process, as ``make bench`` does.

Tests never import ``bench/`` (tests/unit/test_tests_and_bench.py), so a renamed or re-signed function
of gpufence would otherwise break a benchmark unnoticed until someone measures. Every benchmark's
``--help`` imports the module and builds its parser; the in-process benchmark of the review
(``bench.mutation_core``, which calls the core and the server's ``_answer`` directly) runs for real, briefly,
without writing docs/PERFORMANCE.md.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.server_process import REPO_ROOT, child_env

# Every module of bench/ with a command line (the others are helpers they import, or a pytest file).
BENCHMARKS = sorted(
    path.stem for path in (REPO_ROOT / "bench").glob("*.py")
    if "argparse" in path.read_text(encoding="utf-8") and not path.stem.startswith("_")
)


def _run(*argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO_ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_the_benchmark_list_is_found() -> None:
    assert {"mutation_core", "cpu_per_request", "pod_creation", "run_all"} <= set(BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_help(name: str) -> None:
    done = _run(f"bench.{name}", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_mutation_core_runs() -> None:
    done = _run("bench.mutation_core", "--repeats", "1", "--budget", "0.005", "--no-write")
    assert done.returncode == 0, done.stderr
    assert "| typical (3 containers, 30 env, volumes) |" in done.stdout
    assert "| typical, as stored, to verify (/validate) | " in done.stdout and "| verified |" in done.stdout
    assert "Decision log: the server's `_answer`" in done.stdout
