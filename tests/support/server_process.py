"""A server as a child process on a free loopback port: the real webhook CLI (``python -m
gpufence.webhook``) serving a test PKI's Secret volume, or another server (the benchmarks' floor).
Optionally pinned to CPUs, so a benchmark can keep it apart from its load generator."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.tlsutil import LocalPKI

REPO_ROOT = Path(__file__).resolve().parents[2]


def cpu_plan() -> tuple[set[int] | None, set[int] | None]:
    """(server CPUs, load generator CPUs): disjoint when there are at least two CPUs, else (None, None)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:2])


def pin(pid: int, cpus: set[int] | None) -> None:
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cpus)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout}s")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFENCE_", "KUBERNETES_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["KUBECONFIG"] = os.devnull  # never a real cluster: all namespaces opted in
    return env


@contextlib.contextmanager
def gpufence_server(pki: LocalPKI, *, cpus: set[int] | None = None, reload_interval: str = "1s",
                    log_path: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``python -m gpufence.webhook`` on 127.0.0.1 (a free port) serving ``pki``'s Secret volume."""
    port = free_port()
    argv = [sys.executable, "-m", "gpufence.webhook", "--port", str(port), "--bind-address", "127.0.0.1",
            "--shutdown-delay", "0",
            "--tls-cert-file", str(pki.volume.cert_file), "--tls-private-key-file", str(pki.volume.key_file),
            "--cert-reload-interval", reload_interval, "--log-level", "warning"]
    with serve(argv, port, cpus, log_path) as proc:
        yield proc, port


@contextlib.contextmanager
def serve(argv: list[str], port: int, cpus: set[int] | None,
          log_path: Path | None) -> Iterator[subprocess.Popen[bytes]]:
    """Runs ``argv`` (a server that listens on ``port``) until the block ends; its output to ``log_path``."""
    log = open(log_path or os.devnull, "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=child_env(), stdout=log, stderr=log)
    try:
        pin(proc.pid, cpus)
        wait_listening(port, proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()
