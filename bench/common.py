"""Shared helpers of the benchmarks: environment facts, statistics, docs/PERFORMANCE.md sections,
test PKI with a Kubernetes-style Secret volume, sample pods, and server subprocess launchers.

Nothing here is imported by the product; the benchmarks (and the hardening tests) only.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import re
import shlex
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.support.tlsutil import SecretVolume

REPO_ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE_MD = REPO_ROOT / "docs" / "PERFORMANCE.md"
SANS = ["localhost", "127.0.0.1"]


# --- environment and statistics -----------------------------------------------------------------
def environment() -> dict[str, str]:
    import aiohttp

    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()),
        "affinity": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "openssl": ssl.OPENSSL_VERSION,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for an empty sequence."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def command_line() -> str:
    """The command that reproduces this run (as typed from the repository root)."""
    module = sys.modules["__main__"].__spec__
    prog = f"python -m {module.name}" if module is not None else f"python {sys.argv[0]}"
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    out = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(out)


def write_section(name: str, title: str, body: str, *, command: str | None = None,
                  path: Path = PERFORMANCE_MD) -> None:
    """Replace (or append) the section ``name`` of docs/PERFORMANCE.md, between marker comments."""
    env = environment()
    header = (
        f"## {title}\n\n"
        f"Reproduce: `{command or command_line()}`  \n"
        f"Measured {env['date']}; nproc {env['nproc']}, load average {env['load']}; Python {env['python']}, "
        f"aiohttp {env['aiohttp']}, {env['openssl']}.\n\n"
    )
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{header}{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# gpufence performance\n\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    found = pattern.search(text)
    text = pattern.sub(lambda _: block, text) if found else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


# --- CPU placement --------------------------------------------------------------------------------
def cpu_plan() -> tuple[set[int] | None, set[int] | None]:
    """(server CPUs, load generator CPUs): disjoint when there are at least two CPUs, else (None, None)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return {cpus[0]}, set(cpus[1:2])


def pin(pid: int, cpus: set[int] | None) -> None:
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, cpus)


# --- PKI ------------------------------------------------------------------------------------------
@dataclass
class Pki:
    ca: Any
    ca_file: Path
    volume: SecretVolume
    serial: int = 0

    @classmethod
    def create(cls, root: Path) -> Pki:
        from gpufence.certs.pki import make_ca
        from tests.support.tlsutil import SecretVolume  # a Secret volume rotated as the kubelet does

        root.mkdir(parents=True, exist_ok=True)
        ca = make_ca()
        ca_file = root / "ca.crt"
        ca_file.write_bytes(ca.cert_pem)
        pki = cls(ca, ca_file, SecretVolume(root / "secret"))
        pki.rotate()
        return pki

    def rotate(self) -> int:
        """Write a new serving pair signed by the same CA; returns its serial."""
        from gpufence.certs.pki import make_serving_cert

        pair = make_serving_cert(self.ca, SANS)
        self.volume.write(pair.cert_pem, pair.key_pem)
        self.serial = pair.cert.serial_number
        return self.serial

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
        return ctx


# --- sample pods and reviews ----------------------------------------------------------------------
def admission_review(pod: dict[str, Any], uid: str = "00000000-0000-0000-0000-000000000001",
                     namespace: str = "team-a", operation: str = "CREATE") -> dict[str, Any]:
    from gpufence.webhook.client import pod_admission_review

    return pod_admission_review(pod, uid=uid, namespace=namespace, operation=operation)


