"""``certs.renewal`` (pure): ``assess_secret``, Secret manifests, the caBundle patch."""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Callable

import jsonpatch
import pytest

from gpufence.certs import bootstrap as bs
from gpufence.certs import pki
from gpufence.certs import renewal as rn

NOW = dt.datetime(2030, 6, 1, 12, 0, tzinfo=dt.UTC)
WINDOW = dt.timedelta(days=30)
NAMES = pki.service_dns_names("gpufence-webhook", "gpufence")


@pytest.fixture(scope="module")
def ca() -> pki.KeyPair:
    return pki.make_ca(now=NOW - dt.timedelta(days=100))


@pytest.fixture(scope="module")
def good(ca: pki.KeyPair) -> dict[str, bytes]:
    serving = pki.make_serving_cert(ca, NAMES, days=365, now=NOW - dt.timedelta(days=10))
    return rn.secret_data(ca.cert_pem, ca.key_pem, serving)


def test_valid_secret_is_kept(good: dict[str, bytes], ca: pki.KeyPair) -> None:
    verdict = rn.assess_secret(good, NAMES, NOW, WINDOW)
    assert verdict.action is rn.Action.KEEP and not verdict.needs_renewal
    assert verdict.ca is not None and verdict.ca.cert == ca.cert
    assert verdict.not_after == pki.load_cert(good["tls.crt"]).not_valid_after_utc
    assert "valid until" in verdict.reason


def test_missing_secret_replaces_everything() -> None:
    verdict = rn.assess_secret(None, NAMES, NOW, WINDOW)
    assert verdict.action is rn.Action.REPLACE_CA and verdict.reason == "secret does not exist"


Mutation = Callable[[dict[str, bytes], pki.KeyPair], None]


def _other_ca_serving(d: dict[str, bytes], ca: pki.KeyPair) -> None:
    other = pki.make_ca(now=NOW - dt.timedelta(days=1))
    s = pki.make_serving_cert(other, NAMES, now=NOW - dt.timedelta(days=1))
    d["tls.crt"], d["tls.key"] = s.cert_pem, s.key_pem


def _serving(days: int, issued_days_ago: float, names: list[str] = NAMES) -> Mutation:
    def mutate(d: dict[str, bytes], ca: pki.KeyPair) -> None:
        s = pki.make_serving_cert(ca, names, days=days, now=NOW - dt.timedelta(days=issued_days_ago))
        d["tls.crt"], d["tls.key"] = s.cert_pem, s.key_pem
    return mutate


def _set(**values: bytes) -> Mutation:
    def mutate(d: dict[str, bytes], ca: pki.KeyPair) -> None:
        for k, v in values.items():
            key = k.replace("_", ".")
            if v is None:
                d.pop(key, None)
            else:
                d[key] = v
    return mutate


def _ca_as(cert_and_key: Callable[[pki.KeyPair], pki.KeyPair]) -> Mutation:
    def mutate(d: dict[str, bytes], ca: pki.KeyPair) -> None:
        new = cert_and_key(ca)
        d["ca.crt"], d["ca.key"] = new.cert_pem, new.key_pem
    return mutate


