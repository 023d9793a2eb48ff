"""``gpufence-certs bootstrap`` (and ``inspect --secret``) against a fake Kubernetes API server."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.x509 import verification

from gpufence.certs import cli, pki
from gpufence.certs import renewal as rn
from tests.support.fake_kube_api import FakeKubeApi

NS = "gpufence"
SECRET = "gpufence-webhook-tls"
NAMES = pki.service_dns_names("gpufence-webhook", NS)
SECRET_PATH = f"/api/v1/namespaces/{NS}/secrets/{SECRET}"
SECRETS_PATH = f"/api/v1/namespaces/{NS}/secrets"
MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/gpufence"
VWC_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/gpufence"
MUTATING, VALIDATING = "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"
# The webhooks of the two configurations, both named gpufence, served by the same Service and CA.
WEBHOOKS = {MUTATING: [("inject.gpufence.io", "/mutate"), ("debug.gpufence.io", "/mutate")],
            VALIDATING: [("verify.gpufence.io", "/validate")]}
ALL_WEBHOOKS = [name for entries in WEBHOOKS.values() for name, _ in entries]


def webhook_configuration(ca_bundle: str | None = None, kind: str = MUTATING) -> dict[str, Any]:
    def entry(name: str, path: str) -> dict[str, Any]:
        client_config: dict[str, Any] = {"service": {"name": "gpufence-webhook", "namespace": NS, "path": path,
                                                     "port": 443}}
        if ca_bundle is not None:
            client_config["caBundle"] = ca_bundle
        return {"name": name, "clientConfig": client_config, "sideEffects": "None",
                "admissionReviewVersions": ["v1"], "failurePolicy": "Fail"}
    return {"kind": kind, "metadata": {"name": "gpufence"},
            "webhooks": [entry(name, path) for name, path in WEBHOOKS[kind]]}


def put_webhook_configurations(api: FakeKubeApi, ca_bundle: str | None = None) -> None:
    for kind in WEBHOOKS:
        api.put_webhook_configuration(webhook_configuration(ca_bundle, kind))


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as fake:
        put_webhook_configurations(fake)
        yield fake


@pytest.fixture
def kubeconfig(api: FakeKubeApi, tmp_path: Path) -> str:
    return str(api.write_kubeconfig(tmp_path / "kubeconfig"))


def bootstrap(kubeconfig: str, *extra: str) -> int:
    return cli.main(["bootstrap", "--kubeconfig", kubeconfig, *extra])


def stored(api: FakeKubeApi) -> dict[str, bytes]:
    return rn.decode_secret_data(api.secrets[(NS, SECRET)])


def bundles(api: FakeKubeApi, kind: str | None = None) -> list[bytes]:
    """The caBundle of every webhook of ``kind`` (None: of both configurations), decoded."""
    return [base64.b64decode(w["clientConfig"]["caBundle"])
            for k in ([kind] if kind else WEBHOOKS) for w in api.configurations_of(k)["gpufence"]["webhooks"]]


def events(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def put_secret(api: FakeKubeApi, data: dict[str, bytes], **extra: Any) -> None:
    api.put_secret(NS, {"metadata": {"name": SECRET, **extra.pop("metadata", {})}, "type": "kubernetes.io/tls",
                        "data": {k: base64.b64encode(v).decode() for k, v in data.items()}, **extra})


def aged_secret(serving_days: int, issued_days_ago: int, ca: pki.KeyPair | None = None,
                names: list[str] = NAMES) -> tuple[dict[str, bytes], pki.KeyPair]:
    now = dt.datetime.now(dt.UTC)
    ca = ca or pki.make_ca(now=now - dt.timedelta(days=issued_days_ago))
    serving = pki.make_serving_cert(ca, names, days=serving_days, now=now - dt.timedelta(days=issued_days_ago))
    return rn.secret_data(ca.cert_pem, ca.key_pem, serving), ca


def test_first_run_creates_secret_and_patches_every_ca_bundle(api: FakeKubeApi, kubeconfig: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert bootstrap(kubeconfig) == 0
    assert api.calls() == [("GET", SECRET_PATH), ("POST", SECRETS_PATH), ("GET", MWC_PATH), ("PATCH", MWC_PATH),
                           ("GET", VWC_PATH), ("PATCH", VWC_PATH)]
    post, patch, vpatch = api.requests[1], api.requests[3], api.requests[5]
    assert post.content_type == "application/json"
    assert post.body["type"] == "kubernetes.io/tls"
    assert post.body["metadata"]["name"] == SECRET and "resourceVersion" not in post.body["metadata"]
    assert patch.content_type == vpatch.content_type == "application/json-patch+json"
    assert [op["op"] for op in patch.body] == ["test", "add", "test", "add"]
    assert vpatch.body[0] == {"op": "test", "path": "/webhooks/0/name", "value": "verify.gpufence.io"}
    assert [op["op"] for op in vpatch.body] == ["test", "add"]

    data = stored(api)
    assert sorted(data) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    assert bundles(api, MUTATING) == [data["ca.crt"]] * 2
    assert bundles(api, VALIDATING) == [data["ca.crt"]]
    ca, leaf = pki.load_cert(data["ca.crt"]), pki.load_cert(data["tls.crt"])
    assert pki.load_key(data["tls.key"]).public_key() == leaf.public_key()
    for name in NAMES:
        verifier = verification.PolicyBuilder().store(verification.Store([ca])).build_server_verifier(
            verification.DNSName(name))
        verifier.verify(leaf, [])
    # the rest of the webhook entries is untouched
    for kind in WEBHOOKS:
        for webhook, (name, path) in zip(api.configurations_of(kind)["gpufence"]["webhooks"], WEBHOOKS[kind],
                                         strict=True):
            assert webhook["name"] == name and webhook["failurePolicy"] == "Fail"
            assert webhook["clientConfig"]["service"] == {"name": "gpufence-webhook", "namespace": NS, "path": path,
                                                          "port": 443}
    captured = capsys.readouterr()
    assert "replace_ca (secret does not exist)" in captured.out
    assert "caBundle patched in inject.gpufence.io, debug.gpufence.io, verify.gpufence.io" in captured.out
    logged = events(captured.err)
    assert "secret_created" in [e["event"] for e in logged]
    assert [(e["kind"], e["name"], e["webhooks"]) for e in logged if e["event"] == "ca_bundle_patched"] == [
        (MUTATING, "gpufence", ["inject.gpufence.io", "debug.gpufence.io"]),
        (VALIDATING, "gpufence", ["verify.gpufence.io"]),
    ]


def test_second_run_only_reads(api: FakeKubeApi, kubeconfig: str) -> None:
    assert bootstrap(kubeconfig) == 0
    secret_before = api.secrets[(NS, SECRET)]
    mwc_before = api.webhook_configurations["gpufence"]
    vwc_before = api.validating_webhook_configurations["gpufence"]
    api.clear_requests()
    assert bootstrap(kubeconfig) == 0
    assert api.calls() == [("GET", SECRET_PATH), ("GET", MWC_PATH), ("GET", VWC_PATH)]
    assert api.secrets[(NS, SECRET)] is secret_before
    assert api.webhook_configurations["gpufence"] is mwc_before
    assert api.validating_webhook_configurations["gpufence"] is vwc_before


def test_expiring_serving_cert_is_renewed_with_same_ca_and_bundle_kept(api: FakeKubeApi, kubeconfig: str) -> None:
    data, ca = aged_secret(serving_days=365, issued_days_ago=350)
    put_secret(api, data, metadata={"ownerReferences": [{"kind": "Deployment", "name": "x", "uid": "1",
                                                           "apiVersion": "apps/v1"}]})
    put_webhook_configurations(api, base64.b64encode(ca.cert_pem).decode())
    rv = api.secrets[(NS, SECRET)]["metadata"]["resourceVersion"]
    assert bootstrap(kubeconfig) == 0
    assert api.calls() == [("GET", SECRET_PATH), ("PUT", SECRET_PATH), ("GET", MWC_PATH), ("GET", VWC_PATH)]
    put = api.requests[1]
    assert put.body["metadata"]["resourceVersion"] == rv
    assert put.body["metadata"]["ownerReferences"][0]["name"] == "x"
    assert "tls.crt expires at" in put.body["metadata"]["annotations"][rn.RENEW_REASON_ANNOTATION]
    new = stored(api)
    assert new["ca.crt"] == data["ca.crt"] and new["ca.key"] == data["ca.key"]
    assert new["tls.crt"] != data["tls.crt"]
    assert rn.assess_secret(new, NAMES, dt.datetime.now(dt.UTC), dt.timedelta(days=30)).action is rn.Action.KEEP
    assert bundles(api) == [data["ca.crt"]] * 3


def test_expired_ca_is_replaced_and_bundle_updated(api: FakeKubeApi, kubeconfig: str) -> None:
    now = dt.datetime.now(dt.UTC)
    old_ca = pki.make_ca(days=400, now=now - dt.timedelta(days=390))
    data, _ = aged_secret(serving_days=365, issued_days_ago=100, ca=old_ca)
    put_secret(api, data)
    put_webhook_configurations(api, base64.b64encode(old_ca.cert_pem).decode())
    assert bootstrap(kubeconfig) == 0
    assert api.calls() == [("GET", SECRET_PATH), ("PUT", SECRET_PATH), ("GET", MWC_PATH), ("PATCH", MWC_PATH),
                           ("GET", VWC_PATH), ("PATCH", VWC_PATH)]
    new = stored(api)
    assert new["ca.crt"] != old_ca.cert_pem
    assert bundles(api, MUTATING) == [new["ca.crt"]] * 2
    assert bundles(api, VALIDATING) == [new["ca.crt"]]


@pytest.mark.parametrize("case", ["garbage", "key mismatch", "other names", "other CA"])
def test_invalid_secret_is_replaced(case: str, api: FakeKubeApi, kubeconfig: str) -> None:
    data, ca = aged_secret(serving_days=365, issued_days_ago=1)
    if case == "garbage":
        data["tls.crt"] = b"garbage"
    elif case == "key mismatch":
        data["tls.key"] = pki.make_serving_cert(ca, NAMES).key_pem
    elif case == "other names":
        data = aged_secret(365, 1, ca=ca, names=["gpufence-webhook.elsewhere.svc"])[0]
    else:
        other = aged_secret(365, 1)[0]
        data["tls.crt"], data["tls.key"] = other["tls.crt"], other["tls.key"]
    put_secret(api, data)
    put_webhook_configurations(api, base64.b64encode(ca.cert_pem).decode())
    assert bootstrap(kubeconfig) == 0
    assert [c[0] for c in api.calls()] == ["GET", "PUT", "GET", "GET"]  # same CA: caBundles already right
    new = stored(api)
    assert new["ca.crt"] == ca.cert_pem
    assert rn.assess_secret(new, NAMES, dt.datetime.now(dt.UTC), dt.timedelta(days=30)).action is rn.Action.KEEP
    api.clear_requests()
    assert bootstrap(kubeconfig) == 0
    assert not api.writes()


def test_partial_ca_bundle_patches_only_the_stale_entry(api: FakeKubeApi, kubeconfig: str) -> None:
    assert bootstrap(kubeconfig) == 0
    config = api.webhook_configurations["gpufence"]
    config["webhooks"][1]["clientConfig"]["caBundle"] = base64.b64encode(b"stale").decode()
    api.clear_requests()
    assert bootstrap(kubeconfig) == 0
    assert api.calls() == [("GET", SECRET_PATH), ("GET", MWC_PATH), ("PATCH", MWC_PATH), ("GET", VWC_PATH)]
    assert api.requests[2].body == [
        {"op": "test", "path": "/webhooks/1/name", "value": "debug.gpufence.io"},
        {"op": "add", "path": "/webhooks/1/clientConfig/caBundle",
         "value": config["webhooks"][0]["clientConfig"]["caBundle"]},
    ]


def test_stale_validating_bundle_alone_is_patched(api: FakeKubeApi, kubeconfig: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert bootstrap(kubeconfig) == 0
    api.validating_webhook_configurations["gpufence"]["webhooks"][0]["clientConfig"].pop("caBundle")
    api.clear_requests()
    capsys.readouterr()
    assert bootstrap(kubeconfig) == 0
    assert api.calls() == [("GET", SECRET_PATH), ("GET", MWC_PATH), ("GET", VWC_PATH), ("PATCH", VWC_PATH)]
    assert bundles(api) == [stored(api)["ca.crt"]] * 3
    assert "caBundle patched in verify.gpufence.io" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("method", "path", "verb", "resource", "role"),
    [
        ("GET", SECRET_PATH, "get", "secrets", "Role gpufence-certs"),
        ("POST", SECRETS_PATH, "create", "secrets", "Role gpufence-certs"),
        ("GET", MWC_PATH, "get", "mutatingwebhookconfigurations", "ClusterRole gpufence-certs"),
        ("PATCH", MWC_PATH, "patch", "mutatingwebhookconfigurations", "ClusterRole gpufence-certs"),
        ("GET", VWC_PATH, "get", "validatingwebhookconfigurations", "ClusterRole gpufence-certs"),
        ("PATCH", VWC_PATH, "patch", "validatingwebhookconfigurations", "ClusterRole gpufence-certs"),
    ],
)
def test_forbidden_names_verb_resource_and_role(method: str, path: str, verb: str, resource: str, role: str,
                                                api: FakeKubeApi, kubeconfig: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    api.fail(method, f"^{path}$", 403)
    assert bootstrap(kubeconfig) == 1
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("gpufence-certs: error:"))
    assert f"not allowed to {verb} {resource}" in line
    assert f"grant verb '{verb}' on '{resource}'" in line and role in line
    assert "is forbidden" in line  # the API server's own message
    if resource.endswith("webhookconfigurations"):
        assert f"{resource} 'gpufence'" in line and f'{resource} "gpufence" is forbidden' in line
    if resource == "secrets":
        assert "(namespace gpufence)" in line
    # Nothing after the refused call: the mutating configuration is patched first, the validating one last.
    unpatched = [VALIDATING] if resource == "validatingwebhookconfigurations" else list(WEBHOOKS)
    for kind in unpatched:
        assert all("caBundle" not in w["clientConfig"] for w in api.configurations_of(kind)["gpufence"]["webhooks"])


def test_missing_webhook_configuration(api: FakeKubeApi, kubeconfig: str, capsys: pytest.CaptureFixture[str]) -> None:
    del api.webhook_configurations["gpufence"]
    assert bootstrap(kubeconfig) == 1
    err = capsys.readouterr().err
    assert "mutatingwebhookconfigurations 'gpufence' not found" in err
    assert "MutatingWebhookConfiguration 'gpufence'" in err
    # the Secret was still made valid, so a retry of the Job only has to patch the bundles
    assert (NS, SECRET) in api.secrets
    assert VWC_PATH not in [path for _, path in api.calls()]


def test_missing_validating_configuration_is_an_error_after_the_mutating_one_is_set(
        api: FakeKubeApi, kubeconfig: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Half an install (or the Job between two objects of a fresh one): the Job fails and retries,
    because verify.gpufence.io fails closed and would refuse every pod without its caBundle."""
    del api.validating_webhook_configurations["gpufence"]
    assert bootstrap(kubeconfig) == 1
    assert api.calls() == [("GET", SECRET_PATH), ("POST", SECRETS_PATH), ("GET", MWC_PATH), ("PATCH", MWC_PATH),
                           ("GET", VWC_PATH)]
    assert bundles(api, MUTATING) == [stored(api)["ca.crt"]] * 2
    err = capsys.readouterr().err
    assert "validatingwebhookconfigurations 'gpufence' not found" in err
    # Once the install has it, the retry sets its caBundle.
    api.put_webhook_configuration(webhook_configuration(kind=VALIDATING))
    api.clear_requests()
    assert bootstrap(kubeconfig) == 0
    assert api.calls() == [("GET", SECRET_PATH), ("GET", MWC_PATH), ("GET", VWC_PATH), ("PATCH", VWC_PATH)]
    assert bundles(api) == [stored(api)["ca.crt"]] * 3


