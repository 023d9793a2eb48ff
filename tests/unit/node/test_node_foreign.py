"""GPU processes of other namespaces and of the host on a GPU with an opted-in pod's share (pure): what
the policy's other-namespace-gpu-processes and host-gpu-processes decide, in both modes, on GPUs
with and without an opted-in share, for pods the admin allowed device access and for gpufence's own."""

from __future__ import annotations

import itertools

import pytest

from gpufence.contract import HOST_GPU_SHARING, GpuSharing, Mode
from gpufence.node.census import placement
from gpufence.node.decide import Action, GpuProc, NodeEngine, Own, Standing, Verdict, classify, foreign_verdict
from gpufence.node.pods import PodIndex, node_pod
from tests.unit.node.test_node_decide import EIGHT, GIB, OTHER_UID, TRAIN, UID, pod, proc

OPS_UID = "33333333-2222-3333-4444-555555555555"
TOTALS = {0: 80 * GIB, 1: 80 * GIB}


def index(others: GpuSharing = GpuSharing.ALLOW, host: GpuSharing = GpuSharing.ALLOW,
          device_access: tuple[str, ...] = ()) -> PodIndex:
    """An opted-in GPU pod (team-a, UID), a pod of a namespace that is not opted in (elsewhere,
    OTHER_UID) and one of gpu-operator (OPS_UID), which is not opted in either."""
    pods = [node_pod(pod(cfg=EIGHT)), node_pod(pod(uid=OTHER_UID, namespace="elsewhere")),
            node_pod(pod(uid=OPS_UID, namespace="gpu-operator"))]
    return PodIndex.of([p for p in pods if p is not None], ("team-a",), device_access=device_access,
                       other_namespaces=others, host=host)


def host_proc(pid: int = 40, device: int = 0, used: int = 3 * GIB) -> GpuProc:
    return GpuProc(pid, 1000 + pid, device, f"GPU-{device}", used, 0,
                   placement("0::/system.slice/ollama.service\n"))


ADMITTED = proc(10, TRAIN, 2 * GIB)  # the opted-in pod's container, on GPU-0
FOREIGN = proc(20, TRAIN, 6 * GIB, uid=OTHER_UID)  # a container of namespace elsewhere, on GPU-0


def expected(standing: Standing, value: GpuSharing, mode: Mode, shared: bool) -> Verdict:
    """The rule as a table: allow first, then no opted-in share on the GPU, then the key's value."""
    if value is GpuSharing.ALLOW:
        return Verdict.ALLOWED
    if not shared:
        return Verdict.NOT_SHARED
    if value is GpuSharing.TERMINATE and standing is Standing.OTHER:
        return Verdict.AUDIT if mode is Mode.AUDIT else Verdict.TERMINATE
    return Verdict.REPORT


@pytest.mark.parametrize(("value", "mode", "shared"), list(itertools.product(GpuSharing, Mode, (True, False))))
def test_the_other_namespace_key_decides_per_value_mode_and_gpu(value: GpuSharing, mode: Mode, shared: bool) -> None:
    idx = index(others=value)
    entry = classify(FOREIGN, idx)
    assert entry.standing is Standing.OTHER
    verdict, why = foreign_verdict(entry, idx, frozenset({"GPU-0"} if shared else {"GPU-1"}), mode) or (None, "")
    assert verdict is expected(Standing.OTHER, value, mode, shared)
    assert f"other-namespace-gpu-processes is {value.value}" in why or verdict is Verdict.NOT_SHARED
    # Through the engine: terminate in enforce only where the GPU holds an opted-in share.
    processes = [FOREIGN] + ([ADMITTED] if shared else [proc(10, TRAIN, 2 * GIB, device=1)])
    result = NodeEngine(mode=mode, unaccounted_grace=5.0).step(100.0, processes, TOTALS, idx)
    started = {e.reason: e for e in result.step.started}
    audited = {b.reason for b in result.report_only}
    reported = {b.reason for b in result.reported}
    assert ("other_namespace" in started) == (verdict is Verdict.TERMINATE)
    assert ("other_namespace" in audited) == (verdict is Verdict.AUDIT)
    assert ("other_namespace" in reported) == (verdict is Verdict.REPORT)
    if verdict is Verdict.TERMINATE:
        ((action, episode),) = result.step.actions
        assert action is Action.SIGTERM and episode.kill_at == 105.0
        assert episode.cgroup == FOREIGN.placement.path  # the foreign container, through its cgroup
        assert episode.record["pod_uid"] == OTHER_UID and episode.record["sharing_pods"] == [
            {"namespace": "team-a", "pod": "p", "pod_uid": UID}]
    else:
        assert not result.step.actions


