"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager.

Configured like a production cluster where it matters to gpufence: X.509 client certificates and
ServiceAccount tokens for authentication, ``Node,RBAC`` authorization, the admission plugins a real
cluster enables (PodSecurity, the webhook and policy plugins, ServiceAccount, ResourceQuota,
LimitRanger), and the controller manager running the Deployment, ReplicaSet, Job, namespace,
ServiceAccount-token and quota controllers with per-controller credentials. There is no scheduler
and no node: pods are created and stored, never run (the node is a later test bed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.e2e.binaries import ControlPlaneBinaries, GoMissing, control_plane
from tests.e2e.cluster_pki import ClusterPki, make_cluster_pki
from tests.support.prerequisites import missing, skip_by_design

ADMISSION_PLUGINS = (
    "NamespaceLifecycle", "LimitRanger", "ServiceAccount", "PodSecurity", "MutatingAdmissionWebhook",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionWebhook", "ResourceQuota",
)
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StartupFailed(RuntimeError):
    pass


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise StartupFailed(
                f"{self.name} exited with {self.process.returncode}; last log lines:\n{self.log_tail()}"
            )

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start(name: str, argv: list[str], workdir: Path) -> Component:
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    return Component(name, process, log)


def write_kubeconfig(path: Path, server: str, ca_cert: Path, *, cert: Path | None = None,
                     key: Path | None = None, token: str | None = None, user: str = "user") -> Path:
    credentials: dict[str, str] = {}
    if cert is not None and key is not None:
        credentials = {"client-certificate": str(cert), "client-key": str(key)}
    if token is not None:
        credentials = {"token": token}
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "e2e",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user}}],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclass
class ControlPlane:
    binaries: ControlPlaneBinaries
    workdir: Path
    pki: ClusterPki
    server: str
    admin_kubeconfig: Path
    components: list[Component]

    @property
    def version(self) -> str:
        return self.binaries.version

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return ctx

    def check_alive(self) -> None:
        for component in self.components:
            component.check_alive()

    def kubectl(self, *args: str, kubeconfig: Path | None = None, input: str | None = None,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["kubectl", "--kubeconfig", str(kubeconfig or self.admin_kubeconfig), *args],
            input=input, capture_output=True, text=True, timeout=120,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
        return result

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()


def _wait_ready(cp: ControlPlane, path: str = "/readyz") -> None:
    """Poll until the API server answers 200 on ``path`` (there is no event to await)."""
    ctx = cp.ssl_context()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        cp.check_alive()
        try:
            with urllib.request.urlopen(cp.server + path, context=ctx, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise StartupFailed(f"kube-apiserver not ready after {STARTUP_TIMEOUT_S:.0f}s ({last}):\n"
                        f"{cp.components[1].log_tail()}")


def _wait_for(cp: ControlPlane, what: str, condition, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cp.check_alive()
        if condition():
            return
        time.sleep(0.2)
    raise StartupFailed(f"timed out waiting for {what}")


def start_control_plane(binaries: ControlPlaneBinaries, workdir: Path) -> ControlPlane:
    workdir.mkdir(parents=True, exist_ok=True)
    cluster_pki = make_cluster_pki(workdir / "pki")
    etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
    etcd = start("etcd", [
        str(binaries.etcd), "--data-dir", str(workdir / "etcd"), "--name", "e2e",
        "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
        "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
        "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
        "--initial-cluster", f"e2e=http://127.0.0.1:{etcd_peer}",
        # A throwaway test store: fsync buys no safety here and costs most of a write's latency.
        "--unsafe-no-fsync", "--log-level", "warn",
    ], workdir)
    components = [etcd]
    server = f"https://127.0.0.1:{api_port}"
    admin_kubeconfig = write_kubeconfig(workdir / "admin.kubeconfig", server, cluster_pki.ca_cert,
                                        cert=cluster_pki.admin_cert, key=cluster_pki.admin_key, user="e2e-admin")
    cp = ControlPlane(binaries, workdir, cluster_pki, server, admin_kubeconfig, components)
    try:
        apiserver = start("kube-apiserver", [
            str(binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--cert-dir={workdir / 'apiserver-certs'}",
            f"--tls-cert-file={cluster_pki.serving_cert}", f"--tls-private-key-file={cluster_pki.serving_key}",
            f"--client-ca-file={cluster_pki.ca_cert}",
            f"--service-account-key-file={cluster_pki.sa_pub}",
            f"--service-account-signing-key-file={cluster_pki.sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=" + ",".join(ADMISSION_PLUGINS),
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            # Kubernetes >= 1.35 refuses a loopback advertise address for the `kubernetes` Service's
            # endpoints; nothing here runs in-cluster clients, so nothing reads them.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--v=1",
        ], workdir)
        components.append(apiserver)
        _wait_ready(cp)
        kcm_kubeconfig = write_kubeconfig(workdir / "kcm.kubeconfig", server, cluster_pki.ca_cert,
                                          cert=cluster_pki.kcm_cert, key=cluster_pki.kcm_key,
                                          user="system:kube-controller-manager")
        kcm = start("kube-controller-manager", [
            str(binaries.kube_controller_manager),
            f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}",
            f"--authorization-kubeconfig={kcm_kubeconfig}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={cluster_pki.sa_key}",
            f"--root-ca-file={cluster_pki.ca_cert}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            f"--cert-dir={workdir / 'kcm-certs'}",
            "--controllers=*",
            # Quota and garbage collection react quickly in tests instead of every 5 minutes.
            "--resource-quota-sync-period=5s",
            "--v=1",
        ], workdir)
        components.append(kcm)
        # The ServiceAccount controller creates `default` in every namespace: proof the
        # controller manager is up and authorised.
        _wait_for(cp, "the default ServiceAccount (controller manager running)", lambda: cp.kubectl(
            "get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0)
        if binaries.kube_scheduler is not None:
            # The real scheduler (1.37): it places DRA claims by consumable capacity
            # (tests/e2e/test_dra_capacity.py). There are no nodes but the ones a test creates, so
            # other tests' pods stay Pending (Unschedulable), as before without a scheduler.
            assert cluster_pki.scheduler_cert is not None and cluster_pki.scheduler_key is not None
            scheduler_kubeconfig = write_kubeconfig(
                workdir / "scheduler.kubeconfig", server, cluster_pki.ca_cert, cert=cluster_pki.scheduler_cert,
                key=cluster_pki.scheduler_key, user="system:kube-scheduler")
            scheduler = start("kube-scheduler", [
                str(binaries.kube_scheduler),
                f"--kubeconfig={scheduler_kubeconfig}",
                f"--authentication-kubeconfig={scheduler_kubeconfig}",
                f"--authorization-kubeconfig={scheduler_kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                f"--cert-dir={workdir / 'scheduler-certs'}",
                "--profiling=false",
                "--v=1",
            ], workdir)
            components.append(scheduler)
    except BaseException:
        cp.stop()
        raise
    return cp


@contextlib.contextmanager
def running_control_plane(binaries: ControlPlaneBinaries, workdir: Path) -> Iterator[ControlPlane]:
    cp = start_control_plane(binaries, workdir)
    try:
        yield cp
    finally:
        cp.stop()


@contextlib.contextmanager
def control_plane_for(version: str, workdir: Path) -> Iterator[ControlPlane]:
    """A control plane of ``version`` for a fixture: skipped by design under ``GPUFENCE_SKIP_E2E``,
    missing (a failure under ``CI=true``) where its binaries cannot be built."""
    if os.environ.get("GPUFENCE_SKIP_E2E"):
        skip_by_design("opted-out", f"GPUFENCE_SKIP_E2E={os.environ['GPUFENCE_SKIP_E2E']} set")
    try:
        binaries = control_plane(version)
    except GoMissing as exc:
        missing(f"cannot build Kubernetes {version}: {exc}")
    with running_control_plane(binaries, workdir) as cp:
        yield cp


if __name__ == "__main__":  # manual smoke: python -m tests.e2e.controlplane v1.30.14
    import sys
    import tempfile

    bins = control_plane(sys.argv[1] if len(sys.argv) > 1 else "v1.30.14")
    with tempfile.TemporaryDirectory() as tmp, running_control_plane(bins, Path(tmp)) as cp:
        print(cp.kubectl("version", "-o", "yaml").stdout)
        print(cp.kubectl("get", "ns").stdout)
        os.environ["KUBECONFIG"] = str(cp.admin_kubeconfig)
        if "--shell" in sys.argv:
            subprocess.run(["bash"])
