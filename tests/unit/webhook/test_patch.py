"""The RFC 6902 diff (``webhook.core.patch``) and the one injection path it serves.

The diff is checked against ``jsonpatch.apply_patch`` on arbitrary JSON; the injection path on
generated pods (with shuffled key orders, since the order of the operations follows the pod's):
the patch applied to the pod is the desired pod, a first injection only adds (minimal: it never
replaces or removes what the user wrote), and the result is a fixed point.
"""

from __future__ import annotations

import copy
import itertools
import json
import operator
import random
import re
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufence.contract import ANNOTATION_STATUS, SIDECAR_NAME
from gpufence.webhook.client import decode_patch
from gpufence.webhook.core.admission import injection_patch, review
from gpufence.webhook.core.denial import Denial
from gpufence.webhook.core.desired import desired_pod
from gpufence.webhook.core.gpu_paths import PodGpuPaths
from gpufence.webhook.core.patch import diff, dumps, escape
from gpufence.webhook.core.podshape import check_shape
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings
from gpufence.webhook.core.shares import resolve_shares
from tests.support.examples import examples
from tests.support.sample_pods import huge_pod, small_pod, typical_pod
from tests.unit.webhook.test_admission import good_pods, request, setting_variants

NS = AllNamespacesOptedIn()
LD_PRELOAD_VALUE = re.compile(r"/spec/(initContainers|containers)/[0-9]+/env/[0-9]+/value")
ENV_ENTRY = re.compile(r"/spec/(initContainers|containers)/[0-9]+/env(/|$)")


def _owned_entries(pod: dict[str, Any]) -> list[str]:
    """The names of gpufence's hard-limit variables the pod's containers set themselves."""
    from gpufence.webhook.core.container_env import OWNED_VARIABLES

    spec = pod.get("spec") or {}
    return [e.get("name") for key in ("initContainers", "containers") for c in spec.get(key) or ()
            for e in c.get("env") or () if e.get("name") in OWNED_VARIABLES]


def test_escape_rfc6901() -> None:
    assert escape("gpufence.io/status") == "gpufence.io~1status"
    assert escape("a~b/c") == "a~0b~1c"
    ops = diff({"a/b": {"~x": 1}}, {"a/b": {"~x": 2}})
    assert ops == [{"op": "replace", "path": "/a~1b/~0x", "value": 2}]
    assert jsonpatch.apply_patch({"a/b": {"~x": 1}}, ops) == {"a/b": {"~x": 2}}




@pytest.mark.parametrize(
    ("old", "new"),
    [
        ([1, 2, 3], [1, 3]),
        ([], [{"name": "a"}]),
        ([{"name": "a"}, {"name": "b"}], [{"name": "s"}, {"name": "a"}, {"name": "b", "x": 1}]),
        ([{"name": "a"}, {"name": "b"}], [{"name": "b"}, {"name": "a"}]),
        ({"a": True}, {"a": 1}),
        ({"a": None}, {"a": {"b": []}}),
        ({"a": [1]}, {"b": [1]}),
    ],
)
def test_diff_applies(old, new) -> None:
    assert jsonpatch.apply_patch(old, diff(old, new)) == new
    assert json.dumps(jsonpatch.apply_patch(old, diff(old, new))) == json.dumps(new)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
)
named_lists = st.lists(
    st.fixed_dictionaries({"name": st.sampled_from("abcdef")}, optional={"v": json_values}), max_size=5
)


@given(json_values | named_lists, json_values | named_lists)
def test_diff_is_correct_for_any_json(old, new) -> None:
    assert jsonpatch.apply_patch(old, diff(old, new)) == new


@given(json_values | named_lists, json_values | named_lists, st.data())
def test_diff_of_a_copy_on_write_update(old, new, data) -> None:
    """The shapes desired_pod makes: a dict or list copied from the input, shared values, additions."""
    if isinstance(old, list):
        extra = new if isinstance(new, list) else [new]
        updated: Any = old[: data.draw(st.integers(0, len(old)))] + extra  # shared prefix, new tail
    elif isinstance(old, dict):
        updated = {**old, **(new if isinstance(new, dict) else {"added/~": new})}
    else:
        updated = new
    ops = diff(old, updated)
    assert jsonpatch.apply_patch(old, ops) == updated
    if isinstance(old, list) and len(updated) >= len(old) and all(map(operator.is_, old, updated)):
        assert all(op["op"] == "add" for op in ops) and len(ops) == len(updated) - len(old)


def _shuffle(value: Any, rnd: random.Random, depth: int = 0) -> Any:
    """The same JSON value with the keys of its dicts (down to env entries) in another order."""
    if isinstance(value, dict) and depth < 5:
        keys = list(value)
        rnd.shuffle(keys)
        return {k: _shuffle(value[k], rnd, depth + 1) for k in keys}
    if isinstance(value, list) and depth < 5:
        return [_shuffle(v, rnd, depth + 1) for v in value]
    return value


