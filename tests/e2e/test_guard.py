"""The guard policy compiled, cost-checked and evaluated by the API server itself ("fail open, guard closed")."""

from __future__ import annotations

import json

from kubernetes import client

from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess


def test_api_server_accepts_the_policy_and_its_binding(cluster: ControlPlane, gpufence: WebhookProcess):
    policy = json.loads(cluster.kubectl("get", "validatingadmissionpolicy", "gpufence-guard", "-o", "json").stdout)
    # The API server type-checks every expression and reports problems in status.typeChecking.
    kube.wait_for(lambda: json.loads(cluster.kubectl(
        "get", "validatingadmissionpolicy", "gpufence-guard", "-o", "json").stdout).get("status", {})
        .get("observedGeneration") == policy["metadata"]["generation"], "the policy's type check")
    status = json.loads(cluster.kubectl("get", "validatingadmissionpolicy", "gpufence-guard", "-o", "json").stdout)
    warnings = status["status"].get("typeChecking", {}).get("expressionWarnings", [])
    assert warnings == [], warnings
    binding = json.loads(cluster.kubectl("get", "validatingadmissionpolicybinding", "gpufence-guard",
                                         "-o", "json").stdout)
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_with_the_webhook_down_only_unenforced_gpu_pods_are_refused(
    admin: client.ApiClient, webhook: WebhookProcess, opted_in: str, not_opted_in: str,
):
    webhook.stop("KILL")  # failurePolicy Ignore: the API server admits without the webhook
    gpu = kube.create_pod(admin, opted_in, kube.gpu_pod())
    assert not gpu.admitted
    assert gpu.status == 403
    assert "gpufence-guard" in gpu.message
    assert "has no gpufence-enforcer sidecar" in gpu.message
    assert "shareProcessNamespace" in gpu.message

    plain = kube.create_pod(admin, opted_in, kube.plain_pod())
    assert plain.admitted, plain.message
    elsewhere = kube.create_pod(admin, not_opted_in, kube.gpu_pod())
    assert elsewhere.admitted, elsewhere.message
    assert not kube.is_mutated(elsewhere.obj)

    webhook.start()
    again = kube.create_pod(admin, opted_in, kube.gpu_pod())
    assert again.admitted, again.message
    assert kube.is_mutated(again.obj)


def test_opt_out_is_the_namespace_admins_choice(admin: client.ApiClient, webhook: WebhookProcess, opted_in: str):
    """A pod's opt-out label counts only where the namespace allows it, for webhook and guard alike."""
    opted_out = kube.gpu_pod(labels={"gpufence.io/inject": "false"})
    refused = kube.create_pod(admin, opted_in, opted_out)
    assert not refused.admitted and "gpufence.io/allow-opt-out" in refused.message, refused.message

    lenient = kube.create_namespace(admin, "lenient", kube.OPT_IN, annotations={"gpufence.io/allow-opt-out": "true"})
    created = kube.wait_for(lambda: (c := kube.create_pod(admin, lenient, kube.gpu_pod(
        labels={"gpufence.io/inject": "false"}))).admitted and c, "the namespace annotation to reach the webhook")
    assert not kube.is_mutated(created.obj)

    webhook.stop("KILL")  # the guard alone must draw the same line
    assert kube.create_pod(admin, lenient, kube.gpu_pod(labels={"gpufence.io/inject": "false"})).admitted
    guarded = kube.create_pod(admin, opted_in, kube.gpu_pod(labels={"gpufence.io/inject": "false"}))
    assert not guarded.admitted and "gpufence-guard" in guarded.message, guarded.message


def test_mirror_pods_are_not_the_guards_business(admin: client.ApiClient, webhook: WebhookProcess, opted_in: str):
    mirror = kube.gpu_pod(annotations={"kubernetes.io/config.mirror": "abc"})
    created = kube.create_pod(admin, opted_in, mirror)
    # The API server only lets a node create mirror pods; what matters is that a refusal, if any,
    # is not the guard's.
    assert created.admitted or "gpufence-guard" not in created.message, created.message
