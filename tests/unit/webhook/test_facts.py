"""core/facts.py: one review's facts, decided once and immutable."""

from __future__ import annotations

from typing import Any

import pytest

from gpufence.contract import INJECTION_ENABLED, INJECTION_LABEL
from gpufence.webhook.core.denial import Denial
from gpufence.webhook.core.facts import POD_SECURITY_LABEL, pod_facts
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo

S = InjectionSettings()
INFO = NamespaceInfo(name="team-a", labels={INJECTION_LABEL: INJECTION_ENABLED, POD_SECURITY_LABEL: "baseline"},
                     annotations={"gpufence.io/default-memory": "10%"})
REQUEST: dict[str, Any] = {"userInfo": {"username": "alice", "groups": ["devs", "system:authenticated"]}}


def pod() -> dict[str, Any]:
    gpu = {"limits": {"nvidia.com/gpu": "1"}}
    return {
        "metadata": {"name": "p", "labels": {"app": "train"}, "annotations": {"gpufence.io/memory": "8Gi"}},
        "spec": {
            "initContainers": [{"name": "prep", "image": "i", "resources": gpu}],
            "containers": [{"name": "train", "image": "i", "resources": gpu}, {"name": "log", "image": "i"}],
        },
    }


def test_the_facts_are_what_every_rule_reads_in_pod_order() -> None:
    submitted = pod()
    facts = pod_facts(REQUEST, submitted, "team-a", INFO, S)
    assert facts.container_names == ("prep", "train", "log")
    assert facts.gpu_names == ("prep", "train")
    assert facts.paths.gpu_counts() == {"prep": 1, "train": 1}
    assert (facts.namespace, facts.pod_security) == ("team-a", "baseline")
    assert dict(facts.namespace_annotations) == {"gpufence.io/default-memory": "10%"}
    assert facts.groups == ["devs", "system:authenticated"]
    assert dict(facts.labels) == {"app": "train"} and dict(facts.annotations) == {"gpufence.io/memory": "8Gi"}
    assert facts.kai is None and facts.kai_container is None and facts.nv == ()
    assert facts.pod is submitted and facts.spec is submitted["spec"]  # the raw pod, for the patch only


def test_the_facts_cannot_be_changed_by_a_rule() -> None:
    facts = pod_facts(REQUEST, pod(), "team-a", None, S)
    with pytest.raises(AttributeError):
        facts.gpu_names = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        facts.annotations["gpufence.io/memory"] = "80Gi"  # type: ignore[index]
    assert facts.pod_security is None and dict(facts.namespace_annotations) == {}  # no cache entry: the flags


def test_a_malformed_pod_is_a_denial_naming_the_field_before_any_fact() -> None:
    bad = pod()
    bad["spec"]["containers"][1]["env"] = [{"name": "X", "value": 5}]
    with pytest.raises(Denial, match=r"spec\.containers\[1\]\.env\[0\]\.value must be a string"):
        pod_facts(REQUEST, bad, "team-a", INFO, S)
