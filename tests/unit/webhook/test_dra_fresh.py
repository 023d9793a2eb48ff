"""The DRA cache's fresh reads (gpufence/webhook/cluster/dra_cache.py ``for_review``): what a lagging
watch misses of the objects a pod names is read from the API server, so /mutate and /validate of one
create compute the same pod. The API server is the Kubernetes client's CustomObjectsApi at its
boundary: lists, GETs and a watch that fails (the cache keeps its list)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import jsonpatch
import pytest
from kubernetes.client import ApiException

from gpufence.webhook.client import pod_admission_review
from gpufence.webhook.cluster.dra_cache import MAX_FRESH_READS, DraCache
from gpufence.webhook.core.admission import OUTCOME_MUTATED, OUTCOME_REFUSED, OUTCOME_VERIFIED, review, verify
from gpufence.webhook.core.dra import DraObjects, DraSnapshot
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings

GIB = 1 << 30
GPU_CLASS = {"metadata": {"name": "gpu"},
             "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}}
CLAIM = {"metadata": {"namespace": "team", "name": "shared"}, "spec": {"devices": {"requests": [
    {"name": "gpu", "exactly": {"deviceClassName": "gpu", "capacity": {"requests": {"memory": "6Gi"}}}}]}}}


class Api:
    """The API server: ``listed`` is what the watch's lists saw, ``stored`` what a GET finds now."""

    def __init__(self, listed: dict[str, list[dict[str, Any]]], stored: dict[str, list[dict[str, Any]]],
                 *, get_status: int | None = None) -> None:
        self.listed, self.stored, self.get_status = listed, stored, get_status
        self.gets: list[tuple[str, str, str]] = []

    def list_cluster_custom_object(self, group: str, version: str, plural: str, *, watch: bool = False,
                                   **_: Any) -> Any:
        if watch:  # the watch lags: it never delivers (the loop retries after its backoff)
            raise ApiException(status=500, reason="watch held back")
        body = {"metadata": {"resourceVersion": "1"}, "items": self.listed.get(plural, [])}
        return SimpleNamespace(data=json.dumps(body).encode())

    def _get(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        self.gets.append((plural, namespace, name))
        if self.get_status is not None:
            raise ApiException(status=self.get_status, reason="refused")
        for obj in self.stored.get(plural, []):
            if (obj["metadata"].get("namespace", ""), obj["metadata"]["name"]) == (namespace, name):
                return obj
        raise ApiException(status=404, reason="Not Found")

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str, name: str,
                                     **_: Any) -> dict[str, Any]:
        return self._get(plural, namespace, name)

    def get_cluster_custom_object(self, group: str, version: str, plural: str, name: str, **_: Any) -> dict[str, Any]:
        return self._get(plural, "", name)


@pytest.fixture
def lagging() -> Iterator[tuple[DraCache, Api]]:
    """A synced cache that listed the GPU class but not the claim, created since (stored)."""
    api = Api({"deviceclasses": [GPU_CLASS]}, {"deviceclasses": [GPU_CLASS], "resourceclaims": [CLAIM]})
    cache = DraCache(api, min_backoff=60)
    cache.start()
    try:
        for watch in (cache.classes, cache.claims, cache.templates):
            assert watch.wait_for(lambda w: w.has_synced(), timeout=10)
        yield cache, api
    finally:
        cache.stop(5)


def pod(*claims: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": "team"},
            "spec": {"containers": [{"name": "trainer", "image": "cuda",
                                     "resources": {"claims": [{"name": c} for c in claims]}}],
                     "resourceClaims": [{"name": c, "resourceClaimName": c} for c in claims]}}


def judged(judge: Any, obj: dict[str, Any], claims: DraObjects) -> Any:
    return judge(pod_admission_review(obj, uid="u", namespace="team"), InjectionSettings(), AllNamespacesOptedIn(),
                 claims)


def config_memory(obj: dict[str, Any]) -> int:
    sidecar = next(c for c in obj["spec"]["initContainers"] if c["name"] == "gpufence-enforcer")
    config = json.loads(next(e["value"] for e in sidecar["env"] if e["name"] == "GPUFENCE_CONFIG"))
    return int(config["containers"]["trainer"]["memoryBytes"])


