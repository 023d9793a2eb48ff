"""Small helpers over the real ``kubernetes`` client for the e2e tests: namespaces, pods, answers."""

from __future__ import annotations

import copy
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from gpufence.contract import ENV_CONFIG, SIDECAR_NAME
from tests.support.forgeries import same_but_config

_names = itertools.count(1)
OPT_IN = {"gpufence.io/injection": "enabled"}


def api_client(kubeconfig: Path) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(kubeconfig))


@dataclass(frozen=True)
class Created:
    """What the API server answered to a create: the stored object, or the refusal."""

    obj: dict[str, Any] | None
    status: int
    message: str

    @property
    def admitted(self) -> bool:
        return self.obj is not None


def unique(prefix: str) -> str:
    return f"{prefix}-{next(_names)}-{int(time.time() * 1000) % 100000}"


def create_namespace(api: client.ApiClient, prefix: str, labels: dict[str, str] | None = None,
                     annotations: dict[str, str] | None = None) -> str:
    name = unique(prefix)
    client.CoreV1Api(api).create_namespace(
        {"metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}}})
    wait_for(lambda: _has_default_sa(api, name), f"ServiceAccount default in {name}")
    return name


def _has_default_sa(api: client.ApiClient, namespace: str) -> bool:
    try:
        client.CoreV1Api(api).read_namespaced_service_account("default", namespace)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


def create(api: client.ApiClient, path: str, body: dict[str, Any], *, dry_run: bool = False) -> Created:
    """POST ``body`` to ``path`` and return the stored object or the API server's refusal."""
    query = [("dryRun", "All")] if dry_run else []
    method, url, headers, data, _ = api.param_serialize(
        "POST", path, query_params=query, body=body, auth_settings=["BearerToken"],
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
    )
    resp = api.call_api(method, url, header_params=headers, body=data)
    raw = resp.read()
    if 200 <= resp.status < 300:
        return Created(json.loads(raw), resp.status, "")
    try:
        message = json.loads(raw).get("message", "")
    except (TypeError, ValueError):
        message = raw.decode(errors="replace")
    return Created(None, resp.status, message)


def create_pod(api: client.ApiClient, namespace: str, pod: dict[str, Any], *, dry_run: bool = False) -> Created:
    return create(api, f"/api/v1/namespaces/{namespace}/pods", pod, dry_run=dry_run)


def gpu_pod(name: str | None = None, *, gpus: int = 1, annotations: dict[str, str] | None = None,
            labels: dict[str, str] | None = None, generate_name: str | None = None,
            restricted: bool = False, limits: dict[str, str] | None = None) -> dict[str, Any]:
    """A training pod as a user writes it. ``restricted`` makes it pass Pod Security `restricted`."""
    metadata: dict[str, Any] = {"annotations": annotations or {}, "labels": labels or {}}
    if generate_name:
        metadata["generateName"] = generate_name
    else:
        metadata["name"] = name or unique("train")
    container: dict[str, Any] = {
        "name": "trainer", "image": "example.com/train:1", "command": ["python", "train.py"],
        # Quantities in forms the API server rewrites to canonical ones ("0.5" -> "500m", "1Gi").
        "resources": {"limits": {"nvidia.com/gpu": str(gpus), **(limits or {})},
                      "requests": {"cpu": "0.5", "memory": "1073741824"}},
        "env": [{"name": "EPOCHS", "value": "3"}],
    }
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                           "spec": {"containers": [container]}}
    if restricted:
        pod["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000,
                                          "seccompProfile": {"type": "RuntimeDefault"}}
        container["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod


def plain_pod(name: str | None = None) -> dict[str, Any]:
    pod = gpu_pod(name)
    del pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    return pod


def container_names(pod: dict[str, Any]) -> list[str]:
    spec = pod["spec"]
    return [c["name"] for c in spec.get("initContainers", []) + spec["containers"]]


def is_mutated(pod: dict[str, Any]) -> bool:
    return SIDECAR_NAME in container_names(pod) and pod["spec"].get("shareProcessNamespace") is True


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    """The init or regular container of ``pod`` named ``name`` (exactly one)."""
    spec = pod["spec"]
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return found


def enforcer_config(pod: dict[str, Any]) -> dict[str, Any]:
    """The injected sidecar's GPUFENCE_CONFIG, parsed."""
    return json.loads(env_of(container(pod, SIDECAR_NAME))[ENV_CONFIG])


WEBHOOK_DOWN = "failed calling webhook"


def outage_problem(result: Created, webhook: str = "inject.gpufence.io") -> str | None:
    """What is wrong with ``result`` as the API server's answer to a create in an opted-in namespace
    while gpufence's webhook is down (None: refused, naming the webhook, as failurePolicy Fail says)."""
    if result.admitted:
        return "admitted"
    if result.status != 500 or WEBHOOK_DOWN not in result.message or f'"{webhook}"' not in result.message:
        return f"{result.status}: {result.message}"
    return None


def denied_by(result: Created, webhook: str = "inject.gpufence.io") -> bool:
    """Whether the webhook itself judged the pod and denied it (its message follows this prefix)."""
    return (not result.admitted and result.status == 400
            and f'admission webhook "{webhook}" denied the request: ' in result.message)


def forgeries_misjudged(api: client.ApiClient, namespace: str, template: dict[str, Any],
                        forgeries: dict[str, Callable[[dict[str, Any]], None]], *,
                        webhook_up: bool) -> dict[str, str]:
    """Each forgery applied to a copy of ``template`` (a pod as the webhook injected and the API server
    stored it) and created: the names of those gpufence did not stop, with what happened instead.

    Webhook down: each is refused by the API server, naming the webhook (failurePolicy Fail). Webhook
    up: each is denied by the webhook, or stored with the enforcer the untouched template has (the
    webhook rebuilt it): the same sidecar, config and shared PID namespace."""
    wrong: dict[str, str] = {}
    expected_sidecar = container(template, SIDECAR_NAME)
    for name, forge in forgeries.items():
        forged = copy.deepcopy(template)
        forged["metadata"]["name"] = unique("forged")
        forge(forged)
        result = create_pod(api, namespace, forged)
        if not webhook_up:
            problem = outage_problem(result)
            if problem is not None:
                wrong[name] = problem
        elif result.admitted:
            assert result.obj is not None
            stored = container(result.obj, SIDECAR_NAME)
            if not same_but_config(stored, expected_sidecar) or \
                    enforcer_config(result.obj)["containers"].get("trainer") != \
                    enforcer_config(template)["containers"]["trainer"] or not is_mutated(result.obj):
                wrong[name] = "admitted with an enforcer weaker than the template's"
        elif not denied_by(result):
            wrong[name] = f"{result.status}: {result.message}"
    return wrong


def without_server_fields(pod: dict[str, Any]) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "generation"):
        pod["metadata"].pop(key, None)
    pod.pop("status", None)
    return pod


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 60.0, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until truthy: the API offers a watch, but these conditions span objects."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
