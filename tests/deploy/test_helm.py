"""The Helm chart (charts/gpufence): ``helm lint``, ``helm template``, and what the values set.

The chart has its own templates (tests/deploy/test_chart_drift.py checks they render what kustomize
renders). Here: every rendered object, with the defaults and with every value changed, passes the
validation the kustomize output gets (tests/deploy/test_manifests.py ``validate``); the policy ConfigMap
the values produce is read by the webhook's own argument parser, and the protect policy reads the
same ConfigMap; bad values fail the render with a message naming them.

helm is built from its Go module (tests/support/helm_binary.py); without Go these tests skip. A cold build
takes minutes: run ``python -m tests.support.helm_binary`` before pytest to keep it out of a test's time.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufence import __version__
from gpufence.webhook.cli import FLAGS, parse_args, settings_from_args
from gpufence.webhook.core.settings import InjectionSettings
from tests.deploy.test_alerts import PROMTOOL_MISSING, write_rules
from tests.deploy.test_manifests import K8S_VERSION, validate
from tests.support import helm_binary
from tests.support.prerequisites import missing

# The first test that asks for helm builds it when the cache lacks it: minutes with a cold Go build
# cache, more than the suite's per-test limit. Every helm and kubectl call has its own 120 s limit.
pytestmark = pytest.mark.timeout(helm_binary.BUILD_TIMEOUT_SECONDS + 300)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gpufence"
HELPERS = CHART / "templates" / "_helpers.tpl"
RELEASE = "gpufence"
POLICY = ("ConfigMap", "gpufence", "gpufence-policy")
WEBHOOK = ("Deployment", "gpufence", "gpufence-webhook")
# The flags the chart sets on the webhook itself, which webhook.flags may not.
CHART_SET_FLAGS = {"port", "tls-cert-file", "tls-private-key-file", "policy-configmap"}
# The keys the chart always writes into the policy ConfigMap (the common settings an admin edits).
WRITTEN_POLICY_KEYS = {
    "gpu-resource-name", "exclusive-gpu-resource-name", "non-gpu-resource-claims", "kai-scheduler-name",
    "sidecar-image",
    "default-mode", "allow-audit", "allow-opt-out", "max-memory",
    "max-compute", "default-memory", "default-compute", "sidecar-poll-interval", "sidecar-nvidia-visible-devices",
    "driver-memory-limits",
}

# Every value changed from its default.
CUSTOM: dict[str, Any] = {
    "image": {"repository": "registry.example.com/team/gpufence", "tag": "1.2.3-rc.1", "pullPolicy": "Always"},
    "namespace": {"create": False},
    "webhook": {
        "replicas": 3,
        "port": 9443,
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "priorityClassName": "system-cluster-critical",
        "flags": {"log-level": "debug", "shutdown-delay": "10s"},
    },
    "policy": {
        "gpu-resource-name": ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"], "default-mode": "audit",
        "allow-audit": True, "allow-opt-out": "true", "max-memory": "16Gi", "max-compute": "50%",
        "default-memory": "25%", "default-compute": "20", "sidecar-poll-interval": "1s",
        "sidecar-nvidia-visible-devices": "all", "mps-limits": True, "sidecar-metrics-port": 9402,
        # Helm reads a number from a values file as a float: it must still reach the webhook as digits.
        "framework-memory-headroom": 536870912, "gpu-memory": ["nvidia.com/gpu=80Gi", "nvidia.com/mig-1g.10gb=10Gi"],
    },
    "certManager": {"enabled": True},
    "monitoring": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
}
CUSTOM_IMAGE = "registry.example.com/team/gpufence:1.2.3-rc.1"


def run_helm(helm: Path, *args: str, values: dict[str, Any] | None = None, tmp: Path | None = None,
             ) -> subprocess.CompletedProcess[str]:
    argv = [str(helm), *args]
    if values:
        assert tmp is not None
        values_file = tmp / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        argv += ["-f", str(values_file)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT)


def helm_template(helm: Path, tmp: Path, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    # The install's minimum Kubernetes version, the one the manifests are validated against.
    return run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", f"{K8S_VERSION}.0", values=values,
                    tmp=tmp)  # fmt: skip


def template(helm: Path, tmp: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    result = helm_template(helm, tmp, values)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def key(obj: dict[str, Any]) -> tuple[str, str | None, str]:
    return obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = {"Deployment": lambda o: o["spec"]["template"]["spec"], "Job": lambda o: o["spec"]["template"]["spec"],
            "CronJob": lambda o: o["spec"]["jobTemplate"]["spec"]["template"]["spec"]}.get(obj["kind"])  # fmt: skip
    if spec is None:
        return []
    pod = spec(obj)
    return pod.get("initContainers", []) + pod["containers"]


def webhook_container(objects: dict[tuple[str, str | None, str], dict[str, Any]]) -> dict[str, Any]:
    (webhook,) = objects[WEBHOOK]["spec"]["template"]["spec"]["containers"]
    return webhook


def policy_settings(data: dict[str, str]) -> InjectionSettings:
    """What the webhook makes of the policy ConfigMap's data: each key is a flag's name, its value
    as the flag's environment variable takes it (repeatable flags comma-separated)."""
    flags = {f.name: f for f in FLAGS}
    assert set(data) <= set(flags), f"keys the webhook has no flag for: {sorted(set(data) - set(flags))}"
    environ = {flags[name].env: value for name, value in data.items()}
    return settings_from_args(parse_args(["--tls-cert-file=tls.crt", "--tls-private-key-file=tls.key"], environ))


