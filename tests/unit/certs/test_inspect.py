"""``gpufence-certs inspect --cert-file``: output and exit codes (0 fresh, 1 expiring, 2 unreadable)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from gpufence.certs import cli, inspect_cert, pki

NOW = dt.datetime.now(dt.UTC)
NAMES = pki.service_dns_names("gpufence-webhook", "gpufence", ("10.0.0.1",))


@pytest.fixture(scope="module")
def ca() -> pki.KeyPair:
    return pki.make_ca(now=NOW - dt.timedelta(days=1))


def write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def serving_pem(ca: pki.KeyPair, days: int, issued_days_ago: float = 0) -> bytes:
    return pki.make_serving_cert(ca, NAMES, days=days, now=NOW - dt.timedelta(days=issued_days_ago)).cert_pem


def test_fresh_certificate(tmp_path: Path, ca: pki.KeyPair, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "tls.crt", serving_pem(ca, 365))
    assert cli.main(["inspect", "--cert-file", path]) == 0
    out = capsys.readouterr().out
    assert "subject:    CN=gpufence-webhook" in out
    assert "issuer:     CN=gpufence-ca" in out
    assert "DNS:gpufence-webhook.gpufence.svc.cluster.local" in out and "IP:10.0.0.1" in out
    assert "not before: " in out and "not after:  " in out
    assert "days left:  365.0" in out or "days left:  364.9" in out
    assert "status:     OK" in out


@pytest.mark.parametrize(("days", "ago", "warn", "code", "status"), [
    (20, 0, None, 1, "EXPIRING"),
    (20, 0, "10", 0, "OK"),
    (365, 0, "400", 1, "EXPIRING"),
    (10, 11, None, 1, "EXPIRED"),
    (10, 11, "0", 1, "EXPIRED"),
])
def test_expiring_exit_codes(tmp_path: Path, ca: pki.KeyPair, capsys: pytest.CaptureFixture[str],
                             days: int, ago: int, warn: str | None, code: int, status: str) -> None:
    path = write(tmp_path, "tls.crt", serving_pem(ca, days, ago))
    args = ["inspect", "--cert-file", path] + (["--warn-days", warn] if warn else [])
    assert cli.main(args) == code
    assert f"status:     {status}" in capsys.readouterr().out


BAD_PEM = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"


@pytest.mark.parametrize("content", [b"garbage", b"", BAD_PEM])
def test_garbage_is_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    assert cli.main(["inspect", "--cert-file", write(tmp_path, "bad.crt", content)]) == 2
    assert "not a PEM or DER certificate" in capsys.readouterr().err


def test_missing_file_and_bad_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["inspect", "--cert-file", str(tmp_path / "nope.crt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["inspect"])
    assert exc.value.code == 2


def test_der_and_bundles(tmp_path: Path, ca: pki.KeyPair, capsys: pytest.CaptureFixture[str]) -> None:
    leaf = pki.load_cert(serving_pem(ca, 365))
    der = write(tmp_path, "a.der", leaf.public_bytes(serialization.Encoding.DER))
    assert cli.main(["inspect", "--cert-file", der]) == 0
    # A bundle: the soonest expiry decides.
    short_ca = pki.make_ca(days=5)
    bundle = write(tmp_path, "bundle.pem", serving_pem(ca, 365) + short_ca.cert_pem)
    assert cli.main(["inspect", "--cert-file", bundle]) == 1
    out = capsys.readouterr().out
    assert "bundle.pem[0]:" in out and "bundle.pem[1]:" in out and "CA:         yes" in out


def test_describe_is_pure(ca: pki.KeyPair) -> None:
    cert = pki.load_cert(serving_pem(ca, 100))
    info = inspect_cert.describe(cert, "x", NOW + dt.timedelta(days=50))
    assert 49.9 < info.days_left < 50.1 and not info.is_ca
    assert inspect_cert.exit_code([info], 30) == 0
    assert inspect_cert.exit_code([info], 50.1) == 1
    assert inspect_cert.exit_code([], 30) == 2
