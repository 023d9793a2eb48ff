"""The protect ValidatingAdmissionPolicy (k8s/base/protect-policy.yaml), evaluated with cel-python.

Running pods of opted-in namespaces: an UPDATE may not change the gpufence-enforcer container, the
gpufence.io/status annotation or the annotations the GPU share was admitted with, a new ephemeral
container must carry the webhook's NVIDIA_VISIBLE_DEVICES=void and leave the enforcer alone, and
exec/attach may not name the sidecar;
members of admin-groups pass. The real kube-apiserver (1.30 and 1.37) evaluates the same policy in
tests/e2e/test_running_pod_attacks.py; this is the fast loop over the cases, with the policy's CEL
in the subset cel-python supports (tests/support/k8s_cel.py stands in for Kubernetes' CEL libraries).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes
from hypothesis import assume, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from gpufence.contract import (
    ANNOTATION_ADMIN_DEVICE_ACCESS,
    ANNOTATION_STATUS,
    INJECTION_ENABLED,
    INJECTION_LABEL,
    SIDECAR_NAME,
)
from gpufence.webhook.cluster.policy import parse_policy
from gpufence.webhook.core.device_access import DEVICE_ANNOTATIONS
from gpufence.webhook.core.settings import DEFAULT_SIDECAR_IMAGE, InjectionSettings
from gpufence.webhook.core.sidecar import RESERVED_VOLUMES
from tests.support.k8s_cel import FUNCTIONS as K8S_FUNCTIONS

ROOT = Path(__file__).resolve().parents[3]
POLICY_FILE = ROOT / "k8s" / "base" / "protect-policy.yaml"
WEBHOOK_CONFIG_FILE = ROOT / "k8s" / "base" / "mutatingwebhookconfiguration.yaml"
POLICY_CONFIGMAP_FILE = ROOT / "k8s" / "base" / "policy-configmap.yaml"

_ENV = celpy.Environment()


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


POLICIES = {d["metadata"]["name"]: d for d in _docs(POLICY_FILE) if d["kind"] == "ValidatingAdmissionPolicy"}
BINDINGS = {d["metadata"]["name"]: d for d in _docs(POLICY_FILE) if d["kind"] == "ValidatingAdmissionPolicyBinding"}
POLICY = POLICIES["gpufence-protect"]  # UPDATE of pods, pods/ephemeralcontainers, pods/resize
EXEC_POLICY = POLICIES["gpufence-protect-exec"]  # CONNECT to pods/exec, pods/attach
(POLICY_CONFIGMAP,) = _docs(POLICY_CONFIGMAP_FILE)
SHIPPED_POLICY: dict[str, str] = dict(POLICY_CONFIGMAP["data"])
TENANT = ("system:serviceaccounts", "system:serviceaccounts:team-a", "system:authenticated")


def _compile(expression: str) -> celpy.Runner:
    return _ENV.program(_ENV.compile(expression), functions=K8S_FUNCTIONS)


def _ok(value: Any, what: str) -> Any:
    assert not isinstance(value, celpy.CELEvalError), f"{what}: evaluation error {value}"
    return value


class Protect:
    """A compiled copy of the policy, with the cluster policy ConfigMap's data as its params."""

    def __init__(self, policy_data: dict[str, str] | None = None, policy: dict[str, Any] = POLICY) -> None:
        spec = policy["spec"]
        assert "matchConditions" not in spec  # the harness evaluates none
        data = dict(SHIPPED_POLICY if policy_data is None else policy_data)
        self.params = celpy.json_to_cel({"apiVersion": "v1", "kind": "ConfigMap", "data": data})
        self.variables = [(v["name"], _compile(v["expression"])) for v in spec["variables"]]
        self.validations = [(_compile(v["expression"]), _compile(v["messageExpression"]), v)
                            for v in spec["validations"]]

    def activation(self, request: dict[str, Any], obj: Any, old: Any) -> dict[str, Any]:
        activation: dict[str, Any] = {
            "request": celpy.json_to_cel(request), "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old), "params": self.params,
        }
        variables: dict[str, Any] = {}
        for name, program in self.variables:
            activation["variables"] = celtypes.MapType({celtypes.StringType(k): v for k, v in variables.items()})
            variables[name] = _ok(program.evaluate(activation), f"variable {name}")
        activation["variables"] = celtypes.MapType({celtypes.StringType(k): v for k, v in variables.items()})
        return activation

    def judge(self, request: dict[str, Any], obj: Any, old: Any = None) -> tuple[bool, str]:
        activation = self.activation(request, obj, old)
        for program, message_program, validation in self.validations:
            if not _ok(program.evaluate(activation), validation["expression"]):
                message = _ok(message_program.evaluate(activation), validation["messageExpression"])
                assert isinstance(message, str)
                return False, str(message)
        return True, "allowed"

    def update(self, old: dict[str, Any], new: dict[str, Any], *, sub_resource: str = "",
               groups: tuple[str, ...] = TENANT) -> tuple[bool, str]:
        return self.judge(_request("UPDATE", sub_resource, groups), new, old)

    def connect(self, sub_resource: str, container: str | None, *,
                groups: tuple[str, ...] = TENANT) -> tuple[bool, str]:
        kind = "PodExecOptions" if sub_resource == "exec" else "PodAttachOptions"
        options: dict[str, Any] = {"kind": kind, "apiVersion": "v1", "stdin": True, "stdout": True}
        if container is not None:
            options["container"] = container
        if sub_resource == "exec":
            options["command"] = ["sh"]
        return self.judge(_request("CONNECT", sub_resource, groups), options)


