"""The client side of the AdmissionReview wire format: what the demo, the benchmarks and the tests
send and read. The server's decision code (``webhook.core.admission``) never imports it.
"""

from __future__ import annotations

import base64
import json
from typing import Any


def pod_admission_review(
    pod: Any,
    *,
    uid: str,
    namespace: str = "default",
    operation: str = "CREATE",
    kind: str = "Pod",
    username: str = "system:serviceaccount:kube-system:replicaset-controller",
    sub_resource: str | None = None,
    old_object: Any = None,
) -> dict[str, Any]:
    """An AdmissionReview request for ``pod`` shaped as the API server sends it (admission.k8s.io/v1);
    ``sub_resource`` and ``old_object`` for an UPDATE such as ``pods/ephemeralcontainers``."""
    gvk = {"group": "", "version": "v1", "kind": kind}
    gvr = {"group": "", "version": "v1", "resource": kind.lower() + "s"}
    review: dict[str, Any] = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": username, "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": pod,
            "oldObject": old_object,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "UpdateOptions" if operation == "UPDATE" else
                        "CreateOptions"},
        },
    }
    if sub_resource:
        review["request"]["subResource"] = sub_resource
        review["request"]["requestSubResource"] = sub_resource
    return review


def decode_patch(response: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The JSON Patch of an AdmissionReview response, or None when it carries none."""
    if "patch" not in response:
        return None
    if response.get("patchType") != "JSONPatch":
        raise ValueError(f"unexpected patchType {response.get('patchType')!r}")
    return json.loads(base64.b64decode(response["patch"]))
