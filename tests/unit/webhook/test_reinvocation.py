"""Reinvocation after another injector (reinvocationPolicy: IfNeeded).

When Istio, Linkerd or Vault Agent add their init containers, sidecars, volumes and annotations
after gpufence ran, the API server calls gpufence again. The second review must give no patch
beyond gpufence's own parts that are still missing (``NVIDIA_VISIBLE_DEVICES=void`` on the
containers the other injector added, which request no GPU), and never rewrite, remove or reorder
another injector's containers. The shapes below are what those injectors add (names, the native-sidecar
field, their volumes and annotations), written out by hand.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jsonpatch
import pytest

from gpufence.contract import SIDECAR_NAME
from gpufence.webhook.client import decode_patch, pod_admission_review
from gpufence.webhook.core.admission import review
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings

NS = AllNamespacesOptedIn()
Pod = dict[str, Any]


def gpu_pod() -> Pod:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train", "namespace": "team-a", "annotations": {"gpufence.io/memory": "8Gi"}},
        "spec": {
            "initContainers": [{"name": "fetch-data", "image": "busybox:1.36"}],
            "containers": [
                {"name": "train", "image": "pytorch/pytorch:2.3.0", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
        },
    }


def _volumes(pod: Pod, *volumes: dict[str, Any]) -> None:
    pod["spec"].setdefault("volumes", []).extend(volumes)


def _annotate(pod: Pod, **annotations: str) -> None:
    pod["metadata"].setdefault("annotations", {}).update(annotations)


def istio_native(pod: Pod) -> None:
    """Istio with native sidecars: istio-init and istio-proxy (restartPolicy: Always) go first."""
    spec = pod["spec"]
    spec["initContainers"] = [
        {"name": "istio-init", "image": "docker.io/istio/proxyv2:1.22.0", "args": ["istio-iptables", "-p", "15001"],
         "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]}}},
        {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0", "restartPolicy": "Always",
         "args": ["proxy", "sidecar"], "ports": [{"containerPort": 15090, "name": "http-envoy-prom"}],
         "env": [{"name": "ISTIO_META_POD_PORTS", "value": "[]"}],
         "volumeMounts": [{"name": "istio-envoy", "mountPath": "/etc/istio/proxy"}]},
        *spec.get("initContainers", []),
    ]
    _volumes(pod, {"name": "istio-envoy", "emptyDir": {"medium": "Memory"}}, {"name": "istio-data", "emptyDir": {}})
    _annotate(pod, **{"sidecar.istio.io/status": '{"initContainers":["istio-init"],"containers":["istio-proxy"]}'})


def istio_classic(pod: Pod) -> None:
    """Istio without native sidecars, holding the app until the proxy starts: istio-proxy first."""
    spec = pod["spec"]
    spec["initContainers"] = [{"name": "istio-init", "image": "docker.io/istio/proxyv2:1.22.0"},
                              *spec.get("initContainers", [])]
    spec["containers"] = [{"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0",
                           "lifecycle": {"postStart": {"exec": {"command": ["pilot-agent", "wait"]}}}},
                          *spec["containers"]]
    _volumes(pod, {"name": "istio-envoy", "emptyDir": {"medium": "Memory"}})


def linkerd(pod: Pod) -> None:
    spec = pod["spec"]
    spec["initContainers"] = [
        {"name": "linkerd-init", "image": "cr.l5d.io/linkerd/proxy-init:v2.4.1",
         "args": ["--incoming-proxy-port", "4143"],
         "volumeMounts": [{"name": "linkerd-proxy-init-xtables-lock", "mountPath": "/run"}]},
        {"name": "linkerd-proxy", "image": "cr.l5d.io/linkerd/proxy:stable-2.14.10", "restartPolicy": "Always",
         "env": [{"name": "LINKERD2_PROXY_LOG", "value": "warn"}],
         "volumeMounts": [{"name": "linkerd-identity-end-entity",
                           "mountPath": "/var/run/linkerd/identity/end-entity"}]},
        *spec.get("initContainers", []),
    ]
    _volumes(pod, {"name": "linkerd-proxy-init-xtables-lock", "emptyDir": {}},
             {"name": "linkerd-identity-end-entity", "emptyDir": {"medium": "Memory"}})
    _annotate(pod, **{"linkerd.io/proxy-version": "stable-2.14.10", "linkerd.io/inject": "enabled"})


def vault_agent(pod: Pod) -> None:
    """Vault Agent: an init container appended, a sidecar appended, shared volumes on the app."""
    spec = pod["spec"]
    spec.setdefault("initContainers", []).append(
        {"name": "vault-agent-init", "image": "hashicorp/vault:1.16.1",
         "volumeMounts": [{"name": "home-init", "mountPath": "/home/vault"},
                          {"name": "vault-secrets", "mountPath": "/vault/secrets"}]})
    spec["containers"].append(
        {"name": "vault-agent", "image": "hashicorp/vault:1.16.1",
         "volumeMounts": [{"name": "home-sidecar", "mountPath": "/home/vault"},
                          {"name": "vault-secrets", "mountPath": "/vault/secrets"}]})
    for container in spec["containers"]:
        if container["name"] == "train":
            container.setdefault("volumeMounts", []).append({"name": "vault-secrets", "mountPath": "/vault/secrets"})
    _volumes(pod, {"name": "home-init", "emptyDir": {"medium": "Memory"}},
             {"name": "home-sidecar", "emptyDir": {"medium": "Memory"}},
             {"name": "vault-secrets", "emptyDir": {"medium": "Memory"}})
    _annotate(pod, **{"vault.hashicorp.com/agent-inject-status": "injected"})


INJECTORS: dict[str, Callable[[Pod], None]] = {
    "istio-native": istio_native, "istio-classic": istio_classic, "linkerd": linkerd, "vault-agent": vault_agent,
}
SETTINGS = [InjectionSettings(), InjectionSettings(native_sidecar=False)]


def _review(pod: Pod, settings: InjectionSettings) -> tuple[str, list[dict[str, Any]] | None]:
    result = review(pod_admission_review(copy.deepcopy(pod), uid="u", namespace="team-a"), settings, NS)
    return result.outcome, decode_patch(result.review["response"])


VOID = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def _is_void_addition(op: dict[str, Any]) -> bool:
    """An operation that only adds NVIDIA_VISIBLE_DEVICES=void to a container's env."""
    if op["op"] != "add":
        return False
    if op["path"].endswith("/env"):
        return op["value"] == [VOID]
    return "/env/" in op["path"] and op["value"] == VOID


