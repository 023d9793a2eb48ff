"""The heartbeat check of the sidecar's exec probe (gpufence/enforcer/probe.py) where no running
enforcer is needed: a heartbeat that names the probe itself or is malformed, the liveness rule it
carries, and the postStart hook giving up. A heartbeat naming a running process (a child standing
in for the enforcer) is in tests/integration/enforcer/test_probe_heartbeat.py; stopped and gone
processes, and the real enforcer, in tests/integration/enforcer/test_probe.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufence import contract
from gpufence.enforcer import probe
from gpufence.enforcer.report.health import HEARTBEAT_STALE_AFTER_SECONDS, Health
from tests.support.heartbeats import write_heartbeat


def test_a_heartbeat_naming_the_probe_itself_fails(tmp_path: Path) -> None:
    write_heartbeat(tmp_path, os.getpid())
    ok, why = probe.check(str(tmp_path))
    assert not ok and "not an enforcer" in why


@pytest.mark.parametrize("text", ["", "gpufence-heartbeat 2 1 1.0 5.0 1 1\n", "9401\n", "gpufence-heartbeat 1 1\n",
                                  "gpufence-heartbeat 1 yes 1.0 5.0 1 1\n", "\xff\xfe"])
def test_a_malformed_heartbeat_fails(tmp_path: Path, text: str) -> None:
    (tmp_path / probe.HEARTBEAT_FILE).write_text(text, errors="surrogateescape")
    ok, why = probe.check(str(tmp_path))
    assert not ok and "malformed" in why


def test_the_probe_names_the_contracts_state_directory_variable_and_default() -> None:
    assert probe._ENV_STATE_DIR == contract.ENV_STATE_DIR
    assert probe._DEFAULT_STATE_DIR == contract.DEFAULT_STATE_DIR


def test_the_heartbeat_carries_the_liveness_rule_and_the_degraded_states() -> None:
    clock = [100.0]
    health = Health(0.5, clock=lambda: clock[0])
    health.tick_completed()
    assert health.heartbeat() == (True, "ok; not ready: NVML is not available")
    health.nvml(True)
    health.poll_succeeded()
    health.serving_failed("cannot serve on 0.0.0.0:9401: Address already in use")
    assert health.heartbeat() == (True, "ok; no /metrics, /healthz, /readyz: cannot serve on 0.0.0.0:9401: "
                                        "Address already in use")
    clock[0] += 10  # no tick for 10 s: the liveness rule, carried as it is
    live, detail = health.heartbeat()
    assert not live and detail.startswith("the poll loop has not completed a tick")
    assert HEARTBEAT_STALE_AFTER_SECONDS < 10  # a stopped enforcer is seen within one liveness period


# --- the postStart hook (probe.wait_until_up) ----------------------------------------------------


def test_the_hook_gives_up_when_the_enforcer_is_gone(tmp_path: Path, capsys) -> None:
    """The kubelet waits for the hook before it acts on anything else in the pod: an enforcer that
    exited before it was up must not hold the pod for the whole timeout."""
    looks: list[bool] = []

    def gone() -> bool:
        looks.append(False)
        return False

    assert probe.wait_until_up(str(tmp_path), timeout=60, step=0.01, alive=gone) == 1
    assert len(looks) == 1
    out = capsys.readouterr().out
    assert "the enforcer exited before it was up" in out and "has not started" in out, out


def test_the_hook_gives_up_after_its_timeout_while_the_enforcer_runs(tmp_path: Path, capsys) -> None:
    assert probe.wait_until_up(str(tmp_path), timeout=0.05, step=0.01, alive=lambda: True) == 1
    assert "was not up within 0.05s" in capsys.readouterr().out
