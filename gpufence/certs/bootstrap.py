"""In-cluster bootstrap of the webhook's TLS Secret and the caBundle of its webhook configuration.

Layout of the Secret (``type: kubernetes.io/tls``)::

    tls.crt  serving certificate (ECDSA P-256, serverAuth, SANs = the Service DNS names)
    tls.key  its private key
    ca.crt   the CA that signed tls.crt; the same bytes go into every webhook's caBundle
    ca.key   the CA private key, kept so that renewing the serving certificate reuses the CA

Keeping the CA key in the same Secret keeps the caBundle stable across serving-cert renewals (the
API server keeps trusting the webhook while the new serving certificate propagates). The webhook
Deployment should mount only ``tls.crt``/``tls.key`` from it (volume ``items:``).

Renewal semantics (``assess_secret``, pure):

* CA missing, unparsable, key not matching, not a CA, not yet valid or expiring within the renewal
  window → ``replace_ca``: a new CA and a new serving certificate; the caBundle changes. There is
  a short window (until the webhook pods reload the new certificate, typically the kubelet's
  Secret sync period, about a minute) in which the API server's caBundle and the served chain
  disagree and admission calls fail (subject to the webhook's failurePolicy).
* CA fine, serving certificate missing, unparsable, key not matching, not signed by the CA, not
  covering the required DNS names, rejected by X.509 path validation or expiring within the
  window → ``reissue``: a new serving certificate from the existing CA; ca.crt/ca.key are kept
  byte for byte, so the caBundle does not change.
* Otherwise ``keep``: no write at all. The caBundle of every webhook entry is then compared with
  ca.crt and patched (one JSON Patch) only where it differs.

Everything above is pure; ``KubeApi`` is the thin adapter over the ``kubernetes`` client and
``run_bootstrap`` the orchestration (GET Secret → POST/PUT Secret if needed → GET webhook
configuration → PATCH if needed; a second run makes only the two GETs).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import enum
import ipaddress
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import verification

from gpufence.certs import pki
from gpufence.certs.files import CA_CERT, CA_KEY, TLS_CERT, TLS_KEY
from gpufence.logs import log_event as _log_event

log = logging.getLogger("gpufence.certs")

SECRET_TYPE_TLS = "kubernetes.io/tls"
DEFAULT_NAMESPACE = "gpufence"
DEFAULT_SECRET = "gpufence-webhook-tls"
DEFAULT_SERVICE = "gpufence-webhook"
DEFAULT_WEBHOOK_CONFIGURATION = "gpufence"
DEFAULT_RENEW_BEFORE_DAYS = 30
DEFAULT_DAYS = 365
DEFAULT_CA_DAYS = 3650

# RBAC objects the install is expected to bind to the bootstrap Job's ServiceAccount; named in
# permission errors so the operator knows what to fix.
SECRETS_ROLE = "Role gpufence-certs"
WEBHOOK_ROLE = "ClusterRole gpufence-certs"

MANAGED_LABELS = {
    "app.kubernetes.io/name": "gpufence",
    "app.kubernetes.io/component": "webhook-certs",
    "app.kubernetes.io/managed-by": "gpufence-certs",
}
RENEWED_AT_ANNOTATION = "gpufence.io/certs-renewed-at"
RENEW_REASON_ANNOTATION = "gpufence.io/certs-renew-reason"


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    _log_event(log, event, level, **fields)


# --------------------------------------------------------------------------------------------
# Pure assessment
# --------------------------------------------------------------------------------------------


class Action(enum.StrEnum):
    KEEP = "keep"
    REISSUE = "reissue"  # new serving certificate, same CA
    REPLACE_CA = "replace_ca"  # new CA and new serving certificate


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str
    ca: pki.KeyPair | None = None  # the CA to keep (KEEP / REISSUE)
    not_after: dt.datetime | None = None  # of the serving certificate that is kept (KEEP)

    @property
    def needs_renewal(self) -> bool:
        return self.action is not Action.KEEP


def _public_bytes(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _fmt_time(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_pair(data: Mapping[str, bytes], cert_key: str, key_key: str) -> tuple[pki.KeyPair | None, str]:
    missing = [k for k in (cert_key, key_key) if not data.get(k)]
    if missing:
        return None, f"{' and '.join(missing)} missing"
    try:
        cert = pki.load_cert(data[cert_key])
    except ValueError as exc:
        return None, f"{cert_key} is not a parsable PEM certificate ({exc})"
    try:
        key = pki.load_key(data[key_key])
    except (ValueError, TypeError) as exc:
        return None, f"{key_key} is not a parsable unencrypted EC private key ({exc})"
    if _public_bytes(cert.public_key()) != _public_bytes(key.public_key()):
        return None, f"{key_key} does not match {cert_key}"
    return pki.KeyPair(cert, key), ""


def _assess_ca(
    data: Mapping[str, bytes], now: dt.datetime, renew_before: dt.timedelta
) -> tuple[pki.KeyPair | None, str]:
    ca, problem = _parse_pair(data, CA_CERT, CA_KEY)
    if ca is None:
        return None, problem
    try:
        constraints = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        is_ca = constraints.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        return None, f"{CA_CERT} is not a CA certificate"
    try:
        ca.cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return None, f"{CA_CERT} is not a self-signed CA certificate"
    if ca.cert.not_valid_before_utc > now:
        return None, f"{CA_CERT} is not valid before {_fmt_time(ca.cert.not_valid_before_utc)}"
    if ca.cert.not_valid_after_utc - now <= renew_before:
        return None, f"{CA_CERT} expires at {_fmt_time(ca.cert.not_valid_after_utc)} (within {renew_before.days} days)"
    return ca, ""


def _uncovered_names(cert: x509.Certificate, dns_names: Sequence[str]) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return list(dns_names)
    dns = {n.lower().rstrip(".") for n in san.get_values_for_type(x509.DNSName)}
    ips = set(san.get_values_for_type(x509.IPAddress))
    missing = []
    for name in dns_names:
        try:
            covered = ipaddress.ip_address(name) in ips
        except ValueError:
            covered = name.lower().rstrip(".") in dns
        if not covered:
            missing.append(name)
    return missing


def _subject_for(name: str) -> verification.DNSName | verification.IPAddress:
    try:
        return verification.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return verification.DNSName(name)


def verify_chain(leaf: x509.Certificate, ca: x509.Certificate, name: str, now: dt.datetime) -> None:
    """X.509 path validation of ``leaf`` as a TLS server certificate for ``name`` under ``ca``.

    Raises ``cryptography.x509.verification.VerificationError``.
    """
    verifier = (
        verification.PolicyBuilder()
        .store(verification.Store([ca]))
        .time(now)
        .build_server_verifier(_subject_for(name))
    )
    verifier.verify(leaf, [])


def assess_secret(
    data: Mapping[str, bytes] | None,
    dns_names: Sequence[str],
    now: dt.datetime,
    renew_before: dt.timedelta,
) -> Verdict:
    """Decide whether the TLS Secret with (base64-decoded) ``data`` must be (partly) replaced."""
    if data is None:
        return Verdict(Action.REPLACE_CA, "secret does not exist")
    if not dns_names:
        raise ValueError("at least one DNS name is required")
    ca, problem = _assess_ca(data, now, renew_before)
    if ca is None:
        return Verdict(Action.REPLACE_CA, problem)

    def reissue(reason: str) -> Verdict:
        return Verdict(Action.REISSUE, reason, ca=ca)

    serving, problem = _parse_pair(data, TLS_CERT, TLS_KEY)
    if serving is None:
        return reissue(problem)
    cert = serving.cert
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return reissue(f"{TLS_CERT} is not signed by the CA in {CA_CERT}")
    if cert.not_valid_after_utc - now <= renew_before:
        return reissue(f"{TLS_CERT} expires at {_fmt_time(cert.not_valid_after_utc)} (within {renew_before.days} days)")
    if cert.not_valid_before_utc > now:
        return reissue(f"{TLS_CERT} is not valid before {_fmt_time(cert.not_valid_before_utc)}")
    missing = _uncovered_names(cert, dns_names)
    if missing:
        return reissue(f"{TLS_CERT} does not cover {', '.join(missing)}")
    try:
        verify_chain(cert, ca.cert, dns_names[0], now)
    except verification.VerificationError as exc:
        return reissue(f"{TLS_CERT} fails X.509 path validation: {exc}")
    return Verdict(
        Action.KEEP,
        f"valid until {_fmt_time(cert.not_valid_after_utc)}",
        ca=ca,
        not_after=cert.not_valid_after_utc,
    )


def secret_data(ca_cert_pem: bytes, ca_key_pem: bytes, serving: pki.KeyPair) -> dict[str, bytes]:
    return {TLS_CERT: serving.cert_pem, TLS_KEY: serving.key_pem, CA_CERT: ca_cert_pem, CA_KEY: ca_key_pem}


def secret_manifest(
    name: str,
    namespace: str,
    data: Mapping[str, bytes],
    *,
    reason: str,
    now: dt.datetime,
    resource_version: str | None = None,
    base_metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Secret object to POST (or PUT with ``resource_version``), values base64-encoded."""
    base = dict(base_metadata or {})
    labels = {**(base.get("labels") or {}), **MANAGED_LABELS}
    annotations = {
        **(base.get("annotations") or {}),
        RENEWED_AT_ANNOTATION: _fmt_time(now),
        RENEW_REASON_ANNOTATION: reason[:1000],
    }
    # Keep what others put there (ownerReferences, finalizers, ...): a PUT replaces the whole object.
    metadata: dict[str, Any] = {k: v for k, v in base.items() if k not in ("managedFields", "resourceVersion")}
    metadata.update(name=name, namespace=namespace, labels=labels, annotations=annotations)
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": SECRET_TYPE_TLS,
        "data": {k: base64.b64encode(v).decode("ascii") for k, v in sorted(data.items())},
    }


