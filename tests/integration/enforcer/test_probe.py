"""``gpufence-enforcer --probe``: the exec probe for sidecars that bind a free port (hostNetwork pods,
or a pod with a container on the metrics port). A real enforcer process, a real probe process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.enforcer_harness import REPO_ROOT, GpuSandbox


def run_probe(state_dir: Path | None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gpufence.enforcer", "--probe"]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir)]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, env={})


def test_probe_follows_the_running_enforcer_on_the_port_it_picked(gpu: GpuSandbox, make_config) -> None:
    assert run_probe(gpu.state_dir).returncode == 1, "no enforcer yet: the probe must fail"
    enforcer = gpu.enforcer(make_config({"train": {"memoryBytes": 1 << 30}}))  # --metrics-port 0: any free port
    started = enforcer.wait_started()
    assert (gpu.state_dir / "http-port").read_text().strip() == str(started["metrics_port"])
    result = run_probe(gpu.state_dir)
    assert result.returncode == 0, result.stderr

    enforcer.stop()
    result = run_probe(gpu.state_dir)
    assert result.returncode == 1 and "unreachable" in result.stderr


def test_probe_without_a_state_dir_says_so() -> None:
    result = run_probe(None)
    assert result.returncode == 1 and "state-dir" in result.stderr
