"""One log format for the three programs (gpufence/logs.py), and the webhook's decision log."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufence.logs import JsonFormatter, log_event, utc_timestamp
from gpufence.webhook import server
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings
from tests.support.tlsutil import gpu_pod, pod_review

ROOT = Path(__file__).resolve().parents[2]
TIME_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
LEVELS = {"debug", "info", "warning", "error"}


def assert_shape(line: str) -> dict[str, Any]:
    record = json.loads(line)
    assert list(record)[:3] == ["time", "level", "event"], line
    assert TIME_RE.fullmatch(record["time"]), record["time"]
    assert record["level"] in LEVELS and re.fullmatch(r"[a-z][a-z0-9_]*", record["event"]), line
    assert None not in record.values()
    return record


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)


def test_utc_timestamp() -> None:
    assert utc_timestamp(0) == "1970-01-01T00:00:00.000Z"
    assert utc_timestamp(1_796_000_000.9876) == "2026-11-30T00:53:20.987Z"  # truncated, as datetime does
    now = dt.datetime.fromisoformat(utc_timestamp().replace("Z", "+00:00"))
    assert abs((dt.datetime.now(dt.UTC) - now).total_seconds()) < 5


def test_startup_errors_of_all_three_programs_share_the_shape(tmp_path: Path) -> None:
    webhook = run(["-m", "gpufence.webhook", f"--tls-cert-file={tmp_path}/none.crt",
                   f"--tls-private-key-file={tmp_path}/k", "--port=0", "--bind-address=127.0.0.1"])  # fmt: skip
    assert webhook.returncode == 1
    (failed,) = [assert_shape(line) for line in webhook.stderr.splitlines()
                 if json.loads(line)["event"] == "startup_failed"]  # fmt: skip
    assert failed["level"] == "error" and "none.crt" in failed["error"]

    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")  # as the kubelet creates it
    enforcer = run(["-m", "gpufence.enforcer", "--config", str(tmp_path / "missing.json"),
                    "--termination-log", str(termination_log)])
    assert enforcer.returncode == 2 and enforcer.stdout == ""
    (invalid,) = [assert_shape(line) for line in enforcer.stderr.splitlines()]
    assert invalid["event"] == "config_invalid" and "missing.json" in invalid["error"]
    # The same reason is the container's termination message (the kubelet's file, never created).
    assert termination_log.read_text() == f"config_invalid: {invalid['error']}"
    absent = tmp_path / "no-such-termination-log"
    again = run(["-m", "gpufence.enforcer", "--config", str(tmp_path / "missing.json"),
                 "--termination-log", str(absent)])
    assert again.returncode == 2 and not absent.exists()

    certs = run(["-m", "gpufence.certs", "inspect", "--cert-file", str(tmp_path / "missing.pem")])
    assert certs.returncode != 0
    records = [assert_shape(line) for line in certs.stderr.splitlines() if line.startswith("{")]
    assert [r["event"] for r in records] == ["error"] and "missing.pem" in records[0]["message"]


def test_certs_success_lines_share_the_shape(tmp_path: Path) -> None:
    result = run(["-m", "gpufence.certs", "generate", "--out-dir", str(tmp_path / "out")])
    assert result.returncode == 0, result.stderr
    (record,) = [assert_shape(line) for line in result.stderr.splitlines()]
    assert record["event"] == "certificates_generated" and record["level"] == "info"


def test_library_records_become_event_log() -> None:
    record = logging.LogRecord("aiohttp.server", logging.WARNING, __file__, 1, "odd %s", ("peer",), None)
    line = assert_shape(JsonFormatter().format(record))
    assert line["event"] == "log" and line["message"] == "odd peer" and line["logger"] == "aiohttp.server"


# ---------------------------------------------------------------------------------------------
# The webhook's decisions


@pytest.fixture
def decisions() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("webhook.decisions")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def answer(review: dict[str, Any]) -> str:
    # server.review looked up at each call: a test may replace it.
    outcome, _ = server._answer(json.loads(json.dumps(review)), server.review, InjectionSettings(),
                                AllNamespacesOptedIn())
    return outcome


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [assert_shape(line) for line in stream.getvalue().splitlines()]


def test_mutation_is_logged_with_namespace_pod_uid(decisions: io.StringIO) -> None:
    assert answer(pod_review("uid-42")) == "mutated"
    (record,) = lines(decisions)
    assert record["event"] == "pod_mutated" and record["level"] == "info" and record["decision"] == "mutated"
    assert (record["namespace"], record["pod"], record["uid"]) == ("team-a", "train", "uid-42")
    assert record["user"] == "tester"
    assert "reason" not in record and "generate_name" not in record


def test_denial_is_logged_with_its_reason(decisions: io.StringIO) -> None:
    pod = gpu_pod()
    pod["metadata"]["annotations"]["gpufence.io/memory"] = "lots"
    del pod["metadata"]["name"]
    pod["metadata"]["generateName"] = "train-7f9c-"
    review = pod_review("uid-7", pod=pod)
    review["request"]["name"] = ""
    assert answer(review) == "denied"
    (record,) = lines(decisions)
    assert record["event"] == "pod_denied" and record["decision"] == "denied"
    assert record["generate_name"] == "train-7f9c-" and "pod" not in record and record["uid"] == "uid-7"
    assert "lots" in record["reason"]


def test_skipped_pods_are_debug_only(decisions: io.StringIO) -> None:
    pod = gpu_pod()
    # A mirror pod: the webhook never touches those (a pod without GPUs is mutated now, to void
    # its NVIDIA_VISIBLE_DEVICES).
    pod["metadata"].setdefault("annotations", {})["kubernetes.io/config.mirror"] = "abc"
    review = pod_review(pod=pod)
    review["request"]["userInfo"]["username"] = "system:node:gpu-node-1"  # only a node's mirror is one
    assert answer(review) == "skipped"
    assert lines(decisions) == []
    logging.getLogger("webhook.decisions").setLevel(logging.DEBUG)
    assert answer(review) == "skipped"
    assert [r["event"] for r in lines(decisions)] == ["pod_skipped"]


def test_a_failing_review_names_the_pod(decisions: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr("gpufence.webhook.server.review", broken)
    with pytest.raises(RuntimeError):
        answer(pod_review("uid-9"))
    (record,) = lines(decisions)
    assert record["event"] == "review_failed" and record["level"] == "error"
    assert (record["pod"], record["uid"], record["error"]) == ("train", "uid-9", "RuntimeError: bug")


def test_log_event_builds_nothing_when_the_level_is_off() -> None:
    logger = logging.getLogger("gpufence.test.off")
    logger.setLevel(logging.WARNING)

    class Exploding:
        def __str__(self) -> str:
            raise AssertionError("formatted although the level is off")

    log_event(logger, "quiet", logging.INFO, value=Exploding())