def helper_words(define: str) -> list[str]:
    """The words a ``{{- define NAME -}} ... {{- end -}}`` block of _helpers.tpl holds (a list of flag names)."""
    match = re.search(r'\{\{- define "' + re.escape(define) + r'" -\}\}\n(.*?)\{\{- end -\}\}', HELPERS.read_text(),
                      re.DOTALL)  # fmt: skip
    assert match, f"{HELPERS} has no define {define}"
    return match.group(1).split()


def strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [s for item in value for s in strings_in(item)] if isinstance(value, list) else []


class _ReadRecorder(argparse.Namespace):
    """Parsed flags that remember which of them were read."""

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            object.__getattribute__(self, "__dict__").setdefault("_read", set()).add(name)
        return object.__getattribute__(self, name)


# ---------------------------------------------------------------------------------------------


def test_chart_version_is_the_source_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__


def test_chart_does_not_read_k8s() -> None:
    """The chart's templates are its own: no link into k8s/, and every file a template loads is in the chart."""
    assert not [p for p in CHART.rglob("*") if p.is_symlink()]
    templates = sorted((CHART / "templates").rglob("*.yaml"))
    assert len(templates) > 20, "one template per object"
    for path in [*templates, HELPERS]:
        for loaded in re.findall(r'\.Files\.Get "([^"]+)"', path.read_text()):
            assert (CHART / loaded).is_file() and not loaded.startswith("k8s"), f"{path} loads {loaded}"


def test_chart_policy_keys_are_the_webhooks_injection_flags() -> None:
    """The chart refuses a policy key or a webhook.flags key by these lists; they must be the webhook's."""
    parsed = parse_args(["--tls-cert-file=tls.crt", "--tls-private-key-file=tls.key"], environ={})
    recorder = _ReadRecorder(**vars(parsed))
    settings_from_args(recorder)
    read = vars(recorder)["_read"]
    injection = [f.name for f in FLAGS if f.dest in read]
    assert helper_words("gpufence.policyKeys") == injection
    assert set(helper_words("gpufence.repeatedPolicyKeys")) == {f.name for f in FLAGS if f.repeat}
    others = {f.name for f in FLAGS} - set(injection) - CHART_SET_FLAGS
    assert set(helper_words("gpufence.serverFlags")) == others


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["defaults", "custom"])
def test_helm_lint(helm: Path, tmp_path: Path, values: dict[str, Any]) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), "--kube-version", f"{K8S_VERSION}.0",
                      values=values, tmp=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("values", [{}, {"certManager": {"enabled": True}}, {"monitoring": {"enabled": True}}, CUSTOM],
                         ids=["defaults", "cert-manager", "monitoring", "custom"])  # fmt: skip
