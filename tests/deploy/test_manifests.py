"""The kustomize install (k8s/), the Dockerfile, and the monitoring content.

Two views of the manifests are checked:

* file by file (always): every YAML object under k8s/ (kustomization files and their inline
  patches aside) is validated against the Kubernetes 1.30 OpenAPI schema (kubernetes-validate,
  strict: unknown fields fail), or, for CRD kinds that schema does not have (cert-manager,
  Prometheus Operator), against a hand-written structural check below;
* rendered (needs ``kubectl``, which bundles kustomize): the base and every overlay are built with
  ``kubectl kustomize`` and each object is validated the same way; the safety checks run on the
  rendered objects, so they see what ``kubectl apply -k`` would apply.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpufence.contract import DEFAULT_METRICS_PORT, INJECTION_ENABLED, INJECTION_LABEL, SIDECAR_PORT_NAME
from gpufence.node.cli import DEFAULT_METRICS_PORT as NODE_METRICS_PORT
from gpufence.webhook.cli import parse_args
from gpufence.webhook.cluster.policy import parse_policy
from gpufence.webhook.core.settings import DEFAULT_SIDECAR_IMAGE, InjectionSettings
from tests.support.prerequisites import missing

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
ARCHITECTURE = ROOT / "docs" / "internals" / "architecture.md"
DASHBOARD = K8S / "components" / "monitoring" / "dashboards" / "gpufence.json"
K8S_VERSION = "1.30"

NAMESPACE = "gpufence"
WEBHOOK_CONFIGURATION = "gpufence"
TLS_SECRET = "gpufence-webhook-tls"
POLICY_CONFIGMAP = "gpufence-policy"
SERVICE = "gpufence-webhook"
# The sidecar's metrics port name (gpufence/contract.py SIDECAR_PORT_NAME); port names are IANA service
# names of at most 15 characters, so "gpufence-metrics" (16) would be refused by the API server.
SIDECAR_METRICS_PORT_NAME = "gpufence-metric"
SYSTEM_NAMESPACES = {"kube-system", "kube-node-lease"}

# kustomization directory -> what it must (not) contain
BUILDS = {
    "k8s": {"cert_manager": False, "monitoring": False},
    "k8s/overlays/cert-manager": {"cert_manager": True, "monitoring": False},
    "k8s/overlays/monitoring": {"cert_manager": False, "monitoring": True},
    "k8s/overlays/cert-manager-monitoring": {"cert_manager": True, "monitoring": True},
    "k8s/overlays/node-guardian": {"cert_manager": False, "monitoring": False, "node_guardian": True},
}
# The node guardian's own namespace (privileged Pod Security: k8s/components/node-guardian).
NODE_NAMESPACE = "gpufence-node"
BASE_KINDS = {
    "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment",
    "PodDisruptionBudget", "Service", "Job", "CronJob", "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "PriorityClass",
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Loading and rendering


def _kustomization_files() -> set[Path]:
    return set(K8S.rglob("kustomization.yaml"))


def manifest_files() -> list[Path]:
    files = sorted(p for p in K8S.rglob("*.y*ml") if p not in _kustomization_files())
    assert files, "no manifests under k8s/"
    return files


def load_file(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kubectl_missing_reason() -> str | None:
    if shutil.which("kubectl") is None:
        return "kubectl not installed: cannot render the kustomizations (file-by-file validation still runs)"
    return None


@functools.cache
def render(directory: str) -> tuple[dict[str, Any], ...]:
    reason = _kubectl_missing_reason()
    if reason:
        missing(reason)
    result = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def objects_of(directory: str) -> tuple[dict[str, Any], ...]:
    """The objects a build applies: rendered, or without kubectl the base's files as written.

    The safety checks below run on these, so that they still cover the base install when kubectl is
    missing (kustomize adds only labels to the base); the overlays need rendering.
    """
    if _kubectl_missing_reason() is None:
        return render(directory)
    if directory == "k8s":
        return tuple(obj for path in sorted((K8S / "base").glob("*.yaml")) if path.name != "kustomization.yaml"
                     for obj in load_file(path))  # fmt: skip
    missing(f"{_kubectl_missing_reason()}; overlay {directory} not checked")


def find(objects: Iterator[dict[str, Any]] | tuple[dict[str, Any], ...], kind: str, name: str | None = None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return found


def one(objects, kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# Validation: Kubernetes schema, or a structural check for CRD kinds


def _duration_ok(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+", value) is not None


def _prom_duration_ok(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"(\d+(ms|s|m|h|d|w|y))+", value) is not None


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _check_keys(where: str, obj: dict[str, Any], allowed: set[str], required: set[str] = frozenset()) -> list[str]:
    errors = [f"{where}: unknown field {k!r}" for k in obj if k not in allowed]
    errors += [f"{where}: missing {k!r}" for k in required if k not in obj]
    return errors


def _check_issuer(spec: dict[str, Any]) -> list[str]:
    types = {"selfSigned", "ca", "acme", "vault", "venafi"}
    errors = _check_keys("spec", spec, types)
    if len([k for k in spec if k in types]) != 1:
        errors.append("an Issuer needs exactly one of " + ", ".join(sorted(types)))
    if "ca" in spec and not isinstance(spec["ca"].get("secretName"), str):
        errors.append("spec.ca.secretName must be a string")
    return errors


def _check_certificate(spec: dict[str, Any]) -> list[str]:
    allowed = {
        "secretName", "issuerRef", "commonName", "dnsNames", "ipAddresses", "uris", "emailAddresses", "duration",
        "renewBefore", "isCA", "usages", "privateKey", "subject", "secretTemplate", "revisionHistoryLimit",
        "keystores", "literalSubject", "encodeUsagesInRequest", "additionalOutputFormats", "nameConstraints",
    }  # fmt: skip
    errors = _check_keys("spec", spec, allowed, {"secretName", "issuerRef"})
    ref = spec.get("issuerRef", {})
    errors += _check_keys("spec.issuerRef", ref, {"name", "kind", "group"}, {"name"})
    if ref.get("kind", "Issuer") not in {"Issuer", "ClusterIssuer"}:
        errors.append(f"spec.issuerRef.kind {ref.get('kind')!r}")
    for key in ("duration", "renewBefore"):
        if key in spec and not _duration_ok(spec[key]):
            errors.append(f"spec.{key} {spec[key]!r} is not a Go duration")
    if not all(isinstance(n, str) for n in spec.get("dnsNames", [])):
        errors.append("spec.dnsNames must be strings")
    usages = {
        "signing", "digital signature", "content commitment", "key encipherment", "key agreement",
        "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
        "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
        "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc",
    }  # fmt: skip
    errors += [f"spec.usages: unknown usage {u!r}" for u in spec.get("usages", []) if u not in usages]
    key = spec.get("privateKey", {})
    errors += _check_keys("spec.privateKey", key, {"algorithm", "size", "encoding", "rotationPolicy"})
    if key.get("algorithm", "RSA") not in {"RSA", "ECDSA", "Ed25519"}:
        errors.append(f"spec.privateKey.algorithm {key.get('algorithm')!r}")
    if key.get("rotationPolicy", "Never") not in {"Never", "Always"}:
        errors.append(f"spec.privateKey.rotationPolicy {key.get('rotationPolicy')!r}")
    if "isCA" in spec and not isinstance(spec["isCA"], bool):
        errors.append("spec.isCA must be a boolean")
    return errors


_NAMESPACE_SELECTOR_KEYS = {"any", "matchNames"}
_ENDPOINT_KEYS = {
    "port", "targetPort", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "honorTimestamps",
    "tlsConfig", "bearerTokenSecret", "authorization", "basicAuth", "oauth2", "relabelings",
    "metricRelabelings", "params", "proxyUrl", "followRedirects", "enableHttp2", "filterRunning",
    "trackTimestampsStaleness", "bearerTokenFile",
}  # fmt: skip


def _check_endpoints(where: str, endpoints: Any) -> list[str]:
    if not isinstance(endpoints, list) or not endpoints:
        return [f"{where} must be a non-empty list"]
    errors: list[str] = []
    for i, ep in enumerate(endpoints):
        errors += _check_keys(f"{where}[{i}]", ep, _ENDPOINT_KEYS)
        if ep.get("scheme", "http") not in {"http", "https"}:
            errors.append(f"{where}[{i}].scheme {ep.get('scheme')!r}")
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not _prom_duration_ok(ep[key]):
                errors.append(f"{where}[{i}].{key} {ep[key]!r}")
        tls = ep.get("tlsConfig", {})
        errors += _check_keys(
            f"{where}[{i}].tlsConfig", tls, {"ca", "cert", "keySecret", "serverName", "insecureSkipVerify"}
        )
    return errors


def _check_monitor(spec: dict[str, Any], endpoints_key: str) -> list[str]:
    allowed = {
        "selector", "namespaceSelector", endpoints_key, "jobLabel", "podTargetLabels", "targetLabels",
        "sampleLimit", "targetLimit", "labelLimit", "attachMetadata", "scrapeClass",
    }  # fmt: skip
    errors = _check_keys("spec", spec, allowed, {"selector", endpoints_key})
    errors += _check_keys("spec.namespaceSelector", spec.get("namespaceSelector", {}), _NAMESPACE_SELECTOR_KEYS)
    errors += _check_keys("spec.selector", spec.get("selector", {}), {"matchLabels", "matchExpressions"})
    return errors + _check_endpoints(f"spec.{endpoints_key}", spec.get(endpoints_key))


def _check_prometheus_rule(spec: dict[str, Any]) -> list[str]:
    errors = _check_keys("spec", spec, {"groups"}, {"groups"})
    names = set()
    for g, group in enumerate(spec.get("groups", [])):
        group_keys = {"name", "interval", "rules", "partial_response_strategy", "limit", "query_offset", "labels"}
        errors += _check_keys(f"groups[{g}]", group, group_keys, {"name", "rules"})
        if group.get("name") in names:
            errors.append(f"duplicate group {group.get('name')!r}")
        names.add(group.get("name"))
        for r, rule in enumerate(group.get("rules", [])):
            where = f"groups[{g}].rules[{r}]"
            errors += _check_keys(where, rule, {"alert", "record", "expr", "for", "keep_firing_for", "labels",
                                                "annotations"}, {"expr"})  # fmt: skip
            if ("alert" in rule) == ("record" in rule):
                errors.append(f"{where}: exactly one of alert/record")
            if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
                errors.append(f"{where}: expr must be a non-empty string")
            if "for" in rule and not _prom_duration_ok(rule["for"]):
                errors.append(f"{where}: for {rule['for']!r}")
            for key in ("labels", "annotations"):
                if key in rule and not _is_str_map(rule[key]):
                    errors.append(f"{where}: {key} must map strings to strings")
    return errors


# Kinds the Kubernetes 1.30 schema lacks (CustomResourceDefinitions), with a structural check each.
CRD_CHECKS = {
    ("cert-manager.io/v1", "Issuer"): _check_issuer,
    ("cert-manager.io/v1", "Certificate"): _check_certificate,
    ("monitoring.coreos.com/v1", "PodMonitor"): lambda spec: _check_monitor(spec, "podMetricsEndpoints"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): lambda spec: _check_monitor(spec, "endpoints"),
    ("monitoring.coreos.com/v1", "PrometheusRule"): _check_prometheus_rule,
}


def validate(obj: dict[str, Any]) -> None:
    """Raise AssertionError (with the object's kind/name) unless ``obj`` is valid."""
    what = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    check = CRD_CHECKS.get((obj.get("apiVersion"), obj.get("kind")))
    if check is not None:
        meta = obj.get("metadata", {})
        errors = _check_keys(what, obj, {"apiVersion", "kind", "metadata", "spec"}, {"metadata", "spec"})
        errors += _check_keys(f"{what} metadata", meta, {"name", "namespace", "labels", "annotations"}, {"name"})
        errors += [f"{what}: {e}" for e in check(obj.get("spec", {}))]
        assert not errors, "\n".join(errors)
        return
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        raise AssertionError(f"{what} invalid for Kubernetes {K8S_VERSION}: {path}: {e.message}") from None
    except kubernetes_validate.SchemaNotFoundError as e:
        raise AssertionError(f"{what}: {e.message} (add a structural check to CRD_CHECKS)") from None


# ---------------------------------------------------------------------------------------------
# Schema validation


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_file_validates(path: Path) -> None:
    docs = load_file(path)
    assert docs, f"{path} holds no objects"
    for obj in docs:
        validate(obj)


@pytest.mark.parametrize("directory", BUILDS)
def test_rendered_build_validates(directory: str) -> None:
    objects = render(directory)
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys)), "duplicate objects"
    for obj in objects:
        validate(obj)