def _request(operation: str, sub_resource: str, groups: tuple[str, ...]) -> dict[str, Any]:
    return {"operation": operation, "subResource": sub_resource, "name": "train-1", "namespace": "team-a",
            "userInfo": {"username": "system:serviceaccount:team-a:tenant", "groups": list(groups)}}


PROTECT = Protect()
PROTECT_EXEC = Protect(policy=EXEC_POLICY)
STATUS = '{"containers":["trainer"],"mode":"enforce","version":"0.1.0"}'


def injected_pod(*, native: bool = True) -> dict[str, Any]:
    """A GPU pod as the webhook leaves it (the fields the policy reads, and a few it must ignore)."""
    sidecar: dict[str, Any] = {
        "name": SIDECAR_NAME, "image": DEFAULT_SIDECAR_IMAGE, "command": ["gpufence-enforcer"],
        "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}, "requests": {"cpu": "10m", "memory": "64Mi"}},
        "volumeMounts": [{"name": "gpufence-state", "mountPath": "/var/run/gpufence"}],
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
    }
    trainer = {"name": "trainer", "image": "example.com/train:1",
               "resources": {"limits": {"nvidia.com/gpu": "1"}},
               "env": [{"name": "GPUFENCE_CONTAINER", "value": "trainer"}]}
    spec: dict[str, Any] = {"shareProcessNamespace": True, "containers": [trainer],
                            "volumes": [{"name": "gpufence-state", "emptyDir": {"medium": "Memory"}}]}
    if native:
        spec["initContainers"] = [{**sidecar, "restartPolicy": "Always"}]
    else:
        spec["containers"].append(sidecar)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "train-1", "namespace": "team-a", "labels": {"app": "train"},
                         "annotations": {ANNOTATION_STATUS: STATUS}},
            "spec": spec}


def changed(pod: dict[str, Any], change: Any) -> dict[str, Any]:
    new = copy.deepcopy(pod)
    change(new)
    return new


def sidecar_of(pod: dict[str, Any]) -> dict[str, Any]:
    spec = pod["spec"]
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == SIDECAR_NAME)


# --- the sidecar of a running pod ------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native-sidecar", "plain-container"])
def test_changing_the_sidecars_image_is_refused_naming_both_images(native: bool) -> None:
    old = injected_pod(native=native)
    new = changed(old, lambda p: sidecar_of(p).update(image="evil.example.com/noop:1"))
    allowed, message = PROTECT.update(old, new)
    assert not allowed
    assert f'changes the image, from "{DEFAULT_SIDECAR_IMAGE}" to "evil.example.com/noop:1", of container ' \
           '"gpufence-enforcer"' in message
    assert "delete and recreate the pod" in message and "system:masters,gpufence:admins" in message


