"""gpufence installed into a test control plane, as an operator would install it.

``kubectl apply --server-side -k k8s/`` installs everything as shipped. The webhook then runs as a
local process (there is no node to run its Deployment) with the serving pair the project's own
``gpufence-certs generate`` wrote, laid out like a mounted Secret, with a ServiceAccount token of
the install's ``gpufence-webhook`` account (TokenRequest) for its namespace and policy watches, and
with the Deployment's own ``--policy-configmap`` (so it reads the shipped ConfigMap gpufence-policy,
as shipped). The one change to the shipped objects: each webhook's ``clientConfig`` (the
Mutating- and ValidatingWebhookConfiguration gpufence) points at that process by ``url:`` with the
``caBundle`` the cert tooling produced, which is exactly what the certs Job would patch in, plus
the address.
"""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.controlplane import Component, ControlPlane, StartupFailed, free_port, start, write_kubeconfig
from tests.support.tlsutil import SecretVolume

REPO = Path(__file__).resolve().parents[2]
WEBHOOK_CONFIGURATION = "gpufence"
NAMESPACE = "gpufence"
POLICY_CONFIGMAP = "gpufence-policy"
VENV_BIN = Path(sys.executable).parent


def cli(name: str) -> str:
    path = VENV_BIN / name
    return str(path) if path.exists() else shutil.which(name) or name


def service_account_kubeconfig(cp: ControlPlane, namespace: str, name: str, path: Path,
                               duration: str = "2h") -> Path:
    """A kubeconfig holding a real bound token of ``namespace/name`` (TokenRequest API)."""
    token = cp.kubectl("create", "token", name, "-n", namespace, "--duration", duration).stdout.strip()
    return write_kubeconfig(path, cp.server, cp.pki.ca_cert, token=token, user=f"{namespace}-{name}")


