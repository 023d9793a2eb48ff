"""The guardian's edges that need no process: its state file's round trip (what a restart takes over),
the pod watch's cache and the pods file, and the metric names it exports."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from prometheus_client import generate_latest

from gpufence import metric_names as m
from gpufence.contract import GpuSharing
from gpufence.node.census import placement
from gpufence.node.decide import Episode
from gpufence.node.kube import PodWatch, pods_file_index
from gpufence.node.pods import Admission
from gpufence.node.report import NodeMetrics
from gpufence.node.state import GuardianState

UID = "6f1c2b8e-9a3d-4c1e-8f7a-0123456789ab"
CID = "a" * 64
PATH = f"/kubepods/burstable/pod{UID}/{CID}"


def episode(**overrides: Any) -> Episode:
    fields: dict[str, Any] = {
        "cgroup": PATH, "placement": placement(f"12:freezer:{PATH}\n0::/\n"), "reason": "unaccounted",
        "started": 100.0, "term_at": 100.0, "kill_at": 110.0, "termed": True, "record": {"pod": "p"},
    }
    fields.update(overrides)
    return Episode(**fields)


def test_episodes_and_frozen_cgroups_survive_a_restart(tmp_path: pathlib.Path) -> None:
    first = GuardianState(tmp_path, boot="boot-1")
    first.save_episodes([episode()])
    first.mark_frozen(placement(f"0::{PATH}\n"))
    again = GuardianState(tmp_path, boot="boot-1").load(now=105.0)
    assert again.problem is None
    (restored,) = again.episodes
    assert restored.termed and restored.kill_at == 110.0 and restored.started == 100.0
    assert restored.placement == episode().placement and dict(restored.record) == {"pod": "p"}
    assert [p.path for p in again.frozen] == [PATH]


def test_a_record_from_another_boot_or_a_bad_file_holds_nothing(tmp_path: pathlib.Path) -> None:
    GuardianState(tmp_path, boot="boot-1").save_episodes([episode()])
    other = GuardianState(tmp_path, boot="boot-2").load(now=0.0)
    assert other.episodes == () and other.problem == "recorded before the last boot"
    (tmp_path / "guardian.json").write_text("{not json")
    assert GuardianState(tmp_path, boot="boot-1").load(now=0.0).problem is not None


def test_a_recorded_deadline_never_holds_a_sigkill_back_longer_than_any_grace(tmp_path: pathlib.Path) -> None:
    GuardianState(tmp_path, boot="b").save_episodes([episode(kill_at=1e12)])
    (restored,) = GuardianState(tmp_path, boot="b").load(now=100.0).episodes
    assert restored.kill_at == 100.0 + 3600.0


def test_malformed_entries_are_dropped_one_by_one(tmp_path: pathlib.Path) -> None:
    GuardianState(tmp_path, boot="b").save_episodes([episode()])
    doc = json.loads((tmp_path / "guardian.json").read_text())
    doc["episodes"].append({"cgroup": PATH, "kill_at": "soon"})
    doc["episodes"].append({**doc["episodes"][0], "term_at": "now"})
    (tmp_path / "guardian.json").write_text(json.dumps(doc))
    assert len(GuardianState(tmp_path, boot="b").load(now=100.0).episodes) == 1


def pod_object(uid: str, namespace: str = "team-a") -> dict[str, Any]:
    return {"metadata": {"uid": uid, "namespace": namespace, "name": f"p-{uid[:4]}"}, "spec": {"containers": []},
            "status": {"containerStatuses": [{"name": "train", "containerID": f"containerd://{CID}"}]}}


class _Api:
    """Stands for CoreV1Api: the watch loop is not started, only its cache is fed."""

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> None:
        raise AssertionError("not called")

    def list_namespace(self, **kwargs: Any) -> None:
        raise AssertionError("not called")

    def list_namespaced_config_map(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("not called")


def policy_configmap(**data: str) -> dict[str, Any]:
    return {"metadata": {"name": "gpufence-policy", "namespace": "gpufence", "resourceVersion": "1"}, "data": data}


def read_policy(watch: PodWatch, configmap: dict[str, Any]) -> None:
    """What the policy watch's first list does (its loop is not started)."""
    watch.policy_watch._replace([configmap])
    watch.policy_watch._synced.set()


def test_the_pod_watch_keeps_the_nodes_pods_by_uid_and_the_opted_in_namespaces() -> None:
    watch = PodWatch(_Api(), "gpu-node-1")
    read_policy(watch, policy_configmap())
    watch.namespaces._replace([{"metadata": {"name": "team-a", "labels": {"gpufence.io/injection": "enabled"}}},
                               {"metadata": {"name": "other"}}])
    watch._replace([pod_object(UID)])
    watch._apply("ADDED", pod_object("22222222-2222-3333-4444-555555555555", "other"))
    index = watch.index()
    assert set(index.pods) == {UID, "22222222-2222-3333-4444-555555555555"}
    assert index.opted_in == {"team-a"}
    assert index.pods[UID].containers == {CID: "train"}
    watch._apply("DELETED", pod_object(UID))
    assert set(watch.index().pods) == {"22222222-2222-3333-4444-555555555555"}