def test_changing_the_sidecars_resources_is_refused() -> None:
    old = injected_pod()
    new = changed(old, lambda p: sidecar_of(p)["resources"]["limits"].update(memory="8Mi"))
    allowed, message = PROTECT.update(old, new, sub_resource="resize")
    assert not allowed and 'changes the resources of container "gpufence-enforcer"' in message


def test_any_other_change_to_the_sidecar_is_refused() -> None:
    old = injected_pod()
    new = changed(old, lambda p: sidecar_of(p).update(command=["sleep", "infinity"]))
    allowed, message = PROTECT.update(old, new)
    assert not allowed and 'changes container "gpufence-enforcer"' in message


@pytest.mark.parametrize(("what", "change"), [
    ("a label", lambda p: p["metadata"]["labels"].update(release="2")),
    ("another annotation", lambda p: p["metadata"]["annotations"].update({"example.com/note": "x"})),
    ("the GPU container's image", lambda p: p["spec"]["containers"][0].update(image="example.com/train:2")),
    ("a toleration", lambda p: p["spec"].update(tolerations=[{"key": "gpu", "operator": "Exists"}])),
    ("activeDeadlineSeconds", lambda p: p["spec"].update(activeDeadlineSeconds=600)),
    ("the garbage collector's ownerReferences", lambda p: p["metadata"].update(ownerReferences=[])),
    ("a finalizer", lambda p: p["metadata"].update(finalizers=["example.com/keep"])),
])
def test_ordinary_updates_pass(what: str, change: Any) -> None:
    old = injected_pod()
    assert PROTECT.update(old, changed(old, change)) == (True, "allowed"), what


def test_a_pod_without_sidecar_can_be_updated() -> None:
    old = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
           "spec": {"containers": [{"name": "web", "image": "nginx:1"}]}}
    new = changed(old, lambda p: p["spec"]["containers"][0].update(image="nginx:2"))
    assert PROTECT.update(old, new) == (True, "allowed")


@pytest.mark.parametrize(("change", "verb"), [
    (lambda p: p["metadata"]["annotations"].update({ANNOTATION_STATUS: STATUS.replace("enforce", "audit")}),
     "changes"),
    (lambda p: p["metadata"]["annotations"].pop(ANNOTATION_STATUS), "removes"),
])
def test_the_status_annotation_cannot_change(change: Any, verb: str) -> None:
    old = injected_pod()
    allowed, message = PROTECT.update(old, changed(old, change))
    assert not allowed
    assert f"{verb} the annotation gpufence.io/status" in message and "kubectl annotate pod train-1" in message


def test_the_status_annotation_cannot_be_added() -> None:
    old = changed(injected_pod(), lambda p: p["metadata"].pop("annotations"))
    new = changed(old, lambda p: p["metadata"].update(annotations={ANNOTATION_STATUS: STATUS}))
    allowed, message = PROTECT.update(old, new)
    assert not allowed and "adds the annotation gpufence.io/status" in message


@pytest.mark.parametrize("annotated", [True, False])
def test_the_admin_device_access_record_cannot_be_added(annotated: bool) -> None:
    # The node guardian leaves the GPU processes of a pod so marked alone: no tenant may mark one.
    old = injected_pod() if annotated else changed(injected_pod(), lambda p: p["metadata"].pop("annotations"))
    new = changed(old, lambda p: p["metadata"].setdefault("annotations", {}).update(
        {ANNOTATION_ADMIN_DEVICE_ACCESS: "mallory"}))
    allowed, message = PROTECT.update(old, new)
    assert not allowed
    assert "adds the annotation gpufence.io/admin-device-access, which the gpufence webhook writes" in message
    assert "node guardian" in message and "kubectl annotate pod train-1 example.com/note=x" in message