def test_conflict_is_retried(api: FakeKubeApi, kubeconfig: str) -> None:
    api.fail("POST", f"^{SECRETS_PATH}$", 409, 'secrets "gpufence-webhook-tls" already exists', times=1)
    assert bootstrap(kubeconfig) == 0
    assert [c[0] for c in api.calls()] == ["GET", "POST", "GET", "POST", "GET", "PATCH", "GET", "PATCH"]
    assert bundles(api) == [stored(api)["ca.crt"]] * 3


def test_secret_of_wrong_type_is_an_error(api: FakeKubeApi, kubeconfig: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    api.put_secret(NS, {"metadata": {"name": SECRET}, "type": "Opaque", "data": {}})
    assert bootstrap(kubeconfig) == 1
    assert "has type 'Opaque'" in capsys.readouterr().err
    assert not api.writes()


def test_custom_names_and_unusable_windows(api: FakeKubeApi, kubeconfig: str) -> None:
    for kind in WEBHOOKS:
        api.put_webhook_configuration({**webhook_configuration(kind=kind), "metadata": {"name": "hooks"}})
    assert bootstrap(kubeconfig, "--namespace", "sys", "--secret", "tls", "--service", "svc",
                     "--webhook-configuration", "hooks", "--dns-name", "svc.example.com", "--days", "90") == 0
    data = rn.decode_secret_data(api.secrets[("sys", "tls")])
    for kind in WEBHOOKS:
        hooks = api.configurations_of(kind)["hooks"]["webhooks"]
        assert [base64.b64decode(w["clientConfig"]["caBundle"]) for w in hooks] == [data["ca.crt"]] * len(hooks)
    for kind in WEBHOOKS:  # the configurations named gpufence are not touched
        assert all("caBundle" not in w["clientConfig"] for w in api.configurations_of(kind)["gpufence"]["webhooks"])
    leaf = pki.load_cert(data["tls.crt"])
    assert rn._uncovered_names(leaf, ["svc", "svc.sys.svc.cluster.local", "svc.example.com"]) == []
    api.clear_requests()
    assert bootstrap(kubeconfig, "--days", "20") == 2
    assert api.requests == []


def test_unauthenticated_client_gets_clear_error(api: FakeKubeApi, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = api.write_kubeconfig(tmp_path / "kc")
    path.write_text(path.read_text().replace(api.token, "wrong"))
    assert bootstrap(str(path)) == 1
    assert "rejected our credentials when trying to get secrets" in capsys.readouterr().err


def test_unreachable_api_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeKubeApi().start()
    path = fake.write_kubeconfig(tmp_path / "kc")
    fake.stop()
    assert bootstrap(str(path)) == 1
    assert "cannot get secrets 'gpufence-webhook-tls'" in capsys.readouterr().err


# ---- inspect --secret ------------------------------------------------------------------------


def inspect_secret(kubeconfig: str, *extra: str) -> int:
    return cli.main(["inspect", "--secret", SECRET, "--namespace", NS, "--kubeconfig", kubeconfig, *extra])


def test_inspect_secret(api: FakeKubeApi, kubeconfig: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert bootstrap(kubeconfig) == 0
    capsys.readouterr()
    api.clear_requests()
    assert inspect_secret(kubeconfig) == 0
    out = capsys.readouterr().out
    assert "secret/gpufence/gpufence-webhook-tls:tls.crt:" in out
    assert "secret/gpufence/gpufence-webhook-tls:ca.crt:" in out
    assert "DNS:gpufence-webhook.gpufence.svc.cluster.local" in out and "issuer:     CN=gpufence-ca" in out
    assert inspect_secret(kubeconfig, "--warn-days", "400") == 1
    assert not api.writes()


def test_inspect_secret_expiring_and_unreadable(api: FakeKubeApi, kubeconfig: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_secret(kubeconfig) == 2  # missing
    assert "not found" in capsys.readouterr().err
    data, _ = aged_secret(serving_days=30, issued_days_ago=20)
    put_secret(api, data)
    assert inspect_secret(kubeconfig) == 1
    assert inspect_secret(kubeconfig, "--warn-days", "5") == 0
    put_secret(api, {**data, "tls.crt": b"garbage"})
    assert inspect_secret(kubeconfig) == 2
    api.fail("GET", SECRET_PATH, 403)
    assert inspect_secret(kubeconfig) == 2
    assert "not allowed to get secrets" in capsys.readouterr().err