def _without_void(container: dict[str, Any]) -> dict[str, Any]:
    env = [e for e in container.get("env", []) if e != VOID]
    return {**{k: v for k, v in container.items() if k != "env"}, **({"env": env} if env else {})}


def _names(pod: Pod) -> dict[str, list[str]]:
    return {key: [c["name"] for c in pod["spec"].get(key, [])] for key in ("initContainers", "containers")}


@pytest.mark.parametrize("settings", SETTINGS, ids=["native", "plain"])
@pytest.mark.parametrize("injector", list(INJECTORS))
def test_another_injector_after_gpufence_gets_no_patch(injector: str, settings: InjectionSettings) -> None:
    pod = gpu_pod()
    outcome, patch = _review(pod, settings)
    assert outcome == "mutated" and patch
    injected = jsonpatch.apply_patch(pod, patch)
    INJECTORS[injector](injected)
    outcome, patch = _review(injected, settings)
    # Only gpufence's part still missing: void on the other injector's containers, nothing else.
    assert outcome == "mutated" and patch and all(_is_void_addition(op) for op in patch), patch
    settled = jsonpatch.apply_patch(injected, patch)
    assert _names(settled) == _names(injected)
    assert _review(settled, settings) == ("unchanged", None)


@pytest.mark.parametrize("settings", SETTINGS, ids=["native", "plain"])
@pytest.mark.parametrize("injector", list(INJECTORS))
def test_gpufence_after_another_injector_adds_only_its_own_parts(injector: str, settings: InjectionSettings) -> None:
    pod = gpu_pod()
    INJECTORS[injector](pod)
    before = _names(pod)
    outcome, patch = _review(pod, settings)
    assert outcome == "mutated" and patch
    assert {op["op"] for op in patch} == {"add"}
    after = jsonpatch.apply_patch(pod, patch)
    # The other injector's containers keep their relative order and content.
    for key, names in before.items():
        assert [n for n in _names(after)[key] if n != SIDECAR_NAME] == names
        theirs = {c["name"]: c for c in pod["spec"].get(key, []) if c["name"] not in ("train",)}
        for container in after["spec"].get(key, []):
            if container["name"] in theirs:
                assert _without_void(container) == theirs[container["name"]]
    # And reviewing the result again changes nothing.
    assert _review(after, settings) == ("unchanged", None)


@pytest.mark.parametrize("injector", list(INJECTORS))
def test_a_stale_sidecar_behind_another_injector_is_patched_in_place(injector: str) -> None:
    """Our sidecar drifted (an old image) after another injector ran: fixed where it is, nothing moved."""
    settings = InjectionSettings()
    pod = gpu_pod()
    injected = jsonpatch.apply_patch(pod, _review(pod, settings)[1])
    INJECTORS[injector](injected)
    injected = jsonpatch.apply_patch(injected, _review(injected, settings)[1])  # their containers: void
    containers = injected["spec"]["initContainers"]
    index = next(i for i, c in enumerate(containers) if c["name"] == SIDECAR_NAME)
    containers[index]["image"] = "ghcr.io/gpufence/gpufence:0.0.9"
    outcome, patch = _review(injected, settings)
    assert outcome == "mutated"
    assert patch == [{"op": "replace", "path": f"/spec/initContainers/{index}/image", "value": settings.sidecar_image}]
