"""KAI-Scheduler's GPU fractions through the real API server, as a tenant (``edit``) submits them.

A pod of KAI's scheduler with its ``gpu-fraction`` or ``gpu-memory`` annotation gets its GPU from
KAI (``NVIDIA_VISIBLE_DEVICES`` from a ConfigMap that KAI's admission webhook names and its binder
fills), not from a resource: the webhook (gpufence/webhook/core/kai.py) takes that container for a GPU
container whose memory share is KAI's request, within the namespace's ceilings, and never strips or
refuses KAI's variable.
"""

from __future__ import annotations

from typing import Any

from gpufence.contract import ENV_CONFIG, SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.kube import container, enforcer_config
from tests.e2e.tenant import Tenant

KAI_CONFIGMAP = "train-x7k2p9q-shared-gpu-0"  # as KAI's admission webhook names it for containers[0]


def kai_pod(annotations: dict[str, str], *, scheduler: str | None = "kai-scheduler",
            after_kai: bool = True, voided: bool = False) -> dict[str, Any]:
    """A training pod that asks KAI-Scheduler for a fraction, beside a log shipper. ``after_kai``:
    as KAI's admission webhook leaves it (its ConfigMap variables in the trainer); ``voided``: the
    log shipper with the NVIDIA_VISIBLE_DEVICES=void the webhook gives it."""
    pod = kube.gpu_pod(annotations=dict(annotations))
    trainer = pod["spec"]["containers"][0]
    del trainer["resources"]["limits"]
    if after_kai:
        trainer["env"] += [
            {"name": name, "valueFrom": {"configMapKeyRef": {"name": KAI_CONFIGMAP, "key": name}}}
            for name in ("NVIDIA_VISIBLE_DEVICES", "RUNAI_NUM_OF_GPUS", "GPU_PORTION")]
        trainer["envFrom"] = [{"configMapRef": {"name": KAI_CONFIGMAP + "-evar", "optional": False}}]
        pod["metadata"]["annotations"]["runai/shared-gpu-configmap"] = KAI_CONFIGMAP.removesuffix("-0")
    logs: dict[str, Any] = {"name": "logs", "image": "example.com/fluent-bit:3"}
    if voided:
        logs["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    pod["spec"]["containers"].append(logs)
    if scheduler is not None:
        pod["spec"]["schedulerName"] = scheduler
    return pod


def resubmitted(stored: dict[str, Any]) -> dict[str, Any]:
    """The stored pod as a tenant could submit it again, with a name of its own."""
    pod = kube.without_server_fields(stored)
    pod["metadata"]["name"] = kube.unique("copy")
    pod["spec"].pop("nodeName", None)
    return pod


def with_config(pod: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    for entry in container(pod, SIDECAR_NAME)["env"]:
        if entry["name"] == ENV_CONFIG:
            assert old in entry["value"]
            entry["value"] = entry["value"].replace(old, new)
    return pod


def test_a_kai_fraction_gets_its_share_and_keeps_kai_s_device(tenant: Tenant, webhook: WebhookProcess):
    """The tenant's namespace has ceilings of 8Gi of memory and 25% of compute (tests/e2e/tenant.py)."""
    created = kube.create_pod(tenant.api, tenant.namespace, kai_pod({"gpu-memory": "4000"}))
    assert created.admitted, created.message
    stored = created.obj
    assert kube.is_mutated(stored)
    trainer = kube.env_of(container(stored, "trainer"))
    assert trainer["NVIDIA_VISIBLE_DEVICES"] == {"configMapKeyRef": {"name": KAI_CONFIGMAP,
                                                                     "key": "NVIDIA_VISIBLE_DEVICES"}}
    assert container(stored, "trainer")["envFrom"] == [{"configMapRef": {"name": KAI_CONFIGMAP + "-evar",
                                                                         "optional": False}}]
    assert kube.env_of(container(stored, "logs"))["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert enforcer_config(stored)["containers"] == {
        "trainer": {"computePercent": 25, "gpus": 1, "memoryBytes": 4000 << 20}}

    # A fraction against a ceiling in bytes: both apply, the smaller on each GPU; two GPUs.
    created = kube.create_pod(tenant.api, tenant.namespace,
                              kai_pod({"gpu-fraction": "0.5", "gpu-fraction-num-devices": "2"}))
    assert created.admitted, created.message
    assert enforcer_config(created.obj)["containers"] == {
        "trainer": {"computePercent": 25, "gpus": 2, "memoryBytes": 8 << 30, "memoryPercent": 50}}

    # Above the ceiling: denied, naming KAI's annotation, the ceiling and what it accepts.
    refused = kube.create_pod(tenant.api, tenant.namespace, kai_pod({"gpu-memory": "10000"}))
    assert not refused.admitted
    for needle in ('annotation gpu-memory="10000"', "gpufence.io/max-memory", 'gpu-memory: "8192"'):
        assert needle in refused.message

    # KAI's variable in a pod of another scheduler is no fraction of KAI's: a side door, refused.
    refused = kube.create_pod(tenant.api, tenant.namespace, kai_pod({"gpu-memory": "4000"}, scheduler=None))
    assert not refused.admitted and 'container "trainer" sets NVIDIA_VISIBLE_DEVICES' in refused.message

    # Submitted before KAI's webhook ran: the same share, and no void for KAI to replace.
    created = kube.create_pod(tenant.api, tenant.namespace, kai_pod({"gpu-fraction": "0.25"}, after_kai=False))
    assert created.admitted, created.message
    assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(container(created.obj, "trainer"))
    assert enforcer_config(created.obj)["containers"]["trainer"]["memoryPercent"] == 25


def test_a_kai_fraction_is_held_to_its_request_and_refused_while_the_webhook_is_down(
        tenant: Tenant, webhook: WebhookProcess):
    created = kube.create_pod(tenant.api, tenant.namespace, kai_pod({"gpu-memory": "4000"}))
    assert created.admitted, created.message
    injected = created.obj
    # What the webhook made is what it makes again; a config with more memory than KAI's request
    # is rebuilt to the request.
    again = kube.create_pod(tenant.api, tenant.namespace, resubmitted(injected))
    assert again.admitted and enforcer_config(again.obj) == enforcer_config(injected), again.message
    forged = with_config(resubmitted(injected), f'"memoryBytes":{4000 << 20}', f'"memoryBytes":{6000 << 20}')
    rebuilt = kube.create_pod(tenant.api, tenant.namespace, forged)
    assert rebuilt.admitted and enforcer_config(rebuilt.obj) == enforcer_config(injected), rebuilt.message
    # KAI's annotation without KAI's scheduler is a plain pod: admitted with void, no sidecar.
    plain = kai_pod({"gpu-fraction": "0.5"}, scheduler=None, after_kai=False)
    admitted = kube.create_pod(tenant.api, tenant.namespace, plain)
    assert admitted.admitted and not kube.is_mutated(admitted.obj), admitted.message
    assert kube.env_of(container(admitted.obj, "trainer"))["NVIDIA_VISIBLE_DEVICES"] == "void"

    webhook.stop("KILL")  # failurePolicy Fail: the API server refuses what gpufence cannot judge
    for pod in (kai_pod({"gpu-memory": "4000"}, voided=True), resubmitted(injected)):
        down = kube.create_pod(tenant.api, tenant.namespace, pod)
        assert kube.outage_problem(down) is None, down.message