def all_names(pod: dict[str, Any]) -> list[str]:
    return [c["name"] for key in ("initContainers", "containers") for c in pod["spec"].get(key) or ()]


def _first_injection(pod: dict[str, Any], settings_: InjectionSettings) -> tuple[bytes | None, dict[str, Any]] | None:
    """The patch and the desired pod of a GPU pod the webhook would mutate, or None (denied, skipped)."""
    names = PodGpuPaths(pod.get("spec") or {}, settings_).gpu_container_names()
    if not names or SIDECAR_NAME in names:  # denied by the webhook (a reserved name)
        return None
    try:
        all_names = check_shape(pod)
        plan = resolve_shares((pod.get("metadata") or {}).get("annotations") or {}, {}, settings_, names, all_names)
        text, _ = injection_patch(pod, plan, settings_)
    except (Denial, ValueError):
        return None
    return text, desired_pod(pod, plan, settings_)[0]


@settings(max_examples=examples(300))
@given(good_pods, setting_variants, st.randoms(use_true_random=False))
def test_the_patch_of_a_first_injection_adds_only_and_reaches_the_desired_pod(
    pod: dict[str, Any], settings_: InjectionSettings, rnd: random.Random
) -> None:
    pod = _shuffle(pod, rnd)
    before = copy.deepcopy(pod)
    answer = _first_injection(pod, settings_)
    assert pod == before, "the injection changed its input"
    if answer is None:
        return
    text, desired = answer
    assert text is not None
    ops = json.loads(text)
    assert jsonpatch.apply_patch(pod, ops) == desired
    if SIDECAR_NAME not in all_names(pod) and ANNOTATION_STATUS not in pod["metadata"].get("annotations", {}):
        # Nothing of gpufence yet: every operation adds, but for the user's values gpufence owns or
        # extends: LD_PRELOAD's, appended to in place (the preload limiter), and the hard-limit
        # variables (container_env.OWNED_VARIABLES), replaced by the share's or removed.
        owned = _owned_entries(pod)
        rewritten = [op for op in ops if op["op"] != "add"]
        preload = [op for op in rewritten if op["op"] == "replace" and LD_PRELOAD_VALUE.fullmatch(op["path"])
                   and jsonpatch.JsonPointer(op["path"].rsplit("/", 1)[0]).resolve(desired).get("name") == "LD_PRELOAD"]
        others = [op for op in rewritten if op not in preload]
        assert not others or owned, ops  # only a pod with such variables has other rewrites
        assert all(ENV_ENTRY.match(op["path"]) for op in others), ops
        # One operation per new value: no path is a prefix of another (where gpufence only adds:
        # removing a user's entry shifts the list, and what follows is rewritten in its place).
        paths = sorted(op["path"] + "/" for op in ops)
        assert owned or not any(b.startswith(a) for a, b in itertools.pairwise(paths)), paths
    again = _first_injection(jsonpatch.apply_patch(pod, ops), settings_)
    assert again is not None and again[0] is None  # a fixed point


@pytest.mark.parametrize("make", [small_pod, typical_pod, huge_pod])
@pytest.mark.parametrize("native", [True, False])
def test_benchmark_pods_get_a_small_patch(make: Any, native: bool) -> None:
    """The benchmark's pods, 1 MiB included: the patch holds gpufence's parts only."""
    settings_ = InjectionSettings(native_sidecar=native)
    pod = make()
    result = review(request(pod), settings_, NS)
    ops = decode_patch(result.review["response"])
    assert ops is not None and {op["op"] for op in ops} == {"add"}
    assert len(dumps(ops)) < 8192
    patched = jsonpatch.apply_patch(pod, ops)
    assert review(request(patched), settings_, NS).outcome == "unchanged"


@pytest.mark.parametrize(("old", "new"), [
    ({"a": 1}, {"a": True}),  # == says equal; JSON says a number is not a boolean
    ({"a": [1]}, {"a": [1.0]}),
    ({"a": {"b": 0}}, {"a": {"b": False}}),
])
def test_equal_in_python_but_not_in_json_is_still_a_replace(old: Any, new: Any) -> None:
    ops = diff(old, new)
    assert ops and all(op["op"] == "replace" for op in ops)
    assert jsonpatch.apply_patch(copy.deepcopy(old), ops) == new


def test_equal_copies_give_no_patch_without_sharing_a_subtree() -> None:
    pod = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}]}, "n": 1.5}
    assert diff(pod, copy.deepcopy(pod)) == []


def test_nesting_deeper_than_equality_can_follow_still_diffs() -> None:
    old: Any = "x"
    for _ in range(5000):
        old = [old]
    new = {"deep": old, "k": 1}
    assert diff({"deep": old, "k": 1}, new) == []  # the deep subtree is shared: the walk skips it
    assert diff({"deep": old, "k": 1}, {"deep": old, "k": 2}) == [{"op": "replace", "path": "/k", "value": 2}]
