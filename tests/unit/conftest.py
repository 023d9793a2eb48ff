"""tests/unit holds the pure tests (``make unit``): no child process and no network, so the fast
loop stays fast and means the same on every machine. A test that starts a process or opens a
socket belongs in tests/integration; here it fails and says so."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

WHY = "tests/unit is for pure tests (no child processes, no network): put this test in tests/integration"


def _refuse(what: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{what}: {WHY}")

    return refused


@pytest.fixture(autouse=True)
def _pure(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a child process"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("a network connection"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("a network connection"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("a listening socket"))
    yield
