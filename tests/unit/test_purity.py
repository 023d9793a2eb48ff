"""The boundary of tests/unit (its conftest.py) holds: what would make a test impure fails it."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest


def test_a_child_process_is_refused() -> None:
    with pytest.raises(AssertionError, match="put this test in tests/integration"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_an_asyncio_child_process_is_refused() -> None:
    async def spawn() -> None:
        await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")

    with pytest.raises(AssertionError, match="a child process"):
        asyncio.run(spawn())


def test_a_connection_is_refused() -> None:
    with pytest.raises(AssertionError, match="a network connection"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)


def test_a_listening_socket_is_refused() -> None:
    with socket.socket() as sock, pytest.raises(AssertionError, match="a listening socket"):
        sock.bind(("127.0.0.1", 0))
