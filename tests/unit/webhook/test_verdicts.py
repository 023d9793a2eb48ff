"""The memo of verdicts (webhook.verdicts): an answer given again is the answer the review gives, and
any change of what the review reads (the policy, the namespace, the user's groups, the operation,
the nodes, the DRA objects) is a new review. Each test below would fail if the memo answered a
request with the verdict of another state: every case checks first that the two states' own
answers differ."""

from __future__ import annotations

import base64
import copy
import json
import re
from dataclasses import replace
from typing import Any

import jsonpatch
import pytest
import yaml

from gpufence.contract import INJECTION_ENABLED, INJECTION_LABEL
from gpufence.webhook.client import decode_patch
from gpufence.webhook.core.admission import review, verify
from gpufence.webhook.core.dra import DraSnapshot
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo
from gpufence.webhook.verdicts import VerdictCache
from tests.support.sample_pods import admission_review as sample_review
from tests.support.sample_pods import typical_pod
from tests.unit.webhook.test_golden import CASES, GOLDEN, admission_review, dra_objects, load_case, request_extras


class _Namespaces:
    def __init__(self, info: NamespaceInfo | None) -> None:
        self.info = info
        self.asked: list[str] = []

    def get(self, name: str) -> NamespaceInfo | None:
        self.asked.append(name)
        return self.info


def _opted_in(annotations: dict[str, str] | None = None, **labels: str) -> _Namespaces:
    return _Namespaces(NamespaceInfo("team-a", labels={INJECTION_LABEL: INJECTION_ENABLED, **labels},
                                     annotations=annotations or {}))


def _per_object(pod: Any, tag: str) -> Any:
    """``pod`` as the API server hands one more pod of the same template to /validate: its own name,
    uid, creation time and managed fields, and its own name of the token volume."""
    if not isinstance(pod, dict) or not isinstance(pod.get("metadata"), dict):
        return pod
    text = json.dumps(pod)
    for token in set(re.findall(r'"(kube-api-access-[a-z0-9]{5})"', text)):
        text = text.replace(f'"{token}"', f'"kube-api-access-{(tag * 5)[:5]}"')
    pod = json.loads(text)
    pod["metadata"].update(name=f"{pod['metadata'].get('name', 'p')}-{tag}", uid=f"uid-{tag}",
                           creationTimestamp=f"2026-12-05T10:00:0{len(tag)}Z",
                           managedFields=[{"manager": tag, "operation": "Update", "time": "2026-12-05T10:00:00Z"}])
    return pod


def _stored() -> dict[str, Any]:
    """The typical pod as gpufence, under the default policy, in an opted-in namespace, stores it."""
    answer = review(sample_review(typical_pod()), InjectionSettings(), _opted_in()).review["response"]
    return jsonpatch.apply_patch(typical_pod(), decode_patch(answer))


def _typical(uid: str, *, pod: dict[str, Any] | None = None, **request: Any) -> dict[str, Any]:
    payload = sample_review(pod or typical_pod(), uid=uid)
    payload["request"].update(request)
    return payload


def _without_uid(answer: dict[str, Any]) -> dict[str, Any]:
    return {**answer, "response": {k: v for k, v in answer["response"].items() if k != "uid"}}


