"""The webhook's default bounds on clients (gpufence/webhook/server.py ``ServerLimits``)."""

from __future__ import annotations

from gpufence.webhook.server import ServerLimits


def test_default_limits_bound_every_stall():
    d = ServerLimits()
    assert 0 < d.handshake_timeout <= 30 and 0 < d.header_timeout <= 60 and 0 < d.body_timeout <= 30
    assert 0 <= d.lingering_time <= 10 and d.max_body_bytes <= 16 << 20
