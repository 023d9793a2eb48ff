"""The test control plane's own PKI: a cluster CA, the API server's serving pair, client certificates.

The gpufence webhook's certificates are NOT made here: the e2e tests take those from the project's
own tooling (``gpufence-certs``), as an operator would. This module only stands in for what
kubeadm would generate for a real cluster.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpufence.certs import pki


def client_cert(ca: pki.KeyPair, user: str, groups: tuple[str, ...] = ()) -> pki.KeyPair:
    """An X.509 client certificate: the API server reads the user from CN and groups from O."""
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        + [x509.NameAttribute(NameOID.COMMON_NAME, user)]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - pki.CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return pki.KeyPair(cert, key)


@dataclass(frozen=True)
class ClusterPki:
    dir: Path
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path  # signs ServiceAccount tokens (API server and controller manager)
    sa_pub: Path
    admin_cert: Path  # system:masters, the test's cluster admin
    admin_key: Path
    kcm_cert: Path  # system:kube-controller-manager, bound by RBAC's bootstrap policy
    kcm_key: Path
    # The CA's key: the node tests sign the kubelet's system:node:<name> client certificate with it.
    ca_key: Path | None = None
    # system:kube-scheduler, bound by RBAC's bootstrap policy (the scheduler runs on 1.37 only).
    scheduler_cert: Path | None = None
    scheduler_key: Path | None = None


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def make_cluster_pki(directory: Path) -> ClusterPki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = pki.make_ca("gpufence-e2e-cluster-ca", days=2)
    serving = pki.make_serving_cert(
        ca, ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "localhost", "127.0.0.1",
             "10.96.0.1"], days=1,
    )
    admin = client_cert(ca, "e2e-admin", ("system:masters",))
    kcm = client_cert(ca, "system:kube-controller-manager")
    scheduler = client_cert(ca, "system:kube-scheduler")
    sa_key = ec.generate_private_key(ec.SECP256R1())
    return ClusterPki(
        dir=directory,
        ca_cert=_write(directory / "ca.crt", ca.cert_pem),
        serving_cert=_write(directory / "apiserver.crt", serving.cert_pem),
        serving_key=_write(directory / "apiserver.key", serving.key_pem),
        sa_key=_write(directory / "sa.key", sa_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())),
        sa_pub=_write(directory / "sa.pub", sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)),
        admin_cert=_write(directory / "admin.crt", admin.cert_pem),
        admin_key=_write(directory / "admin.key", admin.key_pem),
        kcm_cert=_write(directory / "kcm.crt", kcm.cert_pem),
        kcm_key=_write(directory / "kcm.key", kcm.key_pem),
        ca_key=_write(directory / "ca.key", ca.key_pem),
        scheduler_cert=_write(directory / "scheduler.crt", scheduler.cert_pem),
        scheduler_key=_write(directory / "scheduler.key", scheduler.key_pem),
    )
