"""The Helm chart (charts/gpufence): ``helm lint``, ``helm template``, and equality with kustomize.

The chart renders the kustomize manifests themselves (charts/gpufence/k8s links to k8s/), so the
main check is that, for the defaults and each variant, ``helm template`` gives exactly the objects
of ``kubectl kustomize`` of the matching overlay, apart from Helm's own labels. Every rendered
object, with the defaults and with every value changed, passes the validation the kustomize output
gets (tests/deploy/test_manifests.py ``validate``), and the webhook flags the values produce are parsed by
the webhook's own argument parser.

helm is built from its Go module (tests/support/helm_binary.py); without Go these tests skip. A cold build
takes minutes: run ``python -m tests.support.helm_binary`` before pytest to keep it out of a test's time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes

from gpufence import __version__
from gpufence.webhook.cli import parse_args, settings_from_args
from tests.deploy.test_alerts import PROMTOOL_MISSING, write_rules
from tests.deploy.test_manifests import BUILDS, K8S_VERSION, render, validate
from tests.support import helm_binary
from tests.support.prerequisites import missing

# The first test that asks for helm builds it when the cache lacks it: minutes with a cold Go build
# cache, more than the suite's per-test limit. Every helm and kubectl call has its own 120 s limit.
pytestmark = pytest.mark.timeout(helm_binary.BUILD_TIMEOUT_SECONDS + 300)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gpufence"
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance"}
RELEASE = "gpufence"

# values -> the kustomize build it must equal
VARIANTS: dict[str, dict[str, Any]] = {
    "k8s": {},
    "k8s/overlays/cert-manager": {"certManager": {"enabled": True}},
    "k8s/overlays/monitoring": {"monitoring": {"enabled": True}},
    "k8s/overlays/cert-manager-monitoring": {"certManager": {"enabled": True}, "monitoring": {"enabled": True}},
}
assert set(VARIANTS) == set(BUILDS)

# Every value changed from its default.
CUSTOM: dict[str, Any] = {
    "image": {"repository": "registry.example.com/team/gpufence", "tag": "1.2.3-rc.1", "pullPolicy": "Always"},
    "namespace": {"create": False},
    "webhook": {
        "replicas": 3,
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "priorityClassName": "system-cluster-critical",
        "flags": {"default-memory": "25%", "poll-interval": "1s", "mps-limits": True, "port": 9443,
                  "max-memory": "16Gi", "max-compute": "50%", "default-compute": "20", "default-mode": "audit",
                  "allow-audit": True, "allow-opt-out": "true", "sidecar-nvidia-visible-devices": "all"},
    },
    "gpuResourceNames": ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb"],
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


def template(helm: Path, tmp: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    # The install's minimum Kubernetes version, the one the manifests are validated against.
    result = run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", f"{K8S_VERSION}.0",
                      values=values, tmp=tmp)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def key(obj: dict[str, Any]) -> tuple[str, str | None, str]:
    return obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]


def without_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    labels = obj["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert labels["app.kubernetes.io/instance"] == RELEASE
    assert labels["helm.sh/chart"] == f"gpufence-{__version__}"
    obj["metadata"]["labels"] = {k: v for k, v in labels.items() if k not in HELM_LABELS}
    return obj


def blank_lines_collapsed(value: Any) -> Any:
    """``value`` with runs of newlines in its strings collapsed to one.

    kubectl kustomize (kyaml) re-emits a folded scalar (``>-``) that has more-indented lines with an
    extra line break before each of them, so its string differs from the file's own by blank lines
    (PyYAML and Helm read the file as written). Every multi-line string here (CEL, PromQL, texts,
    the dashboard's JSON) means the same with or without blank lines; anything else must be equal.
    """
    if isinstance(value, str):
        return re.sub(r"\n{2,}", "\n", value)
    if isinstance(value, dict):
        return {k: blank_lines_collapsed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank_lines_collapsed(v) for v in value]
    return value


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = {"Deployment": lambda o: o["spec"]["template"]["spec"], "Job": lambda o: o["spec"]["template"]["spec"],
            "CronJob": lambda o: o["spec"]["jobTemplate"]["spec"]["template"]["spec"]}.get(obj["kind"])  # fmt: skip
    if spec is None:
        return []
    pod = spec(obj)
    return pod.get("initContainers", []) + pod["containers"]


# ---------------------------------------------------------------------------------------------


def test_chart_version_is_the_source_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__


def test_chart_reads_the_kustomize_manifests() -> None:
    """No second copy: the chart's k8s is a link to the repository's k8s/."""
    link = CHART / "k8s"
    assert link.is_symlink() and link.resolve() == (ROOT / "k8s").resolve()
    assert [p.name for p in (CHART / "templates").iterdir()] == ["install.yaml"], "one template, rendering k8s/"


@pytest.mark.parametrize("values", [{}, CUSTOM], ids=["defaults", "custom"])
def test_helm_lint(helm: Path, tmp_path: Path, values: dict[str, Any]) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), "--kube-version", f"{K8S_VERSION}.0",
                      values=values, tmp=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("directory", VARIANTS)
def test_template_equals_kustomize(helm: Path, tmp_path: Path, directory: str) -> None:
    chart = {key(o): without_helm_labels(o) for o in template(helm, tmp_path, VARIANTS[directory])}
    kustomize = {key(o): o for o in render(directory)}
    assert sorted(chart, key=str) == sorted(kustomize, key=str)
    for k, obj in kustomize.items():
        assert blank_lines_collapsed(chart[k]) == blank_lines_collapsed(obj), f"{k} differs from kubectl kustomize"


@pytest.mark.parametrize("values", [*VARIANTS.values(), CUSTOM], ids=[*VARIANTS, "custom"])
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

    deployment = objects["Deployment", "gpufence", "gpufence-webhook"]
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    (webhook,) = pod["containers"]
    assert webhook["resources"] == CUSTOM["webhook"]["resources"]
    # The webhook's own parser reads the args the chart wrote.
    args = parse_args(webhook["args"], environ={})
    settings = settings_from_args(args)
    assert args.port == 9443 and webhook["args"].count("--port=9443") == 1
    assert settings.sidecar_image == CUSTOM_IMAGE and settings.sidecar_image_pull_policy == "Always"
    assert settings.default_memory == "25%" and settings.poll_interval_seconds == 1.0 and settings.mps_limits
    assert settings.gpu_resource_names == ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb")

    guard = objects["ValidatingAdmissionPolicy", None, "gpufence-guard"]
    (names,) = [v for v in guard["spec"]["variables"] if v["name"] == "gpuResourceNames"]
    assert names["expression"] == "['nvidia.com/gpu', 'nvidia.com/mig-1g.10gb']"
    (image,) = [v for v in guard["spec"]["variables"] if v["name"] == "sidecarImage"]
    assert image["expression"] == f"'{CUSTOM_IMAGE}'"  # the guard accepts the sidecar the webhook injects
    # The guard's copies of the policy flags hold what the webhook parses from its args.
    env = celpy.Environment()
    copies = ("cluster", "sidecarPoll", "sidecarVisible")
    guard_vars = {v["name"]: env.program(env.compile(v["expression"])).evaluate({})
                  for v in guard["spec"]["variables"] if v["name"].startswith(copies)}
    assert isinstance(guard_vars["sidecarPollIntervalSeconds"], celtypes.DoubleType)  # compared with a double
    assert guard_vars == {
        "clusterDefaultMode": settings.default_mode, "clusterAllowsAudit": settings.allow_audit,
        "clusterAllowsOptOut": settings.allow_opt_out, "clusterMaxMemory": settings.max_memory,
        "clusterMaxCompute": settings.max_compute, "clusterDefaultMemory": settings.default_memory,
        "clusterDefaultCompute": settings.default_compute,
        "sidecarPollIntervalSeconds": settings.poll_interval_seconds,
        "sidecarVisibleDevices": settings.nvidia_visible_devices,
    }
    assert settings.max_memory == "16Gi" and settings.allow_audit and settings.allow_opt_out

    monitoring = [o for o in objects.values() if o["kind"] in {"PodMonitor", "ServiceMonitor", "PrometheusRule"}]
    assert len(monitoring) == 3
    assert all(o["metadata"]["labels"]["release"] == "kube-prometheus-stack" for o in monitoring)
    assert "release" not in deployment["metadata"]["labels"]
    assert objects["MutatingWebhookConfiguration", None, "gpufence"]["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "gpufence/gpufence-webhook"}


def test_default_webhook_args_parse(helm: Path, tmp_path: Path) -> None:
    objects = {key(o): o for o in template(helm, tmp_path)}
    (webhook,) = objects["Deployment", "gpufence", "gpufence-webhook"]["spec"]["template"]["spec"]["containers"]
    settings = settings_from_args(parse_args(webhook["args"], environ={}))
    assert settings.sidecar_image == webhook["image"] == f"ghcr.io/gpufence/gpufence:{__version__}"


def test_a_kustomize_feature_the_chart_lacks_fails_the_render(helm: Path, tmp_path: Path) -> None:
    """The template refuses kustomization keys it does not implement instead of dropping them."""
    copy = tmp_path / "chart"
    subprocess.run(["cp", "-rL", str(CHART), str(copy)], check=True, timeout=60)
    kustomization = copy / "k8s" / "base" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + "namePrefix: team-\n")
    result = run_helm(helm, "template", RELEASE, str(copy), "--kube-version", f"{K8S_VERSION}.0")
    assert result.returncode != 0
    assert '"namePrefix", which the chart does not implement' in result.stderr


def test_promtool_checks_the_charts_rules(helm: Path, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing(PROMTOOL_MISSING)
    (rule,) = [o for o in template(helm, tmp_path, CUSTOM) if o["kind"] == "PrometheusRule"]
    rules = write_rules(tmp_path, rule["spec"]["groups"])
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
