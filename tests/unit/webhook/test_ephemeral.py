"""Ephemeral containers (UPDATE of pods/ephemeralcontainers): the webhook voids the new ones only.

The golden cases tests/golden/ephemeral-*.in.yaml show the mutation; these check the routing (which
requests take this path), malformed input, and that a pod UPDATE of any other kind is still skipped.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from gpufence.webhook.client import decode_patch, pod_admission_review
from gpufence.webhook.core.admission import new_ephemeral_names, review
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings, NamespaceInfo

S = InjectionSettings()


class _Unknown:
    def get(self, name: str) -> NamespaceInfo | None:
        return None


def pod(*ephemeral: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "web", "image": "nginx"}]}
    if ephemeral:
        spec["ephemeralContainers"] = list(ephemeral)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": "ns"}, "spec": spec}


DEBUG = {"name": "debugger", "image": "nvidia/cuda:12.4.1-base-ubuntu22.04"}


def ephemeral_review(new: Any, old: Any, *, sub_resource: str | None = "ephemeralcontainers",
                     operation: str = "UPDATE") -> dict[str, Any]:
    return pod_admission_review(new, uid="u", namespace="ns", operation=operation, sub_resource=sub_resource,
                                old_object=old, username="system:serviceaccount:ns:tenant")


def test_a_new_ephemeral_container_gets_the_void_and_nothing_else_changes() -> None:
    new, old = pod(DEBUG), pod()
    result = review(ephemeral_review(new, old), S, AllNamespacesOptedIn())
    assert result.outcome == "mutated"
    patched = jsonpatch.apply_patch(new, decode_patch(result.review["response"]))
    assert patched["spec"]["ephemeralContainers"] == [
        {**DEBUG, "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]
    assert {k: v for k, v in patched["spec"].items() if k != "ephemeralContainers"} == old["spec"]


def test_void_off_does_not_spare_ephemeral_containers() -> None:
    result = review(ephemeral_review(pod(DEBUG), pod()), InjectionSettings(void_non_gpu_containers=False),
                    AllNamespacesOptedIn())
    assert result.outcome == "mutated"


def test_a_namespace_not_yet_in_the_cache_is_treated_as_opted_in() -> None:
    # The API server's namespaceSelector sent it, so it is opted in.
    assert review(ephemeral_review(pod(DEBUG), pod()), S, _Unknown()).outcome == "mutated"


def test_existing_ephemeral_containers_are_left_as_they_are() -> None:
    old = pod({"name": "earlier", "image": "busybox"})
    new = pod({"name": "earlier", "image": "busybox"}, DEBUG)
    assert new_ephemeral_names(new, old) == ["debugger"]
    patch = decode_patch(review(ephemeral_review(new, old), S, AllNamespacesOptedIn()).review["response"])
    assert patch is not None and all(op["path"].startswith("/spec/ephemeralContainers/1") for op in patch)


def test_a_reviewed_output_is_a_fixed_point() -> None:
    new, old = pod(DEBUG), pod()
    first = review(ephemeral_review(new, old), S, AllNamespacesOptedIn())
    patched = jsonpatch.apply_patch(copy.deepcopy(new), decode_patch(first.review["response"]))
    again = review(ephemeral_review(patched, old), S, AllNamespacesOptedIn())
    assert again.outcome == "unchanged" and "patch" not in again.review["response"]


@pytest.mark.parametrize(("sub_resource", "operation"), [
    (None, "UPDATE"),  # a pod UPDATE: images, labels; the protect policy judges it, not the webhook
    ("status", "UPDATE"),
    ("ephemeralcontainers", "CREATE"),
    ("resize", "UPDATE"),
])
def test_other_updates_are_skipped(sub_resource: str | None, operation: str) -> None:
    result = review(ephemeral_review(pod(DEBUG), pod(), sub_resource=sub_resource, operation=operation), S,
                    AllNamespacesOptedIn())
    assert result.outcome == "skipped"


@pytest.mark.parametrize(("new", "old", "needle"), [
    ("not a pod", None, "request.object must be a Pod object"),
    ({"spec": {"ephemeralContainers": "x"}}, None, "object.spec.ephemeralContainers must be a list"),
    ({"spec": {"ephemeralContainers": [{"image": "x"}]}}, None, "ephemeralContainers[0] must be an object"),
    ({"spec": {"ephemeralContainers": [{"name": "d", "env": ["x"]}]}}, None, "[0].env must be a list of objects"),
    (pod(DEBUG), {"spec": []}, "oldObject.spec must be an object"),
])
def test_malformed_requests_are_denied_with_the_field(new: Any, old: Any, needle: str) -> None:
    result = review(ephemeral_review(new, old), S, AllNamespacesOptedIn())
    assert result.outcome == "denied"
    assert needle in result.review["response"]["status"]["message"]
