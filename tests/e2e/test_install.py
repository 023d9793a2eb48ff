"""The shipped manifests against the API server's own validation: server-side apply and dry runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.e2e import kube
from tests.e2e.binaries import crd_files
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import REPO, WEBHOOK_CONFIGURATION, WebhookProcess, apply_objects, install, rendered

OVERLAYS = sorted(p.name for p in (REPO / "k8s" / "overlays").iterdir() if p.is_dir())
CRDS_FOR = {"cert-manager": ["cert-manager"], "monitoring": ["prometheus-operator"],
            "cert-manager-monitoring": ["cert-manager", "prometheus-operator"]}


def test_server_side_apply_is_accepted_and_repeatable(cluster: ControlPlane, gpufence: WebhookProcess):
    bundle = _ca_bundle(cluster)
    again = install(cluster, gpufence.url)  # the fixture applied it once; a second apply must converge
    lines = [line for line in again.stdout.splitlines() if line.strip()]
    assert lines and all(line.endswith("serverside-applied") for line in lines), again.stdout
    assert _ca_bundle(cluster) == bundle, "re-applying the install must keep the caBundle the certs Job set"
    for kind in ("deployments", "services", "serviceaccounts", "jobs"):
        items = json.loads(cluster.kubectl("get", kind, "-A", "-l", "app.kubernetes.io/part-of=gpufence",
                                           "-o", "json").stdout)["items"]
        assert items, f"the install created no {kind}"
    for kind, name in (("mutatingwebhookconfiguration", "gpufence"), ("validatingwebhookconfiguration", "gpufence"),
                       ("validatingadmissionpolicy", "gpufence-protect"),
                       ("validatingadmissionpolicybinding", "gpufence-protect"), ("clusterrole", "gpufence-webhook"),
                       ("clusterrole", "gpufence-enforcer-events"), ("namespace", "gpufence")):
        cluster.kubectl("get", kind, name)


def _ca_bundle(cluster: ControlPlane) -> list[str]:
    return [hook["clientConfig"]["caBundle"]
            for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration")
            for hook in json.loads(cluster.kubectl("get", kind, WEBHOOK_CONFIGURATION, "-o", "json").stdout)[
                "webhooks"]]


def test_shipped_webhook_configuration_passes_a_server_dry_run(cluster: ControlPlane, gpufence: WebhookProcess):
    """The installed copies point at a URL; validate the shipped Service forms under another name."""
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        shipped = next(o for o in yaml.safe_load_all(cluster.kubectl("kustomize", str(REPO / "k8s")).stdout)
                       if o and o["kind"] == kind)
        shipped["metadata"]["name"] = "gpufence-dry-run"
        result = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(shipped))
        assert "created (server dry run)" in result.stdout, result.stdout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_with_its_crds_passes_a_server_dry_run(cluster: ControlPlane, gpufence: WebhookProcess,
                                                       overlay: str, tmp_path: Path):
    for source in CRDS_FOR.get(overlay, []):
        for crd in crd_files(source):
            cluster.kubectl("apply", "--server-side", "-f", str(crd))
    # Not `kubectl wait --for=condition=Established crd --all`: it fails at once on a CRD the API
    # server has not given status.conditions yet (".status.conditions accessor error: <nil>").
    kube.wait_for(lambda: all(
        any(c["type"] == "Established" and c["status"] == "True" for c in crd.get("status", {}).get("conditions") or [])
        for crd in json.loads(cluster.kubectl("get", "crd", "-o", "json").stdout)["items"]),
        "the CRDs to be established")
    objects = rendered(cluster, REPO / "k8s" / "overlays" / overlay, gpufence.url)
    # A server dry run creates nothing, so the objects of a namespace the overlay itself brings
    # (node-guardian's gpufence-node) would be refused as in no namespace: its Namespace is applied
    # for real first, as an install does (the guardian's tests apply the same object server-side).
    namespaces = [o for o in objects if o["kind"] == "Namespace"]
    if namespaces:
        apply_objects(cluster, namespaces)
    result = apply_objects(cluster, objects, "--dry-run=server")
    assert "serverside-applied" in result.stdout, result.stdout
