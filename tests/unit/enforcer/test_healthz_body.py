"""The /healthz body: the liveness reason first (what people and older checks read), then the
mechanism holding each container's memory share, by container name."""

from __future__ import annotations

from gpufence.enforcer.report.health import Health, healthz_body


def test_liveness_line_then_one_line_per_container_sorted():
    health = Health(1.0)
    health.memory_enforcement("train", "polling")
    health.memory_enforcement("eval", "driver")
    health.memory_enforcement("train", "driver")  # a change replaces the container's line
    assert healthz_body("ok", health.memory_mechanisms()) == "ok\nmemory eval: driver\nmemory train: driver\n"


def test_before_any_container_is_resolved_only_the_liveness_line():
    assert healthz_body("the poll loop has not completed a tick", Health(1.0).memory_mechanisms()) == (
        "the poll loop has not completed a tick\n"
    )