@pytest.mark.parametrize("judge", [review, verify])
@pytest.mark.parametrize("case", CASES)
def test_every_golden_answered_again_is_answered_as_the_review_answers(case: str, judge: Any) -> None:
    """The second pod of the same template differs only in the fields the key leaves out: the memo's
    answer to it is exactly the review's (so no rule reads those fields), with its own uid."""
    pod, settings, lookup, operation = load_case(case)
    if judge is verify:
        out = yaml.safe_load((GOLDEN / f"{case}.out.yaml").read_text())
        pod = out.get("pod", pod)
    extras = request_extras(case)
    first = admission_review(_per_object(pod, "a"), operation, uid="uid-1", **extras)
    second = admission_review(_per_object(pod, "bb"), operation, uid="uid-2", **extras)
    cache = VerdictCache()
    assert cache.judge(judge, first, settings, lookup, dra_objects(case)) == \
        judge(first, settings, lookup, dra_objects(case))
    got = cache.judge(judge, second, settings, lookup, dra_objects(case))
    assert got == judge(second, settings, lookup, dra_objects(case))
    assert got.review["response"]["uid"] == "uid-2"
    # The patch's bytes beside its base64, for readers that would decode it again: the same patch.
    response = got.review["response"]
    assert got.patch == (base64.b64decode(response["patch"]) if "patch" in response else None)
    assert cache.hits == len(cache) == (0 if dra_objects(case) is not None and "laims" in str(pod) else 1)