@dataclass
class WebhookProcess:
    """The gpufence webhook CLI as a child process on a fixed loopback port (restartable)."""

    cp: ControlPlane
    workdir: Path
    secret: SecretVolume
    ca_file: Path  # the CA the API server trusts for this webhook (its caBundle)
    ca_key_file: Path
    kubeconfig: Path
    port: int
    extra_args: tuple[str, ...] = ()
    component: Component | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def start(self) -> None:
        self.starts += 1
        self.component = start(f"gpufence-webhook-{self.starts}", [
            cli("gpufence-webhook"), "--bind-address", "127.0.0.1", "--port", str(self.port),
            "--tls-cert-file", str(self.secret.cert_file), "--tls-private-key-file", str(self.secret.key_file),
            "--cert-reload-interval", "100ms", "--kubeconfig", str(self.kubeconfig),
            "--shutdown-delay", "0", *self.extra_args,
        ], self.workdir)
        self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Poll /readyz (ready: serving TLS, the namespace cache synced, a valid policy loaded)."""
        deadline = time.monotonic() + timeout
        ctx = self.client_context()
        last = ""
        while time.monotonic() < deadline:
            assert self.component is not None
            self.component.check_alive()
            try:
                with urllib.request.urlopen(self.url + "/readyz", context=ctx, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.05)
        raise StartupFailed(f"gpufence-webhook not ready: {last}\n{self.component.log_tail()}")

    def patch_for(self, namespace: str, pod: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The webhook's patch for a CREATE review of ``pod``, over TLS as the API server sends it."""
        answer = self.review(namespace, pod)
        assert answer["allowed"] is True, answer
        return json.loads(base64.b64decode(answer["patch"])) if "patch" in answer else None

    def review(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
        """The webhook's AdmissionReview response to a CREATE of ``pod`` (allowed or not)."""
        body = {
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                "name": pod["metadata"].get("name", ""), "namespace": namespace, "operation": "CREATE",
                "userInfo": {"username": "e2e"}, "object": pod, "oldObject": None, "dryRun": False,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
            },
        }
        req = urllib.request.Request(self.url + "/mutate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=self.client_context(), timeout=10) as resp:
            return json.loads(resp.read())["response"]

    def wait_until_known(self, namespace: str, timeout: float = 30.0) -> None:
        """Until the webhook's namespace cache has ``namespace``: its watch runs apart from our create,
        and until then the webhook ignores the namespace's labels and annotations (and warns so)."""
        probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
                 "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
        deadline = time.monotonic() + timeout
        while any("not in the webhook's cache" in w for w in self.review(namespace, probe).get("warnings") or []):
            if time.monotonic() > deadline:
                raise AssertionError(f"the webhook did not see namespace {namespace} within {timeout:.0f}s")
            time.sleep(0.05)

    def metric_samples(self, name: str) -> dict[str, float]:
        """The samples of the webhook's metric family ``name`` (its /metrics), by their first label's value."""
        with urllib.request.urlopen(self.url + "/metrics", context=self.client_context(), timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == name:
                return {next(iter(s.labels.values()), s.name): s.value for s in family.samples
                        if not s.name.endswith("_created")}
        raise AssertionError(f"the webhook exports no {name}")

    def request_counts(self) -> dict[str, float]:
        """The webhook's own count of the reviews it answered, by outcome (its /metrics)."""
        return self.metric_samples("gpufence_webhook_requests")

    def stop(self, sig: str = "TERM") -> None:
        if self.component is None:
            return
        if sig == "KILL":
            self.component.process.kill()
            self.component.process.wait()
        else:
            self.component.stop()
        self.component = None

    def log(self) -> str:
        return "".join(
            (self.workdir / f"gpufence-webhook-{n}.log").read_text(errors="replace")
            for n in range(1, self.starts + 1)
            if (self.workdir / f"gpufence-webhook-{n}.log").exists()
        )


def generate_webhook_certs(out_dir: Path) -> tuple[Path, Path, Path]:
    """``gpufence-certs generate`` with 127.0.0.1 added: the project's own tooling, as documented."""
    subprocess.run([cli("gpufence-certs"), "generate", "--out-dir", str(out_dir), "--dns-name", "127.0.0.1"],
                   check=True, capture_output=True, text=True)
    return out_dir / "ca.crt", out_dir / "tls.crt", out_dir / "tls.key"


WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


def _is_gpufence_webhooks(obj: dict[str, Any]) -> bool:
    return obj["kind"] in WEBHOOK_KINDS and obj["metadata"]["name"] == WEBHOOK_CONFIGURATION


def rendered(cp: ControlPlane, kustomization: Path, webhook_url: str) -> list[dict[str, Any]]:
    """``kubectl kustomize`` output with each webhook's Service reference replaced by ``webhook_url``
    and the same path (there is no node to run the Deployment behind the Service); all else as shipped."""
    objects = [o for o in yaml.safe_load_all(cp.kubectl("kustomize", str(kustomization)).stdout) if o]
    for obj in objects:
        if _is_gpufence_webhooks(obj):
            for hook in obj["webhooks"]:
                hook["clientConfig"] = {"url": f"{webhook_url}{hook['clientConfig']['service']['path']}"}
    return objects


def apply_objects(cp: ControlPlane, objects: list[dict[str, Any]], *args: str) -> subprocess.CompletedProcess[str]:
    return cp.kubectl("apply", "--server-side", *args, "-f", "-", input=yaml.safe_dump_all(objects))


def _patch_webhooks(cp: ControlPlane, op: Callable[[int, dict[str, Any]], dict[str, Any]]) -> None:
    for kind in WEBHOOK_KINDS:
        resource = kind.lower()
        config = json.loads(cp.kubectl("get", resource, WEBHOOK_CONFIGURATION, "-o", "json").stdout)
        ops = [op(i, hook) for i, hook in enumerate(config["webhooks"])]
        cp.kubectl("patch", resource, WEBHOOK_CONFIGURATION, "--type=json", "-p", json.dumps(ops))


def set_ca_bundle(cp: ControlPlane, ca_pem: bytes) -> None:
    """What the certs Job does: patch only each webhook's caBundle, in both configurations."""
    bundle = base64.b64encode(ca_pem).decode()
    _patch_webhooks(cp, lambda i, _: {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle})


def point_webhook_at(cp: ControlPlane, webhook_url: str) -> None:
    """Send the API server's calls to another address (e.g. the benchmark's reference webhook), each
    webhook to the same path there."""
    _patch_webhooks(cp, lambda i, hook: {
        "op": "replace", "path": f"/webhooks/{i}/clientConfig/url",
        "value": webhook_url + "/" + hook["clientConfig"]["url"].split("/", 3)[3]})


def install(cp: ControlPlane, webhook_url: str) -> subprocess.CompletedProcess[str]:
    return apply_objects(cp, rendered(cp, REPO / "k8s", webhook_url))


def shipped_policy_args(objects: list[dict[str, Any]]) -> tuple[str, ...]:
    """The policy arguments of the shipped webhook Deployment (its --policy-configmap), to run it so."""
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "gpufence-webhook"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = tuple(a for a in container["args"] if a.startswith("--policy-configmap="))
    assert args == (f"--policy-configmap={NAMESPACE}/{POLICY_CONFIGMAP}",), container["args"]
    return args


def start_gpufence(cp: ControlPlane, workdir: Path) -> WebhookProcess:
    certs = workdir / "webhook-certs"
    ca_file, cert_file, key_file = generate_webhook_certs(certs)
    secret = SecretVolume(workdir / "webhook-secret")
    secret.write(cert_file.read_bytes(), key_file.read_bytes())
    port = free_port()
    objects = rendered(cp, REPO / "k8s", f"https://127.0.0.1:{port}")
    apply_objects(cp, objects)
    kubeconfig = service_account_kubeconfig(cp, NAMESPACE, "gpufence-webhook", workdir / "webhook.kubeconfig")
    hook = WebhookProcess(cp, workdir, secret, ca_file, certs / "ca.key", kubeconfig, port,
                          extra_args=shipped_policy_args(objects))
    hook.start()
    set_ca_bundle(cp, ca_file.read_bytes())
    return hook
