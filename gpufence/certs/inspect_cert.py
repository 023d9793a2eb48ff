"""``gpufence-certs inspect``: describe certificates and their remaining lifetime (pure core)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509

EXIT_OK = 0
EXIT_EXPIRING = 1
EXIT_UNREADABLE = 2

DEFAULT_WARN_DAYS = 30


@dataclass(frozen=True)
class CertInfo:
    source: str  # e.g. "tls.crt[0]" or a file name
    subject: str
    issuer: str
    sans: tuple[str, ...]
    serial: int
    is_ca: bool
    not_before: dt.datetime
    not_after: dt.datetime
    days_left: float

    def expires_within(self, days: float) -> bool:
        return self.days_left <= days


def load_certificates(data: bytes) -> list[x509.Certificate]:
    """Every certificate in a PEM bundle, or the one DER certificate. Raises ``ValueError``."""
    if b"-----BEGIN" in data:
        return list(x509.load_pem_x509_certificates(data))
    return [x509.load_der_x509_certificate(data)]


def describe(cert: x509.Certificate, source: str, now: dt.datetime) -> CertInfo:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        sans = tuple(
            [f"DNS:{n}" for n in san.get_values_for_type(x509.DNSName)]
            + [f"IP:{n}" for n in san.get_values_for_type(x509.IPAddress)]
        )
    except x509.ExtensionNotFound:
        sans = ()
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    not_after = cert.not_valid_after_utc
    return CertInfo(
        source=source,
        subject=cert.subject.rfc4514_string(),
        issuer=cert.issuer.rfc4514_string(),
        sans=sans,
        serial=cert.serial_number,
        is_ca=is_ca,
        not_before=cert.not_valid_before_utc,
        not_after=not_after,
        days_left=(not_after - now).total_seconds() / 86400,
    )


def _ts(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_info(info: CertInfo, warn_days: float) -> str:
    if info.days_left < 0:
        status = "EXPIRED"
    elif info.expires_within(warn_days):
        status = f"EXPIRING (within {warn_days:g} days)"
    else:
        status = "OK"
    lines = [
        f"{info.source}:",
        f"  subject:    {info.subject}",
        f"  issuer:     {info.issuer}",
        f"  SANs:       {', '.join(info.sans) if info.sans else '(none)'}",
        f"  CA:         {'yes' if info.is_ca else 'no'}",
        f"  serial:     {info.serial:x}",
        f"  not before: {_ts(info.not_before)}",
        f"  not after:  {_ts(info.not_after)}",
        f"  days left:  {info.days_left:.1f}",
        f"  status:     {status}",
    ]
    return "\n".join(lines)


def exit_code(infos: Sequence[CertInfo], warn_days: float) -> int:
    if not infos:
        return EXIT_UNREADABLE
    return EXIT_EXPIRING if any(i.expires_within(warn_days) for i in infos) else EXIT_OK


def describe_all(named_pems: Sequence[tuple[str, bytes]], now: dt.datetime) -> list[CertInfo]:
    """Describe every certificate of each ``(name, data)``; raises ``ValueError`` naming the input."""
    infos: list[CertInfo] = []
    for name, data in named_pems:
        try:
            certs = load_certificates(data)
        except ValueError as exc:
            raise ValueError(f"{name}: not a PEM or DER certificate ({exc})") from None
        if not certs:
            raise ValueError(f"{name}: no certificate found")
        for i, cert in enumerate(certs):
            infos.append(describe(cert, name if len(certs) == 1 else f"{name}[{i}]", now))
    return infos
