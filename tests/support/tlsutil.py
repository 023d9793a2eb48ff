"""The test PKI (a CA and serving certs in a Kubernetes-style Secret volume, used by the tests and the
benchmarks alike), and the webhook in process."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufence.certs.pki import KeyPair, make_ca, make_serving_cert
from gpufence.webhook.client import pod_admission_review
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings, NamespaceLookup
from gpufence.webhook.metrics import WebhookMetrics
from gpufence.webhook.server import RunningServer, ServerLimits, create_app, start_server
from gpufence.webhook.tls import CertReloader

SANS = ["localhost", "127.0.0.1"]
# Short bounds so timeout tests take a fraction of a second.
FAST_LIMITS = ServerLimits(handshake_timeout=0.5, header_timeout=0.5, body_timeout=0.5, lingering_time=0.2,
                           shutdown_timeout=5.0)


class SecretVolume:
    """A directory laid out like a mounted Secret: tls.crt -> ..data/tls.crt, ..data -> ..<version>.

    ``write`` swaps ``..data`` atomically as the kubelet does, so the tls.crt symlink never changes.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0
        root.mkdir(parents=True, exist_ok=True)

    @property
    def cert_file(self) -> Path:
        return self.root / "tls.crt"

    @property
    def key_file(self) -> Path:
        return self.root / "tls.key"

    def write(self, cert_pem: bytes, key_pem: bytes) -> None:
        self.version += 1
        versioned = self.root / f"..v{self.version}"
        versioned.mkdir()
        (versioned / "tls.crt").write_bytes(cert_pem)
        (versioned / "tls.key").write_bytes(key_pem)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(versioned.name)
        os.replace(tmp, self.root / "..data")
        for name in ("tls.crt", "tls.key"):
            if not (self.root / name).is_symlink():
                (self.root / name).symlink_to(f"..data/{name}")


@dataclass
class LocalPKI:
    ca: KeyPair
    ca_file: Path
    volume: SecretVolume
    serving: KeyPair

    @property
    def serial(self) -> int:
        """The serial of the serving certificate now in the volume."""
        return self.serving.cert.serial_number

    def new_pair(self) -> KeyPair:
        return make_serving_cert(self.ca, SANS)

    def rotate(self, pair: KeyPair | None = None) -> KeyPair:
        pair = pair or self.new_pair()
        self.volume.write(pair.cert_pem, pair.key_pem)
        self.serving = pair
        return pair

    def write_broken(self) -> None:
        """A cert whose key does not match: what a half-finished manual rotation looks like."""
        self.volume.write(self.new_pair().cert_pem, self.new_pair().key_pem)

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
        return ctx


def make_pki(root: Path) -> LocalPKI:
    """A new CA (``root/ca.crt``) and a serving pair for localhost/127.0.0.1 in ``root/secret``."""
    root.mkdir(parents=True, exist_ok=True)
    ca = make_ca()
    ca_file = root / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    volume = SecretVolume(root / "secret")
    pki = LocalPKI(ca, ca_file, volume, make_serving_cert(ca, SANS))
    pki.rotate(pki.serving)
    return pki


@dataclass
class Webhook:
    running: RunningServer
    reloader: CertReloader
    metrics: WebhookMetrics

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@asynccontextmanager
async def running_webhook(pki: LocalPKI, *, limits: ServerLimits = FAST_LIMITS,
                          namespaces: NamespaceLookup | None = None,
                          settings: InjectionSettings | None = None,
                          reload_interval: float = 0.05) -> AsyncIterator[Webhook]:
    reloader = CertReloader(pki.volume.cert_file, pki.volume.key_file, interval=reload_interval)
    metrics = WebhookMetrics()
    app = create_app(settings or InjectionSettings(), namespaces or AllNamespacesOptedIn(), reloader,
                     limits=limits, metrics=metrics)
    running = await start_server(app, host="127.0.0.1", port=0)
    try:
        yield Webhook(running, reloader, metrics)
    finally:
        await running.close()


async def peer_serial(port: int, ctx: ssl.SSLContext, server_hostname: str = "localhost") -> int:
    """The serial of the certificate a *new* handshake sees (verified against the test CA)."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=server_hostname)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


async def wait_until(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    """Wait for a condition driven by other tasks on this loop (yields; not a timed guess)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def pod_review(uid: str = "uid-1", *, pod: dict[str, Any] | None = None, operation: str = "CREATE",
               kind: str = "Pod", namespace: str = "team-a") -> dict[str, Any]:
    pod = pod if pod is not None else gpu_pod()
    return pod_admission_review(pod, uid=uid, namespace=namespace, operation=operation, kind=kind, username="tester")


def gpu_pod(name: str = "train") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a",
                     "annotations": {"gpufence.io/memory": "4Gi", "gpufence.io/compute": "50"}},
        "spec": {"containers": [{"name": "train", "image": "pytorch:latest",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }
