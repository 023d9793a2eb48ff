"""ResourceQuota and LimitRanger in an opted-in namespace: the injected sidecar must not break them.

A quota on ``limits.cpu`` / ``limits.memory`` makes the API server refuse any pod with a container
(init containers included) that sets no such limit, unless a LimitRange supplies a default. Teams
that share GPUs usually have exactly such quotas, so a sidecar without limits would make every GPU
pod in those namespaces fail.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.gpufence_install import WebhookProcess


@pytest.mark.parametrize("with_limit_range", [False, True], ids=["quota-only", "quota-and-limitrange"])
def test_mutated_pod_is_admitted_under_a_limits_quota(admin: client.ApiClient, webhook: WebhookProcess,
                                                     with_limit_range: bool):
    namespace = kube.create_namespace(admin, "quota", kube.OPT_IN)
    core = client.CoreV1Api(admin)
    core.create_namespaced_resource_quota(namespace, {
        "metadata": {"name": "team"},
        "spec": {"hard": {"limits.cpu": "64", "limits.memory": "256Gi", "requests.nvidia.com/gpu": "4"}},
    })
    if with_limit_range:
        core.create_namespaced_limit_range(namespace, {
            "metadata": {"name": "defaults"},
            "spec": {"limits": [{"type": "Container", "default": {"cpu": "1", "memory": "1Gi"},
                                 "defaultRequest": {"cpu": "100m", "memory": "128Mi"}}]},
        })
    # The quota controller must have computed status before the quota admits anything.
    kube.wait_for(lambda: core.read_namespaced_resource_quota("team", namespace).status.hard, "quota status")

    pod = kube.gpu_pod(limits={"cpu": "2", "memory": "8Gi"})
    created = kube.create_pod(admin, namespace, pod)
    assert created.admitted, created.message
    assert kube.is_mutated(created.obj)
    sidecar = created.obj["spec"]["initContainers"][0]
    assert sidecar["name"] == SIDECAR_NAME
    assert {"cpu", "memory"} <= set(sidecar["resources"]["limits"])

    used = kube.wait_for(lambda: core.read_namespaced_resource_quota("team", namespace).status.used.get("limits.cpu")
                         not in (None, "0") and core.read_namespaced_resource_quota("team", namespace).status.used,
                         "quota usage")
    assert used["requests.nvidia.com/gpu"] == "1"
