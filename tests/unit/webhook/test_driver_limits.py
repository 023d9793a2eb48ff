"""The driver's per-container GPU memory limit: which pods get it, its value, author-set values."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from gpufence.contract import (
    DRIVER_LIMITS_NODE_LABEL,
    ENV_CONFIG,
    ENV_DRIVER_MEMORY_LIMIT,
    ENV_DRIVER_MEMORY_REQUEST,
    SIDECAR_NAME,
    ContainerShare,
    MemoryShare,
    Mode,
)
from gpufence.webhook.cluster.policy import PolicyError, parse_policy
from gpufence.webhook.core.desired import desired_pod
from gpufence.webhook.core.driver_limits import (
    confined_to_driver_limit_nodes,
    driver_limits_apply,
    pinned_to_driver_limit_nodes,
)
from gpufence.webhook.core.patch import diff
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import SharePlan

GiB, MiB = 1 << 30, 1 << 20
ON, OFF, AUTO = (InjectionSettings(driver_memory_limits=v) for v in ("on", "off", "auto"))
PINNED = {"nodeSelector": {DRIVER_LIMITS_NODE_LABEL: "true"}}


def _term(*expressions: dict[str, Any]) -> dict[str, Any]:
    return {"matchExpressions": list(expressions)}


def _affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}}


LABEL_IN_TRUE = {"key": DRIVER_LIMITS_NODE_LABEL, "operator": "In", "values": ["true"]}
OTHER = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}


# (pod spec, pinned to nodes labelled gpufence.io/driver-memory-limits=true).
PIN_CASES: list[tuple[dict[str, Any], bool]] = [
    ({}, False),
    (PINNED, True),
    ({"nodeSelector": {DRIVER_LIMITS_NODE_LABEL: "false"}}, False),
    ({"nodeSelector": {DRIVER_LIMITS_NODE_LABEL: "True"}}, False),  # label values are compared exactly
    (_affinity(_term(LABEL_IN_TRUE)), True),
    (_affinity(_term(OTHER, LABEL_IN_TRUE), _term(LABEL_IN_TRUE)), True),
    (_affinity(_term(LABEL_IN_TRUE), _term(OTHER)), False),  # the second term admits any node of that product
    (_affinity(_term({**LABEL_IN_TRUE, "values": ["true", "false"]})), False),
    (_affinity(_term({**LABEL_IN_TRUE, "operator": "NotIn", "values": ["false"]})), False),
    (_affinity(_term({**LABEL_IN_TRUE, "operator": "Exists", "values": []})), False),
    (_affinity({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}), False),
    (_affinity(), False),
    ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": _term(LABEL_IN_TRUE)}]}}}, False),  # preferred is no pin
]


@pytest.mark.parametrize(("spec", "pinned"), PIN_CASES)
def test_a_pod_is_pinned_only_where_every_placement_has_the_label(spec: dict[str, Any], pinned: bool) -> None:
    assert pinned_to_driver_limit_nodes(spec) is pinned


@pytest.mark.parametrize(("settings", "spec", "mode", "applies"), [
    (AUTO, {}, Mode.ENFORCE, False),
    (AUTO, PINNED, Mode.ENFORCE, True),
    (ON, {}, Mode.ENFORCE, True),
    (OFF, PINNED, Mode.ENFORCE, False),
    (ON, PINNED, Mode.AUDIT, False),  # audit measures, never limits
])
def test_when_driver_limits_apply(settings: InjectionSettings, spec: dict[str, Any], mode: Mode,
                                  applies: bool) -> None:
    assert driver_limits_apply(spec, settings, mode) is applies


def test_the_setting_is_a_policy_key_with_three_values() -> None:
    assert InjectionSettings().driver_memory_limits == "auto"
    assert parse_policy({"driver-memory-limits": "on"}).driver_memory_limits == "on"
    with pytest.raises(PolicyError, match='key "driver-memory-limits" has \'yes\': use one of on, off, auto'):
        parse_policy({"driver-memory-limits": "yes"})


def plan_of(*shares: tuple[str, MemoryShare | None], mode: Mode = Mode.ENFORCE) -> SharePlan:
    return SharePlan(containers=tuple((n, ContainerShare(memory=m, gpus=1)) for n, m in shares), mode=mode,
                     grace_period_seconds=10.0)


def gpu_pod(*names: str, env: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    containers = [{"name": n, "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "1"}}} for n in names]
    if env is not None:
        containers[0]["env"] = env
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": containers, **spec}}


def env_of(pod: dict[str, Any], name: str) -> list[dict[str, Any]]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return container.get("env", [])


def driver_env(pod: dict[str, Any], name: str) -> dict[str, str]:
    return {e["name"]: e["value"] for e in env_of(pod, name)
            if e["name"] in (ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST)}


def ours(warnings: list[str]) -> list[str]:
    """The warnings of the driver limits and the limit variables (not the frameworks' caps)."""
    return [w for w in warnings if "driver-memory-limits" in w or "gpufence re" in w]


def config_of(pod: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME]
    (value,) = [e["value"] for e in sidecar["env"] if e["name"] == ENV_CONFIG]
    return json.loads(value)["containers"]


def test_a_byte_share_becomes_whole_mib_limit_and_request() -> None:
    pod, warnings = desired_pod(gpu_pod("train"), plan_of(("train", MemoryShare(bytes=8 * GiB + MiB - 1))), ON)
    assert driver_env(pod, "train") == {ENV_DRIVER_MEMORY_LIMIT: "8192", ENV_DRIVER_MEMORY_REQUEST: "8192"}
    assert ours(warnings) == []
    assert diff(pod, desired_pod(pod, plan_of(("train", MemoryShare(bytes=8 * GiB + MiB - 1))), ON)[0]) == []


def test_a_percentage_resolves_through_the_gpus_memory_into_the_variables_and_the_config() -> None:
    spec = {"nodeSelector": {"nvidia.com/gpu.memory": "81559", DRIVER_LIMITS_NODE_LABEL: "true"}}
    plan = plan_of(("train", MemoryShare(percent=25)))
    pod, warnings = desired_pod(gpu_pod("train", **spec), plan, AUTO)
    resolved = 81559 * MiB // 4
    assert driver_env(pod, "train") == {ENV_DRIVER_MEMORY_LIMIT: str(resolved // MiB),
                                        ENV_DRIVER_MEMORY_REQUEST: str(resolved // MiB)}
    assert config_of(pod)["train"] == {"gpus": 1, "memoryBytes": resolved, "memoryPercent": 25}
    assert ours(warnings) == []
    assert diff(pod, desired_pod(pod, plan, AUTO)[0]) == []


def test_without_driver_limits_a_percentage_stays_a_percentage() -> None:
    spec = {"nodeSelector": {"nvidia.com/gpu.memory": "81559"}}
    pod, _ = desired_pod(gpu_pod("train", **spec), plan_of(("train", MemoryShare(percent=25))), AUTO)
    assert config_of(pod)["train"] == {"gpus": 1, "memoryPercent": 25}
    assert driver_env(pod, "train") == {}


def test_shares_the_driver_cannot_limit_give_one_warning_naming_the_setting() -> None:
    plan = plan_of(("a", MemoryShare(percent=25)), ("b", MemoryShare(bytes=4 * GiB, percent=10)),
                   ("c", MemoryShare(bytes=2 * GiB)), ("d", None))
    pod, warnings = desired_pod(gpu_pod("a", "b", "c", "d"), plan, ON)
    assert driver_env(pod, "a") == {} and driver_env(pod, "d") == {}
    assert driver_env(pod, "b")[ENV_DRIVER_MEMORY_LIMIT] == "4096"  # the byte part; the percentage is polled
    assert driver_env(pod, "c")[ENV_DRIVER_MEMORY_LIMIT] == "2048"
    (warning,) = ours(warnings)
    assert warning == ('gpufence: driver-memory-limits=on, but polling alone enforces the memory share of "a" '
                       '(25%, GPU memory unknown), "b" (its 10% part, GPU memory unknown); a GPU\'s memory comes from '
                       "node selector nvidia.com/gpu.memory or --gpu-memory")
    assert len(warning) <= 256


def test_a_percentage_below_one_mib_on_its_gpu_gets_no_limit() -> None:
    settings = InjectionSettings(driver_memory_limits="on", gpu_memory=(("nvidia.com/gpu", GiB),))
    pod, warnings = desired_pod(gpu_pod("train"), plan_of(("train", MemoryShare(percent=0.05))), settings)
    assert driver_env(pod, "train") == {}
    assert len(ours(warnings)) == 1 and '"train" (0.05%: below 1Mi)' in ours(warnings)[0]


def test_audit_mode_gets_no_limit() -> None:
    pod, _ = desired_pod(gpu_pod("train"), plan_of(("train", MemoryShare(bytes=GiB)), mode=Mode.AUDIT), ON)
    assert driver_env(pod, "train") == {}


def test_author_set_values_are_replaced_or_removed_with_a_warning() -> None:
    env = [
        {"name": ENV_DRIVER_MEMORY_LIMIT, "value": "1"},
        {"name": "KEEP", "value": "x"},
        {"name": ENV_DRIVER_MEMORY_LIMIT, "value": "99999"},  # a duplicate: the effective one
        {"name": ENV_DRIVER_MEMORY_REQUEST, "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
        {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=99999M"},
        {"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"},
    ]
    plan = plan_of(("train", MemoryShare(bytes=GiB)))
    pod, warnings = desired_pod(gpu_pod("train", env=copy.deepcopy(env)), plan, ON)
    got = env_of(pod, "train")
    assert got[:3] == [{"name": "KEEP", "value": "x"}, {"name": ENV_DRIVER_MEMORY_LIMIT, "value": "1024"},
                       {"name": ENV_DRIVER_MEMORY_REQUEST, "value": "1024"}]
    assert not [e for e in got if e["name"].startswith("CUDA_")]  # neither MPS nor the preload limiter is on
    assert sorted(ours(warnings)) == [
        'container "train": gpufence removes CUDA_DEVICE_SM_LIMIT="100": it writes none for this share',
        'container "train": gpufence removes CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=99999M": it writes none for this '
        "share",
        'container "train": gpufence replaces NVIDIA_GPU_MEMORY_LIMIT="99999" (and 1 earlier entry) with "1024", '
        "the share's value",
        'container "train": gpufence replaces NVIDIA_GPU_MEMORY_REQUEST from valueFrom with "1024", the share\'s value',
    ]
    assert all(len(w) <= 256 for w in warnings)
    again, warnings_again = desired_pod(pod, plan, ON)
    assert diff(pod, again) == [] and ours(warnings_again) == []
    # Where driver limits do not apply, the author's driver variables go too.
    off, off_warnings = desired_pod(gpu_pod("train", env=copy.deepcopy(env)), plan, OFF)
    assert [e for e in env_of(off, "train") if e["name"] == "KEEP" or e["name"].startswith("NVIDIA_GPU")] == [
        {"name": "KEEP", "value": "x"}]
    assert sum("gpufence removes" in w for w in ours(off_warnings)) == 4


def test_an_authors_value_equal_to_the_share_passes_silently() -> None:
    env = [{"name": ENV_DRIVER_MEMORY_LIMIT, "value": "1024"}]
    pod, warnings = desired_pod(gpu_pod("train", env=env), plan_of(("train", MemoryShare(bytes=GiB))), ON)
    assert ours(warnings) == [] and env_of(pod, "train")[0] == {"name": ENV_DRIVER_MEMORY_LIMIT, "value": "1024"}


# --- pods confined to labelled nodes by any constraint the scheduler honours (issue 32 row 8) ------

LABELLED = {DRIVER_LIMITS_NODE_LABEL: "true"}
NODES: dict[str, dict[str, str]] = {
    "gpu-a": {"kubernetes.io/hostname": "gpu-a", "pool": "r615", "gpus": "8", **LABELLED},
    "gpu-b": {"kubernetes.io/hostname": "gpu-b", "pool": "r615", "gpus": "4", **LABELLED},
    "gpu-old": {"kubernetes.io/hostname": "gpu-old", "pool": "r595", "gpus": "8"},
    "gpu-off": {"kubernetes.io/hostname": "gpu-off", "pool": "r615", DRIVER_LIMITS_NODE_LABEL: "false"},
}


def _fields(operator: str, *names: str) -> dict[str, Any]:
    return {"matchFields": [{"key": "metadata.name", "operator": operator, "values": list(names)}]}


def _expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, "values": list(values)}


# (pod spec, every known node it may land on is labelled, and there is one).
CONFINED_CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("nodeName", {"nodeName": "gpu-a"}, True),
    ("nodeName-unlabelled", {"nodeName": "gpu-old"}, False),
    ("nodeName-label-false", {"nodeName": "gpu-off"}, False),
    ("nodeName-unknown", {"nodeName": "gpu-new"}, False),
    ("hostname", {"nodeSelector": {"kubernetes.io/hostname": "gpu-b"}}, True),
    ("hostname-unlabelled", {"nodeSelector": {"kubernetes.io/hostname": "gpu-old"}}, False),
    ("matchFields", _affinity(_fields("In", "gpu-a")), True),
    ("matchFields-two-terms", _affinity(_fields("In", "gpu-a"), _fields("In", "gpu-b")), True),
    ("matchFields-one-unlabelled", _affinity(_fields("In", "gpu-a"), _fields("In", "gpu-old")), False),
    ("matchFields-NotIn", _affinity({"matchFields": [_expr("metadata.name", "NotIn", "gpu-old"),
                                                     _expr("metadata.name", "NotIn", "gpu-off")]}), True),
    ("matchFields-or-hostname", _affinity(_fields("In", "gpu-a"), _term(_expr("kubernetes.io/hostname", "In",
                                                                              "gpu-b"))), True),
    ("terms-one-unlabelled", _affinity(_fields("In", "gpu-a"), _term(_expr("pool", "In", "r595"))), False),
    ("selector-pool", {"nodeSelector": {"pool": "r615", "gpus": "8"}}, True),
    ("selector-pool-with-off", {"nodeSelector": {"pool": "r615"}}, False),
    ("Gt", _affinity(_term(_expr("gpus", "Gt", "4"), _expr("pool", "In", "r615"))), True),
    ("Lt", _affinity(_term(_expr("gpus", "Lt", "8"))), True),
    ("Exists-and-NotIn", _affinity(_term(_expr("pool", "Exists"), _expr("pool", "NotIn", "r595"),
                                         _expr(DRIVER_LIMITS_NODE_LABEL, "NotIn", "false"))), True),
    ("DoesNotExist", _affinity(_term(_expr(DRIVER_LIMITS_NODE_LABEL, "DoesNotExist"))), False),
    ("nodeName-and-selector", {"nodeName": "gpu-a", "nodeSelector": {"pool": "r595"}}, False),  # lands nowhere
    ("no-constraint", {}, False),  # may land on gpu-old
    ("empty-term", _affinity({}), False),  # admits no node: no candidate, no variables
    ("unknown-operator", _affinity(_term(_expr("pool", "Near", "r615"))), False),
    ("unknown-field", _affinity({"matchFields": [_expr("spec.unschedulable", "In", "false")]}), False),
    ("unreadable-terms", {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": "gpu-a"}}}}, False),
    ("unreadable-term-besides-a-pin", _affinity(_fields("In", "gpu-a"), {"matchExpressions": "pool"}), False),
    ("preferred-only", {"nodeName": "gpu-a", "affinity": {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": _term(_expr("pool", "In", "r595"))}]}}}, True),
]


@pytest.mark.parametrize(("spec", "confined"), [(s, c) for _, s, c in CONFINED_CASES],
                         ids=[name for name, _, _ in CONFINED_CASES])
def test_a_pod_is_confined_where_every_node_it_may_land_on_is_labelled(spec: dict[str, Any],
                                                                       confined: bool) -> None:
    assert confined_to_driver_limit_nodes(spec, NODES) is confined
    assert driver_limits_apply(spec, AUTO, Mode.ENFORCE, NODES) is confined


@pytest.mark.parametrize("spec", [{"nodeName": "gpu-a"}, {"nodeSelector": {"kubernetes.io/hostname": "gpu-a"}},
                                  _affinity(_fields("In", "gpu-a"))])
def test_without_known_nodes_a_pinned_pod_gets_no_variables(spec: dict[str, Any]) -> None:
    assert confined_to_driver_limit_nodes(spec, None) is False
    assert confined_to_driver_limit_nodes(spec, {}) is False
    assert driver_limits_apply(spec, AUTO, Mode.ENFORCE, None) is False
    assert driver_limits_apply(spec, OFF, Mode.ENFORCE, NODES) is False
    assert driver_limits_apply(spec, AUTO, Mode.AUDIT, NODES) is False


def test_the_label_rule_needs_no_known_nodes() -> None:
    assert driver_limits_apply(PINNED, AUTO, Mode.ENFORCE, None) is True


def test_a_pod_pinned_by_name_gets_the_variables_and_reviews_again_to_itself() -> None:
    plan = plan_of(("train", MemoryShare(bytes=8 * GiB)))
    pod = gpu_pod("train", nodeName="gpu-a")
    injected, _ = desired_pod(pod, plan, AUTO, nodes=NODES)
    assert driver_env(injected, "train") == {ENV_DRIVER_MEMORY_LIMIT: "8192", ENV_DRIVER_MEMORY_REQUEST: "8192"}
    assert diff(injected, desired_pod(injected, plan, AUTO, nodes=NODES)[0]) == []
    assert driver_env(desired_pod(gpu_pod("train", nodeName="gpu-old"), plan, AUTO, nodes=NODES)[0], "train") == {}


def test_the_node_cache_keeps_names_and_labels_and_publishes_a_new_snapshot_per_change() -> None:
    from gpufence.webhook.cluster.nodes import NodeCache

    class Api:
        def list_node(self, **kwargs: Any) -> Any:
            raise AssertionError("not called")

    cache = NodeCache(Api())
    assert cache.node_labels() is None  # not listed yet: unknown, not empty
    node = {"metadata": {"name": "gpu-a", "labels": dict(NODES["gpu-a"]), "resourceVersion": "1"}}
    cache._replace([node, {"metadata": {"name": "gpu-old", "labels": NODES["gpu-old"]}}])
    cache._synced.set()
    first = cache.node_labels()
    assert first is not None and dict(first["gpu-a"]) == NODES["gpu-a"] and set(first) == {"gpu-a", "gpu-old"}
    cache._apply("MODIFIED", {**node, "metadata": {**node["metadata"], "resourceVersion": "2"}})
    assert cache.node_labels() is first  # a status write, labels as they were: nothing published
    cache._apply("MODIFIED", {"metadata": {"name": "gpu-old", "labels": {**NODES["gpu-old"], **LABELLED}}})
    second = cache.node_labels()
    assert second is not first and second is not None and second["gpu-old"][DRIVER_LIMITS_NODE_LABEL] == "true"
    assert DRIVER_LIMITS_NODE_LABEL not in first["gpu-old"]  # a published snapshot never changes
    cache._apply("DELETED", {"metadata": {"name": "gpu-a"}})
    assert set(cache.node_labels() or {}) == {"gpu-old"} and "gpu-a" in second
