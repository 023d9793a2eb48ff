"""Golden files for the injection (Istio-injector style).

``tests/golden/<case>.in.yaml`` is one YAML document::

    namespace: ...   # optional: omitted = opted in, no annotations; "unknown" = not in the cache;
                     # or {name, labels, annotations}
    settings: ...    # optional: InjectionSettings field overrides
    kubernetes: ...  # optional: the API version whose schema the pods follow (default K8S_VERSION;
                     # DRA claims need 1.31's resourceClaims shape)
    operation: ...   # optional: CREATE by default
    username: ...    # optional: who sends the request (default a ReplicaSet controller's account)
    subResource: ... # optional: e.g. ephemeralcontainers (an UPDATE of that subresource)
    oldPod: ...      # optional: the request's oldObject (UPDATE)
    dra: ...         # optional: {deviceClasses, claims, templates}, the objects the webhook's DRA watch
                     # caches hold (resource.k8s.io/v1, as the API server lists them); omitted = no caches
    pod: ...         # the submitted pod

``<case>.out.yaml`` records the decision: ``outcome``, ``warnings`` (if any), ``message`` (denials)
and ``pod`` (the pod after applying the webhook's JSON Patch with ``jsonpatch``; only when admitted
with a patch or unchanged). ``GPUFENCE_UPDATE_GOLDEN=1`` rewrites the outputs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from gpufence.contract import INJECTION_ENABLED, INJECTION_LABEL
from gpufence.webhook.client import decode_patch, pod_admission_review
from gpufence.webhook.core import sidecar
from gpufence.webhook.core.admission import review, verify
from gpufence.webhook.core.dra import DraSnapshot
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo

GOLDEN = Path(__file__).parents[2] / "golden"
UPDATE = os.environ.get("GPUFENCE_UPDATE_GOLDEN") == "1"
CASES = sorted(p.name.removesuffix(".in.yaml") for p in GOLDEN.glob("*.in.yaml"))
K8S_VERSION = "1.30"


class _Lookup:
    def __init__(self, info: NamespaceInfo | None) -> None:
        self.info = info

    def get(self, name: str) -> NamespaceInfo | None:
        return self.info


@pytest.fixture(autouse=True)
def _fixed_version(monkeypatch: pytest.MonkeyPatch) -> None:
    # The status annotation records the package version; goldens must not change with each release.
    monkeypatch.setattr(sidecar, "GPUFENCE_VERSION", "0.0.0-test")


def request_extras(case: str) -> dict[str, Any]:
    """Who sends the case's request, and its subresource and oldObject (none for a pod CREATE)."""
    doc = yaml.safe_load((GOLDEN / f"{case}.in.yaml").read_text())
    return {"username": doc.get("username", DEFAULT_USERNAME), "sub_resource": doc.get("subResource"),
            "old_object": doc.get("oldPod")}


def dra_objects(case: str) -> DraSnapshot | None:
    """The DRA objects the case's webhook holds in its watch caches, or None (run outside a cluster)."""
    dra = yaml.safe_load((GOLDEN / f"{case}.in.yaml").read_text()).get("dra")
    if dra is None:
        return None
    return DraSnapshot.of(classes=dra.get("deviceClasses") or (), claims=dra.get("claims") or (),
                          templates=dra.get("templates") or ())


def load_case(case: str) -> tuple[dict[str, Any], InjectionSettings, _Lookup, str]:
    doc = yaml.safe_load((GOLDEN / f"{case}.in.yaml").read_text())
    pod = doc["pod"]
    overrides = dict(doc.get("settings") or {})
    for name in ("gpu_resource_names", "exclusive_gpu_resource_names", "non_gpu_resource_claims",
                 "device_access_namespaces"):
        if name in overrides:
            overrides[name] = tuple(overrides[name])
    if "gpu_memory" in overrides:
        overrides["gpu_memory"] = tuple((name, int(size)) for name, size in overrides["gpu_memory"])
    settings = InjectionSettings(**overrides)
    ns_doc = doc.get("namespace")
    if ns_doc == "unknown":
        info = None
    elif ns_doc is None:
        info = NamespaceInfo(name=pod["metadata"]["namespace"], labels={INJECTION_LABEL: INJECTION_ENABLED})
    else:
        info = NamespaceInfo(
            name=ns_doc["name"], labels=ns_doc.get("labels") or {}, annotations=ns_doc.get("annotations") or {}
        )
    return pod, settings, _Lookup(info), doc.get("operation", "CREATE")


DEFAULT_USERNAME = "system:serviceaccount:kube-system:replicaset-controller"


def username_of(case: str) -> str:
    """Who sends the case's request: a node for a static pod's mirror, else a controller."""
    return yaml.safe_load((GOLDEN / f"{case}.in.yaml").read_text()).get("username", DEFAULT_USERNAME)


def admission_review(pod: dict[str, Any], operation: str = "CREATE", uid: str = "0b4e3c2a-golden",
                     **extras: Any) -> dict[str, Any]:
    namespace = pod.get("metadata", {}).get("namespace", "team-a")
    return pod_admission_review(pod, uid=uid, namespace=namespace, operation=operation, **extras)


