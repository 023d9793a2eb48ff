"""The Helm chart and the kustomize install render the same objects.

charts/gpufence has templates of its own (readable Helm, no interpretation of k8s/), so the two can
drift apart; this test is what keeps them together. For the defaults and for each variant the chart
supports, ``helm template`` and ``kubectl kustomize`` of the matching directory must give the same
objects (kind, namespace, name) with the same content. Two differences are allowed, both of form:

* Helm's release labels, on every object the chart renders: ``helm.sh/chart`` (gpufence-<chart
  version>), ``app.kubernetes.io/managed-by`` (Helm) and ``app.kubernetes.io/instance`` (the
  release name). They are checked for those values, then removed;
* blank lines inside strings (``blank_lines_collapsed``).

The protect policy, the alert rules and the dashboard are not rewritten in the chart: they are copies
that scripts/chart_from_k8s.py writes from k8s/, checked here to be current.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from gpufence import __version__
from scripts import chart_from_k8s
from tests.deploy.test_helm import RELEASE, key, template
from tests.deploy.test_manifests import BUILDS, render
from tests.support import helm_binary

pytestmark = pytest.mark.timeout(helm_binary.BUILD_TIMEOUT_SECONDS + 300)

HELM_LABELS = {"helm.sh/chart": f"gpufence-{__version__}", "app.kubernetes.io/managed-by": "Helm",
               "app.kubernetes.io/instance": RELEASE}  # fmt: skip

# kustomize directory -> the values that render it
VARIANTS: dict[str, dict[str, Any]] = {
    "k8s": {},
    "k8s/overlays/cert-manager": {"certManager": {"enabled": True}},
    "k8s/overlays/monitoring": {"monitoring": {"enabled": True}},
    "k8s/overlays/cert-manager-monitoring": {"certManager": {"enabled": True}, "monitoring": {"enabled": True}},
    "k8s/overlays/node-guardian": {"nodeGuardian": {"enabled": True}},
}
assert set(VARIANTS) == set(BUILDS)



def without_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    labels = obj["metadata"]["labels"]
    assert {k: labels.get(k) for k in HELM_LABELS} == HELM_LABELS, key(obj)
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


Objects = dict[tuple[str, str | None, str], dict[str, Any]]


def both(helm: Path, tmp: Path, directory: str) -> tuple[Objects, Objects]:
    chart = {key(o): without_helm_labels(o) for o in template(helm, tmp, VARIANTS[directory])}
    kustomize = {key(o): copy.deepcopy(o) for o in render(directory)}  # render's objects are cached: shared
    return chart, kustomize


def assert_same(chart: Objects, kustomize: Objects) -> None:
    assert sorted(chart, key=str) == sorted(kustomize, key=str)
    for k, obj in kustomize.items():
        assert blank_lines_collapsed(chart[k]) == blank_lines_collapsed(obj), f"{k} differs from kubectl kustomize"


# ---------------------------------------------------------------------------------------------


def test_the_charts_copies_of_k8s_are_current() -> None:
    stale = chart_from_k8s.stale()
    assert not stale, f"stale: {[str(p) for p in stale]}; run `python -m scripts.chart_from_k8s`"


@pytest.mark.parametrize("directory", VARIANTS)
def test_template_equals_kustomize(helm: Path, tmp_path: Path, directory: str) -> None:
    assert_same(*both(helm, tmp_path, directory))


POLICY = """\
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicy
metadata:
  name: gpufence-protect
  labels:
    app.kubernetes.io/name: gpufence-protect
{extra}spec:
  variables:
    - name: x
      expression: "{expression}"
"""


def test_the_copy_replaces_only_the_labels() -> None:
    protect = chart_from_k8s.COPIES[0]
    text = POLICY.format(extra="    app.kubernetes.io/component: protect\n", expression="1 + 1")
    include = ('{{- include "gpufence.labels" (dict "context" $ "name" "gpufence-protect" "component" "protect")'
               " | nindent 4 }}")
    assert chart_from_k8s.template_of(text, protect).split("*/ -}}\n", 1)[1] == text.replace(
        "    app.kubernetes.io/name: gpufence-protect\n    app.kubernetes.io/component: protect\n", f"    {include}\n")


@pytest.mark.parametrize(("extra", "expression", "message"), [
    ("    app.kubernetes.io/component: protect\n    team: a\n", "1",
     "object gpufence-protect: its metadata.labels are 'app.kubernetes.io/name: gpufence-protect"),
    ("    app.kubernetes.io/component: protect\n", "{{ 1",
     "a '{{' the chart cannot copy: each must close with '}}' on the same line"),
], ids=["other-label", "unclosed-template"])
def test_the_copy_refuses_what_helm_would_change(extra: str, expression: str, message: str) -> None:
    with pytest.raises(chart_from_k8s.ChartSourceError, match=re.escape(message)) as raised:
        chart_from_k8s.template_of(POLICY.format(extra=extra, expression=expression), chart_from_k8s.COPIES[0])
    assert "e.g." in str(raised.value) and "k8s/base/protect-policy.yaml" in str(raised.value)
