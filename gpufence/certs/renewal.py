"""What the webhook's TLS Secret and the caBundle of its webhook configurations should hold (pure).

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

No I/O here: ``certs.bootstrap`` reads and writes the objects.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import enum
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509 import verification

from gpufence.certs import pki
from gpufence.certs.files import CA_CERT, CA_KEY, TLS_CERT, TLS_KEY

SECRET_TYPE_TLS = "kubernetes.io/tls"

MANAGED_LABELS = {
    "app.kubernetes.io/name": "gpufence",
    "app.kubernetes.io/component": "webhook-certs",
    "app.kubernetes.io/managed-by": "gpufence-certs",
}
RENEWED_AT_ANNOTATION = "gpufence.io/certs-renewed-at"
RENEW_REASON_ANNOTATION = "gpufence.io/certs-renew-reason"




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


def public_bytes(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def fmt_time(t: dt.datetime) -> str:
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
    if public_bytes(cert.public_key()) != public_bytes(key.public_key()):
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
        return None, f"{CA_CERT} is not valid before {fmt_time(ca.cert.not_valid_before_utc)}"
    if ca.cert.not_valid_after_utc - now <= renew_before:
        return None, f"{CA_CERT} expires at {fmt_time(ca.cert.not_valid_after_utc)} (within {renew_before.days} days)"
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
        return reissue(f"{TLS_CERT} expires at {fmt_time(cert.not_valid_after_utc)} (within {renew_before.days} days)")
    if cert.not_valid_before_utc > now:
        return reissue(f"{TLS_CERT} is not valid before {fmt_time(cert.not_valid_before_utc)}")
    missing = _uncovered_names(cert, dns_names)
    if missing:
        return reissue(f"{TLS_CERT} does not cover {', '.join(missing)}")
    try:
        verify_chain(cert, ca.cert, dns_names[0], now)
    except verification.VerificationError as exc:
        return reissue(f"{TLS_CERT} fails X.509 path validation: {exc}")
    return Verdict(
        Action.KEEP,
        f"valid until {fmt_time(cert.not_valid_after_utc)}",
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
        RENEWED_AT_ANNOTATION: fmt_time(now),
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
