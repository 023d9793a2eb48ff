"""The guardian's pure side: the pods as the API server holds them, the census's standings, the
enforcer's rules run per admitted pod, and one termination per breach (the backstop's timeline)."""

from __future__ import annotations

import json
from typing import Any

from gpufence.contract import ContainerShare, EnforcerConfig, MemoryShare, Mode
from gpufence.node.census import placement
from gpufence.node.decide import Action, Backstop, GpuProc, NodeEngine, Standing, classify
from gpufence.node.pods import Admission, PodIndex, node_pod

GIB = 1 << 30
UID = "6f1c2b8e-9a3d-4c1e-8f7a-0123456789ab"
OTHER_UID = "11111111-2222-3333-4444-555555555555"
TRAIN = "a" * 64
SIDE = "b" * 64
HELPER = "c" * 64
STRAY = "d" * 64


def config(**containers: ContainerShare) -> EnforcerConfig:
    return EnforcerConfig(containers=containers, grace_period_seconds=10, poll_interval_seconds=0.5)


def pod(uid: str = UID, namespace: str = "team-a", cfg: EnforcerConfig | str | None = None,
        statuses: dict[str, str] | None = None, labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None) -> dict[str, Any]:
    sidecar: dict[str, Any] = {"name": "gpufence-enforcer", "image": "gpufence", "restartPolicy": "Always"}
    if cfg is not None:
        text = cfg if isinstance(cfg, str) else cfg.to_json()
        sidecar["env"] = [{"name": "OTHER", "value": "x"}, {"name": "GPUFENCE_CONFIG", "value": text}]
    spec: dict[str, Any] = {"containers": [{"name": "train", "image": "cuda"}, {"name": "helper", "image": "x"}]}
    if cfg is not None:
        spec["initContainers"] = [sidecar]
    statuses = statuses if statuses is not None else {"train": TRAIN, "helper": HELPER, "gpufence-enforcer": SIDE}
    return {
        "metadata": {"uid": uid, "namespace": namespace, "name": "p", "labels": labels or {},
                     "annotations": annotations or {}},
        "spec": spec,
        "status": {
            "initContainerStatuses": [
                {"name": n, "containerID": f"containerd://{c}"} for n, c in statuses.items() if n == "gpufence-enforcer"
            ],
            "containerStatuses": [
                {"name": n, "containerID": f"containerd://{c}"} for n, c in statuses.items() if n != "gpufence-enforcer"
            ],
        },
    }


def proc(pid: int, cid: str | None, used: int, sm: int = 0, uid: str = UID, device: int = 0) -> GpuProc:
    path = f"/kubepods/burstable/pod{uid}" + (f"/{cid}" if cid else "")
    return GpuProc(pid, 1000 + pid, device, f"GPU-{device}", used, sm, placement(f"12:freezer:{path}\n0::/\n"))


EIGHT = config(train=ContainerShare(memory=MemoryShare(bytes=8 * GIB), compute_percent=20))


def index(*pods: dict[str, Any], opted_in: tuple[str, ...] = ("team-a",),
          device_access: tuple[str, ...] = ()) -> PodIndex:
    found = [node_pod(p) for p in pods]
    return PodIndex.of([p for p in found if p is not None], opted_in, device_access=device_access)


# -- the pods ---------------------------------------------------------------------------------------


def test_the_admitted_shares_come_from_the_sidecars_config_in_the_spec() -> None:
    found = node_pod(pod(cfg=EIGHT))
    assert found is not None
    assert found.admission is Admission.ADMITTED
    assert found.config == EIGHT
    assert found.containers == {TRAIN: "train", HELPER: "helper", SIDE: "gpufence-enforcer"}
    assert found.share_of("train") and not found.share_of("helper")


def test_a_pod_without_a_config_is_not_admitted_and_a_bad_config_is_invalid() -> None:
    plain = node_pod(pod())
    assert plain is not None and plain.admission is Admission.NOT_ADMITTED and plain.config is None
    bad = node_pod(pod(cfg=json.dumps({"containers": {"train": {"memoryBytes": -1}}})))
    assert bad is not None and bad.admission is Admission.INVALID
    assert bad.problem is not None and "memoryBytes" in bad.problem


def test_the_opt_out_label_counts_only_where_the_namespace_admin_allows_it() -> None:
    labelled = pod(labels={"gpufence.io/inject": "false"})
    refused = node_pod(labelled)
    allowed = node_pod(labelled, {"gpufence.io/allow-opt-out": "true"})
    assert refused is not None and refused.admission is Admission.NOT_ADMITTED
    assert allowed is not None and allowed.admission is Admission.OPTED_OUT


