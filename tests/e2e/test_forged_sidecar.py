"""A sidecar of the pod author's own making while the webhook is down, judged by the API server's CEL.

The forgeries start from a pod the webhook really mutated (right image, command, status
annotation), stored by the API server; each weakens one thing. The real kube-apiserver evaluates
the guard (with Kubernetes' own strings, regex and quantity libraries, which the unit tests only
stand in for) and must refuse every forgery and admit the untouched copy.
"""

from __future__ import annotations

import copy
from typing import Any

from kubernetes import client

from tests.e2e import kube
from tests.e2e.gpufence_install import WebhookProcess
from tests.unit.guard.test_forged_sidecar import CEILINGS, FORGERIES, sidecar_of

# Most of the unit tests' forgeries (tests/unit/guard/test_forged_sidecar.py runs them all with cel-python).
CHOSEN = ("audit mode", "share above the ceiling", "compute above the ceiling", "more GPUs than requested",
          "container twice", "LD_PRELOAD", "no GPUs for NVML", "args", "mount over the code")


def _has_config(pod: dict[str, Any]) -> bool:
    """Mutated, with a config: the webhook saw the namespace (else it denies or skips)."""
    return kube.is_mutated(pod) and any(e["name"] == "GPUFENCE_CONFIG" for e in sidecar_of(pod)["env"])


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

    for name in CHOSEN:
        forge, expected = FORGERIES[name]
        forged = copy.deepcopy(template)
        forged["metadata"]["name"] = kube.unique("forged")
        forge(forged)
        result = kube.create_pod(admin, namespace, forged)
        assert not result.admitted, f"{name}: admitted"
        assert result.status == 403 and "gpufence-guard" in result.message, (name, result.message)
        assert expected in result.message, (name, result.message)