def test_validator_rejects_unknown_fields() -> None:
    """Guards against a validator that passes everything (e.g. a schema lookup falling back)."""
    deployment = one(load_file(K8S / "base" / "webhook-deployment.yaml"), "Deployment")
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(AssertionError, match="readOnlyRootFileSystem"):
        validate(broken)
    rule = one(load_file(K8S / "components" / "monitoring" / "prometheusrule.yaml"), "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    with pytest.raises(AssertionError, match="for"):
        validate(rule)


def test_kustomizations_list_every_manifest_file() -> None:
    """A manifest that no kustomization lists would never be applied."""
    listed: set[Path] = set()
    for kustomization in _kustomization_files():
        data = yaml.safe_load(kustomization.read_text())
        for entry in data.get("resources", []):
            path = (kustomization.parent / entry).resolve()
            if path.is_file():
                listed.add(path)
    assert set(manifest_files()) - listed == set()


@pytest.mark.parametrize("directory", BUILDS)
def test_build_contents(directory: str) -> None:
    objects = render(directory)
    kinds = {o["kind"] for o in objects}
    expect = BUILDS[directory]
    assert BASE_KINDS - {"Job", "CronJob", "Role", "RoleBinding"} <= kinds
    certs_objects = [o for o in objects if o["metadata"]["name"] == "gpufence-certs" or o["kind"] in {"Job", "CronJob"}]
    if expect["cert_manager"]:
        assert certs_objects == [], "cert-manager overlay must delete the bootstrap Job/CronJob and their RBAC"
        assert {"Certificate", "Issuer"} <= kinds
    else:
        assert {"Job", "CronJob", "Role", "RoleBinding"} <= kinds
        assert len(certs_objects) == 7  # ServiceAccount, Role, RoleBinding, ClusterRole(Binding), Job, CronJob
        assert not {"Certificate", "Issuer"} & kinds
    assert ({"PodMonitor", "ServiceMonitor", "PrometheusRule"} <= kinds) == expect["monitoring"]
    guardian = expect.get("node_guardian", False)
    assert ("DaemonSet" in kinds) == guardian
    for obj in objects:
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "gpufence"
        if obj["kind"] not in {"Namespace", "ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                               "ValidatingWebhookConfiguration", "ValidatingAdmissionPolicy",
                               "ValidatingAdmissionPolicyBinding", "PriorityClass"}:  # fmt: skip
            own = NODE_NAMESPACE if obj["metadata"]["name"] == "gpufence-node" and guardian else NAMESPACE
            assert obj["metadata"].get("namespace") == own, obj["metadata"]["name"]


def test_the_node_guardian_is_read_only_through_the_api_and_host_bound_on_the_node() -> None:
    """Least privilege, as docs/internals/node-guardian.md states it: read pods, namespaces,
    ResourceClaims and ResourceSlices, create Events, nothing else; on the node, the host's PID namespace, cgroupfs and
    a state directory, in a namespace of its own so that gpufence's stays restricted."""
    objects = render("k8s/overlays/node-guardian")
    role = one(objects, "ClusterRole", "gpufence-node")
    granted = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}  # fmt: skip
    assert granted == {("", r, v) for r in ("pods", "namespaces") for v in ("get", "list", "watch")} | {
        ("resource.k8s.io", r, v) for r in ("resourceclaims", "resourceslices") for v in ("get", "list", "watch")} | {
        ("", "events", "create")}
    binding = one(objects, "ClusterRoleBinding", "gpufence-node")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpufence-node", "namespace": NODE_NAMESPACE}]
    # The cluster policy (device-access-namespaces), that one ConfigMap read-only, as the webhook reads it.
    policy_role = one(objects, "Role", "gpufence-node-policy")
    assert policy_role["metadata"]["namespace"] == NAMESPACE and policy_role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["gpufence-policy"],
         "verbs": ["get", "list", "watch"]}]
    policy_binding = one(objects, "RoleBinding", "gpufence-node-policy")
    assert policy_binding["roleRef"]["name"] == "gpufence-node-policy"
    assert policy_binding["subjects"] == binding["subjects"]
    daemonset = one(objects, "DaemonSet", "gpufence-node")
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["serviceAccountName"] == "gpufence-node"
    (container,) = spec["containers"]
    assert container["command"] == ["gpufence-node"]
    # Root: a privileged container's non-root process has no capability (the node bed's containerd ran
    # the image's user 65532 so, and every signal and cgroup write failed).
    assert container["securityContext"] == {"privileged": True, "runAsUser": 0, "runAsGroup": 0}
    assert {v["hostPath"]["path"] for v in spec["volumes"]} == {"/sys/fs/cgroup", "/var/lib/gpufence-node"}
    assert {e["name"]: e.get("valueFrom") for e in container["env"]}["NODE_NAME"] == {
        "fieldRef": {"fieldPath": "spec.nodeName"}}
    namespaces = {o["metadata"]["name"]: o for o in find(objects, "Namespace")}
    assert namespaces[NAMESPACE]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert namespaces[NODE_NAMESPACE]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert "gpufence.io/injection" not in namespaces[NODE_NAMESPACE]["metadata"]["labels"]