@pytest.mark.parametrize(("change", "verb"), [
    (lambda p: p["metadata"]["annotations"].update({ANNOTATION_ADMIN_DEVICE_ACCESS: "bob"}), "changes"),
    (lambda p: p["metadata"]["annotations"].pop(ANNOTATION_ADMIN_DEVICE_ACCESS), "removes"),
])
def test_the_admin_device_access_record_cannot_change_or_go_but_for_an_admin(change: Any, verb: str) -> None:
    old = changed(injected_pod(),
                  lambda p: p["metadata"]["annotations"].update({ANNOTATION_ADMIN_DEVICE_ACCESS: "alice"}))
    allowed, message = PROTECT.update(old, changed(old, change))
    assert not allowed and f"{verb} the annotation gpufence.io/admin-device-access," in message
    assert PROTECT.update(old, changed(old, change), groups=("gpufence:admins",)) == (True, "allowed")
    # Any other annotation still may change beside it.
    note = changed(old, lambda p: p["metadata"]["annotations"].update({"example.com/note": "x"}))
    assert PROTECT.update(old, note) == (True, "allowed")


# --- the annotations the pod's GPU share was admitted with (issue 32 row 7) ------------------------

NV_LIMIT = "nvidia.com/container.trainer.gpu-memory.limit"
SHARE_ANNOTATIONS = {"gpu-fraction": "0.25", "gpu-fraction-num-devices": "2",
                     "gpu-fraction-container-name": "trainer", NV_LIMIT: "8Gi",
                     "nvidia.com/container.trainer.gpu-compute.mode": "sm-sharing",
                     "gpufence.io/memory": "8Gi", "gpufence.io/compute.trainer": "25"}


def share_pod() -> dict[str, Any]:
    return changed(injected_pod(), lambda p: p["metadata"]["annotations"].update(SHARE_ANNOTATIONS))


@pytest.mark.parametrize("key", sorted(SHARE_ANNOTATIONS))
@pytest.mark.parametrize("verb", ["changes", "removes"])
def test_a_share_annotation_cannot_change_or_go(key: str, verb: str) -> None:
    old = share_pod()
    annotations = lambda p: p["metadata"]["annotations"]  # noqa: E731
    change = (lambda p: annotations(p).pop(key)) if verb == "removes" else \
        (lambda p: annotations(p).update({key: "1"}))
    allowed, message = PROTECT.update(old, changed(old, change))
    assert not allowed
    assert f"{verb} the annotation {key}, which a scheduler" in message
    assert "kubectl annotate pod train-1 example.com/note=x" in message and "admin-groups" in message


@pytest.mark.parametrize("key", ["gpu-memory", "gpu-fraction", "nvidia.com/container.trainer.gpu-memory.request",
                                 "gpufence.io/memory.trainer", "gpufence.io/mode"])
def test_a_share_annotation_cannot_be_added(key: str) -> None:
    old = injected_pod()
    allowed, message = PROTECT.update(old, changed(old, lambda p: p["metadata"]["annotations"].update({key: "1"})))
    assert not allowed and f"adds the annotation {key}," in message


@pytest.mark.parametrize("change", [
    # KAI's binder writes the device it chose on the bound pod (KAI's own admission limits who may).
    lambda p: p["metadata"]["annotations"].update({"nvidia.com/container.trainer.gpus.devices": "GPU-0"}),
    lambda p: p["metadata"]["annotations"].update({"example.com/gpu-fraction": "0.1"}),
    lambda p: p["metadata"]["annotations"].update({"runai/shared-gpu-configmap": "train-1-shared-gpu"}),
    lambda p: p["metadata"]["labels"].update({"gpu-fraction": "0.1"}),
], ids=["kai-binder-devices", "look-alike-key", "kai-binder-configmap", "a-label-of-that-name"])
def test_other_annotations_beside_the_share_pass(change: Any) -> None:
    old = share_pod()
    assert PROTECT.update(old, changed(old, change)) == (True, "allowed")


