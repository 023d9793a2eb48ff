"""Pods keep being created while the webhook's certificate rotates, and while it is killed and restarted.

Invariants, checked on every create: no GPU pod in an opted-in namespace is stored without the
enforcer, nor a non-GPU pod without the void; a pod is refused only while the webhook is down (from
the kill until the restarted process reports ready, plus the API server's reconnect), by the API
server naming the webhook (failurePolicy Fail).
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from kubernetes import client

from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess, cli

# The API server may still try one pooled connection to the dead process after it is ready again.
RECONNECT_SLACK_S = 2.0


@dataclass(frozen=True)
class Attempt:
    started: float
    finished: float
    gpu: bool
    created: kube.Created


class Load:
    def __init__(self, cp: ControlPlane, namespace: str, workers: int = 2) -> None:
        self.namespace = namespace
        self.attempts: list[Attempt] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(kube.api_client(cp.admin_kubeconfig), i % 2 == 0),
                                          daemon=True) for i in range(workers)]

    def _run(self, api: client.ApiClient, gpu: bool) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            created = kube.create_pod(api, self.namespace, kube.gpu_pod() if gpu else kube.plain_pod())
            with self._lock:
                self.attempts.append(Attempt(started, time.monotonic(), gpu, created))
            gpu = not gpu

    def snapshot(self) -> list[Attempt]:
        with self._lock:
            return list(self.attempts)

    def count(self) -> int:
        with self._lock:
            return len(self.attempts)

    def wait_more(self, n: int) -> None:
        target = self.count() + n
        kube.wait_for(lambda: self.count() >= target, f"{n} more creates", timeout=60, interval=0.02)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def serving_serial(hook: WebhookProcess) -> int:
    with socket.create_connection(("127.0.0.1", hook.port), timeout=5) as raw, \
            hook.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def rotate(hook: WebhookProcess, workdir: Path) -> int:
    """Issue a new serving pair under the same CA with the project's tooling and 'mount' it."""
    out = workdir / f"rotation-{hook.secret.version + 1}"
    subprocess.run([cli("gpufence-certs"), "generate", "--out-dir", str(out), "--dns-name", "127.0.0.1",
                    "--ca-cert", str(hook.ca_file), "--ca-key", str(hook.ca_key_file)],
                   check=True, capture_output=True, text=True)
    hook.secret.write((out / "tls.crt").read_bytes(), (out / "tls.key").read_bytes())
    return x509.load_pem_x509_certificate((out / "tls.crt").read_bytes()).serial_number


def check_invariants(attempts: list[Attempt], down: list[tuple[float, float]]) -> None:
    assert attempts, "no pods were created"
    for a in attempts:
        if a.created.admitted and not a.gpu:
            assert all(kube.env_of(c).get("NVIDIA_VISIBLE_DEVICES") == "void"
                       for c in a.created.obj["spec"]["containers"]), "a non-GPU pod was stored without void"
        elif a.created.admitted:
            assert kube.is_mutated(a.created.obj), "a GPU pod was stored without the enforcer"
        else:
            assert kube.WEBHOOK_DOWN in a.created.message and "gpufence.io" in a.created.message, a.created.message
            # In flight at the kill, or sent while the webhook was down.
            assert any(a.finished >= start and a.started <= end + RECONNECT_SLACK_S for start, end in down), (
                f"pod refused while the webhook was up: {a.created.message}")


def test_rotation_and_restart_under_load(cluster: ControlPlane, webhook: WebhookProcess, opted_in: str,
                                         tmp_path: Path):
    down: list[tuple[float, float]] = []
    with Load(cluster, opted_in) as load:
        load.wait_more(10)
        for _ in range(2):
            serial = rotate(webhook, tmp_path)
            kube.wait_for(lambda serial=serial: serving_serial(webhook) == serial, "the webhook to serve the new pair",
                          timeout=30)
            load.wait_more(10)
        killed = time.monotonic()
        webhook.stop("KILL")
        load.wait_more(6)
        webhook.start()
        ready = time.monotonic()
        down.append((killed, ready))
        kube.wait_for(lambda: sum(a.started > ready + RECONNECT_SLACK_S for a in load.snapshot()) >= 10,
                      "creates after the restart", timeout=60, interval=0.05)
    attempts = load.attempts
    check_invariants(attempts, down)
    gpu_after = [a for a in attempts if a.gpu and a.started > down[0][1] + RECONNECT_SLACK_S]
    assert gpu_after and all(a.created.admitted for a in gpu_after)
    refused = [a for a in attempts if not a.created.admitted]
    assert refused, "the API server refused nothing while the webhook was down"