# ---------------------------------------------------------------------------------------------
# Admission webhook configuration


def _webhooks(objects) -> dict[str, dict[str, Any]]:
    """Every webhook gpufence registers, by name (both configurations are named gpufence)."""
    mutating = one(objects, "MutatingWebhookConfiguration", WEBHOOK_CONFIGURATION)
    validating = one(objects, "ValidatingWebhookConfiguration", WEBHOOK_CONFIGURATION)
    return {w["name"]: w for w in mutating["webhooks"] + validating["webhooks"]}


POD_CREATE = {"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
              "scope": "Namespaced"}
NOT_A_NODES_MIRROR = ("!has(object.metadata.annotations) || "
                      "!('kubernetes.io/config.mirror' in object.metadata.annotations) || "
                      "!request.userInfo.username.startsWith('system:node:')")


@pytest.mark.parametrize("directory", BUILDS)
def test_webhook_configuration_is_safe(directory: str) -> None:
    """Pod creation fails closed on both webhooks (the API server refuses what gpufence could not
    judge); kubectl debug fails open (the protect policy refuses an ephemeral container without the
    void meanwhile)."""
    objects = objects_of(directory)
    webhooks = _webhooks(objects)
    assert set(webhooks) == {"inject.gpufence.io", "debug.gpufence.io", "verify.gpufence.io"}
    inject, debug, verify = (webhooks[n] for n in ("inject.gpufence.io", "debug.gpufence.io", "verify.gpufence.io"))
    assert inject["failurePolicy"] == verify["failurePolicy"] == "Fail"
    assert debug["failurePolicy"] == "Ignore"
    assert inject["reinvocationPolicy"] == "IfNeeded"
    assert inject["rules"] == verify["rules"] == [POD_CREATE]
    assert debug["rules"] == [{"operations": ["UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                               "resources": ["pods/ephemeralcontainers"], "scope": "Namespaced"}]
    # A static pod's mirror from its node is never sent (the kubelet runs the manifest, not the mirror).
    for hook in (inject, verify):
        (condition,) = hook["matchConditions"]
        assert " ".join(condition["expression"].split()) == NOT_A_NODES_MIRROR
    assert "matchConditions" not in debug
    for name, webhook in webhooks.items():
        _check_webhook(objects, name, webhook)


def _check_webhook(objects: list[dict[str, Any]], name: str, webhook: dict[str, Any]) -> None:
    assert webhook["sideEffects"] == "None"
    assert webhook["timeoutSeconds"] <= 10
    assert webhook["matchPolicy"] == "Equivalent"
    assert webhook["admissionReviewVersions"] == ["v1"]
    expressions = webhook["namespaceSelector"]["matchExpressions"]
    assert {"key": INJECTION_LABEL, "operator": "In", "values": [INJECTION_ENABLED]} in expressions
    (exclusion,) = [e for e in expressions if e["key"] == "kubernetes.io/metadata.name"]
    assert exclusion["operator"] == "NotIn"
    assert {NAMESPACE, *SYSTEM_NAMESPACES} <= set(exclusion["values"])
    # No objectSelector: pods labelled gpufence.io/inject=false reach the webhook, which honours the
    # label only where the namespace allows opt-out.
    assert "objectSelector" not in webhook
    service = webhook["clientConfig"]["service"]
    path = "/validate" if name == "verify.gpufence.io" else "/mutate"
    assert service == {"namespace": NAMESPACE, "name": SERVICE, "path": path, "port": 443}
    assert "url" not in webhook["clientConfig"]
    # The Service exists and maps 443 to the webhook container's 8443.
    svc = one(objects, "Service", SERVICE)
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 443
    container = _webhook_container(objects)
    (cport,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    assert cport["containerPort"] == 8443
    deployment = one(objects, "Deployment", "gpufence-webhook")
    assert svc["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("kind", ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"])
def test_ca_bundle_source(kind: str) -> None:
    base = one(objects_of("k8s"), kind, WEBHOOK_CONFIGURATION)
    assert all("caBundle" not in w["clientConfig"] for w in base["webhooks"]), "set by gpufence-certs, not kubectl"
    cm = one(objects_of("k8s/overlays/cert-manager"), kind, WEBHOOK_CONFIGURATION)
    assert cm["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/gpufence-webhook"


def test_cert_manager_issues_the_webhook_secret() -> None:
    objects = objects_of("k8s/overlays/cert-manager")
    serving = one(objects, "Certificate", "gpufence-webhook")
    assert serving["spec"]["secretName"] == TLS_SECRET
    assert f"{SERVICE}.{NAMESPACE}.svc" in serving["spec"]["dnsNames"]
    assert "server auth" in serving["spec"]["usages"]
    ca_issuer = one(objects, "Issuer", serving["spec"]["issuerRef"]["name"])
    ca_cert = one(objects, "Certificate", "gpufence-ca")
    assert ca_cert["spec"]["isCA"] is True
    assert ca_issuer["spec"]["ca"]["secretName"] == ca_cert["spec"]["secretName"]
    assert "selfSigned" in one(objects, "Issuer", ca_cert["spec"]["issuerRef"]["name"])["spec"]


# ---------------------------------------------------------------------------------------------
# RBAC


def _rules(objects) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] in {"Role", "ClusterRole"}:
            for rule in obj.get("rules", []):
                yield obj, rule


@pytest.mark.parametrize("directory", BUILDS)
def test_rbac_is_least_privilege(directory: str) -> None:
    objects = objects_of(directory)
    for role, rule in _rules(objects):
        for field in ("verbs", "resources", "apiGroups", "resourceNames"):
            assert "*" not in rule.get(field, []), f"{role['kind']}/{role['metadata']['name']}: * in {field}"
        assert not {"escalate", "bind", "impersonate", "deletecollection", "delete"} & set(rule["verbs"])
        if "secrets" in rule["resources"]:
            assert role["kind"] == "Role", "no cluster-wide access to Secrets"
            assert rule.get("resourceNames") == [TLS_SECRET] or rule["verbs"] == ["create"]
        if {"mutatingwebhookconfigurations", "validatingwebhookconfigurations"} & set(rule["resources"]):
            assert rule.get("resourceNames") == [WEBHOOK_CONFIGURATION]
            assert set(rule["verbs"]) <= {"get", "patch"}
    webhook_role = one(objects, "ClusterRole", "gpufence-webhook")
    assert webhook_role["rules"] == [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
        # The nodes' names and labels, listed and watched (webhook.cluster.nodes), never read one by one or written.
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]},
        # Exactly the DRA objects a pod's claims lead to, read only (webhook.cluster.dra_cache).
        {"apiGroups": ["resource.k8s.io"], "resources": ["deviceclasses", "resourceclaims", "resourceclaimtemplates"],
         "verbs": ["get", "list", "watch"]},
    ]
    # The policy ConfigMap by name only (the webhook lists and watches it with a metadata.name selector).
    policy_role = one(objects, "Role", "gpufence-webhook-policy")
    assert policy_role["metadata"]["namespace"] == NAMESPACE
    assert policy_role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [POLICY_CONFIGMAP],
         "verbs": ["get", "list", "watch"]}
    ]
    binding = one(objects, "RoleBinding", "gpufence-webhook-policy")
    assert binding["roleRef"]["name"] == "gpufence-webhook-policy"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpufence-webhook", "namespace": NAMESPACE}]
    for _, rule in _rules(objects):
        if "configmaps" in rule["resources"]:
            assert rule.get("resourceNames") == [POLICY_CONFIGMAP], "no other ConfigMap is anyone's business"
    if not BUILDS[directory]["cert_manager"]:
        role = one(objects, "Role", "gpufence-certs")
        assert {"get", "update", "patch", "create"} == {v for r in role["rules"] for v in r["verbs"]}
    # Every binding points at an existing role and ServiceAccount, and every pod's SA exists.
    accounts = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in find(objects, "ServiceAccount")}
    for binding in find(objects, "RoleBinding") + find(objects, "ClusterRoleBinding"):
        one(objects, binding["roleRef"]["kind"], binding["roleRef"]["name"])
        for subject in binding["subjects"]:
            assert (subject["namespace"], subject["name"]) in accounts
    for _, pod_spec in _pod_specs(objects):
        assert (NAMESPACE, pod_spec["serviceAccountName"]) in accounts


