"""Forged enforcement, judged by the webhook alone: the one implementation of the pod rules.

Each forgery (tests/support/forgeries.py) takes what the webhook really injected and weakens one
thing. Two ways such a pod meets gpufence:
- submitted by a tenant: the mutating webhook rebuilds what is gpufence's (the result gives the
  enforcer exactly what the untouched injection gives it) or denies the pod;
- made by a mutating step after gpufence's: the validating webhook (``admission.verify``) sees it
  last and refuses it, naming what differs.
With the webhook down the API server refuses every such pod (failurePolicy Fail), which
tests/e2e/test_forged_sidecar.py shows on real API servers.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest

from gpufence.contract import ENV_DRIVER_MEMORY_LIMIT, INJECTION_ENABLED, INJECTION_LABEL
from gpufence.webhook.client import decode_patch, pod_admission_review
from gpufence.webhook.core.admission import review, verify
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo
from tests.support.forgeries import (
    CEILINGS,
    FORGERIES,
    LIMIT_FORGERIES,
    SHARES,
    TOKEN_PATH,
    TOKEN_VOLUME,
    config_of,
    gpu_pod,
    injected,
    pinned_gpu_pod,
    same_but_config,
    sidecar_of,
    workload_env,
)


class _Lookup:
    def __init__(self, annotations: dict[str, str]) -> None:
        self.annotations = annotations

    def get(self, name: str) -> NamespaceInfo:
        return NamespaceInfo(name=name, labels={INJECTION_LABEL: INJECTION_ENABLED}, annotations=self.annotations)


def _judged(pod: dict[str, Any], annotations: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the validating webhook's response, the pod after the mutating webhook's patch or None if denied)."""
    settings, lookup = InjectionSettings(), _Lookup(annotations)
    checked = verify(pod_admission_review(copy.deepcopy(pod), uid="u", namespace="team-a"), settings, lookup)
    mutated = review(pod_admission_review(copy.deepcopy(pod), uid="u", namespace="team-a"), settings, lookup)
    response = mutated.review["response"]
    if not response["allowed"]:
        return checked.review["response"], None
    patch = decode_patch(response)
    return checked.review["response"], jsonpatch.apply_patch(pod, patch) if patch else pod


@pytest.fixture(scope="module")
def untouched() -> dict[str, Any]:
    """The webhook's output as the API server stores it: its ServiceAccount plugin mounts the pod's
    token into every container (the forgeries of the token start from there)."""
    pod = injected(gpu_pod(dict(SHARES)), CEILINGS)
    pod["spec"].setdefault("volumes", []).append(copy.deepcopy(TOKEN_VOLUME))
    for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        container.setdefault("volumeMounts", []).append(
            {"name": TOKEN_VOLUME["name"], "mountPath": TOKEN_PATH, "readOnly": True})
    return pod


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_sidecar_is_rebuilt_or_denied_and_never_passes_validation(untouched: dict[str, Any],
                                                                          name: str) -> None:
    forged = copy.deepcopy(untouched)
    FORGERIES[name](forged)
    checked, result = _judged(forged, CEILINGS)
    assert checked["allowed"] is False, f"verify admitted the forgery {name!r}"
    assert checked["status"]["message"], checked  # the API server shows it after 'admission webhook
    # "verify.gpufence.io" denied the request: '
    if result is None:
        return  # denied, with the reason (the goldens pin the messages)
    assert same_but_config(sidecar_of(result), sidecar_of(untouched)), name
    expected, got = config_of(untouched), config_of(result)
    assert got["containers"]["trainer"] == expected["containers"]["trainer"], name
    assert (got.get("mode"), got.get("pollIntervalSeconds")) == (expected.get("mode"),
                                                                   expected.get("pollIntervalSeconds"))
    again, _ = _judged(result, CEILINGS)
    assert again["allowed"] is True, again  # what the webhook made of it is a fixed point


def test_the_untouched_injection_passes_validation(untouched: dict[str, Any]) -> None:
    checked, result = _judged(untouched, CEILINGS)
    assert checked["allowed"] is True and result == untouched


@pytest.mark.parametrize("name", list(LIMIT_FORGERIES))
def test_forged_limit_variables_are_rewritten_and_never_pass_validation(name: str) -> None:
    output = injected(pinned_gpu_pod(), {})
    limits = [e for e in workload_env(output) if e["name"].startswith("NVIDIA_GPU_MEMORY")]
    assert {e["name"]: e["value"] for e in limits}[ENV_DRIVER_MEMORY_LIMIT] == "4096"
    forged = copy.deepcopy(output)
    LIMIT_FORGERIES[name](forged)
    checked, result = _judged(forged, {})
    assert checked["allowed"] is False, f"verify admitted {name!r}"
    assert result is not None, "the webhook rewrites limit variables rather than deny"
    pinned = bool(forged["spec"].get("nodeSelector"))
    got = [e for e in workload_env(result) if e["name"].startswith(("NVIDIA_GPU_MEMORY", "CUDA_MPS"))]
    assert sorted(got, key=json.dumps) == (sorted(limits, key=json.dumps) if pinned else []), json.dumps(got)
