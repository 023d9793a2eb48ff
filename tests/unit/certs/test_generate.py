"""``gpufence-certs generate``: files, modes, overwrite protection, chain verification, SANs."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509 import verification

from gpufence.certs import cli, files, pki

DEFAULT_NAMES = [
    "gpufence-webhook",
    "gpufence-webhook.gpufence",
    "gpufence-webhook.gpufence.svc",
    "gpufence-webhook.gpufence.svc.cluster.local",
]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _load(out: Path) -> tuple[x509.Certificate, x509.Certificate]:
    return pki.load_cert((out / "ca.crt").read_bytes()), pki.load_cert((out / "tls.crt").read_bytes())


def _verify(ca: x509.Certificate, leaf: x509.Certificate, name: str) -> None:
    try:
        subject = verification.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        subject = verification.DNSName(name)
    verifier = verification.PolicyBuilder().store(verification.Store([ca])).build_server_verifier(subject)
    chain = verifier.verify(leaf, [])
    assert chain[0] == leaf and chain[-1] == ca


def _sans(cert: x509.Certificate) -> tuple[list[str], list[str]]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.DNSName), [str(i) for i in san.get_values_for_type(x509.IPAddress)]


def test_generate_writes_pem_files_with_private_keys_0600(tmp_path: Path) -> None:
    out = tmp_path / "out"
    old_umask = os.umask(0)  # the 0600 must come from os.open, not from the umask
    try:
        assert cli.main(["generate", "--out-dir", str(out)]) == 0
    finally:
        os.umask(old_umask)
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert _mode(out / "ca.key") == 0o600
    assert _mode(out / "tls.key") == 0o600
    assert _mode(out / "ca.crt") == 0o644
    assert _mode(out) == 0o700
    ca, leaf = _load(out)
    pki.load_key((out / "ca.key").read_bytes())
    key = pki.load_key((out / "tls.key").read_bytes())
    assert key.public_key() == leaf.public_key()
    assert (out / "tls.key").read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_generate_chain_verifies_for_every_service_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli.main(["generate", "--out-dir", str(out), "--dns-name", "webhook.example.com",
                     "--dns-name", "10.0.0.7", "--days", "30", "--ca-days", "60"]) == 0
    ca, leaf = _load(out)
    dns, ips = _sans(leaf)
    assert dns == [*DEFAULT_NAMES, "webhook.example.com"]
    assert ips == ["10.0.0.7"]
    for name in [*DEFAULT_NAMES, "webhook.example.com", "10.0.0.7"]:
        _verify(ca, leaf, name)
    with pytest.raises(verification.VerificationError):
        _verify(ca, leaf, "other.gpufence.svc")
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert 30 <= lifetime.days <= 31


def test_generate_custom_service_and_namespace(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli.main(["generate", "--out-dir", str(out), "--service", "hook", "--namespace", "sys"]) == 0
    _, leaf = _load(out)
    assert _sans(leaf)[0] == ["hook", "hook.sys", "hook.sys.svc", "hook.sys.svc.cluster.local"]


def test_generate_refuses_to_overwrite_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "tls.key").write_bytes(b"precious")
    assert cli.main(["generate", "--out-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"refusing to overwrite existing file {out / 'tls.key'}" in err
    assert "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["tls.key"]
    assert (out / "tls.key").read_bytes() == b"precious"


def test_generate_force_replaces_and_tightens_key_mode(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli.main(["generate", "--out-dir", str(out)]) == 0
    first = (out / "tls.crt").read_bytes()
    (out / "tls.key").chmod(0o644)
    assert cli.main(["generate", "--out-dir", str(out)]) == 1
    assert (out / "tls.crt").read_bytes() == first
    assert cli.main(["generate", "--out-dir", str(out), "--force"]) == 0
    assert (out / "tls.crt").read_bytes() != first
    assert _mode(out / "tls.key") == 0o600
    assert _mode(out / "ca.key") == 0o600
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    ca, leaf = _load(out)
    _verify(ca, leaf, DEFAULT_NAMES[-1])


def test_generate_with_existing_ca(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    assert cli.main(["generate", "--out-dir", str(ca_dir)]) == 0
    out = tmp_path / "out"
    assert cli.main(["generate", "--out-dir", str(out), "--ca-cert", str(ca_dir / "ca.crt"),
                     "--ca-key", str(ca_dir / "ca.key")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]  # CA key not copied
    assert (out / "ca.crt").read_bytes() == (ca_dir / "ca.crt").read_bytes()
    ca, leaf = _load(out)
    _verify(ca, leaf, DEFAULT_NAMES[2])
    # Re-signing in place: the identical ca.crt is not an overwrite; tls.* still need --force.
    args = ["generate", "--out-dir", str(ca_dir),
            "--ca-cert", str(ca_dir / "ca.crt"), "--ca-key", str(ca_dir / "ca.key")]
    assert cli.main(args) == 1
    assert cli.main([*args, "--force"]) == 0
    ca2, leaf2 = _load(ca_dir)
    assert ca2 == ca
    _verify(ca2, leaf2, DEFAULT_NAMES[0])


def test_generate_rejects_bad_ca_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli.main(["generate", "--out-dir", str(a)]) == 0
    assert cli.main(["generate", "--out-dir", str(b)]) == 0
    out = tmp_path / "out"
    assert cli.main(["generate", "--out-dir", str(out), "--ca-cert", str(a / "ca.crt")]) == 2
    gen = ["generate", "--out-dir", str(out)]
    assert cli.main([*gen, "--ca-cert", str(a / "ca.crt"), "--ca-key", str(b / "ca.key")]) == 1
    assert "does not match" in capsys.readouterr().err
    assert cli.main([*gen, "--ca-cert", str(a / "tls.crt"), "--ca-key", str(a / "tls.key")]) == 1
    assert "not a CA certificate" in capsys.readouterr().err
    assert not out.exists()


def test_write_files_exclusive_unless_forced(tmp_path: Path) -> None:
    files.write_files(tmp_path, [files.OutputFile("x.key", b"one", private=True)])
    with pytest.raises(files.FileExistsRefused, match=r"x\.key"):
        files.write_files(tmp_path, [files.OutputFile("x.key", b"two", private=True)])
    assert (tmp_path / "x.key").read_bytes() == b"one"
    files.write_files(tmp_path, [files.OutputFile("x.key", b"two", private=True)], force=True)
    assert (tmp_path / "x.key").read_bytes() == b"two"
