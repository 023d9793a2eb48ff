"""The cluster policy ConfigMap, changed in a real cluster: the webhook follows it without a restart.

The install reads ConfigMap gpufence/gpufence-policy in two places: the webhook watches it
(--policy-configmap, with its own ServiceAccount token) and the protect ValidatingAdmissionPolicy
takes it as params (admin-groups). Each test changes it the way an admin would (a patch through the
API) and waits for the observable effect, with a deadline: a pod above a new ceiling denied by the
webhook, the webhook's own earlier output above it denied too. The webhook process is never
restarted in between. Every test puts the shipped data back.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from kubernetes import client

from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import (
    NAMESPACE,
    POLICY_CONFIGMAP,
    REPO,
    WebhookProcess,
    apply_objects,
    rendered,
)


def shipped_configmap(cluster: ControlPlane, webhook: WebhookProcess) -> dict[str, Any]:
    (obj,) = [o for o in rendered(cluster, REPO / "k8s", webhook.url)
              if o["kind"] == "ConfigMap" and o["metadata"]["name"] == POLICY_CONFIGMAP]
    return obj


def policy_valid(webhook: WebhookProcess) -> bool:
    return webhook.metric_samples("gpufence_webhook_policy_valid") == {"gpufence_webhook_policy_valid": 1.0}


def logged(webhook: WebhookProcess, event: str) -> list[dict[str, Any]]:
    """The webhook's log entries of ``event`` (one JSON object per line)."""
    entries = (json.loads(line) for line in webhook.log().splitlines() if line.startswith("{"))
    return [e for e in entries if e.get("event") == event]


def attempt(admin: client.ApiClient, namespace: str, memory: str) -> kube.Created:
    return kube.create_pod(admin, namespace, kube.gpu_pod(annotations={"gpufence.io/memory": memory}), dry_run=True)


def as_template(created: kube.Created) -> dict[str, Any]:
    """A stored (dry-run) pod, ready to be sent again under another name."""
    assert created.obj is not None
    template = kube.without_server_fields(created.obj)
    template["spec"].pop("nodeName", None)
    return template


def again(admin: client.ApiClient, namespace: str, template: dict[str, Any]) -> kube.Created:
    pod = copy.deepcopy(template)
    pod["metadata"]["name"] = kube.unique("again")
    return kube.create_pod(admin, namespace, pod, dry_run=True)


def test_a_new_ceiling_reaches_the_webhook_without_a_restart(
    admin: client.ApiClient, webhook: WebhookProcess, set_policy: Callable[[dict[str, str]], None],
):
    namespace = kube.create_namespace(admin, "policy", kube.OPT_IN)
    assert webhook.component is not None
    process, starts = webhook.component.process, webhook.starts
    # As shipped there is no cluster ceiling: the webhook mutates a 12Gi share. That output is kept:
    # once the ceiling is lower, it is a forgery.
    big = attempt(admin, namespace, "12Gi")
    assert big.admitted and kube.is_mutated(big.obj), big.message
    above = as_template(big)

    set_policy({"max-memory": "8Gi"})
    # The webhook: above the new ceiling denied by the webhook itself; within it, mutated.
    refused = kube.wait_for(lambda: (c := attempt(admin, namespace, "12Gi")).status == 400 and c,
                            "the webhook to apply max-memory 8Gi", timeout=30)
    assert "memory ceiling" in refused.message and '"8Gi"' in refused.message, refused.message
    within = attempt(admin, namespace, "4Gi")
    assert within.admitted and kube.is_mutated(within.obj), within.message
    assert webhook.starts == starts and process.poll() is None, "the webhook was restarted"
    assert webhook.metric_samples("gpufence_webhook_policy_reloads")["success"] >= 2  # the first read, then this

    # The webhook's own earlier output is now a sidecar above the ceiling: denied like the pod it
    # came from; its output within the ceiling is its own again.
    forged = again(admin, namespace, above)
    assert kube.denied_by(forged) and '"8Gi"' in forged.message, forged.message
    untouched = again(admin, namespace, as_template(within))
    assert untouched.admitted, untouched.message