def decode_secret_data(secret: Mapping[str, Any]) -> dict[str, bytes]:
    """Base64-decode ``secret['data']``; an undecodable value becomes ``b''`` (treated as missing)."""
    out: dict[str, bytes] = {}
    for key, value in (secret.get("data") or {}).items():
        try:
            out[key] = base64.b64decode(value or "", validate=True)
        except (binascii.Error, ValueError, TypeError):
            out[key] = b""
    return out


def ca_bundle_patch(webhook_configuration: Mapping[str, Any], ca_pem: bytes) -> list[dict[str, Any]]:
    """JSON Patch ops setting ``clientConfig.caBundle`` of every webhook entry that differs.

    Each ``add`` is guarded by a ``test`` of that entry's name, so a concurrent reordering of the
    webhooks makes the patch fail instead of writing the bundle into the wrong entry.
    """
    wanted = base64.b64encode(ca_pem).decode("ascii")
    ops: list[dict[str, Any]] = []
    for i, webhook in enumerate(webhook_configuration.get("webhooks") or []):
        client_config = webhook.get("clientConfig") or {}
        if client_config.get("caBundle") == wanted:
            continue
        if "name" in webhook:
            ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": webhook["name"]})
        if "clientConfig" not in webhook:
            ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig", "value": {"caBundle": wanted}})
        else:
            ops.append({"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": wanted})
    return ops