# -- the census -------------------------------------------------------------------------------------


def test_each_process_gets_its_standing() -> None:
    idx = index(pod(cfg=EIGHT), pod(uid=OTHER_UID, namespace="elsewhere"))
    assert classify(proc(10, TRAIN, GIB), idx).standing is Standing.ADMITTED
    helper = classify(proc(11, HELPER, GIB), idx)
    assert helper.standing is Standing.UNACCOUNTED and helper.container == "helper"
    assert classify(proc(12, None, GIB), idx).standing is Standing.UNACCOUNTED  # the pod's own cgroup
    assert classify(proc(13, STRAY, GIB), idx).standing is Standing.PENDING  # an ID the status lacks (yet)
    assert classify(proc(14, TRAIN, GIB, uid=OTHER_UID), idx).standing is Standing.OTHER
    host = GpuProc(15, 1, 0, "GPU-0", GIB, 0, placement("0::/system.slice/ollama.service\n"))
    assert classify(host, idx).standing is Standing.HOST
    unknown = classify(proc(16, TRAIN, GIB, uid="99999999-2222-3333-4444-555555555555"), idx)
    assert unknown.standing is Standing.PENDING


def test_a_pod_admitted_without_a_gpu_in_an_opted_in_namespace_is_unaccounted() -> None:
    idx = index(pod())
    entry = classify(proc(10, TRAIN, 6 * GIB), idx)
    assert entry.standing is Standing.UNACCOUNTED
    assert entry.why == "a pod admitted without a GPU share"
    assert classify(proc(10, TRAIN, 6 * GIB), index(pod(), opted_in=())).standing is Standing.OTHER


def test_a_gpu_process_the_admins_policy_allowed_is_reported_apart_and_never_acted_on() -> None:
    ops = "gpu-operator"
    idx = index(pod(namespace=ops), pod(uid=OTHER_UID, cfg=EIGHT, namespace=ops),
                opted_in=("team-a", ops), device_access=(ops,))
    allowed = classify(proc(10, TRAIN, 6 * GIB), idx)  # admitted without a GPU, in a device-access namespace
    assert allowed.standing is Standing.ADMIN_ALLOWED and allowed.container == "train"
    assert allowed.why == ("admin-allowed device access: namespace gpu-operator is in device-access-namespaces "
                           "(a pod admitted without a GPU share)")
    # A GPU pod there: the container with a share is held to it, the one without is the admin's.
    assert classify(proc(11, TRAIN, GIB, uid=OTHER_UID), idx).standing is Standing.ADMITTED
    assert classify(proc(12, HELPER, GIB, uid=OTHER_UID), idx).standing is Standing.ADMIN_ALLOWED
    assert classify(proc(13, None, GIB, uid=OTHER_UID), idx).standing is Standing.ADMIN_ALLOWED
    # The same pods where the namespace is not listed: unaccounted, as before.
    plain = index(pod(namespace=ops), opted_in=("team-a", ops))
    assert classify(proc(10, TRAIN, 6 * GIB), plain).standing is Standing.UNACCOUNTED
    for mode in Mode:
        result = NodeEngine(mode=mode, unaccounted_grace=1.0).step(
            100.0, [proc(10, TRAIN, 6 * GIB), proc(12, HELPER, GIB, uid=OTHER_UID)], {0: 80 * GIB}, idx)
        assert [e.standing for e in result.new_census] == [Standing.ADMIN_ALLOWED] * 2
        assert not result.step.actions and not result.step.started and not result.report_only


def test_a_policy_change_re_classifies_a_process_the_engine_has_already_classified() -> None:
    # The engine's classify cache keys on the index: a new device-access list is a new index.
    engine = NodeEngine(mode=Mode.AUDIT)
    seen = proc(10, TRAIN, 6 * GIB)  # the same record, poll after poll: the cache's case
    before = engine.step(100.0, [seen], {0: 80 * GIB}, index(pod()))
    assert before.census[0].standing is Standing.UNACCOUNTED
    after = engine.step(101.0, [seen], {0: 80 * GIB}, index(pod(), device_access=("team-a",)))
    assert after.census[0].standing is Standing.ADMIN_ALLOWED and not after.report_only