@pytest.mark.parametrize(("value", "mode", "shared"), list(itertools.product(HOST_GPU_SHARING, Mode, (True, False))))
def test_the_host_key_reports_and_never_terminates(value: GpuSharing, mode: Mode, shared: bool) -> None:
    idx = index(host=value)
    entry = classify(host_proc(), idx)
    assert entry.standing is Standing.HOST
    verdict, _ = foreign_verdict(entry, idx, frozenset({"GPU-0"} if shared else set()), mode) or (None, "")
    assert verdict is expected(Standing.HOST, value, mode, shared)
    processes = [host_proc(), ADMITTED if shared else proc(10, TRAIN, 2 * GIB, device=1)]
    result = NodeEngine(mode=mode).step(100.0, processes, TOTALS, idx)
    assert not result.step.actions and not result.step.started and not result.report_only
    assert [b.reason for b in result.reported] == (["host"] if verdict is Verdict.REPORT else [])
    if verdict is Verdict.REPORT:
        (report,) = result.reported
        # The Events go to the opted-in pods sharing the GPU: the record names them.
        assert report.record["sharing_pods"] == [{"namespace": "team-a", "pod": "p", "pod_uid": UID}]
        assert report.record["pod"] is None and report.record["pid"] == 40


def test_a_host_key_of_terminate_given_past_the_flags_still_only_reports() -> None:
    # The ConfigMap's parser refuses it; the rule does not rely on that.
    idx = index(host=GpuSharing.TERMINATE)
    verdict, why = foreign_verdict(classify(host_proc(), idx), idx, frozenset({"GPU-0"}), Mode.ENFORCE) or (None, "")
    assert verdict is Verdict.REPORT and "host-gpu-processes is report" in why


@pytest.mark.parametrize(("value", "mode"), list(itertools.product(GpuSharing, Mode)))
def test_a_pod_the_admin_allowed_device_access_is_never_acted_on(value: GpuSharing, mode: Mode) -> None:
    idx = index(others=value, device_access=("gpu-operator",))
    ops = proc(30, TRAIN, 4 * GIB, uid=OPS_UID)
    entry = classify(ops, idx)
    assert entry.standing is Standing.OTHER
    verdict, why = foreign_verdict(entry, idx, frozenset({"GPU-0"}), mode) or (None, "")
    assert verdict is (Verdict.ALLOWED if value is GpuSharing.ALLOW else Verdict.ADMIN_ALLOWED)
    engine = NodeEngine(mode=mode)
    result = engine.step(100.0, [ops, ADMITTED], TOTALS, idx)
    assert not result.step.actions and not result.report_only and not result.reported
    # Said once per episode where the policy would have acted: an admin sees it was seen and left alone.
    assert len(result.allowed) == (0 if value is GpuSharing.ALLOW else 1)
    if result.allowed:
        assert "namespace gpu-operator is in device-access-namespaces" in result.allowed[0].why == why