# ---------------------------------------------------------------------------------------------
# Workloads


def _pod_specs(objects) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] in {"Deployment", "Job"}:
            yield obj, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "CronJob":
            yield obj, obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def _webhook_container(objects) -> dict[str, Any]:
    deployment = one(objects, "Deployment", "gpufence-webhook")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_webhook_deployment() -> None:
    objects = objects_of("k8s")
    deployment = one(objects, "Deployment", "gpufence-webhook")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    assert spec["replicas"] == 2
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for constraint in pod["topologySpreadConstraints"]:
        assert constraint["labelSelector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    container = _webhook_container(objects)
    resources = container["resources"]
    assert "cpu" in resources["requests"] and "cpu" not in resources.get("limits", {}), "CPU request, no CPU limit"
    assert "memory" in resources["limits"]
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["scheme"] == "HTTPS"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    args = container["args"]
    assert "--port=8443" in args
    assert container["image"] == DEFAULT_SIDECAR_IMAGE, "webhook and sidecar images are the same release"
    # The policy comes from the ConfigMap, its one source; the webhook refuses policy flags with it.
    assert f"--policy-configmap={NAMESPACE}/{POLICY_CONFIGMAP}" in args
    settings_args = parse_args(args, environ={})
    assert settings_args.policy_configmap == (NAMESPACE, POLICY_CONFIGMAP)
    # The TLS files named on the command line come from the Secret volume.
    (tls_volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert tls_volume["secret"]["secretName"] == TLS_SECRET
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == tls_volume["name"]]
    assert "subPath" not in mount, "a subPath mount never sees a renewed Secret"
    assert f"--tls-cert-file={mount['mountPath']}/tls.crt" in args
    assert f"--tls-private-key-file={mount['mountPath']}/tls.key" in args
    pdb = one(objects, "PodDisruptionBudget", "gpufence-webhook")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"] == spec["selector"]


@pytest.mark.parametrize("directory", BUILDS)
def test_pods_meet_the_restricted_pod_security_standard(directory: str) -> None:
    objects = objects_of(directory)
    namespace = one(objects, "Namespace", NAMESPACE)
    for mode in ("enforce", "audit", "warn"):
        assert namespace["metadata"]["labels"][f"pod-security.kubernetes.io/{mode}"] == "restricted"
    for owner, pod in _pod_specs(objects):
        where = f"{owner['kind']}/{owner['metadata']['name']}"
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where
        assert all("hostPath" not in v for v in pod.get("volumes", [])), where
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc.get("runAsUser", pod["securityContext"].get("runAsUser", 1)) != 0, where
            assert "cpu" not in container["resources"].get("limits", {}), where
            assert "memory" in container["resources"]["limits"], where


def test_the_policy_configmap_is_valid_and_names_this_release() -> None:
    """The shipped policy parses with the webhook's own parser into its defaults, this release's image included."""
    configmap = one(objects_of("k8s"), "ConfigMap", POLICY_CONFIGMAP)
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert parse_policy(configmap["data"]) == InjectionSettings()
    assert configmap["data"]["sidecar-image"] == DEFAULT_SIDECAR_IMAGE
    protect = one(objects_of("k8s"), "ValidatingAdmissionPolicyBinding", "gpufence-protect")
    assert protect["spec"]["paramRef"]["name"] == POLICY_CONFIGMAP
    assert protect["spec"]["paramRef"]["namespace"] == NAMESPACE


def test_certificate_jobs() -> None:
    objects = objects_of("k8s")
    job = one(objects, "Job", "gpufence-certs-bootstrap")
    cron = one(objects, "CronJob", "gpufence-certs-renew")
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert job["spec"]["backoffLimit"] > 0
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert len(cron["spec"]["schedule"].split()) == 5
    expected = ["bootstrap", f"--namespace={NAMESPACE}", f"--secret={TLS_SECRET}", f"--service={SERVICE}",
                f"--webhook-configuration={WEBHOOK_CONFIGURATION}"]  # fmt: skip
    for pod in (job["spec"]["template"]["spec"], cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]):
        (container,) = pod["containers"]
        assert container["command"] == ["gpufence-certs"]
        assert container["args"] == expected
        assert pod["serviceAccountName"] == "gpufence-certs"