def test_a_pod_the_webhook_recorded_as_created_by_an_admin_is_admin_allowed() -> None:
    stamped = pod(annotations={"gpufence.io/admin-device-access": "alice"})
    entry = classify(proc(10, TRAIN, 6 * GIB), index(stamped))
    assert entry.standing is Standing.ADMIN_ALLOWED
    assert entry.why.startswith("admin-allowed device access: created with it by alice, a member of admin-groups")
    # An empty value records nobody; outside opted-in namespaces nothing changes.
    assert classify(proc(10, TRAIN, GIB), index(pod(annotations={"gpufence.io/admin-device-access": ""}))
                    ).standing is Standing.UNACCOUNTED
    assert classify(proc(10, TRAIN, GIB), index(stamped, opted_in=())).standing is Standing.OTHER


def test_a_listed_non_gpu_claim_allows_no_gpu() -> None:
    # non-gpu-resource-claims says which claims hold no GPU, by names a tenant may create: a GPU
    # process of a container with no share stays unaccounted, whatever claim it names.
    claimed = pod()
    claimed["spec"]["resourceClaims"] = [{"name": "nic", "resourceClaimTemplateName": "nic-claim"}]
    claimed["spec"]["containers"][0]["resources"] = {"claims": [{"name": "nic"}]}
    assert classify(proc(10, TRAIN, 6 * GIB), index(claimed)).standing is Standing.UNACCOUNTED


def test_an_unknown_container_of_a_device_access_pod_settles_as_admin_allowed() -> None:
    engine = NodeEngine(settle_seconds=5.0, unaccounted_grace=3.0)
    idx = index(pod(cfg=EIGHT), device_access=("team-a",))
    assert engine.step(100.0, [proc(13, STRAY, GIB)], {0: 80 * GIB}, idx).census[0].standing is Standing.PENDING
    later = engine.step(105.0, [proc(13, STRAY, GIB)], {0: 80 * GIB}, idx)
    assert later.census[0].standing is Standing.ADMIN_ALLOWED and not later.step.actions
    assert later.census[0].why.endswith("(a container ID the pod's status does not name (yet), for 5 s)")


def test_an_unknown_container_of_a_known_pod_is_unaccounted_after_its_settle_time() -> None:
    engine = NodeEngine(settle_seconds=5.0, unaccounted_grace=3.0)
    idx = index(pod(cfg=EIGHT))
    first = engine.step(100.0, [proc(13, STRAY, GIB)], {0: 80 * GIB}, idx)
    assert first.census[0].standing is Standing.PENDING and not first.step.actions
    later = engine.step(105.0, [proc(13, STRAY, GIB)], {0: 80 * GIB}, idx)
    assert later.census[0].standing is Standing.UNACCOUNTED
    assert [a for a, _ in later.step.actions] == [Action.SIGTERM]


# -- the enforcer's rules, and who acts --------------------------------------------------------------


def test_memory_over_share_is_the_sidecars_first_then_the_guardians_sigkill() -> None:
    engine = NodeEngine(poll_interval=0.5)
    idx = index(pod(cfg=EIGHT))
    over = [proc(10, TRAIN, 9 * GIB)]
    first = engine.step(100.0, over, {0: 80 * GIB}, idx)
    (episode,) = first.step.started
    assert episode.reason == "memory_over_share" and episode.term_at is None
    # The pod's grace period (10 s) plus the handover: the pod's poll (0.5 s) and two of ours.
    assert episode.kill_at == 100.0 + 10 + 0.5 + 2 * 0.5
    assert episode.record["limit_bytes"] == 8 * GIB and episode.record["container"] == "train"
    assert not engine.step(111.0, over, {0: 80 * GIB}, idx).step.actions
    (action,) = engine.step(111.5, over, {0: 80 * GIB}, idx).step.actions
    assert action[0] is Action.SIGKILL and action[1].cgroup == f"/kubepods/burstable/pod{UID}/{TRAIN}"


def test_a_breach_the_sidecar_ends_within_its_grace_gets_nothing_from_the_guardian() -> None:
    engine = NodeEngine()
    idx = index(pod(cfg=EIGHT))
    engine.step(100.0, [proc(10, TRAIN, 9 * GIB)], {0: 80 * GIB}, idx)
    gone = engine.step(110.0, [], {0: 80 * GIB}, idx)
    assert len(gone.step.ended) == 1 and not gone.step.actions
    assert not engine.step(200.0, [], {0: 80 * GIB}, idx).step.actions