def small_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "cuda", "namespace": "team-a", "annotations": {"gpufence.io/memory": "8Gi"}},
        "spec": {"containers": [{"name": "cuda", "image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }


def typical_pod() -> dict[str, Any]:
    """A training pod as a Job controller would create it: 3 containers, 30 env vars, volumes."""

    def env(prefix: str, n: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"name": f"{prefix}_VAR_{i}", "value": f"value-{i}-" + "x" * 24} for i in range(n)]
        out.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}})
        return out

    def container(name: str, gpu: bool, n_env: int) -> dict[str, Any]:
        resources: dict[str, Any] = {"requests": {"cpu": "4", "memory": "32Gi"},
                                     "limits": {"cpu": "8", "memory": "64Gi"}}
        if gpu:
            resources["limits"]["nvidia.com/gpu"] = "1"
        return {
            "name": name, "image": f"registry.example.com/ml/{name}:2024.06.1",
            "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-m", f"ml.{name}"], "args": ["--config", "/etc/train/config.yaml", "--epochs", "90"],
            "env": env(name.upper(), n_env),
            "resources": resources,
            "ports": [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}],
            "volumeMounts": [
                {"name": "data", "mountPath": "/data", "readOnly": True},
                {"name": "config", "mountPath": "/etc/train"},
                {"name": "dshm", "mountPath": "/dev/shm"},
                {"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                 "readOnly": True},
            ],
            "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }

    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "generateName": "resnet-train-", "namespace": "team-a",
            "labels": {"app": "resnet", "job-name": "resnet-train", "controller-uid": "6c1f3a8e-8f0e"},
            "annotations": {"gpufence.io/memory": "20Gi", "gpufence.io/memory.eval": "10%",
                            "gpufence.io/compute": "50", "gpufence.io/grace-period": "30",
                            "prometheus.io/scrape": "true"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "resnet-train",
                                 "uid": "6c1f3a8e-8f0e", "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "restartPolicy": "Never", "serviceAccountName": "trainer", "schedulerName": "default-scheduler",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "containers": [container("train", True, 10), container("eval", True, 10), container("logger", False, 8)],
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": "imagenet"}},
                {"name": "config", "configMap": {"name": "resnet-config"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                {"name": "kube-api-access-abcde", "projected": {"sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}},
            ],
        },
    }


def huge_pod(target_bytes: int = 1 << 20) -> dict[str, Any]:
    """A GPU pod of about ``target_bytes`` of JSON: a large annotation plus many env vars."""
    pod = typical_pod()
    pod["metadata"]["annotations"]["example.com/blob"] = "a" * (target_bytes // 2)
    per = 64
    n = (target_bytes // 2) // (per + 30)
    pod["spec"]["containers"][0]["env"] += [{"name": f"BULK_{i}", "value": "v" * per} for i in range(n)]
    return pod


def denied_pod() -> dict[str, Any]:
    pod = small_pod()
    pod["metadata"]["annotations"]["gpufence.io/memory"] = "lots"
    return pod


def plain_pod() -> dict[str, Any]:
    pod = small_pod()
    del pod["spec"]["containers"][0]["resources"]
    return pod


def mixed_bodies() -> list[tuple[str, bytes]]:
    """(kind, body) for mixed traffic: mutated, denied, skipped, 400 malformed JSON, 400 wrong envelope."""
    wrong = admission_review(small_pod())
    wrong["apiVersion"] = "admission.k8s.io/v1beta1"
    return [
        ("typical", json.dumps(admission_review(typical_pod())).encode()),
        ("small", json.dumps(admission_review(small_pod())).encode()),
        ("denied", json.dumps(admission_review(denied_pod())).encode()),
        ("skipped", json.dumps(admission_review(plain_pod())).encode()),
        ("bad-json", b'{"apiVersion": "admission.k8s.io/v1", "kind": '),
        ("bad-envelope", json.dumps(wrong).encode()),
    ]


# --- servers --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {port} after {timeout}s")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFENCE_", "KUBERNETES_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["KUBECONFIG"] = os.devnull  # never a real cluster: all namespaces opted in
    return env


@contextlib.contextmanager
def gpufence_server(pki: Pki, *, cpus: set[int] | None = None, reload_interval: str = "1s",
                    log_path: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``python -m webhook`` on 127.0.0.1 (a free port) serving ``pki``'s Secret volume."""
    port = free_port()
    argv = [sys.executable, "-m", "gpufence.webhook", "--port", str(port), "--bind-address", "127.0.0.1",
            "--shutdown-delay", "0",
            "--tls-cert-file", str(pki.volume.cert_file), "--tls-private-key-file", str(pki.volume.key_file),
            "--cert-reload-interval", reload_interval, "--log-level", "warning"]
    with _server(argv, port, cpus, log_path) as proc:
        yield proc, port


@contextlib.contextmanager
def floor_server(pki: Pki, response_file: Path, *, cpus: set[int] | None = None,
                 log_path: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.floor_server", "--port", str(port), "--tls-cert-file",
            str(pki.volume.cert_file), "--tls-private-key-file", str(pki.volume.key_file),
            "--response-file", str(response_file)]
    with _server(argv, port, cpus, log_path) as proc:
        yield proc, port


@contextlib.contextmanager
def _server(argv: list[str], port: int, cpus: set[int] | None,
            log_path: Path | None) -> Iterator[subprocess.Popen[bytes]]:
    log = open(log_path or os.devnull, "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=child_env(), stdout=log, stderr=log)
    try:
        pin(proc.pid, cpus)
        wait_listening(port, proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()


def run_loadgen(args: list[str], *, cpus: set[int] | None = None, timeout: float = 600) -> dict[str, Any]:
    """Run ``python -m bench.loadgen ARGS`` in its own process (pinned to ``cpus``); its JSON result."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.loadgen", *args], cwd=REPO_ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pin(proc.pid, cpus)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise RuntimeError(f"load generator timed out: {err.decode()[-2000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode}): {err.decode()[-2000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])
