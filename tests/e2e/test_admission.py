"""Pods created through the real API server: what is stored is exactly the contract's mutation, or none.

The API server defaults and canonicalises the pod before calling the webhook, applies its JSON
Patch, validates the result, calls verify.gpufence.io and stores it; these tests read back what was
stored. Each stored GPU pod is then sent back to the running webhook as the API server would on a
reinvocation: the answer must be "no patch" (otherwise a webhook fights the API server's own
canonical forms).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from gpufence.contract import ANNOTATION_STATUS, POST_START_COMMAND, PROBE_COMMAND, SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.gpufence_install import WebhookProcess


def assert_contract_mutation(pod: dict[str, Any], gpu_containers: set[str]) -> None:
    spec = pod["spec"]
    assert spec["shareProcessNamespace"] is True
    inits = spec.get("initContainers", [])
    assert inits and inits[0]["name"] == SIDECAR_NAME, "the enforcer must be the first init container"
    sidecar = inits[0]
    assert sidecar.get("restartPolicy") == "Always", "a native sidecar"
    sidecar_env = kube.env_of(sidecar)
    config = json.loads(sidecar_env["GPUFENCE_CONFIG"])
    assert set(config["containers"]) == gpu_containers
    for container in spec["containers"]:
        env = kube.env_of(container)
        if container["name"] in gpu_containers:
            assert env["GPUFENCE_CONTAINER"] == container["name"]
        else:
            assert "GPUFENCE_CONTAINER" not in env
    status = json.loads(pod["metadata"]["annotations"][ANNOTATION_STATUS])
    assert status, "the status annotation records what was injected"


def assert_stable(hook: WebhookProcess, namespace: str, stored: dict[str, Any]) -> None:
    patch = hook.patch_for(namespace, kube.without_server_fields(stored))
    assert patch is None, f"the webhook would patch its own stored output again: {patch}"


def test_gpu_pod_by_name_is_mutated_and_stable(admin: client.ApiClient, opted_in: str, webhook: WebhookProcess):
    pod = kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi", "gpufence.io/compute": "50"})
    created = kube.create_pod(admin, opted_in, pod)
    assert created.admitted, created.message
    stored = created.obj
    assert_contract_mutation(stored, {"trainer"})
    # The user's own settings survive untouched.
    trainer = stored["spec"]["containers"][0]
    assert kube.env_of(trainer)["EPOCHS"] == "3"
    assert trainer["resources"]["requests"]["cpu"] == "500m"  # canonicalised by the API server
    assert_stable(webhook, opted_in, stored)


def test_generate_name_pod_is_mutated(admin: client.ApiClient, opted_in: str, webhook: WebhookProcess):
    created = kube.create_pod(admin, opted_in, kube.gpu_pod(generate_name="train-"))
    assert created.admitted, created.message
    assert created.obj["metadata"]["name"].startswith("train-")
    assert_contract_mutation(created.obj, {"trainer"})
    assert_stable(webhook, opted_in, created.obj)


def test_pod_in_unlabelled_namespace_is_stored_as_written(admin: client.ApiClient, not_opted_in: str,
                                                          webhook: WebhookProcess):
    created = kube.create_pod(admin, not_opted_in, kube.gpu_pod())
    assert created.admitted, created.message
    assert not kube.is_mutated(created.obj)
    assert ANNOTATION_STATUS not in (created.obj["metadata"].get("annotations") or {})


def test_non_gpu_pod_in_opted_in_namespace_is_untouched(admin: client.ApiClient, opted_in: str,
                                                        webhook: WebhookProcess):
    created = kube.create_pod(admin, opted_in, kube.plain_pod())
    assert created.admitted, created.message
    assert not kube.is_mutated(created.obj)


def test_bad_share_is_denied_with_the_webhooks_message(admin: client.ApiClient, opted_in: str,
                                                       webhook: WebhookProcess):
    created = kube.create_pod(admin, opted_in, kube.gpu_pod(annotations={"gpufence.io/memory": "lots"}))
    assert not created.admitted
    assert created.status == 400
    assert 'gpufence.io/memory="lots"' in created.message and "8Gi" in created.message


def _controller_pods(admin: client.ApiClient, namespace: str, selector: str, count: int) -> list[dict[str, Any]]:
    core = client.CoreV1Api(admin)

    def pods() -> list[dict[str, Any]] | None:
        items = admin.sanitize_for_serialization(core.list_namespaced_pod(namespace, label_selector=selector).items)
        return items if len(items) >= count else None

    return kube.wait_for(pods, f"{count} pods with {selector} in {namespace}")


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_pods_made_by_controllers_are_mutated(admin: client.ApiClient, opted_in: str, webhook: WebhookProcess,
                                              kind: str):
    template = kube.gpu_pod("ignored", annotations={"gpufence.io/memory": "4Gi"}, labels={"app": kind.lower()})
    template["metadata"].pop("name")
    template.pop("apiVersion")
    template.pop("kind")
    if kind == "Deployment":
        body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "trainer"},
                "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "deployment"}}, "template": template}}
        path = f"/apis/apps/v1/namespaces/{opted_in}/deployments"
    else:
        template["spec"]["restartPolicy"] = "Never"
        body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "trainer"},
                "spec": {"parallelism": 2, "completions": 2, "template": template}}
        path = f"/apis/batch/v1/namespaces/{opted_in}/jobs"
    created = kube.create(admin, path, body)
    assert created.admitted, created.message
    pods = _controller_pods(admin, opted_in, f"app={kind.lower()}", 2)
    for pod in pods:
        assert_contract_mutation(pod, {"trainer"})
        assert pod["metadata"]["ownerReferences"][0]["kind"] in ("ReplicaSet", "Job")
        assert_stable(webhook, opted_in, pod)


def test_reinvocation_after_the_service_account_plugin_keeps_its_token_mount(
    admin: client.ApiClient, opted_in: str, webhook: WebhookProcess,
):
    """The API server re-runs its ServiceAccount plugin after a webhook adds a container (mounting the
    token into the sidecar), then reinvokes gpufence (reinvocationPolicy IfNeeded). gpufence must
    answer that second call with no patch; removing the mount would leave the enforcer without
    credentials to post Events."""
    before = webhook.request_counts()
    created = kube.create_pod(admin, opted_in, kube.gpu_pod())
    assert created.admitted, created.message
    after = webhook.request_counts()
    sidecar = created.obj["spec"]["initContainers"][0]
    mounts = {m["mountPath"] for m in sidecar.get("volumeMounts", [])}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts, sidecar.get("volumeMounts")
    assert after["mutated"] - before["mutated"] == 1, (before, after)
    # gpufence mounts the token itself, so the ServiceAccount plugin changes nothing and the API
    # server has no reason to reinvoke: one call per pod.
    assert after["unchanged"] - before["unchanged"] == 0, (before, after)


def test_host_network_pod_gets_a_sidecar_that_binds_no_fixed_port(admin: client.ApiClient, opted_in: str,
                                                                    webhook: WebhookProcess):
    pod = kube.gpu_pod(annotations={"gpufence.io/memory": "8Gi"})
    pod["spec"]["hostNetwork"] = True
    created = kube.create_pod(admin, opted_in, pod)
    assert created.admitted, created.message
    sidecar = created.obj["spec"]["initContainers"][0]
    assert "ports" not in sidecar
    # The probes read the enforcer's heartbeat, whatever port it bound (and the API server keeps them as injected).
    assert sidecar["livenessProbe"]["exec"]["command"] == list(PROBE_COMMAND), sidecar["livenessProbe"]
    assert sidecar["lifecycle"]["postStart"]["exec"]["command"] == list(POST_START_COMMAND), sidecar["lifecycle"]
    assert kube.env_of(sidecar)["GPUFENCE_METRICS_PORT"] == "0"
    assert_stable(webhook, opted_in, created.obj)