# ---------------------------------------------------------------------------------------------
# Monitoring: Prometheus Operator objects, alerts and dashboard against docs/internals/architecture.md


@functools.cache
def documented_metrics() -> dict[str, tuple[str, dict[str, set[str]]]]:
    """{metric: (type, {label: documented values (may be empty)})} from the Metrics tables."""
    metrics: dict[str, tuple[str, dict[str, set[str]]]] = {}
    row = re.compile(r"^\|\s*`(gpufence_[a-z0-9_]+)`\s*\|\s*([^|]+?)\s*\|\s*([^|]*?)\s*\|\s*$")
    for line in ARCHITECTURE.read_text().splitlines():
        m = row.match(line)
        if not m:
            continue
        name, kind, label_text = m.groups()
        labels: dict[str, set[str]] = {}
        for part in re.split(r",\s*(?![^()]*\))", label_text):
            part = part.strip()
            if not part:
                continue
            label = re.match(r"[A-Za-z_][A-Za-z0-9_]*", part)
            assert label, f"cannot parse label {part!r} of {name}"
            labels[label.group(0)] = set(re.findall(r"`([^`]+)`", part))
        metrics[name] = (kind.split()[0], labels)
    assert len(metrics) >= 10, "docs/internals/architecture.md metric tables not found"
    return metrics