def run_case(case: str) -> dict[str, Any]:
    pod, settings, lookup, operation = load_case(case)
    result = review(admission_review(pod, operation, **request_extras(case)), settings, lookup, dra_objects(case))
    answer = result.review
    assert answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "0b4e3c2a-golden"
    out: dict[str, Any] = {"outcome": result.outcome}
    if response.get("warnings"):
        out["warnings"] = response["warnings"]
    patch = decode_patch(response)
    if result.outcome == "denied":
        assert response["allowed"] is False
        assert response["status"]["code"] == 400
        assert patch is None
        out["message"] = response["status"]["message"]
    else:
        assert response["allowed"] is True
        assert (patch is not None) == (result.outcome == "mutated")
        if result.outcome != "skipped":
            out["pod"] = jsonpatch.apply_patch(pod, patch) if patch else pod
    return out


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str) -> None:
    actual = run_case(case)
    out_path = GOLDEN / f"{case}.out.yaml"
    if UPDATE:
        out_path.write_text(yaml.safe_dump(actual, sort_keys=False, width=100, allow_unicode=True))
    assert out_path.exists(), f"{out_path.name} is missing: run with GPUFENCE_UPDATE_GOLDEN=1"
    expected = yaml.safe_load(out_path.read_text())
    assert actual == expected


@pytest.mark.parametrize("case", CASES)
def test_golden_input_and_output_pods_are_valid_kubernetes(case: str) -> None:
    pod, *_ = load_case(case)
    version = str(yaml.safe_load((GOLDEN / f"{case}.in.yaml").read_text()).get("kubernetes", K8S_VERSION))
    kubernetes_validate.validate(pod, version, strict=True)
    expected = yaml.safe_load((GOLDEN / f"{case}.out.yaml").read_text())
    if "pod" in expected:
        kubernetes_validate.validate(expected["pod"], version, strict=True)


@pytest.mark.parametrize("case", CASES)
def test_golden_output_is_a_fixed_point(case: str) -> None:
    """Reinvocation (reinvocationPolicy: IfNeeded) of the webhook's own output changes nothing."""
    _, settings, lookup, operation = load_case(case)
    expected = yaml.safe_load((GOLDEN / f"{case}.out.yaml").read_text())
    if expected["outcome"] not in ("mutated", "unchanged"):
        return
    result = review(admission_review(expected["pod"], operation, **request_extras(case)), settings, lookup,
                    dra_objects(case))
    assert result.outcome == "unchanged"
    assert "patch" not in result.review["response"]


@pytest.mark.parametrize("case", CASES)
def test_golden_verify_admits_the_output_and_refuses_the_input_it_would_change(case: str) -> None:
    """verify.gpufence.io (the validating webhook) on the same rules: what the mutating webhook made
    of a pod passes; a pod it would have changed or denied, reaching validation as it was (another
    mutating step undid gpufence's work), is refused, with the mutating webhook's own reason where
    it would deny."""
    pod, settings, lookup, operation = load_case(case)
    if operation != "CREATE" or request_extras(case)["sub_resource"]:
        return  # the validating webhook judges pod creations only
    expected = yaml.safe_load((GOLDEN / f"{case}.out.yaml").read_text())
    if "pod" in expected:
        kept = verify(admission_review(expected["pod"], **request_extras(case)), settings, lookup, dra_objects(case))
        assert kept.review["response"]["allowed"] is True, kept.review["response"]
        assert kept.outcome in ("verified", "skipped") and "warnings" not in kept.review["response"]
    as_sent = verify(admission_review(pod, **request_extras(case)), settings, lookup,
                     dra_objects(case)).review["response"]
    if expected["outcome"] == "denied":
        assert as_sent["allowed"] is False
        assert as_sent["status"]["message"] == "gpufence re-checked the pod after every mutating admission step: " + \
            expected["message"]
    elif expected["outcome"] == "mutated":
        assert as_sent["allowed"] is False, as_sent
        assert as_sent["status"]["message"].startswith("gpufence: the pod differs from what gpufence admits at /")
    else:
        assert as_sent["allowed"] is True, as_sent


def test_every_golden_file_has_a_partner() -> None:
    names = {p.name for p in GOLDEN.iterdir()}
    unpaired = sorted(
        n
        for n in names
        if not (
            (n.endswith(".in.yaml") and n.replace(".in.yaml", ".out.yaml") in names)
            or (n.endswith(".out.yaml") and n.replace(".out.yaml", ".in.yaml") in names)
        )
    )
    assert not unpaired, f"golden files without a partner (stale or unused): {unpaired}"


def test_golden_covers_every_outcome() -> None:
    assert len(CASES) >= 22
    outcomes = {yaml.safe_load((GOLDEN / f"{c}.out.yaml").read_text())["outcome"] for c in CASES}
    assert outcomes == {"mutated", "unchanged", "denied", "skipped"}
