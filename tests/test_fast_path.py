"""The first-injection fast path (``mutate._first_injection_patch``) against the general path.

For any pod, the fast path either declines (None) or answers exactly what
``_general_injection_patch`` answers: the same patch text, byte for byte, and the same warnings;
and where the general path denies (MutationError) the fast path declines. Checked on every golden
input, on hypothesis-generated pods (mostly valid GPU pods, with shuffled key orders, since the
order of the operations follows the pod's), and end to end: ``review`` answers the same
AdmissionReview with the fast path switched off.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
from collections.abc import Iterator
from typing import Any
from unittest import mock

import jsonpatch
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bench.common import admission_review as bench_review
from bench.common import small_pod, typical_pod
from tests.test_admission import good_containers, good_pods, pods, request, security_contexts, setting_variants
from tests.test_golden import CASES, GOLDEN, admission_review, load_case
from webhook import admission, mutate
from webhook.admission import review
from webhook.mutate import MutationError, _first_injection_patch, _general_injection_patch, injection_patch
from webhook.settings import AllNamespacesOptedIn, InjectionSettings

NS = AllNamespacesOptedIn()


def compare(pod: dict[str, Any], plan: Any, settings_: InjectionSettings) -> bool:
    """Asserts the fast path declines or agrees with the general path; True when it answered."""
    before = copy.deepcopy(pod)
    fast = _first_injection_patch(pod, plan, settings_)
    assert pod == before, "the fast path changed its input"
    try:
        general: Any = _general_injection_patch(pod, plan, settings_)
    except MutationError as exc:
        assert fast is None, f"the fast path answered where the general path denies: {exc}"
        return False
    if fast is None:
        return False
    text, warnings = fast
    assert text == general[0]  # byte-identical patch text
    assert warnings == general[1]
    # And it is what the reference definition gives: the compact JSON of the diff.
    new_pod, desired_warnings = mutate.desired_pod(pod, plan, settings_)
    assert text == json.dumps(mutate.diff(pod, new_pod), separators=(",", ":"))
    assert warnings == desired_warnings
    return True


@contextlib.contextmanager
def comparing() -> Iterator[list[bool]]:
    """While active, every ``injection_patch`` call of ``review`` is checked with ``compare``."""
    taken: list[bool] = []

    def spy(pod: dict[str, Any], plan: Any, settings_: InjectionSettings) -> Any:
        taken.append(compare(pod, plan, settings_))
        return injection_patch(pod, plan, settings_)

    with mock.patch.object(admission, "injection_patch", spy):
        yield taken


@contextlib.contextmanager
def fast_path_off() -> Iterator[None]:
    with mock.patch.object(mutate, "_first_injection_patch", lambda *_: None):
        yield


def check_review(payload: dict[str, Any], settings_: InjectionSettings, namespaces: Any) -> bool | None:
    """``review`` with and without the fast path answers the same; whether the fast path answered."""
    reference = copy.deepcopy(payload)
    with fast_path_off():
        expected = review(copy.deepcopy(payload), settings_, namespaces)
    with comparing() as taken:
        actual = review(payload, settings_, namespaces)
    assert payload == reference
    assert actual == expected  # outcome, patch (base64 of the text), warnings, message
    return taken[0] if taken else None


# --- golden inputs ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fixed_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mutate, "GPUFENCE_VERSION", "0.0.0-test")


@pytest.mark.parametrize("case", CASES)
def test_golden_inputs_fast_path_declines_or_agrees(case: str) -> None:
    pod, settings_, lookup, operation = load_case(case)
    check_review(admission_review(pod, operation), settings_, lookup)


def test_golden_first_injections_mostly_take_the_fast_path() -> None:
    taken = []
    for case in CASES:
        pod, settings_, lookup, operation = load_case(case)
        if check_review(admission_review(pod, operation), settings_, lookup):
            taken.append(case)
    # Not a correctness property, a guard against a fast path that silently always declines.
    assert len(taken) >= 10, taken
    assert "flag-defaults" in taken


def test_golden_outputs_reinvoked_decline() -> None:
    """A golden output (the injected pod) is never a first injection."""
    for case in CASES:
        _, settings_, lookup, operation = load_case(case)
        expected = yaml.safe_load((GOLDEN / f"{case}.out.yaml").read_text())
        if "pod" not in expected or expected["outcome"] == "skipped":
            continue
        assert check_review(admission_review(expected["pod"], operation), settings_, lookup) is not True


# --- the benchmark pods -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [typical_pod, small_pod])
@pytest.mark.parametrize(
    "settings_",
    [
        InjectionSettings(),
        InjectionSettings(native_sidecar=False),
        InjectionSettings(mps_limits=True, mount_host_proc=True, preload_library_host_path="/node/libvgpu.so"),
    ],
)
def test_benchmark_pods_take_the_fast_path(make: Any, settings_: InjectionSettings) -> None:
    pod = make()
    assert check_review(bench_review(pod), settings_, NS) is True
    answer = review(bench_review(pod), settings_, NS).review["response"]
    patched = jsonpatch.apply_patch(pod, admission.decode_patch(answer))
    assert check_review(bench_review(patched), settings_, NS) is False  # reinvocation: general path


# --- hypothesis ---------------------------------------------------------------------------------


def _shuffle(value: Any, rnd: random.Random, depth: int = 0) -> Any:
    """The same JSON value with the keys of its dicts (down to env entries) in another order."""
    if isinstance(value, dict) and depth < 5:
        keys = list(value)
        rnd.shuffle(keys)
        return {k: _shuffle(value[k], rnd, depth + 1) for k in keys}
    if isinstance(value, list) and depth < 5:
        return [_shuffle(v, rnd, depth + 1) for v in value]
    return value


maybe_empty_list = st.sampled_from(["absent", "empty", "keep"])


def _vary(pod: dict[str, Any], init_mode: str, volumes_mode: str, drop_metadata: bool, env_mode: str,
          share: Any, context: Any) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    for key, mode in (("initContainers", init_mode), ("volumes", volumes_mode)):
        if mode == "absent":
            spec.pop(key, None)
        elif mode == "empty":
            spec[key] = []
    for container in spec.get("containers", []):
        if env_mode == "empty" and "env" not in container:
            container["env"] = []
        if env_mode == "mounts-empty" and "volumeMounts" not in container:
            container["volumeMounts"] = []
    if drop_metadata:
        pod.pop("metadata", None)
    if share is not None:
        spec["shareProcessNamespace"] = share
    if context is not None:
        spec["securityContext"] = context
    return pod


first_injection_pods = st.builds(
    _vary,
    good_pods,
    maybe_empty_list,
    maybe_empty_list,
    st.booleans(),
    st.sampled_from(["keep", "empty", "mounts-empty"]),
    st.sampled_from([None, True]),
    st.none() | security_contexts,
)
restart_policies = st.sampled_from([None, "Never", "OnFailure", "Always"])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(first_injection_pods, first_injection_pods, good_pods, pods),
    setting_variants,
    st.randoms(use_true_random=False),
    restart_policies,
    good_containers(["i1", "i2"], 2),
)
def test_fast_path_declines_or_agrees_on_generated_pods(
    pod: Any, settings_: InjectionSettings, rnd: random.Random, restart: str | None, inits: list[dict[str, Any]]
) -> None:
    if isinstance(pod, dict) and isinstance(pod.get("spec"), dict):
        if restart is not None:
            pod["spec"]["restartPolicy"] = restart
        if inits and rnd.random() < 0.3 and "initContainers" not in pod["spec"]:
            pod["spec"]["initContainers"] = inits
    pod = _shuffle(pod, rnd)
    taken = check_review(request(pod), settings_, NS)
    event(f"fast path: {taken}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setting_variants, st.randoms(use_true_random=False), st.sampled_from([typical_pod, small_pod]))
def test_fast_path_agrees_on_shuffled_benchmark_pods(
    settings_: InjectionSettings, rnd: random.Random, make: Any
) -> None:
    pod = _shuffle(make(), rnd)
    assert check_review(bench_review(pod), settings_, NS) in (True, False)
