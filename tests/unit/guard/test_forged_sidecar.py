"""The guard against a sidecar of the pod author's own making while the webhook is down.

``FORGERIES`` is shared with tests/e2e/test_forged_sidecar.py, where the real API server judges
them; the pods there have the same container name and shares.

Every forgery starts from what the webhook really injects (so it has the right image, command and
status annotation) and weakens one thing; the guard must refuse each with a message that says
what is wrong, and must keep admitting the webhook's own output and what a pod could legitimately
have asked for. The policy is evaluated with cel-python (tests/unit/guard/test_policy.py's harness); the
real kube-apiserver evaluates it in tests/e2e/test_guard.py.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Callable
from typing import Any

import jsonpatch
import pytest

from gpufence.contract import INJECTION_ENABLED, INJECTION_LABEL, SIDECAR_NAME
from gpufence.webhook import admission, client
from gpufence.webhook.cluster_policy import parse_policy
from gpufence.webhook.settings import InjectionSettings, NamespaceInfo
from tests.unit.guard.test_policy import GUARD, POLICY, SHIPPED_POLICY, Guard

CEILINGS = {"gpufence.io/max-memory": "20Gi", "gpufence.io/max-compute": "50"}


def gpu_pod(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train-0", "namespace": "team-a", "annotations": annotations or {}},
        "spec": {"containers": [{"name": "trainer", "image": "cuda:12",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }


def injected(pod: dict[str, Any], ns_annotations: dict[str, str],
             settings: InjectionSettings | None = None) -> dict[str, Any]:
    """The pod as the webhook mutates it in a namespace with ``ns_annotations``."""

    class Lookup:
        def get(self, name: str) -> NamespaceInfo:
            return NamespaceInfo(name=name, labels={INJECTION_LABEL: INJECTION_ENABLED}, annotations=ns_annotations)

    review = admission.review(client.pod_admission_review(copy.deepcopy(pod), uid="u", namespace="team-a"),
                              settings or InjectionSettings(), Lookup())
    assert review.outcome == "mutated", review.review["response"]
    patch = json.loads(base64.b64decode(review.review["response"]["patch"]))
    return jsonpatch.apply_patch(pod, patch)


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = [c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME]
    return sidecar


def config_of(pod: dict[str, Any]) -> dict[str, Any]:
    (entry,) = [e for e in sidecar_of(pod)["env"] if e["name"] == "GPUFENCE_CONFIG"]
    return json.loads(entry["value"])


def with_config(pod: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrites the sidecar's config as the webhook would write it (compact, keys sorted)."""
    doc = config_of(pod)
    change(doc)
    for entry in sidecar_of(pod)["env"]:
        if entry["name"] == "GPUFENCE_CONFIG":
            entry["value"] = json.dumps(doc, separators=(",", ":"), sort_keys=True)


def set_env(pod: dict[str, Any], name: str, value: str) -> None:
    env = sidecar_of(pod)["env"]
    env[:] = [e for e in env if e["name"] != name] + [{"name": name, "value": value}]


GIB = 1 << 30


def _twice(pod: dict[str, Any]) -> None:
    """A small share listed first and none after: JSON keeps the last of two equal keys (no limit),
    a regular expression would find the first."""
    text = json.dumps(config_of(pod), separators=(",", ":"), sort_keys=True)
    entry = text[text.index('"trainer":{'):].split("}", 1)[0] + "}"
    set_env(pod, "GPUFENCE_CONFIG", text.replace(entry, '"trainer":{"memoryBytes":1073741824},"trainer":{}'))


def _mount_over_code(pod: dict[str, Any]) -> None:
    """A ConfigMap of the author's own over the enforcer's package (the volume must exist: the API
    server validates the pod before the guard sees it)."""
    pod["spec"].setdefault("volumes", []).append({"name": "mine", "configMap": {"name": "my-enforcer"}})
    sidecar_of(pod)["volumeMounts"].append(
        {"name": "mine", "mountPath": "/opt/gpufence/lib/python3.11/site-packages/enforcer"})


def replace_env(pod: dict[str, Any], name: str, value: str) -> None:
    """The sidecar's variable ``name`` with another value, in its place."""
    for entry in sidecar_of(pod)["env"]:
        if entry["name"] == name:
            entry["value"] = value


def _other_user(pod: dict[str, Any]) -> None:
    """Not root: the enforcer can no longer read or signal the workloads' processes."""
    context = sidecar_of(pod)["securityContext"]
    context.pop("runAsNonRoot", None)
    context.update(runAsUser=1000, capabilities={"drop": ["ALL"]})


