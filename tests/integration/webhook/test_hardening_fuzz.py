"""Fuzzing the webhook over real HTTPS: never a 5xx; a well-formed AdmissionReview or a 4xx JSON error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.field_types import random_swapped_pods
from tests.support.review_checks import HttpsClient, check_http, hypothesis_reviews, json_values
from tests.support.sample_pods import admission_review, typical_pod
from tests.support.server_process import gpufence_server
from tests.support.tlsutil import make_pki

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsClient]:
    pki = make_pki(Path(tmp_path_factory.mktemp("fuzz")) / "pki")
    with gpufence_server(pki) as (_, port):
        c = HttpsClient(port, pki.client_context())
        yield c
        c.close()


@FUZZ
@given(hypothesis_reviews())
def test_reviews_over_https(client: HttpsClient, payload):
    status, data = client.post(json.dumps(payload).encode())
    check_http(payload, status, data)


@FUZZ
@given(json_values(max_leaves=30))
def test_arbitrary_json_bodies(client: HttpsClient, value):
    status, data = client.post(json.dumps(value).encode())
    assert status < 500, data[:300]
    doc = json.loads(data)
    if status == 200:  # only a real AdmissionReview envelope gets a 200
        assert doc["kind"] == "AdmissionReview" and isinstance(doc["response"]["allowed"], bool)
    else:
        assert 400 <= status < 500 and isinstance(doc["error"], str)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=2000) | st.text(max_size=500).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_arbitrary_bytes(client: HttpsClient, body: bytes):
    if not body:
        body = b" "
    status, data = client.post(body)
    assert 400 <= status < 500 or status == 200, (status, data[:300])
    assert isinstance(json.loads(data), dict)


@pytest.mark.parametrize("mutation", ["huge-annotation", "deep-nesting", "dup-containers", "unicode-keys"])
def test_targeted_inputs(client: HttpsClient, mutation: str):
    pod = typical_pod()
    if mutation == "huge-annotation":
        pod["metadata"]["annotations"]["example.com/blob"] = "a" * (3 << 20)
    elif mutation == "deep-nesting":
        body = json.dumps(admission_review(pod))[:-2] + ', "extra": ' + '{"k": ' * 5000 + '"x"' + "}" * 5000 + "}}"
        status, data = client.post(body.encode())
        assert status < 500, data[:300]
        return
    elif mutation == "dup-containers":
        pod["spec"]["containers"].append(dict(pod["spec"]["containers"][0]))
    else:
        pod["metadata"]["annotations"]["gpufence.io/memory.ü🚀"] = "8Gi"
        pod["metadata"]["annotations"]["\ud800"] = "x"
    payload = admission_review(pod)
    status, data = client.post(json.dumps(payload).encode())
    check_http(payload, status, data)


SWAPPED_REVIEWS = 3000  # issue 38: two of 3,000 such reviews got HTTP 500


@pytest.mark.timeout(600)
def test_field_types_swapped_in_golden_pods_over_https(client: HttpsClient) -> None:
    """Every golden pod with one to three of its fields given another JSON type (a list or an
    object where a string belongs, and the reverse): 200 with a well-formed answer or a 4xx, never
    a 5xx (tests/support/field_types.py)."""
    statuses: dict[str, int] = {}
    for i, (_, pod) in enumerate(random_swapped_pods(SWAPPED_REVIEWS, seed=38)):
        payload = admission_review(pod, uid=f"swap-{i}")
        status = check_http(payload, *client.post(json.dumps(payload).encode()))
        statuses[status] = statuses.get(status, 0) + 1
    print(f"{SWAPPED_REVIEWS} reviews with swapped field types, answers by HTTP status: {statuses}")
    assert sum(statuses.values()) == SWAPPED_REVIEWS
