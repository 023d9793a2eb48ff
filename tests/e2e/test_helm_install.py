"""The Helm chart installed with ``helm install`` into a real control plane, checked as the kustomize
install is: the API server accepts every object, the webhook mutates a GPU pod in an opted-in
namespace, with the webhook down the API server refuses it, and the webhook's service account may read
the policy ConfigMap and no other.

The chart gets a control plane of its own (the session's holds the kustomize install, and the
objects' names are fixed), at the oldest supported Kubernetes version. As for the kustomize install
(tests/e2e/gpufence_install.py), the webhook runs as a local process, so the one change to what the
chart renders is each webhook's clientConfig, made by a Helm post-renderer (the
documented hook for that), not by editing the chart's output by hand.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e import kube
from tests.e2e.binaries import KUBERNETES_VERSIONS
from tests.e2e.controlplane import ControlPlane, control_plane_for, free_port
from tests.e2e.gpufence_install import (
    NAMESPACE,
    REPO,
    WebhookProcess,
    generate_webhook_certs,
    service_account_kubeconfig,
    set_ca_bundle,
)
from tests.support.tlsutil import SecretVolume

CHART = REPO / "charts" / "gpufence"
RELEASE = "gpufence"

# A Helm post-renderer: stdin is the rendered manifest, stdout what Helm installs.
POST_RENDERER = '''#!{python}
import sys, yaml
url = sys.argv[1]
objects = [o for o in yaml.safe_load_all(sys.stdin) if o]
for obj in objects:
    if obj["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for hook in obj["webhooks"]:
            hook["clientConfig"] = {{"url": url + hook["clientConfig"]["service"]["path"]}}
yaml.safe_dump_all(objects, sys.stdout)
'''


@pytest.fixture(scope="module")
def helm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    version = KUBERNETES_VERSIONS[0]
    with control_plane_for(version, tmp_path_factory.mktemp(f"helm-k8s-{version}")) as cp:
        yield cp


@pytest.fixture(scope="module")
def helm_installed(helm: Path, helm_cluster: ControlPlane) -> Iterator[tuple[WebhookProcess, str]]:
    cp = helm_cluster
    workdir = cp.workdir / "gpufence-helm"
    workdir.mkdir()
    ca_file, cert_file, key_file = generate_webhook_certs(workdir / "webhook-certs")
    secret = SecretVolume(workdir / "webhook-secret")
    secret.write(cert_file.read_bytes(), key_file.read_bytes())
    port = free_port()
    renderer = workdir / "post-render"
    renderer.write_text(POST_RENDERER.format(python=sys.executable))
    renderer.chmod(renderer.stat().st_mode | stat.S_IXUSR)
    result = subprocess.run(
        [str(helm), "install", RELEASE, str(CHART), "--kubeconfig", str(cp.admin_kubeconfig),
         "--post-renderer", str(renderer), "--post-renderer-args", f"https://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    set_ca_bundle(cp, ca_file.read_bytes())  # what the certs Job does
    kubeconfig = service_account_kubeconfig(cp, NAMESPACE, "gpufence-webhook", workdir / "webhook.kubeconfig")
    hook = WebhookProcess(cp, workdir, secret, ca_file, workdir / "webhook-certs" / "ca.key", kubeconfig, port)
    hook.start()
    try:
        yield hook, result.stdout
    finally:
        if hook.component is not None and hook.component.process.poll() is None:
            hook.stop()


def test_helm_install_is_deployed_with_every_object(helm: Path, helm_cluster: ControlPlane,
                                                    helm_installed: tuple[WebhookProcess, str]) -> None:
    _, output = helm_installed
    assert "STATUS: deployed" in output
    status = subprocess.run([str(helm), "status", RELEASE, "-o", "json", "--kubeconfig",
                             str(helm_cluster.admin_kubeconfig)], capture_output=True, text=True, timeout=60,
                            check=True)  # fmt: skip
    manifest = [o for o in yaml.safe_load_all(json.loads(status.stdout)["manifest"]) if o]
    assert len(manifest) >= 18
    for obj in manifest:
        kind, meta = obj["kind"], obj["metadata"]
        args = ["get", kind, meta["name"], "-o", "json"] + (["-n", meta["namespace"]] if "namespace" in meta else [])
        live = json.loads(helm_cluster.kubectl(*args).stdout)
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm", (kind, meta["name"])


def test_webhook_of_the_helm_install_mutates_and_fails_closed(
    helm_cluster: ControlPlane, helm_installed: tuple[WebhookProcess, str],
) -> None:
    hook, _ = helm_installed
    admin = kube.api_client(helm_cluster.admin_kubeconfig)
    namespace = kube.create_namespace(admin, "team", kube.OPT_IN)
    mutated = kube.create_pod(admin, namespace, kube.gpu_pod())
    assert mutated.admitted, mutated.message
    assert kube.is_mutated(mutated.obj)

    hook.stop("KILL")  # failurePolicy Fail: the API server refuses every new pod of the namespace
    for pod in (kube.gpu_pod(), kube.plain_pod()):
        down = kube.create_pod(admin, namespace, pod)
        assert kube.outage_problem(down) is None, down.message


def test_webhook_of_the_helm_install_reads_the_policy_configmap_and_no_other(
    helm_cluster: ControlPlane, helm_installed: tuple[WebhookProcess, str],
) -> None:
    hook, _ = helm_installed
    policy = json.loads(helm_cluster.kubectl("get", "configmap", "gpufence-policy", "-n", NAMESPACE, "-o", "json",
                                             kubeconfig=hook.kubeconfig).stdout)  # fmt: skip
    assert policy["data"]["default-mode"] == "enforce"  # read with the webhook's own service account

    def allowed(verb: str, resource: str) -> str:
        result = helm_cluster.kubectl("auth", "can-i", verb, resource, "-n", NAMESPACE,
                                      f"--as=system:serviceaccount:{NAMESPACE}:gpufence-webhook", check=False)
        return result.stdout.strip()

    assert [allowed(verb, "configmap/gpufence-policy") for verb in ("get", "list", "watch")] == ["yes"] * 3
    assert allowed("get", "configmap/kube-root-ca.crt") == "no"
    assert allowed("update", "configmap/gpufence-policy") == "no"
