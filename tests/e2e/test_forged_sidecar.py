"""A sidecar of the pod author's own making while the webhook is down, judged by the API server's CEL.

The forgeries start from a pod the webhook really mutated (right image, command, status
annotation), stored by the API server; each weakens one thing. The real kube-apiserver evaluates
the guard (with Kubernetes' own strings, regex and quantity libraries, which the unit tests only
stand in for) and must refuse every forgery and admit the untouched copy.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from kubernetes import client

from tests.e2e import kube
from tests.e2e.gpufence_install import WebhookProcess
from webhook.settings import SIDECAR_NAME

CEILINGS = {"gpufence.io/max-memory": "20Gi", "gpufence.io/max-compute": "50"}
GIB = 1 << 30


def _sidecar(pod: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = [c for c in pod["spec"].get("initContainers", []) if c["name"] == SIDECAR_NAME]
    return sidecar


def _config(pod: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> None:
    for entry in _sidecar(pod)["env"]:
        if entry["name"] == "GPUFENCE_CONFIG":
            doc = json.loads(entry["value"])
            change(doc)
            entry["value"] = json.dumps(doc, separators=(",", ":"), sort_keys=True)


def _env(pod: dict[str, Any], name: str, value: str) -> None:
    env = _sidecar(pod)["env"]
    env[:] = [e for e in env if e["name"] != name] + [{"name": name, "value": value}]


def _twice(pod: dict[str, Any]) -> None:
    """A small share first and the real one after: JSON keeps the last, a regex would read the first."""
    (value,) = [e["value"] for e in _sidecar(pod)["env"] if e["name"] == "GPUFENCE_CONFIG"]
    small = '"containers":{"trainer":{"memoryBytes":1073741824},'
    _env(pod, "GPUFENCE_CONFIG", value.replace('"containers":{', small, 1))


def _has_config(pod: dict[str, Any]) -> bool:
    """Mutated, with a config: the webhook saw the namespace (else it denies or skips)."""
    return kube.is_mutated(pod) and any(e["name"] == "GPUFENCE_CONFIG" for e in _sidecar(pod)["env"])


FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "audit mode": (lambda p: _config(p, lambda d: d.update(mode="audit")), "asks for audit mode"),
    "share above the byte ceiling": (
        lambda p: _config(p, lambda d: d["containers"]["trainer"].update(memoryBytes=30 * GIB)),
        "no memory share within the namespace's ceiling 20Gi"),
    "compute above the ceiling": (
        lambda p: _config(p, lambda d: d["containers"]["trainer"].update(computePercent=90)),
        "no compute share within the namespace's ceiling 50"),
    "more GPUs than requested": (
        lambda p: _config(p, lambda d: d["containers"]["trainer"].update(gpus=8)),
        "not the number of GPUs it requested"),
    "the container twice": (_twice, 'container "trainer" is not in it exactly once'),
    "LD_PRELOAD": (lambda p: _env(p, "LD_PRELOAD", "/tmp/fake.so"), "changes what the enforcer loads"),
    "no GPUs for NVML": (lambda p: _env(p, "NVIDIA_VISIBLE_DEVICES", "void"), "NVML would not see the GPUs"),
    "args": (lambda p: _sidecar(p).update(args=["--config", "/tmp/weak.json"]), "it has args"),
}


def test_with_the_webhook_down_a_forged_sidecar_is_refused_by_the_api_server(
    admin: client.ApiClient, webhook: WebhookProcess,
):
    namespace = kube.create_namespace(admin, "ceil", kube.OPT_IN, annotations=CEILINGS)
    # The webhook learns of the new namespace from a watch: wait until it mutates there.
    real = kube.wait_for(lambda: (c := kube.create_pod(admin, namespace, kube.gpu_pod(
        annotations={"gpufence.io/memory": "4Gi", "gpufence.io/compute": "50"}), dry_run=True)).admitted
        and _has_config(c.obj) and c, "the webhook to see the new namespace")
    assert kube.is_mutated(real.obj)
    template = kube.without_server_fields(real.obj)
    template["metadata"].pop("name")
    template["spec"].pop("nodeName", None)

    webhook.stop("KILL")  # failurePolicy Ignore: only the guard stands between the pod and the cluster
    copied = copy.deepcopy(template)
    copied["metadata"]["name"] = kube.unique("copy")
    untouched = kube.create_pod(admin, namespace, copied)
    assert untouched.admitted, untouched.message  # a true copy of an injection is what the webhook makes

    for name, (forge, expected) in FORGERIES.items():
        forged = copy.deepcopy(template)
        forged["metadata"]["name"] = kube.unique("forged")
        forge(forged)
        result = kube.create_pod(admin, namespace, forged)
        assert not result.admitted, f"{name}: admitted"
        assert result.status == 403 and "gpufence-guard" in result.message, (name, result.message)
        assert expected in result.message, (name, result.message)
