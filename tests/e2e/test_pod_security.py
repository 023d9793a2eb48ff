"""Pod Security Admission's own verdict on mutated pods, level by level.

The expectations are what docs/install.md ("Pod Security of the namespaces you opt in") promises;
the API server's PodSecurity plugin is the oracle. Each workload pod is itself compliant with the
level under test, so a refusal can only come from what gpufence injected.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.e2e import kube
from tests.e2e.gpufence_install import WebhookProcess

# (level, workload runs as a set non-root user) -> does the mutated pod pass?  Keep in step with
# docs/install.md.
DOCUMENTED = {
    ("privileged", False): True,  # root sidecar: drop ALL, add KILL and SYS_PTRACE
    ("privileged", True): True,  # root sidecar too (runAsUser: 0, runAsNonRoot: false of its own)
    ("baseline", False): True,  # root sidecar: the runtime's defaults plus KILL, no SYS_PTRACE
    ("baseline", True): True,  # the GPU containers' user, defaults plus KILL
    # The image's user (no runAsUser): gpufence refuses it itself, before Pod Security would.
    ("restricted", False): False,
    ("restricted", True): True,  # the GPU containers' non-root user, drop ALL, RuntimeDefault seccomp
}


@pytest.mark.parametrize(("level", "non_root"), sorted(DOCUMENTED))
def test_mutated_pod_meets_the_documented_pod_security_level(
    admin: client.ApiClient, webhook: WebhookProcess, level: str, non_root: bool,
):
    namespace = kube.create_namespace(admin, f"pss-{level}", {
        **kube.OPT_IN, "pod-security.kubernetes.io/enforce": level,
        "pod-security.kubernetes.io/enforce-version": "latest",
    }, annotations={"gpufence.io/allow-opt-out": "true"})  # for the workload-alone check below
    webhook.wait_until_known(namespace)  # else it would miss the level and the opt-out of the new namespace
    pod = kube.gpu_pod(restricted=non_root)
    # The workload alone passes the level (checked with the webhook out of the picture).
    alone = kube.create_pod(admin, namespace, {**pod, "metadata": {**pod["metadata"],
                            "labels": {"gpufence.io/inject": "false"}}}, dry_run=True)
    if level != "restricted" or non_root:
        assert alone.admitted, f"test workload itself violates {level}: {alone.message}"

    created = kube.create_pod(admin, namespace, pod)
    expected = DOCUMENTED[(level, non_root)]
    if expected:
        assert created.admitted, created.message
        assert kube.is_mutated(created.obj)
    else:
        assert not created.admitted, "docs/install.md says this level rejects mutated pods: update it"
        # gpufence's own denial, naming the field: the non-root sidecar cannot be given an unknown user.
        assert created.status == 400 and "spec.securityContext.runAsUser" in created.message, created.message
