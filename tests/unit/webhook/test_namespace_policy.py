"""The admin-owned policy (gpufence/webhook/core/namespace_policy.py): who wins, and what a pod may not ask."""

from __future__ import annotations

import pytest

from gpufence.contract import MemoryShare, Mode
from gpufence.webhook.core.denial import Denial
from gpufence.webhook.core.namespace_policy import namespace_policy
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import SharePlan, resolve_shares

GPU = ("a", "b")
DEFAULTS = InjectionSettings()


def plan(pod: dict[str, str], ns: dict[str, str] | None = None, settings: InjectionSettings = DEFAULTS) -> SharePlan:
    ns = ns or {}
    return resolve_shares(pod, ns, settings, GPU, GPU, namespace_policy("team-a", ns, settings))


def test_the_safe_defaults_forbid_audit_by_the_pods_choice() -> None:
    with pytest.raises(Denial, match='namespace "team-a" runs in enforce mode'):
        plan({"gpufence.io/memory": "1Gi", "gpufence.io/mode": "audit"})
    assert plan({"gpufence.io/memory": "1Gi", "gpufence.io/mode": "enforce"}).mode is Mode.ENFORCE


@pytest.mark.parametrize(
    ("ns", "flag", "allowed"),
    [
        ({"gpufence.io/allow-audit": "true"}, False, True),
        ({}, True, True),
        ({"gpufence.io/allow-audit": "false"}, True, False),  # the namespace's word wins over the flag
        ({"gpufence.io/allow-audit": "yes"}, False, False),  # only "true" allows
        ({"gpufence.io/mode": "audit"}, False, True),  # audit is not weaker than an audit namespace
    ],
)
def test_who_may_allow_audit(ns: dict[str, str], flag: bool, allowed: bool) -> None:
    pod = {"gpufence.io/memory": "1Gi", "gpufence.io/mode": "audit"}
    settings = InjectionSettings(allow_audit=flag)
    if allowed:
        assert plan(pod, ns, settings).mode is Mode.AUDIT
    else:
        with pytest.raises(Denial, match="allow-audit"):
            plan(pod, ns, settings)


def test_the_namespace_mode_and_the_flag() -> None:
    assert plan({"gpufence.io/memory": "1Gi"}, settings=InjectionSettings(default_mode="audit")).mode is Mode.AUDIT
    audit_ns = {"gpufence.io/mode": "audit"}
    assert plan({"gpufence.io/memory": "1Gi"}, audit_ns).mode is Mode.AUDIT
    enforce_ns = {"gpufence.io/mode": "enforce"}
    assert plan({"gpufence.io/memory": "1Gi"}, enforce_ns, InjectionSettings(default_mode="audit")).mode is Mode.ENFORCE


def test_a_per_container_override_above_the_ceiling_is_named() -> None:
    ns = {"gpufence.io/max-memory": "10Gi"}
    with pytest.raises(Denial, match=r'annotation gpufence.io/memory.b="12Gi" is above .* use at most "10Gi"'):
        plan({"gpufence.io/memory": "8Gi", "gpufence.io/memory.b": "12Gi"}, ns)
    shares = dict(plan({"gpufence.io/memory": "8Gi", "gpufence.io/memory.b": "10Gi"}, ns).containers)
    assert shares["a"].memory == MemoryShare(bytes=8 << 30) and shares["b"].memory == MemoryShare(bytes=10 << 30)


def test_a_namespace_default_above_its_own_ceiling_is_the_admins_error() -> None:
    ns = {"gpufence.io/default-memory": "20Gi", "gpufence.io/max-memory": "10Gi"}
    with pytest.raises(Denial, match=r"^Namespace annotation gpufence.io/default-memory=\"20Gi\" is above"):
        plan({}, ns)


def test_the_namespace_ceiling_wins_over_the_flag_and_fills_missing_shares() -> None:
    settings = InjectionSettings(max_memory="40Gi", max_compute="50")
    shares = dict(plan({"gpufence.io/compute.a": "10"}, {"gpufence.io/max-memory": "25%"}, settings).containers)
    assert shares["a"].memory == MemoryShare(percent=25.0) and shares["a"].compute_percent == 10.0
    assert shares["b"].memory == MemoryShare(percent=25.0) and shares["b"].compute_percent == 50.0


@pytest.mark.parametrize(
    ("ns", "needle"),
    [
        ({"gpufence.io/max-memory": "lots"}, 'Namespace annotation gpufence.io/max-memory="lots" is not a valid'),
        ({"gpufence.io/max-compute": "150"}, 'Namespace annotation gpufence.io/max-compute="150" is not a valid'),
        ({"gpufence.io/mode": "strict"}, 'Namespace annotation gpufence.io/mode="strict" is not a valid mode'),
    ],
)
def test_an_admins_typo_is_denied_naming_the_namespace_annotation(ns: dict[str, str], needle: str) -> None:
    with pytest.raises(Denial, match=needle):
        plan({"gpufence.io/memory": "1Gi"}, ns)


def test_opt_out_is_the_admins_choice() -> None:
    assert namespace_policy("n", {}, InjectionSettings()).allow_opt_out is False
    assert namespace_policy("n", {}, InjectionSettings(allow_opt_out=True)).allow_opt_out is True
    assert namespace_policy("n", {"gpufence.io/allow-opt-out": "true"}, InjectionSettings()).allow_opt_out is True
    denied = namespace_policy("n", {"gpufence.io/allow-opt-out": "false"}, InjectionSettings(allow_opt_out=True))
    assert denied.allow_opt_out is False