# Labels Prometheus adds to every scraped series (PodMonitor/ServiceMonitor target labels).
# node: the PodMonitor's relabelling of __meta_kubernetes_pod_node_name.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint", "node"}
# Series Prometheus itself generates for every target.
PROMETHEUS_SERIES = {"up"}
_PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "by", "without", "on", "ignoring",
    "histogram_quantile", "time", "absent", "avg_over_time", "max_over_time", "min_over_time", "and", "or",
    "unless", "bool", "offset", "label_values", "group_left", "group_right", "topk", "bottomk", "clamp_min",
    "label_replace",
}  # fmt: skip


def _resolve(metric: str) -> tuple[str, dict[str, set[str]]] | None:
    metrics = documented_metrics()
    if metric in metrics:
        return metric, metrics[metric][1]
    for suffix in ("_bucket", "_sum", "_count"):
        base = metric.removesuffix(suffix)
        if base != metric and metrics.get(base, ("",))[0] == "histogram":
            labels = dict(metrics[base][1])
            if suffix == "_bucket":
                labels["le"] = set()
            return base, labels
    return None


def check_promql(expr: str, extra_labels: set[str] = frozenset()) -> list[str]:
    """Metric names, label matchers and grouping labels of ``expr`` against the documentation."""
    errors: list[str] = []
    stripped = re.sub(r'"[^"]*"', '""', expr)
    used_labels: set[str] = set()
    for name in re.findall(r"\b(gpufence_[a-z0-9_]+)\b", expr):
        resolved = _resolve(name)
        if resolved is None:
            errors.append(f"metric {name} is not in docs/internals/architecture.md")
    # Every selector names a documented metric (or a series Prometheus generates).
    for name in re.findall(r"\b([A-Za-z_:][A-Za-z0-9_:]*)\s*\{", stripped):
        if not name.startswith("gpufence_") and name not in PROMETHEUS_SERIES:
            errors.append(f"selector on unknown series {name}")
    for name, matchers in re.findall(r"\b([a-z_:][a-z0-9_:]*)\{([^}]*)\}", expr):
        resolved = _resolve(name)
        if resolved is None:
            continue
        _, labels = resolved
        for label, op, value in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"', matchers):
            if label not in labels and label not in TARGET_LABELS:
                errors.append(f"{name} has no label {label}")
            elif labels.get(label) and not value.startswith("$"):
                alternatives = value.split("|") if op in {"=~", "!~"} else [value]
                errors += [
                    f"{name}{{{label}}}: undocumented value {v!r}" for v in alternatives if v not in labels[label]
                ]
    for name in re.findall(r"\b(gpufence_[a-z0-9_]+)\b", expr):
        resolved = _resolve(name)
        if resolved:
            used_labels |= set(resolved[1])
    allowed = used_labels | TARGET_LABELS | extra_labels
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", stripped):
        errors += [
            f"grouping by unknown label {g}" for g in re.split(r"\s*,\s*", group.strip()) if g and g not in allowed
        ]
    for word in re.findall(r"\b([a-z_]+)\s*\(", stripped):
        if word not in _PROMQL_WORDS:
            errors.append(f"unexpected function {word}()")
    return errors