def _to_containers(pod: dict[str, Any]) -> None:
    """A regular container (it starts with the workload, not before it) with a limit it cannot live in."""
    sidecar = sidecar_of(pod)
    pod["spec"]["initContainers"].remove(sidecar)
    sidecar.pop("restartPolicy")
    sidecar["resources"] = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "16Mi"}}
    pod["spec"]["containers"].append(sidecar)


def _no_probes(pod: dict[str, Any]) -> None:
    """Nothing restarts an enforcer that is stopped or hung."""
    sidecar_of(pod).pop("livenessProbe")


def _no_post_start(pod: dict[str, Any]) -> None:
    """The workload starts at once, before the enforcer is up."""
    sidecar_of(pod).pop("lifecycle")


def _post_start_sleeps(pod: dict[str, Any]) -> None:
    """A hook that returns whether or not the enforcer came up."""
    sidecar_of(pod)["lifecycle"]["postStart"] = {"exec": {"command": ["python3", "-c", "pass"]}}


def _pre_stop(pod: dict[str, Any]) -> None:
    """A preStop hook of the author's, run inside the enforcer's container."""
    sidecar_of(pod)["lifecycle"]["preStop"] = {"exec": {"command": ["kill", "-STOP", "1"]}}


TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
# The volume the API server's ServiceAccount plugin adds (its name ends in a random suffix).
TOKEN_VOLUME = {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}


def _mount_in_sidecar(pod: dict[str, Any], volume: dict[str, Any], path: str) -> None:
    pod["spec"].setdefault("volumes", []).append(volume)
    sidecar = sidecar_of(pod)
    sidecar["volumeMounts"] = [m for m in sidecar["volumeMounts"] if m["mountPath"] != TOKEN_PATH]
    sidecar["volumeMounts"].append({"name": volume["name"], "mountPath": path, "readOnly": True})


def _authors_file_as_token(pod: dict[str, Any]) -> None:
    """The pod opts out of the token and puts a JWT of its own making where the enforcer reads
    the name of its pod (its logs, metrics and Events would be about another pod)."""
    pod["spec"]["automountServiceAccountToken"] = False
    _mount_in_sidecar(pod, {"name": "kube-api-access-fake", "configMap": {"name": "forged-token"}}, TOKEN_PATH)


def _token_for_another_audience(pod: dict[str, Any]) -> None:
    volume = copy.deepcopy(TOKEN_VOLUME)
    volume["name"] = "vault-token"
    volume["projected"]["sources"][0]["serviceAccountToken"]["audience"] = "vault"
    _mount_in_sidecar(pod, volume, TOKEN_PATH)


def _secrets_above_the_token(pod: dict[str, Any]) -> None:
    """Without the pod's own token mounted below it, a volume at /var/run/secrets shows its files."""
    pod["spec"]["automountServiceAccountToken"] = False
    _mount_in_sidecar(pod, {"name": "secrets", "secret": {"secretName": "forged"}}, "/var/run/secrets")


def _shared_state(pod: dict[str, Any]) -> None:
    """The sidecar's state directory on a volume of the author's, which the workload mounts too."""
    pod["spec"]["volumes"].append({"name": "shared", "emptyDir": {}})
    for mount in sidecar_of(pod)["volumeMounts"]:
        if mount["name"] == "gpufence-state":
            mount["name"] = "shared"
    pod["spec"]["containers"][0].setdefault("volumeMounts", []).append({"name": "shared", "mountPath": "/state"})


def _dev_hidden(pod: dict[str, Any]) -> None:
    """An emptyDir over /dev: NVML finds no GPU device nodes."""
    pod["spec"]["volumes"].append({"name": "nodev", "emptyDir": {}})
    sidecar_of(pod)["volumeMounts"].append({"name": "nodev", "mountPath": "/dev"})


def _workload_mounts_state(pod: dict[str, Any]) -> None:
    """The workload mounts the enforcer's own state volume (the webhook's name for it)."""
    pod["spec"]["containers"][0].setdefault("volumeMounts", []).append(
        {"name": "gpufence-state", "mountPath": "/var/run/gpufence"})


def _helper_without_void(pod: dict[str, Any]) -> None:
    """A container with no device whose CUDA image (or envFrom) sets NVIDIA_VISIBLE_DEVICES=all,
    without the void the webhook gives it."""
    pod["spec"]["containers"].append({"name": "helper", "image": "nvidia/cuda:12.4.1-base-ubuntu22.04",
                                      "envFrom": [{"configMapRef": {"name": "gpus", "optional": True}}]})