def test_an_admin_allowed_container_is_said_once_per_episode() -> None:
    ops = "gpu-operator"
    idx = PodIndex.of([p for p in (node_pod(pod(namespace=ops)),) if p is not None], (ops,), device_access=(ops,))
    engine = NodeEngine()
    first = engine.step(100.0, [proc(10, TRAIN, GIB)], TOTALS, idx)
    assert [e.standing for e in first.allowed] == [Standing.ADMIN_ALLOWED] and not first.step.actions
    # Two processes of the same container, later polls: the same episode.
    assert not engine.step(100.5, [proc(10, TRAIN, GIB), proc(11, TRAIN, GIB)], TOTALS, idx).allowed
    assert not engine.step(101.0, [proc(11, TRAIN, GIB)], TOTALS, idx).allowed
    # A poll without its GPU processes ends the episode; the next one is a new episode.
    assert not engine.step(101.5, [], TOTALS, idx).allowed
    assert len(engine.step(102.0, [proc(12, TRAIN, GIB)], TOTALS, idx).allowed) == 1


def test_a_report_is_said_once_per_episode_and_per_host_process() -> None:
    idx = index(others=GpuSharing.REPORT, host=GpuSharing.REPORT)
    engine = NodeEngine()
    first = engine.step(100.0, [ADMITTED, FOREIGN, host_proc(40), host_proc(41)], TOTALS, idx)
    assert sorted((b.reason, b.record["pid"]) for b in first.reported) == [
        ("host", 40), ("host", 41), ("other_namespace", 20)]
    again = engine.step(100.5, [ADMITTED, FOREIGN, host_proc(40), host_proc(41)], TOTALS, idx)
    assert not again.reported
    # The opted-in pod leaves GPU-0: the episodes end; it comes back: they start again.
    assert not engine.step(101.0, [FOREIGN, host_proc(40)], TOTALS, idx).reported
    assert len(engine.step(101.5, [ADMITTED, FOREIGN, host_proc(40)], TOTALS, idx).reported) == 2


def test_gpufence_s_own_processes_and_namespaces_are_never_acted_on() -> None:
    idx = index(others=GpuSharing.TERMINATE, host=GpuSharing.REPORT)
    own = Own(pids=frozenset({40}), namespaces=frozenset({"elsewhere"}))
    for process in (FOREIGN, host_proc(40)):
        verdict, _ = foreign_verdict(classify(process, idx), idx, frozenset({"GPU-0"}), Mode.ENFORCE, own) or (None, "")
        assert verdict is Verdict.OWN
    result = NodeEngine(own=own).step(100.0, [ADMITTED, FOREIGN, host_proc(40)], TOTALS, idx)
    assert not result.step.actions and not result.reported and not result.report_only
    # Someone else's host process beside it is reported.
    assert [b.record["pid"] for b in NodeEngine(own=own).step(
        100.0, [ADMITTED, host_proc(41)], TOTALS, idx).reported] == [41]


def test_an_opted_in_pods_unaccounted_or_pending_process_is_not_foreign() -> None:
    idx = index(others=GpuSharing.TERMINATE, host=GpuSharing.REPORT)
    for process in (proc(11, "c" * 64, GIB), proc(13, "e" * 64, GIB),
                    proc(16, TRAIN, GIB, uid="99999999-2222-3333-4444-555555555555")):
        assert foreign_verdict(classify(process, idx), idx, frozenset({"GPU-0"}), Mode.ENFORCE) is None


def test_a_terminated_foreign_container_is_sigkilled_after_the_grace_even_if_the_share_leaves() -> None:
    idx = index(others=GpuSharing.TERMINATE)
    engine = NodeEngine(unaccounted_grace=3.0)
    ((action, _),) = engine.step(100.0, [ADMITTED, FOREIGN], TOTALS, idx).step.actions
    assert action is Action.SIGTERM
    # SIGTERM committed the SIGKILL: the opted-in pod's process is gone meanwhile, the deadline holds.
    assert not engine.step(101.0, [FOREIGN], TOTALS, idx).step.actions
    ((action, episode),) = engine.step(103.0, [FOREIGN], TOTALS, idx).step.actions
    assert action is Action.SIGKILL and episode.reason == "other_namespace"
