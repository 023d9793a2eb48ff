"""Annotations that hand out devices are the admin's (issue 38 row 1): in opted-in namespaces the
webhook refuses, GPU pod or not, the annotations a node component turns into device access
(NVIDIA's NRI plugin, CDI, the NRI device injector, CRI-O's devices), unless a member of
admin-groups creates the pod."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from gpufence.contract import INJECTION_ENABLED, INJECTION_LABEL
from gpufence.webhook.client import pod_admission_review
from gpufence.webhook.core.admission import review
from gpufence.webhook.core.device_access import DEVICE_ANNOTATIONS, device_annotation, device_annotation_denial
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo

ADMINS = ("system:masters", "gpufence:admins")
NRI_KEYS = ("nvidia.cdi.k8s.io/container.{name}", "nvidia.cdi.k8s.io/pod", "nvidia.cdi.k8s.io")


@pytest.mark.parametrize("key", [
    "nvidia.cdi.k8s.io", "nvidia.cdi.k8s.io/pod", "nvidia.cdi.k8s.io/container.main", "nvidia.cdi.k8s.io/container.*",
    "cdi.k8s.io/nvidia-device-plugin_GPU-0", "cdi.k8s.io/x", "devices.noderesource.dev/container.a",
    "devices.nri.io", "cdi-devices.noderesource.dev/pod", "cdi-devices.nri.io/container.a", "mounts.noderesource.dev",
    "mounts.nri.io/pod", "io.kubernetes.cri-o.Devices",
])
def test_keys_that_hand_out_devices(key: str) -> None:
    assert device_annotation(key) is not None


@pytest.mark.parametrize("key", [
    "nvidia.cdi.k8s.io.example.com/x", "example.com/nvidia.cdi.k8s.io", "mycdi.k8s.io/x", "cdi.k8s.io.example/x",
    "nvidia.com/gpu", "gpufence.io/memory", "io.kubernetes.cri-o.ShmSize", "devices.example.com/x",
])
def test_keys_that_do_not(key: str) -> None:
    assert device_annotation(key) is None


def test_every_listed_key_names_what_reads_it() -> None:
    assert all(domain and reader for domain, reader in DEVICE_ANNOTATIONS)


def _review(annotations: dict[str, str], containers: list[dict[str, Any]], groups: list[str],
            labels: dict[str, str] | None = None) -> Any:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "team", "annotations": annotations, "labels": labels or {}},
           "spec": {"containers": containers}}
    payload = pod_admission_review(pod, uid="u", namespace="team")
    payload["request"]["userInfo"]["groups"] = groups

    class Lookup:
        def get(self, name: str) -> NamespaceInfo:
            return NamespaceInfo(name, labels={INJECTION_LABEL: INJECTION_ENABLED},
                                 annotations={"gpufence.io/allow-opt-out": "true"})

    return review(payload, InjectionSettings(), Lookup())


GPU = {"name": "gpu", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
PLAIN = {"name": "main", "image": "i"}


@pytest.mark.parametrize("key", NRI_KEYS)
@pytest.mark.parametrize(("containers", "target"), [
    ([PLAIN], "main"),  # a pod without a GPU
    ([GPU, PLAIN], "main"),  # the non-GPU container of a GPU pod
    ([GPU], "gpu"),  # the GPU container: more GPUs than its count
], ids=["non-gpu-pod", "non-gpu-container", "gpu-container"])
def test_the_issues_nine_forms_are_denied_naming_the_key_and_value(key: str, containers: list[dict[str, Any]],
                                                                   target: str) -> None:
    name = key.format(name=target)
    result = _review({name: "nvidia.com/gpu=all"}, containers, ["system:authenticated"])
    assert result.outcome == "denied"
    message = result.review["response"]["status"]["message"]
    assert message.startswith(f'annotation {name}="nvidia.com/gpu=all" (metadata.annotations): ')
    assert "NRI plugin" in message and "admin-groups" in message and 'resources.limits["nvidia.com/gpu"]' in message


def test_opted_out_pods_are_denied_too_and_admins_pass() -> None:
    annotations = {"cdi.k8s.io/x": "nvidia.com/gpu=all"}
    opted_out = {"gpufence.io/inject": "false"}
    assert _review(annotations, [GPU], ["system:authenticated"], opted_out).outcome == "denied"
    assert _review(annotations, [PLAIN], ["system:authenticated"], opted_out).outcome == "denied"
    # Admitted, opted out: only the webhook's record of the admin creator is written (for the node guardian).
    by_admin = _review(annotations, [GPU], ["gpufence:admins"], opted_out)
    assert by_admin.outcome == "mutated"
    assert [op["path"] for op in json.loads(base64.b64decode(by_admin.review["response"]["patch"]))] == [
        "/metadata/annotations/gpufence.io~1admin-device-access"]
    assert _review(annotations, [PLAIN], ["system:masters"]).outcome != "denied"
    assert _review({"example.com/note": "x"}, [PLAIN], ["system:authenticated"]).outcome != "denied"


def test_garbage_is_tolerated() -> None:
    for pod in (None, [], {"metadata": None}, {"metadata": {"annotations": ["x"]}},
                {"metadata": {"annotations": {1: 2}}}):
        assert device_annotation_denial(pod, [], ADMINS) is None
    assert device_annotation_denial({"metadata": {"annotations": {"cdi.k8s.io/a": 3}}}, None, ADMINS) is not None