def _gpu_init_first(pod: dict[str, Any]) -> None:
    """A GPU init container placed before the sidecar runs before enforcement starts."""
    pod["spec"]["initContainers"].insert(0, {"name": "warmup", "image": "cuda:12", "resources": {
        "limits": {"nvidia.com/gpu": "1"}}})
    with_config(pod, lambda d: d["containers"].update(warmup=dict(d["containers"]["trainer"])))


def _workload_declares_the_port(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": 9401, "protocol": "TCP"}]


FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "audit mode": (lambda p: with_config(p, lambda d: d.update(mode="audit")), "asks for audit mode"),
    "share above the ceiling": (
        lambda p: with_config(p, lambda d: d["containers"]["trainer"].update(memoryBytes=30 * GIB)),
        "no memory share within the namespace's ceiling 20Gi"),
    "no memory share": (
        lambda p: with_config(p, lambda d: d["containers"]["trainer"].pop("memoryBytes")),
        "no memory share within the namespace's ceiling 20Gi"),
    "compute above the ceiling": (
        lambda p: with_config(p, lambda d: d["containers"]["trainer"].update(computePercent=90)),
        "no compute share within the namespace's ceiling 50"),
    "container left out": (
        lambda p: with_config(p, lambda d: d.update(containers={})), 'container "trainer" is not in it exactly once'),
    "more GPUs than requested": (
        lambda p: with_config(p, lambda d: d["containers"]["trainer"].update(gpus=8)),
        "not the number of GPUs it requested"),
    "GPU count left out": (
        lambda p: with_config(p, lambda d: d["containers"]["trainer"].pop("gpus")),
        "not the number of GPUs it requested"),
    "poll interval stretched": (
        lambda p: with_config(p, lambda d: d.update(pollIntervalSeconds=60)), "polls less often"),
    "container twice": (_twice, 'container "trainer" is not in it exactly once'),
    "not the webhook's JSON": (
        lambda p: set_env(p, "GPUFENCE_CONFIG", json.dumps(config_of(p), indent=1)),
        "not the JSON the webhook writes"),
    "config from a ConfigMap": (
        lambda p: sidecar_of(p)["env"].__setitem__(0, {"name": "GPUFENCE_CONFIG", "valueFrom": {
            "configMapKeyRef": {"name": "weak", "key": "config"}}}),
        "exactly one GPUFENCE_CONFIG with a value"),
    "a second config": (
        lambda p: sidecar_of(p)["env"].append({"name": "GPUFENCE_CONFIG", "value": '{"mode":"audit"}'}),
        "exactly one GPUFENCE_CONFIG"),
    "args": (lambda p: sidecar_of(p).update(args=["--config", "/tmp/weak.json"]), "it has args"),
    "envFrom": (lambda p: sidecar_of(p).update(envFrom=[{"configMapRef": {"name": "x"}}]), "it has envFrom"),
    "LD_PRELOAD": (lambda p: set_env(p, "LD_PRELOAD", "/tmp/fake-nvml.so"), "its env has LD_PRELOAD="),
    "PYTHONPATH": (lambda p: set_env(p, "PYTHONPATH", "/tmp/mine"), "its env has PYTHONPATH="),
    "device prefix": (lambda p: set_env(p, "GPUFENCE_NVIDIA_DEVICE_PREFIX", "/dev/none"),
                      "its env has GPUFENCE_NVIDIA_DEVICE_PREFIX=/dev/none, which the webhook does not set"),
    "no GPUs for NVML": (lambda p: replace_env(p, "NVIDIA_VISIBLE_DEVICES", "void"),
                         "its env has NVIDIA_VISIBLE_DEVICES=void"),
    "mount over the code": (_mount_over_code, "it mounts volume mine at /opt/gpufence"),
    # The sidecar is exactly what the webhook would build: each of these passed the field checks
    # above and disarmed the enforcer all the same.
    "another uid, capabilities dropped": (_other_user, "its securityContext is not the webhook's"),
    "moved to containers with a 16Mi limit": (_to_containers, "it is not in spec.initContainers"),
    "probes removed": (_no_probes, "its probes are not the webhook's"),
    "postStart hook removed": (_no_post_start, "its probes are not the webhook's"),
    "postStart hook that waits for nothing": (_post_start_sleeps, "its probes are not the webhook's"),
    "preStop hook added": (_pre_stop, "its probes are not the webhook's"),
    "startup probe of its own": (lambda p: sidecar_of(p).update(startupProbe={"exec": {"command": ["true"]}}),
                                 "its probes are not the webhook's"),
    # The webhook leaves the liveness probe's period and threshold to the API server's defaults
    # (10 s, 3): a forgery that sets its own is refused, before and after defaulting.
    "liveness probe every 5 minutes": (lambda p: sidecar_of(p)["livenessProbe"].update(periodSeconds=300),
                                       "its probes are not the webhook's"),
    "liveness probe failing 1000 times": (lambda p: sidecar_of(p)["livenessProbe"].update(failureThreshold=1000),
                                          "its probes are not the webhook's"),
    "state directory variable of its own": (lambda p: set_env(p, "GPUFENCE_STATE_DIR", "/tmp/state"),
                                            "its env has GPUFENCE_STATE_DIR=/tmp/state"),
    "a GPU init container before it": (_gpu_init_first, 'init container "warmup" requests a GPU and comes before it'),
    "driver capabilities compute": (lambda p: replace_env(p, "NVIDIA_DRIVER_CAPABILITIES", "compute"),
                                    "its env has NVIDIA_DRIVER_CAPABILITIES=compute"),
    "fake host-proc directory": (lambda p: set_env(p, "GPUFENCE_HOST_PROC", "/var/run/gpufence/proc"),
                                 "its env has GPUFENCE_HOST_PROC=/var/run/gpufence/proc"),
    "state directory shared with a workload": (_shared_state, "its volumeMounts lack the webhook's"),
    "an emptyDir over /dev": (_dev_hidden, "it mounts volume nodev at /dev"),
    # The pod around it: the enforcer's volume and port are its own.
    "workload mounts the state volume": (_workload_mounts_state, 'container "trainer" mounts volume gpufence-state'),
    "workload declares the metrics port": (_workload_declares_the_port, 'container "trainer" declares port 9401'),
    # The token the enforcer names its pod by (gpufence/enforcer/pod_identity.py).
    "a file of the author's as the token": (_authors_file_as_token, "it mounts volume kube-api-access-fake at "
                                            "/var/run/secrets/kubernetes.io/serviceaccount, where the enforcer reads"),
    "a token for another audience": (_token_for_another_audience, "only the pod's own token"),
    "a volume above the token": (_secrets_above_the_token, "it mounts volume secrets at /var/run/secrets, where"),
    # A container without a device: the webhook's NVIDIA_VISIBLE_DEVICES=void, or no pod.
    "a container without a device and without the void": (
        _helper_without_void, 'container "helper" requests no GPU and has no NVIDIA_VISIBLE_DEVICES'),
}


