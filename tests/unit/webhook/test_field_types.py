"""Never an exception, whatever the type of a field the webhook reads (issue 38, row 4).

The API server decodes pods into typed objects before admission, so a pod whose ``volumes[].name``
is a list only comes from a hand-made request; the webhook must still answer it (a denial naming
the field) rather than fail with HTTP 500. Each example takes the pod of a golden case, with the
case's settings and namespace, and swaps the type of one to three of its fields
(tests/support/field_types.py).
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpufence.webhook.client import pod_admission_review
from gpufence.webhook.core.admission import review, verify
from tests.support.examples import examples
from tests.support.field_types import golden_pods, put, swapped
from tests.unit.webhook.test_admission import check_well_formed
from tests.unit.webhook.test_golden import dra_objects, load_case, request_extras

UID = "0b4e3c2a-golden"


def answer(case: str, pod: dict[str, Any]) -> dict[str, Any]:
    """The review of ``pod`` in the golden ``case``'s setting, checked well-formed; its response."""
    original, settings_, lookup, operation = load_case(case)
    extras = request_extras(case)
    payload = pod_admission_review(pod, uid=UID, namespace=original["metadata"]["namespace"],
                                   operation=operation, **extras)
    result = review(payload, settings_, lookup, dra_objects(case))
    patch = check_well_formed(result, UID)
    if patch is not None:
        jsonpatch.apply_patch(pod, patch)
    if operation == "CREATE" and not extras["sub_resource"]:
        checked = verify(payload, settings_, lookup, dra_objects(case)).review["response"]
        assert checked["uid"] == UID and isinstance(checked["allowed"], bool)
        assert checked["allowed"] or checked["status"]["message"]
    return result.review["response"]


@st.composite
def swapped_golden_pods(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    case, pod = draw(st.sampled_from(golden_pods()))
    return case, swapped(pod, lambda options: draw(st.sampled_from(options)), draw(st.integers(1, 3)))


@settings(max_examples=examples(500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swapped_golden_pods())
def test_swapped_field_types_get_an_answer(drawn: tuple[str, dict[str, Any]]) -> None:
    response = answer(*drawn)
    event("allowed" if response["allowed"] else "denied")


@pytest.mark.parametrize(("case", "place", "value", "field"), [
    # The two of the 3,000 fuzzed reviews that got HTTP 500.
    ("existing-env-preload", ("spec", "volumes", 0, "name"), ["data"], "spec.volumes[0].name"),
    ("existing-env-preload", ("spec", "volumes", 0, "name"), {"k": "data"}, "spec.volumes[0].name"),
    ("reinvocation-defaulted", ("spec", "initContainers", 0, "volumeMounts", 1, "name"), ["x"],
     "spec.initContainers[0].volumeMounts[1].name"),
    ("dra-template-claim", ("spec", "resourceClaims", 0, "resourceClaimTemplateName"), ["t"],
     "spec.resourceClaims[0].resourceClaimTemplateName"),
    ("dra-template-claim", ("spec", "containers", 0, "resources", "claims", 0, "name"), {"k": "gpu"},
     "spec.containers[0].resources.claims[0]"),
    ("deny-host-path-root", ("spec", "volumes", 0, "hostPath", "path"), ["/dev"], "spec.volumes[0].hostPath.path"),
])
def test_a_field_of_the_wrong_type_is_a_denial_naming_it(case: str, place: tuple[Any, ...], value: Any,
                                                         field: str) -> None:
    pod = copy.deepcopy(dict(golden_pods())[case])
    put(pod, place, value)
    response = answer(case, pod)
    assert response["allowed"] is False
    assert response["status"]["message"].startswith(f"the pod is malformed: {field} must be ")


def test_a_lone_surrogate_is_a_denial_not_an_exception() -> None:
    """Only in process (over HTTP the server's JSON decoder refuses it): found by bench.fuzz_webhook."""
    pod = copy.deepcopy(dict(golden_pods())["audit-mode"])
    put(pod, ("spec", "containers", 0, "name"), "\udfff\ud800")
    response = answer("audit-mode", pod)
    assert response["allowed"] is False and "not valid Unicode" in response["status"]["message"]