def test_an_invalid_policy_keeps_the_last_valid_one_in_the_webhook(
    admin: client.ApiClient, webhook: WebhookProcess, set_policy: Callable[[dict[str, str]], None],
):
    namespace = kube.create_namespace(admin, "invalid", kube.OPT_IN)
    assert webhook.component is not None
    process = webhook.component.process
    pod = kube.gpu_pod(annotations={"gpufence.io/memory": "12Gi"})

    set_policy({"max-memory": "8Gi"})
    kube.wait_for(lambda: webhook.review(namespace, pod)["allowed"] is False, "the webhook to apply 8Gi", timeout=30)
    failures = webhook.metric_samples("gpufence_webhook_policy_reloads")["failure"]

    set_policy({"max-memory": "lots"})
    (invalid,) = kube.wait_for(lambda: logged(webhook, "policy_invalid"), "the webhook to log the invalid policy",
                               timeout=30)
    assert invalid["level"] == "error" and 'key "max-memory" has \'lots\'' in invalid["error"], invalid
    assert "keeping the last valid version" in invalid["message"], invalid
    assert webhook.metric_samples("gpufence_webhook_policy_valid") == {"gpufence_webhook_policy_valid": 0.0}
    assert webhook.metric_samples("gpufence_webhook_policy_reloads")["failure"] == failures + 1
    answer = webhook.review(namespace, pod)  # the last valid ceiling still applies
    assert answer["allowed"] is False and '"8Gi"' in answer["status"]["message"], answer
    assert webhook.review(namespace, kube.gpu_pod(annotations={"gpufence.io/memory": "4Gi"}))["allowed"] is True
    webhook.wait_ready(timeout=5)  # still ready: it has a valid policy
    assert process.poll() is None

    set_policy({"max-memory": ""})  # fixed: no ceiling again
    kube.wait_for(lambda: policy_valid(webhook) and webhook.review(namespace, pod)["allowed"] is True,
                  "the webhook to apply the fixed policy", timeout=30)


def test_without_the_policy_configmap_the_webhook_keeps_its_policy_and_running_pods_stay_protected(
    admin: client.ApiClient, webhook: WebhookProcess, set_policy: Callable[[dict[str, str]], None],
):
    """The webhook keeps serving its last valid policy (and says the ConfigMap is gone); the protect
    policy (parameterNotFoundAction: Deny) refuses every update of a pod in an opted-in namespace
    until the ConfigMap is back, and nothing elsewhere."""
    namespace = kube.create_namespace(admin, "nopolicy", kube.OPT_IN)
    stored = kube.create_pod(admin, namespace, kube.gpu_pod())
    assert stored.admitted, stored.message
    name = stored.obj["metadata"]["name"]
    core = client.CoreV1Api(admin)
    client.CoreV1Api(admin).delete_namespaced_config_map(POLICY_CONFIGMAP, NAMESPACE)

    def relabel() -> int:
        try:
            core.patch_namespaced_pod(name, namespace, {"metadata": {"labels": {"step": kube.unique("s")}}})
        except client.ApiException as exc:
            assert "gpufence-protect" in str(exc.body) and "no params found" in str(exc.body), exc.body
            return exc.status
        return 200

    assert kube.wait_for(lambda: relabel() == 422, "the protect policy to miss its params", timeout=30)
    created = kube.create_pod(admin, namespace, kube.gpu_pod(), dry_run=True)
    assert created.admitted and kube.is_mutated(created.obj), created.message
    kube.wait_for(lambda: logged(webhook, "policy_missing"), "the webhook to log the missing ConfigMap", timeout=30)
    assert webhook.metric_samples("gpufence_webhook_policy_valid") == {"gpufence_webhook_policy_valid": 0.0}
    webhook.wait_ready(timeout=5)
    apply_objects(webhook.cp, [shipped_configmap(webhook.cp, webhook)])
    kube.wait_for(lambda: relabel() == 200, "the protect policy to find its params again", timeout=30)
    kube.wait_for(lambda: policy_valid(webhook), "the webhook to read the re-created ConfigMap", timeout=30)
