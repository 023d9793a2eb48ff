"""The serving certificate: a TLS context that follows the cert/key files as they rotate.

Kubernetes Secret volumes rotate by swapping a ``..data`` symlink, so the ``tls.crt`` path (a
symlink) keeps its own mtime forever. We therefore poll the *contents* of both files and, when
their hash changes, load the new pair into a throwaway ``SSLContext``. Only a pair that loads
is switched in, atomically, through an ``sni_callback`` that points each new handshake at the
current context: established connections (and the requests on them) keep the context they
handshook with. ``load_cert_chain`` on the live context is never called, because a broken pair
would leave it without a usable key (measured with aiohttp 3.14 on OpenSSL 3; tests/integration/webhook/test_tls.py
reloads a broken pair and checks that handshakes keep working).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from gpufence.logs import log_event
from gpufence.webhook.flags import DEFAULT_RELOAD_INTERVAL_SECONDS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedPair:
    context: ssl.SSLContext
    cert: x509.Certificate
    digest: str


def new_server_context() -> ssl.SSLContext:
    """A server context with our protocol policy and no certificate yet."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # HTTP/1.1 only (aiohttp); advertising it lets HTTP/2-preferring clients settle quickly.
    ctx.set_alpn_protocols(["http/1.1"])
    # No session tickets: the API server's webhook client (client-go) keeps no session cache, so it
    # never resumes a session, and OpenSSL would otherwise mint and send two tickets after every
    # TLS 1.3 handshake. TLS 1.2 clients get no ticket either (OP_NO_TICKET).
    ctx.num_tickets = 0
    ctx.options |= ssl.OP_NO_TICKET
    return ctx


def _digest(cert_file: Path, key_file: Path) -> tuple[str, bytes]:
    cert_pem = cert_file.read_bytes()
    key_pem = key_file.read_bytes()
    h = hashlib.sha256(cert_pem)
    h.update(b"\0")
    h.update(key_pem)
    return h.hexdigest(), cert_pem


def load_pair(cert_file: Path, key_file: Path) -> LoadedPair:
    """Load the pair into a fresh context; raise (ssl.SSLError, OSError, ValueError) if it is unusable.

    The files are hashed before and after loading: a rotation landing between the two reads
    would otherwise pair the digest of one version with the content of another.
    """
    before, cert_pem = _digest(cert_file, key_file)
    ctx = new_server_context()
    ctx.load_cert_chain(cert_file, key_file)  # raises on a key that does not match the cert
    after, _ = _digest(cert_file, key_file)
    if before != after:
        raise ValueError("certificate files changed while loading; will retry")
    return LoadedPair(ctx, x509.load_pem_x509_certificate(cert_pem), before)


class CertReloader:
    """Owns the listening ``SSLContext`` and keeps it serving the newest loadable pair.

    ``server_context`` is what the listener is created with; ``run()`` polls the files.
    Counters and ``wait_attempts`` let metrics and tests observe reloads without sleeping.
    """

    def __init__(self, cert_file: str | Path, key_file: str | Path, *,
                 interval: float = DEFAULT_RELOAD_INTERVAL_SECONDS) -> None:
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.interval = interval
        first = load_pair(self.cert_file, self.key_file)  # no fallback at start: fail loudly
        self._current = first
        self._last_seen = first.digest  # digest of the last attempt, good or bad
        self.server_context = first.context
        self.server_context.sni_callback = self._select_context
        self.successes = 0
        self.failures = 0
        self._attempted = asyncio.Condition()
        self._attempts = 0

    @property
    def cert(self) -> x509.Certificate:
        return self._current.cert

    @property
    def attempts(self) -> int:
        """Reload attempts so far (successful or not); the initial load is not one."""
        return self._attempts

    def _select_context(self, ssl_object: ssl.SSLObject, _server_name: str | None,
                        _ctx: ssl.SSLContext) -> None:
        # OpenSSL calls this for every ClientHello, with or without SNI.
        current = self._current.context
        if ssl_object.context is not current:
            ssl_object.context = current

    async def check(self) -> bool | None:
        """Poll once: None when unchanged, True when a new pair was switched in, False when it was refused."""
        try:
            digest, _ = await asyncio.to_thread(_digest, self.cert_file, self.key_file)
        except OSError as exc:
            # Mid-rotation a path can briefly be missing; not a new pair yet.
            log_event(log, "certificate_unreadable", logging.WARNING, error=str(exc))
            return None
        if digest == self._last_seen:
            return None
        self._last_seen = digest
        try:
            pair = await asyncio.to_thread(load_pair, self.cert_file, self.key_file)
        except (ssl.SSLError, OSError, ValueError) as exc:
            self.failures += 1
            log_event(log, "certificate_reload_failed", logging.ERROR, error=str(exc),
                      serial=format(self.cert.serial_number, "x"), message="still serving the previous certificate")
            await self._attempt_done()
            return False
        self._current = pair
        self._last_seen = pair.digest
        self.successes += 1
        log_event(log, "certificate_reloaded", serial=format(pair.cert.serial_number, "x"),
                  not_after=pair.cert.not_valid_after_utc.isoformat())
        await self._attempt_done()
        return True

    async def _attempt_done(self) -> None:
        async with self._attempted:
            self._attempts += 1
            self._attempted.notify_all()

    async def wait_attempts(self, count: int) -> None:
        """Wait until at least ``count`` reload attempts have finished."""
        async with self._attempted:
            await self._attempted.wait_for(lambda: self._attempts >= count)

    async def run(self) -> None:
        """Poll forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:  # a bug here must not stop future reloads
                log_event(log, "certificate_check_crashed", logging.ERROR, exc_info=True)
