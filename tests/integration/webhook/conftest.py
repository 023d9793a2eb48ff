"""Fixtures of the webhook's integration tests: the one test PKI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tlsutil import LocalPKI, make_pki


@pytest.fixture
def pki(tmp_path: Path) -> LocalPKI:
    """A fresh CA and serving pair for localhost/127.0.0.1 in a Secret-style volume."""
    return make_pki(tmp_path / "pki")