def test_admins_may_change_a_share_annotation() -> None:
    old = share_pod()
    new = changed(old, lambda p: p["metadata"]["annotations"].update({"gpu-fraction": "0.5"}))
    assert PROTECT.update(old, new, groups=("gpufence:admins",)) == (True, "allowed")


@pytest.mark.parametrize("groups", [("system:masters", "system:authenticated"), ("gpufence:admins",)])
def test_admins_may_change_the_sidecar(groups: tuple[str, ...]) -> None:
    old = injected_pod()
    new = changed(old, lambda p: (sidecar_of(p).update(image="example.com/gpufence:debug"),
                                  p["metadata"]["annotations"].pop(ANNOTATION_STATUS)))
    assert PROTECT.update(old, new, groups=groups) == (True, "allowed")


def test_admin_groups_come_from_the_policy_configmap() -> None:
    protect = Protect({**SHIPPED_POLICY, "admin-groups": " platform:gpu-admins ,oncall"})
    old = injected_pod()
    new = changed(old, lambda p: sidecar_of(p).update(image="example.com/gpufence:debug"))
    assert protect.update(old, new, groups=("oncall",))[0]
    allowed, message = protect.update(old, new, groups=("system:masters",))
    assert not allowed and " platform:gpu-admins ,oncall (admin-groups" in message


@pytest.mark.parametrize("policy", [POLICY, EXEC_POLICY], ids=lambda p: p["metadata"]["name"])
@pytest.mark.parametrize("data", [None, {"admin-groups": ""}, {}])
def test_admin_groups_default_to_the_webhooks(data: dict[str, str] | None, policy: dict[str, Any]) -> None:
    """Absent or empty, each policy falls back to exactly the webhook's default (InjectionSettings)."""
    protect = Protect(data if data is not None else {}, policy=policy)
    activation = protect.activation(_request("UPDATE", "", TENANT), injected_pod(), injected_pod())
    assert list(activation["variables"]["adminGroups"]) == list(InjectionSettings().admin_groups)
    assert parse_policy(data) == InjectionSettings()


@pytest.mark.parametrize("policy", [POLICY, EXEC_POLICY], ids=lambda p: p["metadata"]["name"])
def test_the_shipped_admin_groups_parse_as_the_webhook_parses_them(policy: dict[str, Any]) -> None:
    spelled = {"admin-groups": "team:gpu-admins, system:masters ,x"}
    activation = Protect(spelled, policy=policy).activation(_request("UPDATE", "", TENANT), injected_pod(),
                                                            injected_pod())
    assert list(activation["variables"]["adminGroups"]) == list(parse_policy(spelled).admin_groups)
    assert parse_policy(SHIPPED_POLICY).admin_groups == InjectionSettings().admin_groups


# --- ephemeral containers ------------------------------------------------------------------------

VOID = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def with_ephemeral(pod: dict[str, Any], *containers: dict[str, Any]) -> dict[str, Any]:
    return changed(pod, lambda p: p["spec"].setdefault("ephemeralContainers", []).extend(containers))


@pytest.mark.parametrize("gpu_pod", [True, False], ids=["gpu-pod", "non-gpu-pod"])
def test_an_ephemeral_container_with_the_webhooks_void_passes(gpu_pod: bool) -> None:
    old = injected_pod() if gpu_pod else {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
                                          "spec": {"containers": [{"name": "web", "image": "nginx"}]}}
    new = with_ephemeral(old, {"name": "debugger", "image": "busybox", "env": [VOID], "targetContainerName": "web"})
    assert PROTECT.update(old, new, sub_resource="ephemeralcontainers") == (True, "allowed")


