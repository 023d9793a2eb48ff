"""POST core/v1 Events to the API server with the standard library only.

The enforcer sidecar runs in every GPU pod and posts an Event now and then (a kill, a throttle
start); loading the ``kubernetes`` client for that cost each pod tens of MiB and a large part of its
start-up, mostly where the Events RoleBinding is off and every post is refused. This client is one
``http.client`` request per Event over TLS verified against the service account's ``ca.crt``.

The bearer token is read from its file for every request, and once more after a 401: the kubelet
rotates projected service-account tokens in place, so a token held in memory goes stale.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

if TYPE_CHECKING:
    import http.client

# http.client (with the email package it parses headers with) is imported on the first post, not
# at start: most sidecars never post an Event, and every one of them starts under a CPU limit.

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
USER_AGENT = "gpufence-enforcer"
MAX_RESPONSE_BYTES = 1 << 20  # an Event's echo is a few hundred bytes; never buffer more than this


class CredentialsUnavailable(Exception):
    """No usable service-account token or CA: the recorder stays off."""


class ApiError(Exception):
    """The API server answered with a status other than 2xx."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}" if message else f"HTTP {status} {reason}")
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


class TokenFile:
    """The projected token, read anew on every call (the kubelet swaps it while the pod runs)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> str:
        try:
            token = self.path.read_text().strip()
        except OSError as exc:
            raise CredentialsUnavailable(f"cannot read the service-account token {self.path}: {exc}") from exc
        if not token:
            raise CredentialsUnavailable(f"the service-account token {self.path} is empty")
        return f"Bearer {token}"


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


class EventsApi:
    """``create_event(namespace, body)`` against one API server."""

    def __init__(
        self,
        base_url: str,
        authorization: Callable[[], str | None],
        ssl_context: ssl.SSLContext | None = None,
        *,
        timeout: float = 5.0,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError(f"API server URL {base_url!r}: expected https://HOST[:PORT], e.g. https://10.96.0.1:443")
        self.base_url = base_url.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path.rstrip("/")
        self._authorization = authorization
        self._ssl_context = ssl_context or ssl.create_default_context()
        self._timeout = timeout

    @classmethod
    def in_cluster(cls, host: str, port: str, service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> EventsApi:
        """The API server behind the ``kubernetes`` Service, as the pod's service account."""
        token = TokenFile(service_account_dir / "token")
        token()  # fail now, with one log line, rather than on every Event
        ca_file = service_account_dir / "ca.crt"
        try:
            context = ssl.create_default_context(cafile=str(ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise CredentialsUnavailable(f"cannot load the service-account CA {ca_file}: {exc}") from exc
        netloc = f"[{host}]" if ":" in host else host  # an IPv6 service address
        return cls(f"https://{netloc}:{port}", token, context)

    @classmethod
    def from_kubernetes_configuration(cls, configuration: Any) -> EventsApi:
        """Use the server, credentials and CA of a ``kubernetes.client.Configuration`` someone already holds.

        Read by attribute (host, the bearer token via ``auth_settings()``, ssl_ca_cert, verify_ssl,
        cert_file/key_file), so this module never imports the package.
        """
        context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
        if not configuration.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if configuration.cert_file:
            context.load_cert_chain(configuration.cert_file, configuration.key_file or None)

        def authorization() -> str | None:
            # The header the kubernetes client itself would send (its api_key and refresh hook).
            setting = configuration.auth_settings().get("BearerToken")
            return setting["value"] if setting else None

        return cls(configuration.host, authorization, context)

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        path = f"{self._prefix}/api/v1/namespaces/{quote(namespace, safe='')}/events"
        data = json.dumps(body, separators=(",", ":")).encode()
        authorization = self._authorization()
        try:
            return self._post(path, data, authorization)
        except ApiError as exc:
            if exc.status != 401:
                raise
            fresh = self._authorization()
            if fresh == authorization:
                raise
            return self._post(path, data, fresh)

    def _post(self, path: str, data: bytes, authorization: str | None) -> dict[str, Any]:
        import http.client

        headers = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": USER_AGENT}
        if authorization:
            headers["Authorization"] = authorization
        conn: http.client.HTTPConnection
        if self._scheme == "https":
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout,
                                               context=self._ssl_context)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        try:
            conn.request("POST", path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read(MAX_RESPONSE_BYTES)
            status, reason = response.status, response.reason
            retry_after = parse_retry_after(response.getheader("Retry-After"))
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            payload = {}
        if not isinstance(payload, dict):
            payload = {}
        if 200 <= status < 300:
            return payload
        message = payload.get("message") if isinstance(payload.get("message"), str) else ""
        raise ApiError(status, str(payload.get("reason") or reason), message or "", retry_after)