def test_rendered_objects_validate(helm: Path, tmp_path: Path, values: dict[str, Any]) -> None:
    objects = template(helm, tmp_path, values)
    keys = [key(o) for o in objects]
    assert len(keys) == len(set(keys)), "duplicate objects"
    for obj in objects:
        validate(obj)


def test_values_change_what_they_say(helm: Path, tmp_path: Path) -> None:
    objects = {key(o): o for o in template(helm, tmp_path, CUSTOM)}
    assert not [k for k in objects if k[0] == "Namespace"], "namespace.create=false"
    images = {c["image"] for o in objects.values() for c in containers(o)}
    assert images == {CUSTOM_IMAGE}
    assert {c["imagePullPolicy"] for o in objects.values() for c in containers(o)} == {"Always"}

    deployment = objects[WEBHOOK]
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    webhook = webhook_container(objects)
    assert webhook["resources"] == CUSTOM["webhook"]["resources"]
    assert webhook["ports"] == [{"name": "https", "containerPort": 9443, "protocol": "TCP"}]
    assert webhook["args"] == [
        "--port=9443", "--tls-cert-file=/etc/gpufence/tls/tls.crt", "--tls-private-key-file=/etc/gpufence/tls/tls.key",
        "--policy-configmap=gpufence/gpufence-policy", "--log-level=debug", "--shutdown-delay=10s"]

    # The webhook's own parser reads the policy the chart wrote.
    settings = policy_settings(objects[POLICY]["data"])
    assert settings.sidecar_image == CUSTOM_IMAGE and settings.sidecar_image_pull_policy == "Always"
    assert settings.gpu_resource_names == ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb")
    assert (settings.default_mode, settings.allow_audit, settings.allow_opt_out) == ("audit", True, True)
    assert (settings.max_memory, settings.max_compute) == ("16Gi", "50%")
    assert (settings.default_memory, settings.default_compute) == ("25%", "20")
    assert settings.poll_interval_seconds == 1.0 and settings.nvidia_visible_devices == "all"
    assert settings.mps_limits and settings.metrics_port == 9402
    assert settings.framework_memory_headroom_bytes == 512 << 20
    assert settings.gpu_memory == (("nvidia.com/gpu", 80 << 30), ("nvidia.com/mig-1g.10gb", 10 << 30))

    monitoring = [o for o in objects.values() if o["kind"] in {"PodMonitor", "ServiceMonitor", "PrometheusRule"}]
    assert len(monitoring) == 4  # the enforcer's and the guardian's PodMonitors, the ServiceMonitor, the rules
    assert all(o["metadata"]["labels"]["release"] == "kube-prometheus-stack" for o in monitoring)
    assert "release" not in deployment["metadata"]["labels"]
    assert objects["MutatingWebhookConfiguration", None, "gpufence"]["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "gpufence/gpufence-webhook"}


def test_default_policy_is_the_webhooks_default(helm: Path, tmp_path: Path) -> None:
    """With the defaults, the ConfigMap changes nothing the webhook would do without it, and the
    webhook gets no policy flag: only the ConfigMap says what it injects."""
    objects = {key(o): o for o in template(helm, tmp_path)}
    data = objects[POLICY]["data"]
    assert data["sidecar-image"] == webhook_container(objects)["image"] == f"ghcr.io/gpufence/gpufence:{__version__}"
    assert policy_settings(data) == InjectionSettings()
    assert set(data) >= WRITTEN_POLICY_KEYS
    injection = set(helper_words("gpufence.policyKeys"))
    flags = {arg.removeprefix("--").split("=")[0] for arg in webhook_container(objects)["args"]}
    assert not flags & injection, f"policy flags on the webhook: {sorted(flags & injection)}"


def test_default_webhook_args_parse(helm: Path, tmp_path: Path) -> None:
    objects = {key(o): o for o in template(helm, tmp_path)}
    args = webhook_container(objects)["args"]
    assert "--policy-configmap=gpufence/gpufence-policy" in args
    parsed = parse_args(args, environ={})
    assert parsed.port == 8443 and parsed.tls_cert_file == "/etc/gpufence/tls/tls.crt"


def test_protect_reads_the_policy_configmap(helm: Path, tmp_path: Path) -> None:
    """The protect policy reads admin-groups from ConfigMap gpufence-policy, never a copy of a value."""
    policies = []
    for values in ({}, CUSTOM):
        objects = {key(o): o for o in template(helm, tmp_path, values)}
        for name in ("gpufence-protect", "gpufence-protect-exec"):
            policy = objects["ValidatingAdmissionPolicy", None, name]
            policies.append(policy)
            assert policy["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "ConfigMap"}
            binding = objects["ValidatingAdmissionPolicyBinding", None, name]
            assert binding["spec"]["paramRef"] == {
                "name": "gpufence-policy", "namespace": "gpufence", "parameterNotFoundAction": "Deny"}
            cel = "\n".join(strings_in(policy["spec"]))
            read = set(re.findall(r"""variables\.clusterPolicy\[\s*'([a-z0-9-]+)'\s*\]""", cel))
            assert read == {"admin-groups"}, read
    # The values reach the policies only through the ConfigMap: the objects are the same for any values.
    assert policies[:2] == policies[2:], "a policy value was copied into the protect policy"


def test_the_webhook_configurations_fail_closed_for_pods(helm: Path, tmp_path: Path) -> None:
    objects = {key(o): o for o in template(helm, tmp_path, CUSTOM)}
    hooks = {w["name"]: w for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
             for w in objects[kind, None, "gpufence"]["webhooks"]}
    assert {n: w["failurePolicy"] for n, w in hooks.items()} == {
        "inject.gpufence.io": "Fail", "debug.gpufence.io": "Ignore", "verify.gpufence.io": "Fail"}
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        assert objects[kind, None, "gpufence"]["metadata"]["annotations"] == {
            "cert-manager.io/inject-ca-from": "gpufence/gpufence-webhook"}


@pytest.mark.parametrize(("values", "message"), [
    ({"policy": {"max-memroy": "16Gi"}},
     'policy.max-memroy: 16Gi: not a policy setting of gpufence-webhook; the keys are its injection flags'),
    ({"policy": {"poll-interval": "1s"}}, "policy.poll-interval: 1s: not a policy setting"),
    ({"policy": {"sidecar-image": "example.com/x:1"}},
     "policy.sidecar-image: example.com/x:1: the sidecar runs the chart's image; set image.repository and image.tag"),
    ({"policy": {"max-memory": ["8Gi", "16Gi"]}},
     "policy.max-memory: [8Gi 16Gi]: a list, but only gpu-resource-name, exclusive-gpu-resource-name, "
     "non-gpu-resource-claims, dra-gpu-driver-name, gpu-memory, admin-groups, kai-scheduler-name, "
     "device-access-namespaces take several values; "
     "give one, e.g. policy.max-memory: 8Gi"),
    ({"webhook": {"flags": {"default-memory": "25%"}}},
     "webhook.flags.default-memory: 25%: a policy setting, which the webhook reads from the ConfigMap "
     "gpufence-policy; set policy.default-memory instead"),
    ({"webhook": {"flags": {"port": 9443}}}, "webhook.flags.port: 9443: the chart sets --port from webhook.port"),
    ({"webhook": {"flags": {"tls-cert-file": "/x"}}},
     "webhook.flags.tls-cert-file: /x: not a flag webhook.flags can set"),
    ({"gpuResourceNames": ["nvidia.com/gpu"]},
     "gpuResourceNames: [nvidia.com/gpu]: this value moved into the policy ConfigMap; set policy.gpu-resource-name"),
], ids=["typo", "deprecated-name", "sidecar-image", "list", "policy-flag", "port", "chart-flag", "moved-value"])
def test_bad_values_fail_naming_them(helm: Path, tmp_path: Path, values: dict[str, Any], message: str) -> None:
    result = helm_template(helm, tmp_path, values)
    assert result.returncode != 0
    assert message in result.stderr
    assert "e.g." in result.stderr[result.stderr.index(message):], "an accepted example"


def test_promtool_checks_the_charts_rules(helm: Path, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing(PROMTOOL_MISSING)
    (rule,) = [o for o in template(helm, tmp_path, CUSTOM) if o["kind"] == "PrometheusRule"]
    rules = write_rules(tmp_path, rule["spec"]["groups"])
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