def test_the_webhooks_sidecar_passes() -> None:
    pod = injected(gpu_pod({"gpufence.io/memory": "4Gi", "gpufence.io/compute": "50"}), CEILINGS)
    assert GUARD.admit(pod, namespace_annotations=CEILINGS) == (True, "allowed")


@pytest.mark.parametrize("forgery", FORGERIES, ids=list(FORGERIES))
def test_a_forged_sidecar_is_refused_with_what_is_wrong(forgery: str) -> None:
    pod = injected(gpu_pod({"gpufence.io/memory": "4Gi", "gpufence.io/compute": "50"}), CEILINGS)
    forge, expected = FORGERIES[forgery]
    forge(pod)
    allowed, message = GUARD.admit(pod, namespace_annotations=CEILINGS)
    assert not allowed
    assert expected in message, message
    assert 'namespace "team-a"' in message


def test_audit_is_admitted_where_the_namespace_allows_it() -> None:
    annotations = {"gpufence.io/allow-audit": "true"}
    pod = injected(gpu_pod({"gpufence.io/memory": "4Gi", "gpufence.io/mode": "audit"}), annotations)
    assert config_of(pod)["mode"] == "audit"
    assert GUARD.admit(pod, namespace_annotations=annotations)[0]
    assert not GUARD.admit(pod, namespace_annotations={})[0]


def test_a_pod_without_any_share_may_run_in_audit_mode() -> None:
    """The webhook admits a pod with no share in audit mode (nothing to limit): not a forgery."""
    pod = injected(gpu_pod(), {})
    assert config_of(pod)["mode"] == "audit"
    assert GUARD.admit(pod, namespace_annotations={})[0]


@pytest.mark.parametrize(("share", "ceiling", "kept"),
                         [("25%", "20Gi", "memoryBytes"), ("40Gi", "25%", "memoryPercent")])