def mutated(obj: dict[str, Any], claims: DraObjects) -> dict[str, Any]:
    result = judged(review, obj, claims)
    assert result.outcome == OUTCOME_MUTATED, result.review
    patch = json.loads(base64.b64decode(result.review["response"]["patch"]))
    return dict(jsonpatch.apply_patch(obj, patch))


def test_a_claim_the_watch_has_not_seen_is_read_so_mutate_and_validate_agree(lagging: tuple[DraCache, Api]) -> None:
    cache, api = lagging
    caught_up = DraSnapshot.of(classes=[GPU_CLASS], claims=[CLAIM])  # the cache at /validate
    # What went wrong before: /mutate on the lagging cache, /validate once it caught up.
    stale = mutated(pod("shared"), cache)
    assert judged(verify, stale, caught_up).outcome == OUTCOME_REFUSED

    assert cache.needs_fresh("team", pod("shared")["spec"])
    fresh = cache.for_review("team", pod("shared")["spec"])
    assert api.gets == [("resourceclaims", "team", "shared")]  # the class was listed: not read again
    made = mutated(pod("shared"), fresh)
    assert config_memory(made) == 6 * GIB  # the claim's memory, as the API server has it
    assert judged(verify, made, caught_up).outcome == OUTCOME_VERIFIED
    # /validate before the watch caught up reads the claim again, and agrees too.
    assert judged(verify, made, cache.for_review("team", made["spec"])).outcome == OUTCOME_VERIFIED


def test_what_the_cache_holds_is_not_read() -> None:
    api = Api({"deviceclasses": [GPU_CLASS], "resourceclaims": [CLAIM]}, {})
    cache = DraCache(api, min_backoff=60)
    cache.start()
    try:
        assert cache.claims.wait_for(lambda w: ("team", "shared") in w.items, timeout=10)
        assert cache.classes.wait_for(lambda w: w.has_synced(), timeout=10)
        assert cache.templates.wait_for(lambda w: w.has_synced(), timeout=10)
        assert not cache.needs_fresh("team", pod("shared")["spec"])
        assert cache.for_review("team", pod("shared")["spec"]) is cache
        assert api.gets == []
    finally:
        cache.stop(5)


def test_a_missing_claim_stays_unresolved_and_the_reads_are_bounded(lagging: tuple[DraCache, Api]) -> None:
    cache, api = lagging
    names = [f"c{i}" for i in range(MAX_FRESH_READS + 4)]
    fresh = cache.for_review("team", pod(*names)["spec"])
    assert len(api.gets) == MAX_FRESH_READS
    assert fresh.unavailable() is None and all(fresh.claim("team", n) is None for n in names)
    warnings = judged(review, pod(*names), fresh).review["response"]["warnings"]
    assert any('"c0"' in w and "could not be resolved" in w for w in warnings)


def test_a_failed_read_keeps_the_claim_unresolved() -> None:
    api = Api({}, {"resourceclaims": [CLAIM]}, get_status=403)
    cache = DraCache(api, min_backoff=60)  # never started: not synced
    fresh = cache.for_review("team", pod("shared")["spec"])
    assert api.gets == [("resourceclaims", "team", "shared")]
    assert fresh.claim("team", "shared") is None
    assert fresh.unavailable() == "the webhook's DRA cache has not synced yet"


def test_before_the_first_lists_a_pod_whose_objects_were_all_read_is_resolved() -> None:
    api = Api({}, {"deviceclasses": [GPU_CLASS], "resourceclaims": [CLAIM]})
    cache = DraCache(api, min_backoff=60)  # never started: not synced
    fresh = cache.for_review("team", pod("shared")["spec"])
    assert sorted(api.gets) == [("deviceclasses", "", "gpu"), ("resourceclaims", "team", "shared")]
    assert fresh.unavailable() is None
    assert config_memory(mutated(pod("shared"), fresh)) == 6 * GIB


def test_nothing_is_read_where_the_api_is_not_served() -> None:
    api = Api({}, {"resourceclaims": [CLAIM]})
    cache = DraCache(api, min_backoff=60)
    cache.claims.not_served = True  # as its list's 404 leaves it
    assert not cache.needs_fresh("team", pod("shared")["spec"])
    assert cache.for_review("team", pod("shared")["spec"]) is cache
    assert api.gets == []
