"""Sustained load over real TLS with two certificate rotations (a short soak, tests/support/soak.py).

A verifying client (its own process) sends mixed valid/invalid AdmissionReviews at 300 req/s for
10 s to ``python -m webhook``, reconnecting every 50 requests so new handshakes meet the rotated
certificates; the Secret volume is rotated twice during the run.
"""

from __future__ import annotations

import pytest

from tests.support.soak import soak

pytestmark = pytest.mark.timeout(90)


def test_sustained_mixed_load_with_two_rotations():
    r = soak(10.0, 300.0, reconnect_every=50, pin_cpus=False)
    assert r["failed"] == 0, r["errors"]
    assert r["status_5xx"] == 0, r["statuses"]
    assert r["handshake_failures"] == 0, r["errors"]
    assert r["sent"] >= 2900  # the generator kept its schedule
    assert set(r["statuses"]) <= {"200", "400"}, r["statuses"]
    assert r["statuses"].get("400", 0) > 0 and r["statuses"].get("200", 0) > 0
    # Every rotated certificate was served to new handshakes, and none failed.
    assert r["serials_seen"] == r["serials_written"], (r["serials"], r["serials_written"])
    assert r["server_errors_logged"] == 0
    # Generous: no growth proportional to the ~3000 requests (a leak of even 10 kB a request shows).
    assert r["rss_end_mb"] < r["rss_warm_mb"] * 1.3 + 15, r