def test_an_unaccounted_container_is_sigtermed_at_once_and_sigkilled_after_the_grace() -> None:
    engine = NodeEngine(unaccounted_grace=4.0)
    idx = index(pod(cfg=EIGHT))
    first = engine.step(100.0, [proc(11, HELPER, GIB)], {0: 80 * GIB}, idx)
    ((action, episode),) = first.step.actions
    assert action is Action.SIGTERM and episode.record["why"] == "a container with no admitted GPU share"
    # Committed: the container is terminated even if its GPU process is gone meanwhile.
    assert not engine.step(102.0, [], {0: 80 * GIB}, idx).step.actions
    ((action, _),) = engine.step(104.0, [], {0: 80 * GIB}, idx).step.actions
    assert action is Action.SIGKILL
    assert not engine.step(105.0, [], {0: 80 * GIB}, idx).step.actions


def test_audit_reports_and_never_acts() -> None:
    engine = NodeEngine(mode=Mode.AUDIT)
    idx = index(pod(cfg=EIGHT))
    result = engine.step(100.0, [proc(11, HELPER, GIB), proc(10, TRAIN, 9 * GIB)], {0: 80 * GIB}, idx)
    assert not result.step.actions and not result.step.started
    assert sorted(b.reason for b in result.report_only) == ["memory_over_share", "unaccounted"]
    audit_pod = config(train=ContainerShare(memory=MemoryShare(bytes=8 * GIB)))
    audit_pod = EnforcerConfig(containers=audit_pod.containers, mode=Mode.AUDIT)
    pod_audit = NodeEngine().step(100.0, [proc(10, TRAIN, 9 * GIB)], {0: 80 * GIB}, index(pod(cfg=audit_pod)))
    assert not pod_audit.step.started and [b.reason for b in pod_audit.report_only] == ["memory_over_share"]


def test_a_restored_episode_keeps_its_deadline_and_its_sigterm() -> None:
    engine = NodeEngine(unaccounted_grace=4.0)
    idx = index(pod(cfg=EIGHT))
    engine.step(100.0, [proc(11, HELPER, GIB)], {0: 80 * GIB}, idx)
    saved = list(engine.backstop.episodes.values())
    restarted = NodeEngine(unaccounted_grace=4.0)
    restarted.backstop.restore(saved)
    assert not restarted.step(101.0, [proc(11, HELPER, GIB)], {0: 80 * GIB}, idx).step.actions  # no second SIGTERM
    ((action, _),) = restarted.step(104.0, [proc(11, HELPER, GIB)], {0: 80 * GIB}, idx).step.actions
    assert action is Action.SIGKILL


def test_a_restored_episode_waits_for_the_pods_list_and_keeps_its_deadline() -> None:
    """A guardian restarted mid-grace sees its pods' processes as pending until its first list: the
    episode it took over is neither ended (that would start a new grace period after the list) nor
    acted on meanwhile; once listed, it is SIGKILLed at the first guardian's deadline, once."""
    engine = NodeEngine()
    idx = index(pod(cfg=EIGHT))
    over = [proc(10, TRAIN, 9 * GIB)]
    (episode,) = engine.step(100.0, over, {0: 80 * GIB}, idx).step.started
    restarted = NodeEngine()
    restarted.backstop.restore([episode])
    not_listed = PodIndex.of([], ())
    for now in (105.0, 111.0, 112.0):  # past its deadline (111.5) too: nothing on a view it does not have
        result = restarted.step(now, over, {0: 80 * GIB}, not_listed)
        assert [e.standing for e in result.census] == [Standing.PENDING]
        assert not result.step.actions and not result.step.ended and not result.step.started
    ((action, killed),) = restarted.step(112.5, over, {0: 80 * GIB}, idx).step.actions
    assert action is Action.SIGKILL and (killed.started, killed.kill_at) == (100.0, 100.0 + 10 + 0.5 + 1.0)
    assert not restarted.step(113.0, over, {0: 80 * GIB}, idx).step.actions
    # Where the list shows the breach over, the episode ends as before.
    again = NodeEngine()
    again.backstop.restore([episode])
    assert again.step(105.0, over, {0: 80 * GIB}, not_listed).step.ended == ()
    assert len(again.step(106.0, [proc(10, TRAIN, GIB)], {0: 80 * GIB}, idx).step.ended) == 1