def _two_states(judge: Any, a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    """``a`` and ``b``: (payload, settings, namespaces, claims, nodes). Their own answers differ; the
    memo, asked in the order a, b, a, b, gives each its own."""
    own_a, own_b = judge(*a), judge(*b)
    assert (own_a.outcome, _without_uid(own_a.review)) != (own_b.outcome, _without_uid(own_b.review)), \
        "the test needs two states the review tells apart"
    cache = VerdictCache()
    for state, own in ((a, own_a), (b, own_b), (a, own_a), (b, own_b)):
        assert cache.judge(judge, *state) == own


@pytest.mark.parametrize("judge", [review, verify])
def test_another_policy_is_another_verdict(judge: Any) -> None:
    ns = _opted_in()
    settings = InjectionSettings()
    pod = _stored() if judge is verify else typical_pod()
    _two_states(judge, (_typical("1", pod=pod), settings, ns, None, None),
                (_typical("2", pod=pod), replace(settings, metrics_port=9555), ns, None, None))


def test_an_equal_policy_that_is_a_new_object_is_reviewed_again() -> None:
    cache = VerdictCache()
    cache.judge(review, _typical("1"), InjectionSettings(), _opted_in())
    cache.judge(review, _typical("2"), InjectionSettings(), _opted_in())
    assert cache.hits == 0 and cache.misses == 2 and len(cache) == 1


@pytest.mark.parametrize("judge", [review, verify])
def test_another_namespace_state_is_another_verdict(judge: Any) -> None:
    settings = InjectionSettings()
    pod = _stored() if judge is verify else typical_pod()
    # Labels: a namespace no longer opted in.
    _two_states(judge, (_typical("1", pod=pod), settings, _opted_in(), None, None),
                (_typical("2", pod=pod), settings, _Namespaces(NamespaceInfo("team-a", labels={})), None, None))
    # Annotations: the namespace's default mode.
    _two_states(judge, (_typical("1", pod=pod), settings, _opted_in(), None, None),
                (_typical("2", pod=pod), settings, _opted_in({"gpufence.io/mode": "audit"}), None, None))
    if judge is review:  # Not in the webhook's cache at all: a warning (verify repeats none).
        _two_states(judge, (_typical("1"), settings, _opted_in(), None, None),
                    (_typical("2"), settings, _Namespaces(None), None, None))


def test_the_users_groups_and_the_operation_are_part_of_the_request() -> None:
    settings, ns = InjectionSettings(), _opted_in()
    pod = typical_pod()
    pod["metadata"].setdefault("annotations", {})["nvidia.cdi.k8s.io/pod"] = "nvidia.com/gpu=all"
    tenant = sample_review(pod, uid="1")
    admin = copy.deepcopy(tenant)
    admin["request"]["userInfo"]["groups"] = ["system:masters"]
    _two_states(review, (tenant, settings, ns, None, None), (admin, settings, ns, None, None))
    _two_states(review, (_typical("1"), settings, ns, None, None),
                (_typical("2", operation="UPDATE"), settings, ns, None, None))


class _Nodes:
    def __init__(self, labels: dict[str, dict[str, str]]) -> None:
        self.labels = labels

    def node_labels(self) -> dict[str, dict[str, str]]:
        return self.labels


def test_other_node_labels_are_another_verdict() -> None:
    pod = typical_pod()
    pod["spec"]["nodeName"] = "gpu-1"
    for field in ("nodeSelector", "affinity"):
        pod["spec"].pop(field, None)
    settings, ns = InjectionSettings(gpu_memory=(("nvidia.com/gpu", 80 << 30),)), _opted_in()
    limited = _Nodes({"gpu-1": {"gpufence.io/driver-memory-limits": "true"}})
    _two_states(review, (sample_review(pod, uid="1"), settings, ns, None, _Nodes({"gpu-1": {}})),
                (sample_review(pod, uid="2"), settings, ns, None, limited))


def test_a_verdict_that_read_dra_objects_is_not_kept() -> None:
    pod = typical_pod()
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "shared-gpu"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
    cache, settings = VerdictCache(), InjectionSettings()
    for uid in ("1", "2"):
        cache.judge(review, sample_review(pod, uid=uid), settings, _opted_in(), DraSnapshot.of())
    assert cache.hits == 0 and len(cache) == 0
    # The same pod with no claim reads no DRA object and is kept; whether the cache can resolve
    # anything is part of the key.
    for uid in ("1", "2"):
        cache.judge(review, _typical(uid), settings, _opted_in(), DraSnapshot.of())
    assert cache.hits == 1 and len(cache) == 1
    unsynced = replace(DraSnapshot.of(), why_unavailable="the DRA caches have not synced")
    cache.judge(review, _typical("3"), settings, _opted_in(), unsynced)
    assert cache.hits == 1 and len(cache) == 2


def test_bounded_least_recently_used_goes_first() -> None:
    settings, ns = InjectionSettings(), _opted_in()

    def pod_review(n: int, uid: str) -> dict[str, Any]:
        pod = typical_pod()
        pod["metadata"]["labels"] = {"n": str(n)}
        return sample_review(pod, uid=uid)

    cache = VerdictCache(entries=2)
    for n in (1, 2, 1, 3):  # 1 used again after 2: 2 goes when 3 comes
        cache.judge(review, pod_review(n, "x"), settings, ns)
    assert len(cache) == 2 and cache.hits == 1
    cache.judge(review, pod_review(1, "y"), settings, ns)
    cache.judge(review, pod_review(2, "y"), settings, ns)
    assert cache.hits == 2 and len(cache) == 2


def test_a_large_request_and_a_broken_envelope_are_reviewed_uncached() -> None:
    cache = VerdictCache(max_key_bytes=1000)
    for uid in ("1", "2"):
        cache.judge(review, _typical(uid), InjectionSettings(), _opted_in())
    assert len(cache) == 0 and cache.hits == 0
    with pytest.raises(ValueError, match="apiVersion"):
        VerdictCache().judge(review, {"request": {"uid": "1"}}, InjectionSettings(), _opted_in())


def _with_token_volume(name: str) -> dict[str, Any]:
    """The typical pod (as the ServiceAccount admission plugin hands it on) with a token volume of
    that name."""
    pod: dict[str, Any] = json.loads(json.dumps(typical_pod()).replace('"kube-api-access-abcde"', f'"{name}"'))
    assert name in [v["name"] for v in pod["spec"]["volumes"]]
    return pod


@pytest.mark.parametrize("judge", [review, verify])
def test_pods_whose_token_volumes_differ_share_a_verdict_and_get_their_own_name(judge: Any) -> None:
    settings, ns = InjectionSettings(), _opted_in()
    cache = VerdictCache()
    answers = []
    for name in ("kube-api-access-abcde", "kube-api-access-x7k2q", "kube-api-access-abcde"):
        pod = _with_token_volume(name)
        if judge is verify:  # the pod as gpufence stored it
            answer = review(sample_review(pod), settings, ns).review["response"]
            pod = jsonpatch.apply_patch(pod, decode_patch(answer))
        payload = sample_review(pod, uid=name)
        got = cache.judge(judge, payload, settings, ns)
        assert got == judge(payload, settings, ns)
        answers.append(got)
    assert cache.hits == 2 and len(cache) == 1
    assert cache.lookups == {(judge.__name__, "miss"): 1, (judge.__name__, "hit"): 2}
    if judge is review:  # the sidecar mounts the pod's own token volume
        assert "x7k2q" in base64.b64decode(answers[1].review["response"]["patch"]).decode()
        assert "abcde" not in base64.b64decode(answers[1].review["response"]["patch"]).decode()


def test_a_token_volume_named_elsewhere_in_the_pod_is_not_templated() -> None:
    settings, ns = InjectionSettings(), _opted_in()
    cache = VerdictCache()
    for name in ("kube-api-access-abcde", "kube-api-access-x7k2q"):
        pod = _with_token_volume(name)
        pod["metadata"]["annotations"]["note"] = f"mounts {name}"  # inside a longer string
        cache.judge(review, sample_review(pod, uid=name), settings, ns)
    assert cache.hits == 0 and len(cache) == 2


def _tampered(pod: dict[str, Any], how: str) -> dict[str, Any]:
    """The stored pod as another mutating webhook, run after gpufence, might leave it."""
    pod = copy.deepcopy(pod)
    sidecar = pod["spec"]["initContainers"][0]
    if how == "sidecar image":
        sidecar["image"] = "registry.example/other:1"
    elif how == "sidecar env":
        sidecar["env"] = [e for e in sidecar["env"] if e["name"] != "GPUFENCE_CONFIG"]
    elif how == "workload privileged":
        pod["spec"]["containers"][0].setdefault("securityContext", {})["privileged"] = True
    return pod


@pytest.mark.parametrize("how", ["sidecar image", "sidecar env", "workload privileged"])
def test_validate_serves_only_the_pod_mutate_produced(how: str) -> None:
    """/validate remembers the pod exactly as /mutate produced it (and the next pod of its template);
    the same pod changed after mutation by anyone else is reviewed again and gets its own verdict,
    whatever the memo holds, and the pod as produced is still answered from the memo after it."""
    settings, ns = InjectionSettings(), _opted_in()
    stored = _stored()
    changed = _tampered(stored, how)
    own_changed = verify(sample_review(changed, uid="c"), settings, ns)
    assert verify(sample_review(stored, uid="s"), settings, ns).outcome == "verified"
    assert own_changed.outcome != "verified", "the test needs a change that verify refuses"
    cache = VerdictCache()
    cache.judge(verify, sample_review(_per_object(stored, "a"), uid="1"), settings, ns)
    got = cache.judge(verify, sample_review(changed, uid="c"), settings, ns)
    assert got == own_changed
    assert cache.lookups == {("verify", "miss"): 2}
    again = cache.judge(verify, sample_review(_per_object(stored, "bb"), uid="2"), settings, ns)
    assert again.outcome == "verified" and cache.lookups[("verify", "hit")] == 1


def test_validate_under_another_policy_is_reviewed_again() -> None:
    """The pod /mutate produced under one policy, at /validate after the policy changed: reviewed
    under the new one (here refused: the sidecar's image is not the new policy's), never answered
    with the verdict remembered under the old."""
    ns = _opted_in()
    old, new = InjectionSettings(), replace(InjectionSettings(), sidecar_image="registry.example/gpufence:next")
    stored = _stored()
    cache = VerdictCache()
    assert cache.judge(verify, sample_review(stored, uid="1"), old, ns).outcome == "verified"
    got = cache.judge(verify, sample_review(_per_object(stored, "a"), uid="2"), new, ns)
    assert got == verify(sample_review(_per_object(stored, "a"), uid="2"), new, ns)
    assert got.outcome == "refused" and cache.hits == 0