def test_no_pod_is_shown_before_the_policy_is_read_and_its_device_access_namespaces_after() -> None:
    watch = PodWatch(_Api(), "gpu-node-1")
    watch.namespaces._replace([{"metadata": {"name": "team-a", "labels": {"gpufence.io/injection": "enabled"}}}])
    watch._replace([pod_object(UID)])
    # Before the policy's first read, a pod of a device-access namespace would be taken for unaccounted.
    assert not watch.index().pods and not watch.has_synced()
    read_policy(watch, policy_configmap(**{"device-access-namespaces": "team-a, gpu-operator"}))
    index = watch.index()
    assert set(index.pods) == {UID} and index.device_access == {"team-a", "gpu-operator"}
    # An invalid version keeps the last valid one (the webhook's own rule).
    watch.policy_watch._apply("MODIFIED", policy_configmap(**{"device-access-namespaces": "Not A Name"}))
    assert watch.index().device_access == {"team-a", "gpu-operator"}


def test_the_sharing_keys_come_from_the_policy_with_the_defaults_until_a_valid_version() -> None:
    watch = PodWatch(_Api(), "gpu-node-1")
    watch.namespaces._replace([{"metadata": {"name": "team-a", "labels": {"gpufence.io/injection": "enabled"}}}])
    watch._replace([pod_object(UID)])
    read_policy(watch, policy_configmap())
    assert (watch.index().other_namespaces, watch.index().host) == (GpuSharing.ALLOW, GpuSharing.ALLOW)
    read_policy(watch, policy_configmap(**{"other-namespace-gpu-processes": "terminate",
                                           "host-gpu-processes": "report"}))
    changed = watch.index()
    assert (changed.other_namespaces, changed.host) == (GpuSharing.TERMINATE, GpuSharing.REPORT)
    # An invalid version (the host key has no terminate) keeps the last valid one.
    watch.policy_watch._apply("MODIFIED", policy_configmap(**{"host-gpu-processes": "terminate"}))
    assert watch.index() is changed


def test_the_pod_watch_reads_each_pod_once_per_version_and_keeps_its_index_while_nothing_changes() -> None:
    other = "22222222-2222-3333-4444-555555555555"
    watch = PodWatch(_Api(), "gpu-node-1")
    watch.namespaces._replace([{"metadata": {"name": "team-a", "labels": {"gpufence.io/injection": "enabled"}}}])
    watch._replace([pod_object(UID), pod_object(other)])
    read_policy(watch, policy_configmap())
    first = watch.index()
    assert watch.index() is first  # nothing changed: the same index (the engine's caches key on it)
    watch._apply("MODIFIED", pod_object(other))
    second = watch.index()
    assert second is not first and second.pods[UID] is first.pods[UID]  # the unchanged pod is not read again
    assert second.pods[other] is not first.pods[other]
    # A namespace's change reads its pods again: its admin annotations decide the opt-out.
    watch.namespaces._replace([{"metadata": {"name": "team-a"}}])
    third = watch.index()
    assert third.opted_in == frozenset() and third.pods[UID] is not second.pods[UID]
    # A policy change to its device-access namespaces makes a new index (the engine re-classifies).
    read_policy(watch, policy_configmap(**{"device-access-namespaces": "team-a"}))
    fourth = watch.index()
    assert fourth is not third and fourth.device_access == {"team-a"} and watch.index() is fourth
    watch._apply("DELETED", pod_object(other))
    assert set(watch.index().pods) == {UID}


def test_the_pods_file_holds_pods_and_namespaces() -> None:
    index = pods_file_index({
        "pods": [pod_object(UID)],
        "namespaces": [{"metadata": {"name": "team-a", "labels": {"gpufence.io/injection": "enabled"}}}],
    })
    assert index.opted_in == {"team-a"}
    assert index.pods[UID].admission is Admission.NOT_ADMITTED


def test_the_guardian_exports_exactly_the_node_metric_names() -> None:
    registry = NodeMetrics().registry
    exported = {family.name + ("_total" if family.type == "counter" else "") for family in registry.collect()}
    assert exported == set(m.NODE_METRICS)
    # Every (action, reason) the guardian can count exists at zero, so its first kill is an increase.
    assert 'gpufence_node_actions_total{action="sigkill",reason="memory_over_share"} 0.0' in (
        generate_latest(registry).decode())


def test_the_guardians_events_name_it_not_the_sidecar() -> None:
    from datetime import UTC, datetime

    from gpufence.enforcer.report.decision_log import DecisionLog
    from gpufence.enforcer.report.events import PodRef
    from gpufence.node.report import _GuardianRecorder

    recorder = _GuardianRecorder(DecisionLog(), PodRef("team-a", "p", UID), None, host="gpu-node-1")
    body = recorder.event_body("GPUProcessUnaccounted", "m", "Warning", "", datetime.now(UTC))
    assert body["reportingComponent"] == "gpufence-node"
    assert body["source"] == {"component": "gpufence-node", "host": "gpu-node-1"}
    assert body["involvedObject"]["uid"] == UID and body["involvedObject"]["namespace"] == "team-a"