REISSUE_CASES: dict[str, tuple[Mutation, str]] = {
    "tls.crt missing": (_set(tls_crt=None), "tls.crt missing"),
    "tls.crt garbage": (_set(tls_crt=b"not a cert"), "tls.crt is not a parsable"),
    "tls.key garbage": (_set(tls_key=b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"),
                        "tls.key is not a parsable"),
    "key mismatch": (lambda d, ca: d.__setitem__("tls.key", d["ca.key"]), "tls.key does not match tls.crt"),
    "other CA": (_other_ca_serving, "not signed by the CA"),
    "expiring": (_serving(days=365, issued_days_ago=340), "tls.crt expires at"),
    "expired": (_serving(days=10, issued_days_ago=20), "tls.crt expires at"),
    "not yet valid": (_serving(days=365, issued_days_ago=-2), "not valid before"),
    "other names": (_serving(days=365, issued_days_ago=1, names=["gpufence-webhook", "gpufence-webhook.other.svc"]),
                    "does not cover gpufence-webhook.gpufence, gpufence-webhook.gpufence.svc"),
}


@pytest.mark.parametrize("case", REISSUE_CASES)
def test_bad_serving_cert_is_reissued_from_same_ca(case: str, good: dict[str, bytes], ca: pki.KeyPair) -> None:
    mutate, reason = REISSUE_CASES[case]
    data = dict(good)
    mutate(data, ca)
    verdict = rn.assess_secret(data, NAMES, NOW, WINDOW)
    assert verdict.action is rn.Action.REISSUE, verdict
    assert reason in verdict.reason
    assert verdict.ca is not None and verdict.ca.cert == ca.cert


REPLACE_CASES: dict[str, tuple[Mutation, str]] = {
    "ca.crt missing": (_set(ca_crt=None), "ca.crt missing"),
    "ca.key missing": (_set(ca_key=None), "ca.key missing"),
    "ca.crt garbage": (_set(ca_crt=b"-----BEGIN CERTIFICATE-----\nxx\n-----END CERTIFICATE-----\n"),
                       "ca.crt is not a parsable"),
    "ca.key mismatch": (lambda d, ca: d.__setitem__("ca.key", d["tls.key"]), "ca.key does not match ca.crt"),
    "not a CA": (lambda d, ca: d.update({"ca.crt": d["tls.crt"], "ca.key": d["tls.key"]}),
                 "ca.crt is not a CA certificate"),
    "CA expiring": (_ca_as(lambda ca: pki.make_ca(days=40, now=NOW - dt.timedelta(days=20))), "ca.crt expires at"),
    "CA not yet valid": (_ca_as(lambda ca: pki.make_ca(now=NOW + dt.timedelta(days=1))), "ca.crt is not valid before"),
}


@pytest.mark.parametrize("case", REPLACE_CASES)
def test_bad_ca_replaces_everything(case: str, good: dict[str, bytes], ca: pki.KeyPair) -> None:
    mutate, reason = REPLACE_CASES[case]
    data = dict(good)
    mutate(data, ca)
    verdict = rn.assess_secret(data, NAMES, NOW, WINDOW)
    assert verdict.action is rn.Action.REPLACE_CA, verdict
    assert reason in verdict.reason
    assert verdict.ca is None


def test_extra_names_and_ip_sans(ca: pki.KeyPair) -> None:
    names = [*NAMES, "10.1.2.3", "Webhook.Example.com"]
    s = pki.make_serving_cert(ca, [*NAMES, "10.1.2.3", "webhook.example.com"], now=NOW - dt.timedelta(days=1))
    data = rn.secret_data(ca.cert_pem, ca.key_pem, s)
    assert rn.assess_secret(data, names, NOW, WINDOW).action is rn.Action.KEEP
    verdict = rn.assess_secret(data, [*names, "10.1.2.4"], NOW, WINDOW)
    assert verdict.action is rn.Action.REISSUE and verdict.reason.endswith("does not cover 10.1.2.4")
    # A superset of the required names is fine.
    assert rn.assess_secret(data, NAMES[:2], NOW, WINDOW).action is rn.Action.KEEP


def test_window_boundary(ca: pki.KeyPair) -> None:
    s = pki.make_serving_cert(ca, NAMES, days=60, now=NOW)
    data = rn.secret_data(ca.cert_pem, ca.key_pem, s)
    assert rn.assess_secret(data, NAMES, NOW, dt.timedelta(days=59)).action is rn.Action.KEEP
    assert rn.assess_secret(data, NAMES, NOW, dt.timedelta(days=60)).action is rn.Action.REISSUE


def test_decode_secret_data_tolerates_bad_base64() -> None:
    data = rn.decode_secret_data({"data": {"tls.crt": "!!notbase64", "ca.crt": base64.b64encode(b"x").decode()}})
    assert data == {"tls.crt": b"", "ca.crt": b"x"}
    verdict = rn.assess_secret({**data, "ca.key": b"y"}, NAMES, NOW, WINDOW)
    assert verdict.action is rn.Action.REPLACE_CA


def test_secret_manifest_keeps_foreign_metadata(good: dict[str, bytes]) -> None:
    existing = {"name": "s", "namespace": "ns", "resourceVersion": "7", "uid": "u",
                "labels": {"team": "gpu"}, "ownerReferences": [{"kind": "Deployment", "name": "x"}],
                "managedFields": [{"manager": "kubectl"}]}
    body = rn.secret_manifest("s", "ns", good, reason="r", now=NOW, resource_version="7", base_metadata=existing)
    assert body["type"] == "kubernetes.io/tls"
    assert body["metadata"]["resourceVersion"] == "7"
    assert body["metadata"]["ownerReferences"] == existing["ownerReferences"]
    assert body["metadata"]["labels"]["team"] == "gpu"
    assert body["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gpufence-certs"
    assert body["metadata"]["annotations"][rn.RENEWED_AT_ANNOTATION] == "2030-06-01T12:00:00Z"
    assert "managedFields" not in body["metadata"]
    assert {k: base64.b64decode(v) for k, v in body["data"].items()} == good


def test_ca_bundle_patch_only_touches_entries_that_differ() -> None:
    pem = b"-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n"
    wanted = base64.b64encode(pem).decode()
    config = {"webhooks": [
        {"name": "a.gpufence.io", "clientConfig": {"service": {"name": "s"}, "caBundle": wanted}},
        {"name": "b.gpufence.io", "clientConfig": {"service": {"name": "s"}}},
        {"name": "c.gpufence.io", "clientConfig": {"service": {"name": "s"}, "caBundle": "b2xk"}},
    ]}
    ops = rn.ca_bundle_patch(config, pem)
    assert rn.changed_webhooks(ops, config) == ["b.gpufence.io", "c.gpufence.io"]
    patched = jsonpatch.apply_patch(config, ops)
    assert all(w["clientConfig"]["caBundle"] == wanted for w in patched["webhooks"])
    assert patched["webhooks"][1]["clientConfig"]["service"] == {"name": "s"}
    assert rn.ca_bundle_patch(patched, pem) == []
    assert rn.ca_bundle_patch({"webhooks": []}, pem) == []
    # The name guard makes a stale patch fail instead of writing into the wrong entry.
    reordered = {"webhooks": list(reversed(config["webhooks"]))}
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(reordered, ops)


@pytest.mark.parametrize(("days", "ca_days", "renew"), [(30, 3650, 30), (365, 20, 30), (365, 3650, -1)])
def test_options_reject_windows_that_would_renew_forever(days: int, ca_days: int, renew: int) -> None:
    opts = bs.BootstrapOptions(days=days, ca_days=ca_days, renew_before=dt.timedelta(days=renew))
    with pytest.raises(ValueError):
        opts.validate()


def test_default_options_are_valid() -> None:
    bs.BootstrapOptions().validate()
    assert bs.BootstrapOptions(extra_dns_names=("x",)).dns_names == [*NAMES, "x"]


def test_path_validation_rejects_a_client_only_certificate(ca: pki.KeyPair) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client")]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=300))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in NAMES]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    data = rn.secret_data(ca.cert_pem, ca.key_pem, pki.KeyPair(cert, key))
    verdict = rn.assess_secret(data, NAMES, NOW, WINDOW)
    assert verdict.action is rn.Action.REISSUE
    assert "fails X.509 path validation" in verdict.reason
