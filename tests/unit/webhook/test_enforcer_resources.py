"""What a GPU pod's workloads may not touch: the enforcer's volumes and port (podshape.sidecar_resource_use,
through the admission review), and who may send a mirror pod past the injection."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gpufence.contract import MIRROR_POD_ANNOTATION, SIDECAR_NAME
from gpufence.webhook import client
from gpufence.webhook.core import admission
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings


def gpu_pod(**container: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team-a"},
            "spec": {"containers": [{"name": "train", "image": "cuda:12",
                                     "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                                    {"name": "helper", "image": "busybox", **container}]}}


def decide(pod: dict[str, Any], settings: InjectionSettings | None = None,
           username: str = "system:serviceaccount:team-a:tenant") -> tuple[str, str]:
    payload = client.pod_admission_review(copy.deepcopy(pod), uid="u", namespace="team-a", username=username)
    result = admission.review(payload, settings or InjectionSettings(), AllNamespacesOptedIn())
    return result.outcome, result.review["response"].get("status", {}).get("message", "")


@pytest.mark.parametrize(("container", "expected"), [
    ({"volumeMounts": [{"name": "gpufence-state", "mountPath": "/x"}]},
     'container "helper" mounts volume "gpufence-state" (spec.containers[1].volumeMounts[0])'),
    ({"volumeMounts": [{"name": "gpufence-host-proc", "mountPath": "/x", "readOnly": True}]},
     'container "helper" mounts volume "gpufence-host-proc"'),
    ({"volumeMounts": [{"name": "gpufence-preload", "mountPath": "/x"}]},
     'container "helper" mounts volume "gpufence-preload" writable'),
    ({"ports": [{"containerPort": 9401, "protocol": "UDP"}]}, 'container "helper" declares port 9401'),
    ({"ports": [{"containerPort": 8080, "name": "gpufence-metric"}]}, 'declares port 8080 ("gpufence-metric")'),
])
def test_a_workload_of_a_gpu_pod_may_not_use_the_enforcers_volumes_or_port(container: dict[str, Any],
                                                                          expected: str) -> None:
    outcome, message = decide(gpu_pod(**container))
    assert outcome == "denied" and expected in message, message


@pytest.mark.parametrize("container", [
    {"volumeMounts": [{"name": "gpufence-preload", "mountPath": "/x", "readOnly": True}]},
    {"ports": [{"containerPort": 9402, "name": "metrics"}]},
    {"volumeMounts": [{"name": "scratch", "mountPath": "/var/run/gpufence"}]},
])
def test_what_is_not_the_enforcers_is_admitted(container: dict[str, Any]) -> None:
    pod = gpu_pod(**container)
    if "volumeMounts" in container and container["volumeMounts"][0]["name"] == "scratch":
        pod["spec"]["volumes"] = [{"name": "scratch", "emptyDir": {}}]
    assert decide(pod)[0] == "mutated"


def test_the_sidecar_itself_is_rebuilt_not_judged() -> None:
    """A copy of an injected pod carries our sidecar with the state mount and the port: not a workload."""
    pod = gpu_pod()
    pod["spec"]["initContainers"] = [{"name": SIDECAR_NAME, "image": "x", "ports": [{"containerPort": 9401}],
                                      "volumeMounts": [{"name": "gpufence-state", "mountPath": "/var/run/gpufence"}]}]
    assert decide(pod)[0] == "mutated"


def test_a_pod_without_a_gpu_is_not_judged() -> None:
    pod = gpu_pod(volumeMounts=[{"name": "gpufence-state", "mountPath": "/x"}])
    del pod["spec"]["containers"][0]["resources"]
    pod["spec"]["volumes"] = [{"name": "gpufence-state", "emptyDir": {}}]
    assert decide(pod)[0] == "mutated"  # only the void


@pytest.mark.parametrize(("username", "outcome"), [
    ("system:node:gpu-1", "skipped"),
    ("system:serviceaccount:team-a:tenant", "mutated"),
    ("system:nodes", "mutated"),
    ("alice", "mutated"),
])
def test_only_a_node_sends_a_mirror_pod_past_the_injection(username: str, outcome: str) -> None:
    pod = gpu_pod()
    pod["metadata"]["annotations"] = {MIRROR_POD_ANNOTATION: "abc"}
    assert decide(pod, username=username)[0] == outcome
