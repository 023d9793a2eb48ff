"""The enforcer turns the webhook's recorded warnings into Events (gpufence/enforcer/report/events.py)."""

from __future__ import annotations

import io
import json

import pytest

from gpufence.enforcer.report.decision_log import DecisionLog
from gpufence.enforcer.report.events import ADMISSION_WARNING_REASON, report_admission_warnings, warnings_from_status


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def record(self, reason: str, message: str, *, event_type: str = "Warning", action: str = "") -> None:
        self.events.append((reason, message, event_type))


@pytest.mark.parametrize("text", [None, "", "not json", "[]", '{"warnings": "x"}', '{"containers": ["a"]}'])
def test_no_warnings(text: str | None) -> None:
    assert warnings_from_status(text) == []


def test_each_recorded_warning_becomes_a_warning_event_and_a_log_line() -> None:
    status = json.dumps({"containers": ["llm"], "warnings": ["container \"llm\": vLLM ... use 0.25", 7, "second"]})
    out = io.StringIO()
    recorder = Recorder()
    assert report_admission_warnings(DecisionLog(namespace="ns", pod="p", stream=out), recorder, status) == 2
    assert recorder.events == [(ADMISSION_WARNING_REASON, 'container "llm": vLLM ... use 0.25', "Warning"),
                               (ADMISSION_WARNING_REASON, "second", "Warning")]
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["admission_warning", "admission_warning"]
    assert lines[1]["detail"] == "second"