def changed_webhooks(ops: Sequence[Mapping[str, Any]], webhook_configuration: Mapping[str, Any]) -> list[str]:
    webhooks = webhook_configuration.get("webhooks") or []
    names = []
    for op in ops:
        if op["op"] == "add":
            index = int(op["path"].split("/")[2])
            names.append(str(webhooks[index].get("name", index)))
    return names


# --------------------------------------------------------------------------------------------
# Kubernetes API adapter
# --------------------------------------------------------------------------------------------


class KubeError(Exception):
    """An API call failed; the message is meant for the operator."""


class Forbidden(KubeError):
    pass


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    pass


def _server_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            message = json.loads(body).get("message")
            if message:
                return str(message)
        except (ValueError, AttributeError):
            pass
    return f"{getattr(exc, 'status', '?')} {getattr(exc, 'reason', '') or ''}".strip()


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient``: ``kubeconfig`` if given, else in-cluster, else ~/.kube/config."""
    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig, context=context, persist_config=False)
    try:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except config.ConfigException:
        return config.new_client_from_config(context=context, persist_config=False)


# The generated client sends POST/PUT bodies without a Content-Type (the API server then assumes
# JSON); say it explicitly.
JSON_BODY = {"Content-Type": "application/json"}


@dataclass
class KubeApi:
    """The few calls ``bootstrap`` and ``inspect`` need, on plain JSON dicts."""

    api_client: Any
    timeout: float = 30.0
    _core: Any = field(init=False, repr=False)
    _admission: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(self.api_client)
        self._admission = client.AdmissionregistrationV1Api(self.api_client)

    def _call(
        self, verb: str, resource: str, name: str, namespace: str | None, role: str, fn: Any, *args: Any, **kw: Any
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        where = f" in namespace {namespace}" if namespace else ""
        try:
            response = fn(*args, _preload_content=False, _request_timeout=self.timeout, **kw)
        except ApiException as exc:
            detail = _server_message(exc)
            if exc.status == 401:
                raise Forbidden(
                    f"the API server rejected our credentials when trying to {verb} {resource} {name!r}{where} "
                    f"({detail}); check the ServiceAccount token or the kubeconfig user"
                ) from None
            if exc.status == 403:
                raise Forbidden(
                    f"not allowed to {verb} {resource} {name!r}{where} ({detail}); grant verb {verb!r} on "
                    f"{resource!r} to this ServiceAccount in {role}"
                    + (f" (namespace {namespace})" if namespace and role.startswith("Role ") else "")
                ) from None
            if exc.status == 404:
                raise NotFound(f"{resource} {name!r} not found{where} ({detail})") from None
            if exc.status == 409:
                raise Conflict(f"conflict on {verb} {resource} {name!r}{where} ({detail})") from None
            raise KubeError(f"cannot {verb} {resource} {name!r}{where}: {detail}") from None
        except OSError as exc:  # urllib3 errors are OSErrors or wrap them
            raise KubeError(f"cannot {verb} {resource} {name!r}{where}: {exc}") from None
        except Exception as exc:
            if type(exc).__module__.startswith("urllib3"):
                raise KubeError(f"cannot {verb} {resource} {name!r}{where}: {exc}") from None
            raise
        return json.loads(response.data or b"{}")

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call(
                "get", "secrets", name, namespace, SECRETS_ROLE, self._core.read_namespaced_secret, name, namespace
            )
        except NotFound:
            return None

    def create_secret(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            "create", "secrets", name, namespace, SECRETS_ROLE,
            self._core.create_namespaced_secret, namespace, dict(body), _headers=JSON_BODY,
        )

    def replace_secret(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            "update", "secrets", name, namespace, SECRETS_ROLE,
            self._core.replace_namespaced_secret, name, namespace, dict(body), _headers=JSON_BODY,
        )

    def get_mutating_webhook_configuration(self, name: str) -> dict[str, Any]:
        return self._call(
            "get", "mutatingwebhookconfigurations", name, None, WEBHOOK_ROLE,
            self._admission.read_mutating_webhook_configuration, name,
        )

    def patch_mutating_webhook_configuration(self, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        return self._call(
            "patch", "mutatingwebhookconfigurations", name, None, WEBHOOK_ROLE,
            self._admission.patch_mutating_webhook_configuration, name, ops,
            _content_type="application/json-patch+json",
        )


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BootstrapOptions:
    namespace: str = DEFAULT_NAMESPACE
    secret: str = DEFAULT_SECRET
    service: str = DEFAULT_SERVICE
    webhook_configuration: str = DEFAULT_WEBHOOK_CONFIGURATION
    extra_dns_names: tuple[str, ...] = ()
    renew_before: dt.timedelta = dt.timedelta(days=DEFAULT_RENEW_BEFORE_DAYS)
    days: int = DEFAULT_DAYS
    ca_days: int = DEFAULT_CA_DAYS

    @property
    def dns_names(self) -> list[str]:
        return pki.service_dns_names(self.service, self.namespace, self.extra_dns_names)

    def validate(self) -> None:
        """A fresh certificate must lie outside the renewal window, or every run would renew."""
        if self.renew_before < dt.timedelta(0):
            raise ValueError("--renew-before-days must not be negative")
        for flag, days in (("--days", self.days), ("--ca-days", self.ca_days)):
            if dt.timedelta(days=days) <= self.renew_before:
                raise ValueError(f"{flag} ({days}) must be larger than --renew-before-days ({self.renew_before.days})")


@dataclass(frozen=True)
class BootstrapResult:
    action: Action
    reason: str
    patched_webhooks: tuple[str, ...]


MAX_ATTEMPTS = 3


def run_bootstrap(api: KubeApi, opts: BootstrapOptions, now: dt.datetime | None = None) -> BootstrapResult:
    """Make the Secret valid and the caBundle match it. Raises ``KubeError`` subclasses."""
    opts.validate()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return _reconcile(api, opts, now or dt.datetime.now(dt.UTC))
        except Conflict as exc:
            if attempt == MAX_ATTEMPTS:
                raise
            log_event("conflict_retry", logging.WARNING, attempt=attempt, error=str(exc))
    raise AssertionError("unreachable")


def _reconcile(api: KubeApi, opts: BootstrapOptions, now: dt.datetime) -> BootstrapResult:
    ns, name = opts.namespace, opts.secret
    dns_names = opts.dns_names
    secret = api.get_secret(ns, name)
    if secret is not None and secret.get("type", SECRET_TYPE_TLS) != SECRET_TYPE_TLS:
        raise KubeError(
            f"Secret {name!r} in namespace {ns} has type {secret.get('type')!r}, not {SECRET_TYPE_TLS!r}; "
            "the type cannot be changed in place: delete the Secret and run bootstrap again"
        )
    data = decode_secret_data(secret) if secret is not None else None
    verdict = assess_secret(data, dns_names, now, opts.renew_before)
    log_event(
        "secret_assessed", namespace=ns, secret=name, action=str(verdict.action), reason=verdict.reason,
        not_after=_fmt_time(verdict.not_after) if verdict.not_after else None,
    )

    if verdict.action is Action.KEEP:
        assert data is not None
        ca_pem = data[CA_CERT]
    else:
        if verdict.action is Action.REISSUE:
            assert data is not None and verdict.ca is not None
            ca_pem, ca_key_pem, ca = data[CA_CERT], data[CA_KEY], verdict.ca
        else:
            ca = pki.make_ca(days=opts.ca_days, now=now)
            ca_pem, ca_key_pem = ca.cert_pem, ca.key_pem
        serving = pki.make_serving_cert(ca, dns_names, days=opts.days, now=now)
        body = secret_manifest(
            name, ns, secret_data(ca_pem, ca_key_pem, serving), reason=verdict.reason, now=now,
            resource_version=(secret or {}).get("metadata", {}).get("resourceVersion"),
            base_metadata=(secret or {}).get("metadata"),
        )
        fields = {
            "namespace": ns, "secret": name, "action": str(verdict.action), "reason": verdict.reason,
            "not_after": _fmt_time(serving.cert.not_valid_after_utc), "dns_names": dns_names,
            "ca_not_after": _fmt_time(ca.cert.not_valid_after_utc),
        }
        if secret is None:
            api.create_secret(ns, body)
            log_event("secret_created", **fields)
        else:
            api.replace_secret(ns, body)
            log_event("secret_replaced", **fields)

    config = api.get_mutating_webhook_configuration(opts.webhook_configuration)
    ops = ca_bundle_patch(config, ca_pem)
    patched: list[str] = []
    if not config.get("webhooks"):
        log_event("webhook_configuration_empty", logging.WARNING, name=opts.webhook_configuration)
    if ops:
        patched = changed_webhooks(ops, config)
        api.patch_mutating_webhook_configuration(opts.webhook_configuration, ops)
        log_event("ca_bundle_patched", name=opts.webhook_configuration, webhooks=patched)
    else:
        log_event("ca_bundle_unchanged", name=opts.webhook_configuration)
    return BootstrapResult(verdict.action, verdict.reason, tuple(patched))