def _rule_objects() -> list[dict[str, Any]]:
    return load_file(K8S / "components" / "monitoring" / "prometheusrule.yaml")


def test_alert_expressions_use_documented_metrics() -> None:
    (rule,) = _rule_objects()
    alerts = {}
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            errors = check_promql(r["expr"])
            assert not errors, f"{r['alert']}: {errors}"
            metrics = {_resolve(m)[0] for m in re.findall(r"\b(gpufence_[a-z0-9_]+)\b", r["expr"])}
            labels = set().union(*(documented_metrics()[m][1] for m in metrics)) | TARGET_LABELS
            for text in list(r.get("annotations", {}).values()):
                for label in re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", text):
                    assert label in labels, f"{r['alert']}: annotation uses unknown label {label}"
            assert r["labels"]["severity"] in {"info", "warning", "critical"}
            alerts[r["alert"]] = r["expr"]
    expr = "\n".join(alerts.values())
    # The alerts the install promises (docs/install.md).
    assert re.search(r'gpufence_enforcement_actions_total\{action=~"(sigterm\|sigkill|sigkill\|sigterm)"\}', expr)
    assert "gpufence_container_throttled" in expr
    assert re.search(r"time\(\) - gpufence_last_successful_poll_timestamp_seconds > 60", expr)
    assert "gpufence_nvml_up == 0" in expr
    assert 'gpufence_webhook_requests_total{outcome="error"}' in expr
    assert "histogram_quantile(0.99" in expr and "gpufence_webhook_request_duration_seconds_bucket" in expr
    assert re.search(r"gpufence_webhook_certificate_expiry_timestamp_seconds - time\(\) < 14 \* 24 \* 3600", expr)


def test_the_documented_standings_are_the_guardians() -> None:
    """Alerts and panels select gpufence_node_gpu_processes by standing; check_promql holds those
    values to the documented ones, and these must be the census's own."""
    from gpufence.node.decide import Standing

    assert documented_metrics()["gpufence_node_gpu_processes"][1]["standing"] == {s.value for s in Standing}
    assert check_promql('gpufence_node_gpu_processes{standing=~"host|foreign"}') != []


def test_promql_checker_catches_mistakes() -> None:
    assert check_promql("gpufence_container_gpu_memory_used_bytes") == []
    assert check_promql("gpufence_container_gpu_memory_used") != []
    assert check_promql('gpufence_enforcement_actions_total{action="kill"}') != []
    assert check_promql('gpufence_webhook_requests_total{result="error"}') != []
    assert check_promql("sum by (uuid) (gpufence_container_gpu_memory_used_bytes)") != []
    assert check_promql("rate(gpufence_nvml_up_bucket[5m])") != []  # a gauge has no buckets