@pytest.mark.parametrize(("container", "needles"), [
    ({"name": "smi", "image": "nvidia/cuda:12", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
     ['ephemeral container "smi" sets NVIDIA_VISIBLE_DEVICES', "remove the variable"]),
    ({"name": "smi", "image": "nvidia/cuda:12", "env": [VOID, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"}]},
     ['"smi" sets NVIDIA_VISIBLE_DEVICES']),
    ({"name": "smi", "image": "nvidia/cuda:12",
      "env": [VOID, {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}]},
     ["NVIDIA_DRIVER_CAPABILITIES"]),
    ({"name": "smi", "image": "nvidia/cuda:12", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {
        "configMapKeyRef": {"name": "x", "key": "devices"}}}]}, ['"smi" sets NVIDIA_VISIBLE_DEVICES']),
    ({"name": "plain", "image": "nvidia/cuda:12"},
     ['"plain" has no NVIDIA_VISIBLE_DEVICES=void', "webhook was probably unavailable", "retry"]),
    ({"name": "peek", "image": "busybox", "env": [VOID], "targetContainerName": SIDECAR_NAME},
     ['"peek" sets targetContainerName: gpufence-enforcer', "--target=<your-container>"]),
    ({"name": "peek", "image": "busybox", "env": [VOID],
      "volumeMounts": [{"name": "gpufence-state", "mountPath": "/state"}]},
     ['"peek" mounts volume "gpufence-state"', "mount your own volumes only"]),
])
def test_ephemeral_attacks_are_refused(container: dict[str, Any], needles: list[str]) -> None:
    old = injected_pod()
    allowed, message = PROTECT.update(old, with_ephemeral(old, container), sub_resource="ephemeralcontainers")
    assert not allowed
    for needle in needles:
        assert needle in message
    assert message.startswith("gpufence: ephemeral container") and "kubectl debug train-1" in message


def test_only_new_ephemeral_containers_are_judged() -> None:
    # One added before gpufence was installed (or by an admin) does not block the next debug session.
    old = with_ephemeral(injected_pod(), {"name": "earlier", "image": "nvidia/cuda:12"})
    new = with_ephemeral(old, {"name": "now", "image": "busybox", "env": [VOID]})
    assert PROTECT.update(old, new, sub_resource="ephemeralcontainers") == (True, "allowed")


def test_admins_may_add_any_ephemeral_container() -> None:
    old = injected_pod()
    new = with_ephemeral(old, {"name": "smi", "image": "nvidia/cuda:12", "targetContainerName": SIDECAR_NAME,
                               "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]})
    assert PROTECT.update(old, new, sub_resource="ephemeralcontainers", groups=("gpufence:admins",))[0]


def test_reserved_volumes_are_the_webhooks() -> None:
    expressions = {v["name"]: v["expression"] for v in POLICY["spec"]["variables"]}
    assert list(_ok(_compile(expressions["reservedVolumes"]).evaluate({}), "reservedVolumes")) == list(
        RESERVED_VOLUMES)


# --- annotations that hand out devices (issue 38 row 1) ---------------------------------------------


def plain_pod() -> dict[str, Any]:
    """A gated pod without a GPU, as the webhook stores it: no sidecar, no status annotation."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "train-1", "namespace": "team-a", "annotations": {"example.com/note": "x"}},
            "spec": {"containers": [{"name": "main", "image": "busybox:1.36",
                                     "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]}}


@pytest.mark.parametrize("key", ["nvidia.cdi.k8s.io/container.main", "nvidia.cdi.k8s.io/pod", "nvidia.cdi.k8s.io",
                                 "cdi.k8s.io/x_GPU-0", "devices.noderesource.dev/pod", "io.kubernetes.cri-o.Devices"])
@pytest.mark.parametrize("make", [plain_pod, injected_pod], ids=["non-gpu-pod", "gpu-pod"])
def test_a_device_annotation_cannot_be_added_to_a_running_pod(key: str, make: Any) -> None:
    old = make()
    new = changed(old, lambda p: p["metadata"]["annotations"].update({key: "nvidia.com/gpu=all"}))
    allowed, message = PROTECT.update(old, new)
    assert not allowed
    assert f'adds the annotation {key}="nvidia.com/gpu=all", which a component of a GPU node' in message
    assert "admin-groups" in message and 'resources.limits["nvidia.com/gpu"]' in message
    assert PROTECT.update(old, new, groups=("gpufence:admins",)) == (True, "allowed")


@pytest.mark.parametrize("verb", ["changes", "removes"])
def test_a_device_annotation_cannot_change_or_go(verb: str) -> None:
    key = "nvidia.cdi.k8s.io/pod"
    old = changed(plain_pod(), lambda p: p["metadata"]["annotations"].update({key: "nvidia.com/gpu=0"}))
    change = (lambda p: p["metadata"]["annotations"].pop(key)) if verb == "removes" else \
        (lambda p: p["metadata"]["annotations"].update({key: "x" * 500}))
    allowed, message = PROTECT.update(old, changed(old, change))
    assert not allowed and f"{verb} the annotation {key}" in message
    if verb == "changes":
        assert "(500 characters)" in message  # a long value is not repeated


@pytest.mark.parametrize("key", ["example.com/nvidia.cdi.k8s.io", "nvidia.cdi.k8s.io.example.com/x", "mycdi.k8s.io/a"])
def test_look_alike_annotations_pass(key: str) -> None:
    old = plain_pod()
    assert PROTECT.update(old, changed(old, lambda p: p["metadata"]["annotations"].update({key: "1"}))) == (
        True, "allowed")


def test_the_device_annotations_are_the_webhooks() -> None:
    expressions = {v["name"]: v["expression"] for v in POLICY["spec"]["variables"]}
    domains = _ok(_compile(expressions["deviceAnnotationDomains"]).evaluate({}), "deviceAnnotationDomains")
    assert list(domains) == [domain for domain, _ in DEVICE_ANNOTATIONS]


# --- exec and attach -----------------------------------------------------------------------------


@pytest.mark.parametrize("sub_resource", ["exec", "attach"])
def test_exec_and_attach_into_the_sidecar_are_refused(sub_resource: str) -> None:
    allowed, message = PROTECT_EXEC.connect(sub_resource, SIDECAR_NAME)
    assert not allowed
    assert message.startswith(f'gpufence: {sub_resource} into container "gpufence-enforcer" of pod "train-1"')
    assert "kubectl exec train-1 -c <your-container> -- sh" in message


@pytest.mark.parametrize("container", ["trainer", "", None])
@pytest.mark.parametrize("sub_resource", ["exec", "attach"])
def test_exec_and_attach_into_other_containers_pass(sub_resource: str, container: str | None) -> None:
    assert PROTECT_EXEC.connect(sub_resource, container) == (True, "allowed")


def test_admins_may_exec_into_the_sidecar() -> None:
    assert PROTECT_EXEC.connect("exec", SIDECAR_NAME, groups=("system:masters",)) == (True, "allowed")
    protect = Protect({"admin-groups": "oncall"}, policy=EXEC_POLICY)
    assert protect.connect("exec", SIDECAR_NAME, groups=("oncall",)) == (True, "allowed")
    assert not protect.connect("exec", SIDECAR_NAME, groups=("system:masters",))[0]


# --- scope ---------------------------------------------------------------------------------------


def rules_of(policy: dict[str, Any]) -> set[tuple[str, str]]:
    return {(op, r) for rule in policy["spec"]["matchConstraints"]["resourceRules"]
            for op in rule["operations"] for r in rule["resources"]}


def test_scope_is_the_webhooks_namespaces_and_covers_its_update_rules() -> None:
    (config,) = [d for d in _docs(WEBHOOK_CONFIG_FILE) if d["kind"] == "MutatingWebhookConfiguration"]
    webhook = next(w for w in config["webhooks"] if w["name"] == "debug.gpufence.io")
    assert all(w["namespaceSelector"] == webhook["namespaceSelector"] for w in config["webhooks"])
    for policy in POLICIES.values():
        constraints = policy["spec"]["matchConstraints"]
        assert constraints["namespaceSelector"] == webhook["namespaceSelector"]
        assert "objectSelector" not in constraints and "matchConditions" not in policy["spec"]
    assert INJECTION_LABEL in str(webhook["namespaceSelector"]) and INJECTION_ENABLED in str(
        webhook["namespaceSelector"])
    for rule in webhook["rules"]:
        if rule["operations"] != ["CREATE"]:  # creation is the webhook's alone (failurePolicy Fail)
            assert {(op, r) for op in rule["operations"] for r in rule["resources"]} <= rules_of(POLICY)
    assert rules_of(POLICY) == {("UPDATE", "pods"), ("UPDATE", "pods/ephemeralcontainers"),
                                ("UPDATE", "pods/resize")}
    # A policy of its own: the API server type-checks against the kinds the rules resolve to (Pod).
    assert rules_of(EXEC_POLICY) == {("CONNECT", "pods/exec"), ("CONNECT", "pods/attach")}
    # Never the kubelet's or the scheduler's writes, never deletion.
    everything = rules_of(POLICY) | rules_of(EXEC_POLICY)
    assert not {r for _, r in everything} & {"pods/status", "pods/binding", "pods/eviction"}
    assert not {op for op, _ in everything} & {"DELETE", "CREATE"}


@pytest.mark.parametrize("name", ["gpufence-protect", "gpufence-protect-exec"])
def test_the_bindings_fail_closed_on_the_shared_policy_configmap(name: str) -> None:
    (configmap,) = _docs(POLICY_CONFIGMAP_FILE)
    policy, binding = POLICIES[name], BINDINGS[name]
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "ConfigMap"}
    assert binding["spec"]["policyName"] == name
    assert binding["spec"]["paramRef"]["name"] == configmap["metadata"]["name"]
    assert binding["spec"]["paramRef"]["namespace"] == "gpufence"
    assert binding["spec"]["paramRef"]["parameterNotFoundAction"] == "Deny"
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_the_admin_groups_variables_are_the_same_in_both_policies() -> None:
    def admin_variables(policy: dict[str, Any]) -> list[dict[str, str]]:
        wanted = ("clusterPolicy", "adminGroupsText", "adminGroups", "isAdmin")
        return [v for v in policy["spec"]["variables"] if v["name"] in wanted]

    assert admin_variables(POLICY) == admin_variables(EXEC_POLICY) and len(admin_variables(POLICY)) == 4


# --- properties ----------------------------------------------------------------------------------

# Changes as the API server hands them over: typed as in a Pod (validation runs before validating
# admission), fields omitted rather than null, an image a non-empty string.
_TEXT = st.text("ab:/.", min_size=1, max_size=6)
_CHANGES = st.one_of(
    st.tuples(st.just("image"), _TEXT),
    st.tuples(st.sampled_from(["command", "args"]), st.lists(_TEXT, max_size=3)),
    st.tuples(st.just("workingDir"), _TEXT),
    st.tuples(st.just("imagePullPolicy"), st.sampled_from(["Always", "Never"])),
    st.tuples(st.just("env"), st.lists(st.fixed_dictionaries({"name": _TEXT, "value": _TEXT}), max_size=2)),
    st.tuples(st.just("volumeMounts"),
              st.lists(st.fixed_dictionaries({"name": _TEXT, "mountPath": _TEXT}), max_size=2)),
    st.tuples(st.just("securityContext"), st.fixed_dictionaries(
        {}, optional={"runAsUser": st.integers(0, 2), "privileged": st.booleans()})),
)


@given(change=_CHANGES, native=st.booleans())
@hypothesis_settings(max_examples=60, deadline=None)
def test_every_change_to_the_sidecar_is_refused(change: tuple[str, Any], native: bool) -> None:
    field, value = change
    old = injected_pod(native=native)
    new = changed(old, lambda p: sidecar_of(p).__setitem__(field, value))
    assume(new != old)
    allowed, message = PROTECT.update(old, new)
    assert not allowed and 'container "gpufence-enforcer"' in message


@given(change=_CHANGES)
@hypothesis_settings(max_examples=40, deadline=None)
def test_changes_to_the_workload_container_pass(change: tuple[str, Any]) -> None:
    # The API server's own validation decides which of these a pod UPDATE may make; gpufence does not.
    field, value = change
    old = injected_pod()
    new = changed(old, lambda p: p["spec"]["containers"][0].__setitem__(field, value))
    assert PROTECT.update(old, new) == (True, "allowed")