def test_compute_over_share_gives_a_freezer_target_at_the_cores_run_fraction() -> None:
    engine = NodeEngine(compute_window_seconds=2.0, compute_period_seconds=0.5)
    idx = index(pod(cfg=EIGHT))
    now = 100.0
    result = None
    for _ in range(12):
        result = engine.step(now, [proc(10, TRAIN, GIB, sm=100)], {0: 80 * GIB}, idx)
        now += 0.25
    assert result is not None
    (target,) = result.throttle.values()
    assert target.container == "train" and 0 < target.fraction < 0.5
    assert result.pods[UID].plan["train"] == target.fraction  # the Core's own plan, not a second rule


def test_backstop_next_due_is_the_earliest_pending_signal() -> None:
    backstop = Backstop()
    assert backstop.next_due() is None
    engine = NodeEngine(unaccounted_grace=4.0)
    engine.step(100.0, [proc(10, TRAIN, 9 * GIB)], {0: 80 * GIB}, index(pod(cfg=EIGHT)))
    assert engine.next_due() == 100.0 + 10 + 0.5 + 1.0


def test_gpu_work_that_outlives_the_freezer_is_terminated_by_the_guardian_itself() -> None:
    # The driver keeps reporting full use while the freezer holds the container at its minimum: the
    # Core's throttle_ineffective order, which no sidecar sees (it is the guardian's freeze that fails).
    engine = NodeEngine(compute_window_seconds=1.0, compute_period_seconds=0.5, compute_ineffective_seconds=3.0,
                        unaccounted_grace=99.0)
    idx = index(pod(cfg=EIGHT))
    now, actions = 100.0, []
    while not actions:
        assert now < 130.0, "no throttle_ineffective order in 30 s of full use"
        result = engine.step(now, [proc(10, TRAIN, GIB, sm=100)], {0: 80 * GIB}, idx)
        actions = list(result.step.actions)
        now += 0.25
    ((action, episode),) = actions
    assert action is Action.SIGTERM and episode.reason == "throttle_ineffective"
    assert episode.kill_at - episode.started == 10  # the pod's grace period
    assert episode.record["compute_share"] == 0.2 and episode.record["sm_utilization"] > 0.2
    assert episode.cgroup not in result.throttle  # terminated, no longer throttled


def test_the_engine_reuses_what_did_not_change_and_notices_what_did() -> None:
    engine = NodeEngine()
    first_index = index(pod(cfg=EIGHT))
    train = proc(10, TRAIN, GIB, sm=5)
    engine.step(100.0, [train], {0: 80 * GIB}, first_index)
    generation = engine.generation
    core = engine._cores[UID]
    again = engine.step(100.5, [train], {0: 80 * GIB}, first_index)
    assert engine.generation == generation and engine._cores[UID] is core
    assert again.census[0].standing is Standing.ADMITTED
    # A new record of the same process (its use changed): the same standing, the same Core.
    grown = engine.step(101.0, [proc(10, TRAIN, 9 * GIB, sm=5)], {0: 80 * GIB}, first_index)
    assert engine.generation == generation and engine._cores[UID] is core
    assert grown.pods[UID].orders  # the Core saw the new use: over its 8 GiB share
    # A new index with an equal config keeps the Core (its compute window); a changed one replaces it.
    engine.step(101.5, [train], {0: 80 * GIB}, index(pod(cfg=EIGHT)))
    assert engine._cores[UID] is core
    four = config(train=ContainerShare(memory=MemoryShare(bytes=4 * GIB), compute_percent=20))
    engine.step(102.0, [train], {0: 80 * GIB}, index(pod(cfg=four)))
    assert engine._cores[UID] is not core and engine.generation > generation
    # A process gone changes the census.
    generation = engine.generation
    engine.step(102.5, [], {0: 80 * GIB}, index(pod(cfg=four)))
    assert engine.generation > generation and UID not in engine._cores


def test_pods_started_at_different_polls_share_one_utilisation_read_a_period() -> None:
    engine = NodeEngine(poll_interval=0.5, compute_period_seconds=1.0)
    other = "22222222-3333-4444-5555-666666666666"
    first, second = pod(cfg=EIGHT), pod(uid=other, cfg=EIGHT, statuses={"train": STRAY})
    both = index(first, second)
    reads = []
    for poll in range(20):
        now = 100.0 + 0.5 * poll
        reads.append(engine.wants_utilisation(now))
        procs = [proc(10, TRAIN, GIB, sm=30)] + ([proc(11, STRAY, GIB, sm=30, uid=other)] if poll >= 3 else [])
        engine.step(now, procs, {0: 80 * GIB}, both)  # the second pod's Core is made half a period later
    assert sum(reads[4:]) == 8  # once a period for both, not at every poll