def test_a_share_in_the_other_unit_keeps_the_ceiling_and_dropping_it_is_refused(share: str, ceiling: str,
                                                                                  kept: str) -> None:
    annotations = {"gpufence.io/max-memory": ceiling}
    pod = injected(gpu_pod({"gpufence.io/memory": share}), annotations)
    entry = config_of(pod)["containers"]["trainer"]
    assert {"memoryBytes", "memoryPercent"} <= set(entry)  # both: the enforcer applies the smaller
    assert GUARD.admit(pod, namespace_annotations=annotations)[0]
    with_config(pod, lambda d: d["containers"]["trainer"].pop(kept))
    allowed, message = GUARD.admit(pod, namespace_annotations=annotations)
    assert not allowed and "ceiling" in message


def test_a_default_share_cannot_be_left_out() -> None:
    annotations = {"gpufence.io/default-compute": "25"}
    pod = injected(gpu_pod({"gpufence.io/memory": "4Gi"}), annotations)
    assert config_of(pod)["containers"]["trainer"]["computePercent"] == 25
    assert GUARD.admit(pod, namespace_annotations=annotations)[0]
    with_config(pod, lambda d: d["containers"]["trainer"].pop("computePercent"))
    allowed, message = GUARD.admit(pod, namespace_annotations=annotations)
    assert not allowed and "no compute share where the namespace sets a default" in message


def test_the_pods_own_token_mounted_as_the_api_server_mounts_it_passes() -> None:
    pod = injected(gpu_pod({"gpufence.io/memory": "4Gi"}), {})
    _mount_in_sidecar(pod, copy.deepcopy(TOKEN_VOLUME), TOKEN_PATH)
    assert GUARD.admit(pod, namespace_annotations={})[0]


def test_other_injectors_mounts_are_not_forgeries() -> None:
    """Vault Agent mounts /vault/secrets into every container, ours included."""
    pod = injected(gpu_pod({"gpufence.io/memory": "4Gi"}), {})
    sidecar_of(pod)["volumeMounts"].append({"name": "vault-secrets", "mountPath": "/vault/secrets"})
    assert GUARD.admit(pod, namespace_annotations={})[0]


def test_the_cluster_policy_configmap_binds_the_webhook_and_the_guard_alike() -> None:
    """Where the Namespace says nothing, the cluster policy applies: one ConfigMap for both."""
    data = {**SHIPPED_POLICY, "max-memory": "16Gi", "default-compute": "40"}
    settings = parse_policy(data)
    assert (settings.max_memory, settings.default_compute) == ("16Gi", "40")
    guard = Guard(POLICY, data)
    pod = injected(gpu_pod({"gpufence.io/memory": "8Gi"}), {}, settings)
    assert guard.admit(pod, namespace_annotations={})[0]
    assert not GUARD.admit(pod, namespace_annotations={"gpufence.io/max-memory": "4Gi"})[0]
    for change in (lambda d: d["containers"]["trainer"].update(memoryBytes=32 * GIB),
                   lambda d: d["containers"]["trainer"].pop("computePercent")):
        forged = copy.deepcopy(pod)
        with_config(forged, change)
        assert not guard.admit(forged, namespace_annotations={})[0]


def test_a_container_named_like_a_config_key_is_judged_correctly() -> None:
    """"containers" is also the config's top-level key: one entry is still exactly once."""
    pod = gpu_pod({"gpufence.io/memory": "4Gi"})
    pod["spec"]["containers"][0]["name"] = "containers"
    mutated = injected(pod, CEILINGS)
    assert GUARD.admit(mutated, namespace_annotations=CEILINGS)[0]
    with_config(mutated, lambda d: d["containers"]["containers"].update(memoryBytes=30 * GIB))
    assert not GUARD.admit(mutated, namespace_annotations=CEILINGS)[0]


def test_a_poll_interval_left_out_is_the_default_and_judged_so() -> None:
    """The webhook leaves out a poll interval of 0.5 s; where the policy asks for a faster one, a
    config without the field (the enforcer's 0.5 s) polls less often than configured."""
    data = {**SHIPPED_POLICY, "sidecar-poll-interval": "200ms"}
    guard = Guard(POLICY, data)
    pod = injected(gpu_pod({"gpufence.io/memory": "4Gi"}), {}, parse_policy(data))
    assert config_of(pod)["pollIntervalSeconds"] == 0.2
    assert guard.admit(pod, namespace_annotations={})[0]
    with_config(pod, lambda d: d.pop("pollIntervalSeconds"))
    allowed, message = guard.admit(pod, namespace_annotations={})
    assert not allowed and "polls less often" in message, message
    # Under the default policy the same config is the webhook's own.
    assert GUARD.admit(pod, namespace_annotations={})[0]
