"""Share resolution: precedence, validation, audit fallback."""

from __future__ import annotations

import pytest

from gpufence.contract import ContainerShare, MemoryShare, Mode
from gpufence.webhook.core.denial import Denial, quote
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import parse_grace_period, resolve_shares

S = InjectionSettings()


def resolve(annotations, namespace=None, settings=S, gpu=("a", "b"), all_names=("a", "b", "c")):
    return resolve_shares(annotations, namespace or {}, settings, list(gpu), list(all_names))


def test_pod_override_beats_pod_beats_namespace_beats_flag() -> None:
    settings = InjectionSettings(default_memory="1Gi", default_compute="10")
    plan = resolve(
        {"gpufence.io/memory": "2Gi", "gpufence.io/memory.b": "3Gi"},
        {"gpufence.io/default-memory": "4Gi", "gpufence.io/default-compute": "20"},
        settings,
    )
    assert dict(plan.containers) == {
        "a": ContainerShare(MemoryShare(bytes=2 * 2**30), 20.0),
        "b": ContainerShare(MemoryShare(bytes=3 * 2**30), 20.0),
    }
    assert plan.mode is Mode.ENFORCE
    flag_only = resolve({}, {}, settings)
    assert dict(flag_only.containers)["a"] == ContainerShare(MemoryShare(bytes=2**30), 10.0)


def test_containers_keep_pod_order() -> None:
    plan = resolve({"gpufence.io/memory": "1Gi"}, gpu=("z", "a"), all_names=("z", "a"))
    assert [name for name, _ in plan.containers] == ["z", "a"]


def test_no_share_means_audit_with_warning_even_if_enforce_was_asked() -> None:
    plan = resolve({"gpufence.io/mode": "enforce"})
    assert plan.mode is Mode.AUDIT
    assert any("audit mode" in w for w in plan.warnings)
    assert all(share == ContainerShare() for _, share in plan.containers)


def test_one_override_is_enough_to_enforce() -> None:
    plan = resolve({"gpufence.io/compute.a": "50%"})
    assert plan.mode is Mode.ENFORCE
    assert dict(plan.containers) == {"a": ContainerShare(compute_percent=50.0), "b": ContainerShare()}


def test_namespace_default_typo_only_matters_when_used() -> None:
    ns = {"gpufence.io/default-memory": "8 GB"}
    assert resolve({"gpufence.io/memory": "1Gi"}, ns).mode is Mode.ENFORCE
    overrides = {"gpufence.io/memory.a": "1Gi", "gpufence.io/memory.b": "1Gi"}
    assert resolve(overrides, ns).mode is Mode.ENFORCE
    with pytest.raises(Denial, match=r"^Namespace annotation gpufence.io/default-memory=\"8 GB\""):
        resolve({"gpufence.io/memory.a": "1Gi"}, ns)


def test_bad_flag_default_names_the_flag() -> None:
    with pytest.raises(Denial, match="webhook flag --default-compute"):
        resolve({}, settings=InjectionSettings(default_compute="lots"))


@pytest.mark.parametrize(
    ("annotations", "fragment"),
    [
        (
            {"gpufence.io/memory": "lots"},
            'annotation gpufence.io/memory="lots" is not a valid memory share: use a '
            'Kubernetes quantity such as "8Gi" or a percentage such as "25%"',
        ),
        ({"gpufence.io/compute": "101"}, 'annotation gpufence.io/compute="101" is not a valid compute share'),
        ({"gpufence.io/compute.a": "x"}, 'annotation gpufence.io/compute.a="x" is not a valid compute share'),
        ({"gpufence.io/memory.c": "1Gi"}, 'names container "c", which is not a GPU container'),
        ({"gpufence.io/compute.zz": "5"}, 'names container "zz", which does not exist in this pod'),
        ({"gpufence.io/mode": "Enforce!"}, 'annotation gpufence.io/mode="Enforce!" is not a valid mode'),
        ({"gpufence.io/grace-period": "soon"}, "is not a valid grace period"),
        ({"gpufence.io/memory": 5}, 'annotation gpufence.io/memory="5" is not a valid memory share'),
        ({"gpufence.io/memory": "x" * 10_000}, '"' + "x" * 64 + '..."'),
    ],
)
def test_denials_name_annotation_value_and_example(annotations: dict, fragment: str) -> None:
    with pytest.raises(Denial) as info:
        resolve(annotations)
    assert fragment in str(info.value)
    assert len(str(info.value)) < 400


def test_override_typo_is_denied_even_when_shadowed() -> None:
    with pytest.raises(Denial):
        resolve({"gpufence.io/memory": "1Gi", "gpufence.io/memory.a": "1 Gi"})


def test_unknown_gpufence_annotation_warns() -> None:
    plan = resolve({"gpufence.io/memroy": "1Gi", "gpufence.io/memory": "1Gi", "other.io/x": "y"})
    assert plan.warnings == ('unknown annotation "gpufence.io/memroy" is ignored',)


def test_grace_period_and_mode() -> None:
    plan = resolve({"gpufence.io/memory": "1Gi", "gpufence.io/mode": "audit", "gpufence.io/grace-period": "2.5"})
    assert plan.mode is Mode.AUDIT and plan.grace_period_seconds == 2.5
    assert resolve({"gpufence.io/memory": "1Gi"}).grace_period_seconds == S.default_grace_period_seconds


@pytest.mark.parametrize(
    ("text", "expected"), [("0", 0.0), ("30", 30.0), ("3600", 3600.0), ("30s", 30.0), ("1.5", 1.5)]
)
def test_parse_grace_period(text: str, expected: float) -> None:
    assert parse_grace_period(text) == expected


@pytest.mark.parametrize("text", ["-1", "3600.5", "1e3", "", "s", "nan", "inf", "1" * 40, "1..2"])
def test_parse_grace_period_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_grace_period(text)


def test_quote_is_safe_and_short() -> None:
    assert quote('a"b') == '"a\\"b"'
    assert quote({"k": [1]}) == '"{\\"k\\": [1]}"'
    assert len(quote("y" * 1000)) < 80