def test_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs: list[str] = []
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            errors = check_promql(expr)
            assert not errors, f"{panel['title']}: {errors}"
            for var in re.findall(r"\$(\w+)", expr):
                assert var in variables or var.startswith("__"), f"{panel['title']}: unknown variable ${var}"
            legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            grouped = set().union(*(set(re.split(r"\s*,\s*", g)) for g in re.findall(r"by \(([^)]*)\)", expr)))
            assert legend_labels <= grouped, f"{panel['title']}: legend uses {legend_labels - grouped}"
            exprs.append(expr)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert not check_promql(variable["definition"]), variable["name"]
    text = "\n".join(exprs)
    for metric in ("gpufence_container_gpu_memory_used_bytes", "gpufence_container_gpu_memory_limit_bytes",
                   "gpufence_container_sm_utilization_ratio", "gpufence_container_compute_share_ratio",
                   "gpufence_enforcement_actions_total", "gpufence_poll_duration_seconds_bucket",
                   "gpufence_webhook_requests_total", "gpufence_webhook_request_duration_seconds_bucket",
                   "gpufence_node_unaccounted_processes", "gpufence_node_unaccounted_memory_bytes",
                   "gpufence_node_actions_total", "gpufence_node_last_successful_poll_timestamp_seconds",
                   'up{job="gpufence/gpufence-node"}', "gpufence_node_gpu_processes",
                   "gpufence_node_admin_allowed_processes", "gpufence_node_admin_allowed_memory_bytes"):  # fmt: skip
        assert metric in text, f"dashboard does not show {metric}"


def test_monitoring_objects() -> None:
    objects = objects_of("k8s/overlays/monitoring")
    podmonitor = one(objects, "PodMonitor", "gpufence-enforcer")
    assert podmonitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = podmonitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == SIDECAR_METRICS_PORT_NAME
    assert endpoint["honorLabels"] is True, "the workload's namespace/pod/container labels must win"
    assert DEFAULT_METRICS_PORT == 9401  # the number behind the sidecar's named port
    servicemonitor = one(objects, "ServiceMonitor", "gpufence-webhook")
    (endpoint,) = servicemonitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": TLS_SECRET, "key": "ca.crt"}
    assert endpoint["tlsConfig"]["serverName"] == f"{SERVICE}.{NAMESPACE}.svc"
    service = one(objects, "Service", SERVICE)
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert servicemonitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    configmap = one(objects, "ConfigMap", "gpufence-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (content,) = configmap["data"].values()
    assert json.loads(content) == json.loads(DASHBOARD.read_text())


# ---------------------------------------------------------------------------------------------
# Dockerfile (static checks only: building an image is not part of the tests)


def _final_stage(text: str) -> list[str]:
    lines = [ln.strip() for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.startswith("#")]
    starts = [i for i, ln in enumerate(lines) if ln.upper().startswith("FROM ")]
    assert len(starts) >= 2, "expected a multi-stage build"
    return lines[starts[-1] :]


def test_dockerfile() -> None:
    text = (ROOT / "Dockerfile").read_text()
    final = _final_stage(text)
    assert re.match(r"FROM (python:3\.11-slim|\$\{?PYTHON_IMAGE\}?)(@sha256:[0-9a-f]+)?( AS \w+)?$", final[0], re.I)
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.11-slim", text)
    users = [ln for ln in final if ln.upper().startswith("USER ")]
    assert users and users[-1].split()[1].startswith("65532"), "the image runs as uid 65532 by default"
    runs = " ".join(ln for ln in final if ln.upper().startswith("RUN "))
    assert not re.search(r"apt-get install|gcc|build-essential", runs), "no build tools in the final stage"
    assert "[test]" not in text and "'.[test]'" not in text, "the image has no test dependencies"
    assert "--require-hashes -r requirements/runtime.lock" in text
    for script in ("gpufence-webhook", "gpufence-enforcer", "gpufence-certs"):
        assert script in text, f"Dockerfile does not mention {script}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= {p.strip("/*") for p in ignored}


def test_podmonitor_port_name_is_the_one_the_webhook_injects() -> None:
    assert SIDECAR_PORT_NAME == SIDECAR_METRICS_PORT_NAME
    assert re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", SIDECAR_METRICS_PORT_NAME), "IANA_SVC_NAME"


def test_webhook_has_a_priority_class_above_workloads_and_a_disruption_budget() -> None:
    """The API server refuses new pods of opted-in namespaces while the webhook is down: it must not be
    evicted first or drained all at once."""
    objects = objects_of("k8s")
    deployment = one(objects, "Deployment", "gpufence-webhook")
    name = deployment["spec"]["template"]["spec"]["priorityClassName"]
    priority = one(objects, "PriorityClass", name)
    assert 0 < priority["value"] <= 1_000_000_000 and not priority["globalDefault"]  # user range, not system
    pdb = one(objects, "PodDisruptionBudget", "gpufence-webhook")
    assert pdb["spec"]["minAvailable"] == 1 < deployment["spec"]["replicas"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_the_guardians_podmonitor_selects_the_daemonsets_pods_and_port() -> None:
    """The monitoring overlay's PodMonitor gpufence-node against the node-guardian overlay's DaemonSet:
    its namespace, the pod template's labels, the port's name; honorLabels for the workload's labels
    on the unaccounted series; `node` relabelled as the enforcer's monitor does (the down alert joins
    on it)."""
    podmonitor = one(objects_of("k8s/overlays/monitoring"), "PodMonitor", "gpufence-node")
    daemonset = one(objects_of("k8s/overlays/node-guardian"), "DaemonSet", "gpufence-node")
    assert podmonitor["spec"]["namespaceSelector"] == {"matchNames": [daemonset["metadata"]["namespace"]]}
    template = daemonset["spec"]["template"]
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (endpoint,) = podmonitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["port"] in ports and ports[endpoint["port"]] == NODE_METRICS_PORT
    assert endpoint["honorLabels"] is True
    enforcer = one(objects_of("k8s/overlays/monitoring"), "PodMonitor", "gpufence-enforcer")
    assert endpoint["relabelings"] == enforcer["spec"]["podMetricsEndpoints"][0]["relabelings"]
