"""The share recommendation's arithmetic, grouping and output."""

from __future__ import annotations

import pytest

from gpufence.contract import ANNOTATION_COMPUTE, ANNOTATION_MEMORY
from gpufence.monitor import recommend as rec
from gpufence.monitor.recommend import ContainerUsage, Workload, workload_of

GIB = 1 << 30
MIB = 1 << 20


@pytest.mark.parametrize(("pod", "owner", "expected"), [
    ("train-5c8f9d7b6d-q2w4x", None, ("Deployment", "train")),
    ("my-app-v2-7d4b9c8f5-zx9kp", None, ("Deployment", "my-app-v2")),
    ("db-0", None, ("StatefulSet", "db")),
    ("etl-1733380000-x7k2p", None, ("generated", "etl-1733380000")),
    ("batch-x7k2p", None, ("generated", "batch")),
    ("standalone", None, ("Pod", "standalone")),
    ("anything", ("ReplicaSet", "web-6b7c9f8d5"), ("Deployment", "web")),
    ("anything", ("ReplicaSet", "hand-made"), ("ReplicaSet", "hand-made")),
    ("anything", ("Job", "nightly-29012345"), ("Job", "nightly-29012345")),
    ("db-0", ("<none>", "<none>"), ("StatefulSet", "db")),
])
def test_workload_of(pod: str, owner: tuple[str, str] | None, expected: tuple[str, str]) -> None:
    kind, name = owner or (None, None)
    assert workload_of("ns", pod, kind, name) == Workload("ns", *expected)


def test_quantities() -> None:
    assert rec.quantity(8 * GIB) == "8Gi"
    assert rec.quantity(1536 * MIB) == "1536Mi"
    assert rec.quantity(1000) == "1000"
    assert rec.parse_bytes("1Gi") == GIB and rec.parse_bytes("512Mi") == 512 * MIB and rec.parse_bytes("42") == 42


def test_memory_share_rounds_the_peak_plus_headroom_up() -> None:
    assert rec.memory_share(3 * GIB, 0.2, GIB) == 4 * GIB  # 3.6 GiB -> 4Gi
    assert rec.memory_share(5 * GIB, 0.2, GIB) == 6 * GIB  # exactly 6 GiB stays 6Gi (no float push)
    assert rec.memory_share(10 * MIB, 0.2, GIB) == GIB  # at least one step
    assert rec.memory_share(3 * GIB, 0.2, 512 * MIB) == 4 * GIB  # 3.6 -> 4.0 in 0.5 GiB steps
    assert rec.memory_share(3 * GIB, 0.0, GIB) == 3 * GIB


def test_compute_share_rounds_the_p99_plus_headroom_up() -> None:
    assert rec.compute_share(0.40, 0.2) == 50  # 48 -> 50
    assert rec.compute_share(0.25, 0.2) == 30
    assert rec.compute_share(0.95, 0.2) == 100  # capped
    assert rec.compute_share(0.0, 0.2) == 5  # at least one step
    assert rec.compute_share(0.33, 0.0, step=10) == 40


