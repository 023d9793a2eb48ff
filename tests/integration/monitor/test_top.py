"""``gpufence top`` on the scenario's real scrapes (conftest.py): ``--once``, ``-o json``, and the live
screen in a terminal (tmux) as a person runs it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.integration.monitor.conftest import DEADLINE, GIB, MIB, ROOT, Scenario
from tests.support.prerequisites import needs
from tests.support.prometheus import MISSING, prometheus_binary

pytestmark = [needs(prometheus_binary() is not None, MISSING), pytest.mark.timeout(300)]

T, G, R = "team-a/train-5c8f9d7b6d-q2w4x", "team-a/greedy-0", "team-b/render-6b7c9f8d5-zx9kp"
E, A = "team-a/eager-5d7f8c9b6-m4n7q", "team-b/etl-7f9c6d5b8-k4m2p"


def gpufence(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufence.monitor", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def row(text: str, pod: str, container: str) -> str:
    lines = [line for line in text.splitlines() if line.split()[:2] == [pod, container]]
    assert len(lines) == 1, (pod, container, text)
    return " ".join(lines[0].split())


def check_screen(text: str) -> None:
    assert "2 GPUs, 5 pods, 5 containers, 1 over their memory share, 1 throttled" in text
    assert "node-a  GPU 0  GPU-0  used 6.5 GiB by 1 pod, budgets 8.0 GiB" in text
    assert "node-b  GPU 0  GPU-1  used 7.0 GiB by 2 pods, budgets 8.0 GiB" in text
    assert "node-a  no GPU process now" in text
    assert row(text, T, "trainer") == f"{T} trainer 6.0 GiB / 8.0 GiB [########..] 40% 50% polling no -"
    assert row(text, R, "render") == \
        f"{R} render 2.0 GiB / 4.0 GiB [#####.....] 90% 30% polling yes throttle_start compute x1"
    assert row(text, G, "loader") == f"{G} loader no GPU process - - polling no sigkill memory x1, sigterm memory x1"
    assert row(text, E, "jax") == f"{E} jax no GPU process - - polling no sigterm memory x1"
    # Audit mode: over both shares, counted, never signalled nor throttled.
    assert row(text, A, "etl") == \
        f"{A} etl 5.0 GiB / 4.0 GiB [##########]! 35% 20% polling no audit compute x1, audit memory x1"
    assert row(text, T, "(unattributed:") == f"{T} (unattributed: 1 process) 512.0 MiB -"
    assert "team-b/broken-0 on node-b: NVML down, never polled NVML successfully" in text


def test_top_once(scenario: Scenario) -> None:
    result = gpufence("top", "--prometheus", scenario.prometheus.url, "--once")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("gpufence top  ") and f"from Prometheus {scenario.prometheus.url}" in \
        result.stdout.splitlines()[0]
    check_screen(result.stdout)


def test_top_once_filters_by_namespace_and_node(scenario: Scenario) -> None:
    result = gpufence("top", "--prometheus", scenario.prometheus.url, "--once", "-n", "team-b", "--node", "node-b")
    assert result.returncode == 0, result.stderr
    assert " render " in result.stdout and "trainer" not in result.stdout and "loader" not in result.stdout


def test_top_json(scenario: Scenario) -> None:
    result = gpufence("top", "--prometheus", scenario.prometheus.url, "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    gpus = {(g["node"], g["uuid"]): g for g in doc["gpus"]}
    assert set(gpus) == {("node-a", "GPU-0"), ("node-a", ""), ("node-b", "GPU-1")}
    (trainer,) = gpus["node-a", "GPU-0"]["containers"]
    assert {k: trainer[k] for k in ("pod", "container", "used_bytes", "limit_bytes", "sm_ratio", "compute_share",
                                    "throttled", "mechanism", "gpu")} == {
        "pod": "train-5c8f9d7b6d-q2w4x", "container": "trainer", "used_bytes": 6 * GIB, "limit_bytes": 8 * GIB,
        "sm_ratio": 0.4, "compute_share": 0.5, "throttled": False, "mechanism": "polling", "gpu": "0"}
    (pod,) = gpus["node-a", "GPU-0"]["pods"]
    assert (pod["used_bytes"], pod["unattributed_bytes"], pod["unattributed_processes"], pod["budget_bytes"]) == \
        (6 * GIB + 512 * MIB, 512 * MIB, 1, 8 * GIB)
    render = next(c for c in gpus["node-b", "GPU-1"]["containers"] if c["container"] == "render")
    assert (render["sm_ratio"], render["compute_share"], render["throttled"]) == (0.9, 0.3, True)
    assert render["actions"] == [{"action": "throttle_start", "resource": "compute", "count": 1.0}]
    loader, _ = sorted(gpus["node-a", ""]["containers"], key=lambda c: c["container"] != "loader")
    assert {(a["action"], a["resource"], a["count"]) for a in loader["actions"]} == \
        {("sigterm", "memory", 1.0), ("sigkill", "memory", 1.0)}
    enforcers = {e["pod"]: e for e in doc["enforcers"]}
    assert {p: e["nvml_up"] for p, e in enforcers.items()} == {
        "train-5c8f9d7b6d-q2w4x": True, "greedy-0": True, "render-6b7c9f8d5-zx9kp": True, "broken-0": False,
        "eager-5d7f8c9b6-m4n7q": True, "etl-7f9c6d5b8-k4m2p": True}
    assert all(time.time() - e["last_poll"] < 30 for p, e in enforcers.items() if p != "broken-0")


def test_top_says_why_when_prometheus_cannot_be_read() -> None:
    result = gpufence("top", "--prometheus", "http://127.0.0.1:9", "--once")
    assert result.returncode == 1
    assert "! cannot query Prometheus at http://127.0.0.1:9" in result.stdout


# --- in a terminal --------------------------------------------------------------------------------


class Tmux:
    """A tmux server of our own (its own socket), killed at the end."""

    def __init__(self) -> None:
        self.socket = f"gpufence-test-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30,
                              check=check)

    def screen(self, target: str) -> str:
        return self("capture-pane", "-p", "-t", target).stdout

    def wait_screen(self, target: str, predicate, what: str) -> str:
        deadline = time.monotonic() + DEADLINE
        while True:
            text = self.screen(target)
            if predicate(text):
                return text
            assert time.monotonic() < deadline, f"{what}: screen after {DEADLINE}s:\n{text}"
            time.sleep(0.1)


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        from tests.support.prerequisites import missing

        missing("tmux not installed (Debian/Ubuntu: apt-get install tmux)")
    server = Tmux()
    try:
        yield server
    finally:
        server("kill-server", check=False)


@needs(shutil.which("tmux") is not None, "tmux not installed (Debian/Ubuntu: apt-get install tmux)")
def test_top_in_a_terminal_refreshes_in_place_and_quits_on_q(scenario: Scenario, tmux: Tmux) -> None:
    command = f"{sys.executable} -m gpufence.monitor top --prometheus {scenario.prometheus.url} --interval 0.5"
    tmux("new-session", "-d", "-s", "top", "-x", "170", "-y", "40", "-c", str(ROOT), command)
    first = tmux.wait_screen("top", lambda s: "q to quit" in s, "the first screen")
    lines = first.splitlines()
    assert lines[0].startswith("gpufence top  ")  # drawn from the top-left corner, not scrolled
    check_screen(first)
    # Refreshed in place: the clock in the first line moves on, the screen keeps one copy of each row.
    stamp = lines[0].split()[2:4]
    again = tmux.wait_screen("top", lambda s: s.splitlines()[0].split()[2:4] != stamp, "a refresh")
    check_screen(again)
    assert again.count("gpufence top") == 1 and again.count(" trainer ") == 1 and again.count(" etl ") == 1
    if os.environ.get("GPUFENCE_TOP_CAPTURE"):  # for docs/monitoring.md
        pathlib.Path(os.environ["GPUFENCE_TOP_CAPTURE"]).write_text(again)
    tmux("send-keys", "-t", "top", "q")
    deadline = time.monotonic() + DEADLINE
    while tmux("has-session", "-t", "top", check=False).returncode == 0:
        assert time.monotonic() < deadline, f"still running after q:\n{tmux.screen('top')}"
        time.sleep(0.1)