def usages() -> list[ContainerUsage]:
    return [
        ContainerUsage("team-a", "train-5c8f9d7b6d-q2w4x", "trainer", 6 * GIB, 5 * GIB, 0.45, 0.40, 8 * GIB, 0.5),
        ContainerUsage("team-a", "train-5c8f9d7b6d-zx9kp", "trainer", 7 * GIB, 6 * GIB, 0.30, 0.25, 8 * GIB, 0.5),
        ContainerUsage("team-a", "train-5c8f9d7b6d-zx9kp", "sidecar-gpu", GIB // 2, GIB // 2, None, None, GIB),
        ContainerUsage("team-a", "greedy-0", "loader", 3 * GIB, 3 * GIB, None, None, 2 * GIB, kills=1),
        ContainerUsage("team-b", "render-6b7c9f8d5-zx9kp", "render", 2 * GIB, 2 * GIB, 0.9, 0.3, 4 * GIB, 0.3,
                       throttled=True),
    ]


def test_recommend_per_workload_and_container() -> None:
    recs = {(r.workload, r.container): r for r in rec.recommend(usages())}
    train = recs[Workload("team-a", "Deployment", "train"), "trainer"]
    assert train.pods == 2
    assert (train.memory_peak, train.memory_p99, train.sm_peak, train.sm_p99) == (7 * GIB, 6 * GIB, 0.45, 0.40)
    assert train.memory_bytes == 9 * GIB  # 7 x 1.2 = 8.4 -> 9Gi
    assert train.compute_percent == 50 and train.notes == ()
    greedy = recs[Workload("team-a", "StatefulSet", "greedy"), "loader"]
    assert greedy.memory_bytes == 4 * GIB and greedy.compute_percent is None
    assert "terminated" in greedy.notes[0]
    render = recs[Workload("team-b", "Deployment", "render"), "render"]
    # Throttled: its SM was held near its share; the share is never lowered below the current one.
    assert render.compute_percent == 40 and "throttled" in render.notes[0]


def test_kube_pod_owner_wins_over_the_name() -> None:
    recs = rec.recommend(usages()[:1], {("team-a", "train-5c8f9d7b6d-q2w4x"): ("Job", "train-job")})
    assert recs[0].workload == Workload("team-a", "Job", "train-job")


def test_annotations_one_container_or_each() -> None:
    docs = rec.annotations_to_set(rec.recommend(usages()))
    assert docs[Workload("team-b", "Deployment", "render")] == {ANNOTATION_MEMORY: "3Gi", ANNOTATION_COMPUTE: "40"}
    assert docs[Workload("team-a", "Deployment", "train")] == {
        f"{ANNOTATION_MEMORY}.sidecar-gpu": "1Gi", f"{ANNOTATION_MEMORY}.trainer": "9Gi",
        f"{ANNOTATION_COMPUTE}.trainer": "50",
    }


def test_table_and_json() -> None:
    recs = rec.recommend(usages())
    text = rec.render_table(recs, window="1h", headroom=0.2, memory_step=GIB, compute_step=5)
    assert "memory share = peak + 20 % rounded up to 1Gi" in text
    line = next(x for x in text.splitlines() if x.startswith("team-b"))
    assert line.split() == ["team-b", "Deployment/render", "render", "1", "2.00Gi", "2.00Gi", "4.00Gi", "3Gi",
                            "90%", "30%", "30%", "40%"]
    assert 'gpufence.io/memory: "3Gi"' in text
    assert ("kubectl -n team-b patch deployment render --type merge -p "
            '\'{"spec":{"template":{"metadata":{"annotations":{"gpufence.io/memory":"3Gi",'
            '"gpufence.io/compute":"40"}}}}}\'') in text
    doc = {(d["workload"], d["container"]): d for d in rec.recommendations_json(recs)}
    assert doc["greedy", "loader"]["memory_share"] == "4Gi" and doc["greedy", "loader"]["kind"] == "StatefulSet"
    assert rec.render_table([], window="1h", headroom=0.2, memory_step=GIB, compute_step=5).endswith(
        "no gpufence container usage in that window\n")


def test_usages_from_query_results() -> None:
    labels = {"namespace": "ns", "pod": "p-0", "container": "c"}
    results = {"memory_peak": [(labels, 3.0 * GIB)], "sm_p99": [(labels, 0.5)], "throttled": [(labels, 1.0)],
               "kills": [({**labels, "container": ""}, 1.0)], "owners": [({"namespace": "ns", "pod": "p-0",
                                                                           "owner_kind": "Job", "owner_name": "j"}, 1)]}
    (u,) = rec.usages_from(results)
    assert (u.pod, u.container, u.memory_peak, u.sm_p99, u.throttled, u.kills) == ("p-0", "c", 3 * GIB, 0.5, True, 0)
    assert rec.owners_from(results["owners"]) == {("ns", "p-0"): ("Job", "j")}


def test_queries_name_the_enforcers_metrics_and_the_window() -> None:
    q = rec.queries("30m", 'namespace="a"')
    assert q["memory_peak"] == ('max by (namespace, pod, container) '
                                '(max_over_time(gpufence_container_gpu_memory_used_bytes{namespace="a"}[30m]))')
    assert 'action=~"sigterm|sigkill",resource="memory",namespace="a"}[30m]' in q["kills"]
    # A kill before the first scrape: a series new in the window, already above 0.
    assert (' unless gpufence_enforcement_actions_total{action=~"sigterm|sigkill",resource="memory",namespace="a"} '
            'offset 30m) > 0') in q["kills"]


def test_a_container_killed_before_any_scrape() -> None:
    (u,) = rec.usages_from({"kills": [({"namespace": "ns", "pod": "db-0", "container": "c"}, 1.0)]})
    (r,) = rec.recommend([u])
    assert (r.memory_bytes, r.compute_percent) == (None, None)
    assert r.notes == ("terminated before any scrape: no usage recorded (measure in audit mode)",)
    text = rec.render_table([r], window="1h", headroom=0.2, memory_step=GIB, compute_step=5)
    assert "# ns StatefulSet/db: nothing to set, no usage recorded" in text and "kubectl" not in text


def test_no_compute_share_for_a_container_that_used_no_sm() -> None:
    idle = [ContainerUsage("ns", "db-0", "c", GIB, GIB, 0.0, 0.0, 2 * GIB, None)]
    assert rec.recommend(idle)[0].compute_percent is None
    shared = [ContainerUsage("ns", "db-0", "c", GIB, GIB, 0.0, 0.0, 2 * GIB, 0.5)]
    assert rec.recommend(shared)[0].compute_percent == 5  # it has one now: the smallest step
