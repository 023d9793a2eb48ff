"""The guard ValidatingAdmissionPolicy (k8s/base/guard-policy.yaml), evaluated with cel-python.

The policy's CEL is written in the subset that both Kubernetes (1.30) and cel-python 0.5 support:
``has()``, ``exists``, ternaries, ``in`` on maps and lists, string concatenation. No optional
syntax (``.?``/``orValue``, a parse error in celpy) and no Kubernetes library functions (e.g.
``join``, undeclared in celpy). What celpy cannot tell us (Kubernetes' type checker and CEL cost
estimate) is listed in docs/install.md, "What is not checked".

The admission flow is simulated as the API server runs it: the policy's namespaceSelector and
objectSelector (label selectors, evaluated here in Python), then the matchConditions, then the
variables in order, then the validations. ``params`` is the cluster policy ConfigMap
(k8s/base/policy-configmap.yaml, the binding's paramRef): as shipped unless a test gives its data.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes
from hypothesis import event, example, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from gpufence.contract import (
    ANNOTATION_STATUS,
    INJECTION_ENABLED,
    INJECTION_LABEL,
    MIRROR_POD_ANNOTATION,
    POD_OPT_OUT_LABEL,
    SIDECAR_NAME,
    ContainerShare,
    MemoryShare,
    Mode,
)
from gpufence.webhook.settings import DEFAULT_GPU_RESOURCE, DEFAULT_SIDECAR_IMAGE, InjectionSettings
from gpufence.webhook.shares import SharePlan
from gpufence.webhook.sidecar import build_sidecar, pod_volumes
from tests.support.k8s_cel import FUNCTIONS as K8S_FUNCTIONS
from tests.unit.webhook.test_admission import good_pods

ROOT = Path(__file__).resolve().parents[3]
POLICY_FILE = ROOT / "k8s" / "base" / "guard-policy.yaml"
POLICY_CONFIGMAP_FILE = ROOT / "k8s" / "base" / "policy-configmap.yaml"
WEBHOOK_CONFIG_FILE = ROOT / "k8s" / "base" / "mutatingwebhookconfiguration.yaml"

_ENV = celpy.Environment()

# Who creates the pod in these tests unless a test says otherwise: a ServiceAccount, not a node.
TENANT_USER = "system:serviceaccount:team-a:default"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _policy() -> dict[str, Any]:
    (policy,) = [d for d in _docs(POLICY_FILE) if d["kind"] == "ValidatingAdmissionPolicy"]
    return policy


POLICY = _policy()
(POLICY_CONFIGMAP,) = _docs(POLICY_CONFIGMAP_FILE)
SHIPPED_POLICY: dict[str, str] = dict(POLICY_CONFIGMAP["data"])


def _compile(expression: str) -> celpy.Runner:
    return _ENV.program(_ENV.compile(expression), functions=K8S_FUNCTIONS)


class Guard:
    """A compiled copy of the policy, judging with the cluster policy ConfigMap as its params."""

    def __init__(self, policy: dict[str, Any], policy_data: Mapping[str, str] | None = None, *,
                 params: dict[str, Any] | None = None) -> None:
        """``policy_data``: the ConfigMap's data (default: as shipped); ``params``: the whole ConfigMap."""
        spec = policy["spec"]
        self.spec = spec
        if params is None:
            params = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": dict(POLICY_CONFIGMAP["metadata"]),
                      "data": dict(SHIPPED_POLICY if policy_data is None else policy_data)}
        self.params = celpy.json_to_cel(params)
        self.match_conditions = [(m["name"], _compile(m["expression"])) for m in spec.get("matchConditions", [])]
        self.variables = [(v["name"], _compile(v["expression"])) for v in spec.get("variables", [])]
        self.validations = [
            (_compile(v["expression"]), _compile(v["messageExpression"]) if "messageExpression" in v else None, v)
            for v in spec["validations"]
        ]

    def selected(self, namespace_labels: dict[str, str], pod: dict[str, Any]) -> bool:
        constraints = self.spec["matchConstraints"]
        return _selector_matches(constraints.get("namespaceSelector", {}), namespace_labels) and _selector_matches(
            constraints.get("objectSelector", {}), pod.get("metadata", {}).get("labels", {})
        )

    def admit(self, pod: dict[str, Any], namespace: str = "team-a", namespace_labels: dict[str, str] | None = None,
              namespace_annotations: dict[str, str] | None = None, username: str = TENANT_USER):
        """(allowed, message): the outcome for a pod CREATE in ``namespace`` by ``username``."""
        if namespace_labels is None:
            namespace_labels = {INJECTION_LABEL: INJECTION_ENABLED}
        namespace_labels = {**namespace_labels, "kubernetes.io/metadata.name": namespace}
        if not self.selected(namespace_labels, pod):
            return True, "not selected"
        namespace_object: dict[str, Any] = {"metadata": {"name": namespace, "labels": namespace_labels}}
        if namespace_annotations is not None:
            namespace_object["metadata"]["annotations"] = namespace_annotations
        activation: dict[str, Any] = {"object": celpy.json_to_cel(pod), "params": self.params,
                                      "namespaceObject": celpy.json_to_cel(namespace_object),
                                      "request": _request(username, namespace)}
        for name, program in self.match_conditions:
            if not _boolean(program.evaluate(activation), f"matchCondition {name}"):
                return True, f"matchCondition {name} is false"
        activation["variables"] = self._variables(activation)
        for program, message_program, validation in self.validations:
            if not _boolean(program.evaluate(activation), validation["expression"]):
                if message_program is None:
                    return False, validation["message"]
                message = message_program.evaluate(activation)
                assert isinstance(message, str), f"messageExpression gave {message!r}"  # StringType subclasses str
                return False, str(message)
        return True, "allowed"

    def variables_for(self, pod: dict[str, Any], namespace: str = "team-a") -> dict[str, Any]:
        """Every variable's value for a CREATE of ``pod`` in an opted-in ``namespace`` without annotations."""
        namespace_object = {"metadata": {"name": namespace, "labels": {INJECTION_LABEL: INJECTION_ENABLED}}}
        activation = {"object": celpy.json_to_cel(pod), "params": self.params,
                      "namespaceObject": celpy.json_to_cel(namespace_object),
                      "request": _request(TENANT_USER, namespace)}
        return dict(self._variables(activation))

    def _variables(self, activation: dict[str, Any]) -> celtypes.MapType:
        variables: dict[str, Any] = {}
        for name, program in self.variables:
            activation["variables"] = celtypes.MapType({celtypes.StringType(k): v for k, v in variables.items()})
            value = program.evaluate(activation)
            assert not isinstance(value, celpy.CELEvalError), f"variable {name}: {value}"
            variables[name] = value
        return celtypes.MapType({celtypes.StringType(k): v for k, v in variables.items()})


def _request(username: str, namespace: str) -> Any:
    """The admission request as CEL sees it (the fields the policy reads)."""
    return celpy.json_to_cel({"operation": "CREATE", "namespace": namespace, "userInfo": {"username": username}})


def _boolean(value: Any, what: str) -> bool:
    assert not isinstance(value, celpy.CELEvalError), f"{what}: evaluation error {value}"
    assert isinstance(value, celtypes.BoolType), f"{what}: not a bool: {value!r}"
    return bool(value)


def _selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels AND matchExpressions)."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def policy_data_for(settings: InjectionSettings) -> dict[str, str]:
    """The ConfigMap data, for the keys the guard reads, that the webhook parses into ``settings``."""
    return {
        "sidecar-image": settings.sidecar_image,
        "gpu-resource-name": ",".join(settings.gpu_resource_names),
        "exclusive-gpu-resource-name": ",".join(settings.exclusive_gpu_resource_names),
        "non-gpu-resource-claims": ",".join(settings.non_gpu_resource_claims),
        "kai-scheduler-name": ",".join(settings.kai_scheduler_names),
        "default-mode": settings.default_mode,
        "allow-audit": str(settings.allow_audit).lower(),
        "allow-opt-out": str(settings.allow_opt_out).lower(),
        "max-memory": settings.max_memory or "",
        "max-compute": settings.max_compute or "",
        "default-memory": settings.default_memory or "",
        "default-compute": settings.default_compute or "",
        "sidecar-poll-interval": repr(settings.poll_interval_seconds),
        "sidecar-nvidia-visible-devices": settings.nvidia_visible_devices,
        "sidecar-mode": "native" if settings.native_sidecar else "container",
        "sidecar-image-pull-policy": settings.sidecar_image_pull_policy,
        "sidecar-nvidia-driver-capabilities": settings.nvidia_driver_capabilities,
        "sidecar-mount-host-proc": str(settings.mount_host_proc).lower(),
        "sidecar-host-proc-mount-path": settings.host_proc_mount_path,
        "sidecar-metrics-port": str(settings.metrics_port),
        "sidecar-cpu-request": settings.sidecar_cpu_request,
        "sidecar-cpu-limit": settings.sidecar_cpu_limit or "none",
        "sidecar-memory-request": settings.sidecar_memory_request,
        "sidecar-memory-limit": settings.sidecar_memory_limit,
        "void-non-gpu-containers": str(settings.void_non_gpu_containers).lower(),
        "driver-memory-limits": settings.driver_memory_limits,
        "mps-limits": str(settings.mps_limits).lower(),
        "preload-library": settings.preload_library_host_path or "",
    }


GUARD = Guard(POLICY)


def status(containers: list[str]) -> str:
    """The webhook's status annotation naming ``containers`` as the GPU containers."""
    return json.dumps({"containers": containers, "mode": "enforce", "sidecar": SIDECAR_NAME, "version": "0.1.0"},
                      separators=(",", ":"))


def pod(
    *,
    gpu_in: str | None = "limits",
    init_gpu: bool = False,
    sidecar: str | None = None,
    share: bool | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    resource: str = DEFAULT_GPU_RESOURCE,
) -> dict[str, Any]:
    """A pod as the API server passes it to validation (only the fields the policy reads)."""
    main: dict[str, Any] = {"name": "train", "image": "cuda:12"}
    if gpu_in:
        main["resources"] = {gpu_in: {resource: "1", "memory": "1Gi"}}
    spec: dict[str, Any] = {"containers": [main]}
    if init_gpu:
        spec["initContainers"] = [
            {"name": "warmup", "image": "cuda:12", "resources": {"limits": {resource: "1"}}},
        ]
    if not gpu_in:  # what the webhook gives a container without a device
        main["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    # A real injection's parts: the sidecar build_sidecar makes for an 8Gi share per GPU
    # container (placement as ``sidecar`` says: the shipped policy wants "native"), its volume, the
    # status annotation.
    gpu_names = (["train"] if gpu_in else []) + (["warmup"] if init_gpu else [])
    gpu_share = ContainerShare(memory=MemoryShare(bytes=8 << 30), gpus=1)
    plan = SharePlan(containers=tuple((n, gpu_share) for n in gpu_names), mode=Mode.ENFORCE,
                     grace_period_seconds=10.0)
    settings = InjectionSettings(native_sidecar=sidecar == "native")
    if sidecar:
        enforcer = build_sidecar(plan, settings)
        spec.setdefault("initContainers" if sidecar == "native" else "containers", []).insert(
            0 if sidecar == "native" else 1, enforcer)
        spec["volumes"] = pod_volumes(settings)
    if share is not None:
        spec["shareProcessNamespace"] = share
    metadata: dict[str, Any] = {"generateName": "job-", "namespace": "team-a"}
    if labels:
        metadata["labels"] = labels
    if sidecar:
        annotations = {ANNOTATION_STATUS: status(gpu_names), **(annotations or {})}
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def test_gpu_pod_without_sidecar_is_denied_with_a_clear_message() -> None:
    allowed, message = GUARD.admit(pod())
    assert not allowed
    assert "gpufence-enforcer" in message and "shareProcessNamespace" in message
    assert "webhook" in message


@pytest.mark.parametrize("placement", ["native", "container"])
def test_gpu_pod_with_sidecar_and_shared_pid_namespace_is_allowed(placement: str) -> None:
    guard = Guard(POLICY, {**SHIPPED_POLICY, "sidecar-mode": placement})
    assert guard.admit(pod(sidecar=placement, share=True)) == (True, "allowed")


def test_the_sidecar_must_be_where_the_policy_puts_it() -> None:
    """sidecar-mode native (as shipped): a regular container does not start before the workload."""
    allowed, message = GUARD.admit(pod(sidecar="container", share=True))
    assert not allowed and "it is not in spec.initContainers with restartPolicy: Always" in message
    container_mode = Guard(POLICY, {**SHIPPED_POLICY, "sidecar-mode": "container"})
    allowed, message = container_mode.admit(pod(sidecar="native", share=True))
    assert not allowed and "it is not in spec.containers" in message


@pytest.mark.parametrize("share", [None, False])
def test_sidecar_without_shared_pid_namespace_is_denied(share: bool | None) -> None:
    allowed, message = GUARD.admit(pod(sidecar="native", share=share))
    assert not allowed
    assert "shareProcessNamespace" in message and "has no gpufence-enforcer" not in message


def test_shared_pid_namespace_without_sidecar_is_denied() -> None:
    allowed, message = GUARD.admit(pod(share=True))
    assert not allowed
    assert "has no gpufence-enforcer sidecar" in message and "shareProcessNamespace" not in message.split(".")[0]


def test_gpu_in_requests_only_is_checked() -> None:
    assert not GUARD.admit(pod(gpu_in="requests"))[0]


def test_gpu_in_init_container_only_is_checked() -> None:
    assert not GUARD.admit(pod(gpu_in=None, init_gpu=True))[0]
    assert GUARD.admit(pod(gpu_in=None, init_gpu=True, sidecar="native", share=True))[0]


@pytest.mark.parametrize("gpu_in", ["limits", "requests"])
def test_zero_gpus_is_no_gpu_for_the_guard_and_the_webhook(gpu_in: str) -> None:
    """`nvidia.com/gpu: 0` (canonical, as the API server passes it) asks for no GPU: one definition."""
    from gpufence.webhook.gpu_paths import PodGpuPaths

    zero = pod(gpu_in=gpu_in)
    zero["spec"]["containers"][0]["resources"][gpu_in][DEFAULT_GPU_RESOURCE] = "0"
    zero["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert PodGpuPaths(zero["spec"], InjectionSettings()).gpu_container_names() == []
    assert GUARD.admit(zero) == (True, "allowed")
    one = pod(gpu_in=gpu_in)
    assert PodGpuPaths(one["spec"], InjectionSettings()).gpu_container_names() == ["train"]
    assert not GUARD.admit(one)[0]


@pytest.mark.parametrize(
    "forgery",
    [
        lambda p: p["metadata"].pop("annotations"),  # no status annotation
        lambda p: p["spec"]["initContainers"][0].update(image="busybox"),  # another image
        lambda p: p["spec"]["initContainers"][0].update(command=["sleep", "inf"]),  # another command
        lambda p: p["spec"]["initContainers"][0].pop("command"),
        lambda p: p["metadata"]["annotations"].update({ANNOTATION_STATUS: "{}"}),  # a status without the sidecar
    ],
)
def test_a_container_merely_named_like_the_sidecar_does_not_pass(forgery: Any) -> None:
    """While the webhook is down, a user container named gpufence-enforcer is not the enforcer."""
    real = pod(sidecar="native", share=True)
    assert GUARD.admit(real) == (True, "allowed")
    forged = copy.deepcopy(real)
    forgery(forged)
    allowed, message = GUARD.admit(forged)
    assert not allowed and "has no gpufence-enforcer sidecar" in message


def test_the_shipped_sidecar_image_is_this_release() -> None:
    """The webhook and the guard read the image from the ConfigMap; as shipped it is the webhook's own."""
    assert SHIPPED_POLICY["sidecar-image"] == DEFAULT_SIDECAR_IMAGE
    assert GUARD.variables_for(pod())["sidecarImage"] == DEFAULT_SIDECAR_IMAGE
    elsewhere = Guard(POLICY, {**SHIPPED_POLICY, "sidecar-image": "registry.example.com/gpufence:1"})
    assert not elsewhere.admit(pod(sidecar="native", share=True))[0]  # the image of the default sidecar


def test_non_gpu_pod_is_allowed() -> None:
    assert GUARD.admit(pod(gpu_in=None)) == (True, "allowed")


@pytest.mark.parametrize(
    "spec",
    [
        {"containers": [{"name": "app", "image": "busybox"}]},  # no resources, no initContainers
        {"containers": [{"name": "app", "image": "busybox", "resources": {}}]},
        {"containers": [{"name": "app", "image": "busybox", "resources": {"limits": {}, "requests": {}}}]},
        {"containers": [{"name": "app", "image": "busybox"}], "initContainers": []},
    ],
)
def test_absent_fields_do_not_cause_evaluation_errors(spec: dict[str, Any]) -> None:
    """(The harness fails on an evaluation error.) Without the webhook's void, the pod is refused."""
    allowed, message = GUARD.admit({"metadata": {"name": "p"}, "spec": spec})
    assert not allowed and 'container "app" requests no GPU and has no NVIDIA_VISIBLE_DEVICES' in message
    for container in spec["containers"]:
        container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert GUARD.admit({"metadata": {"name": "p"}, "spec": spec}) == (True, "allowed")


def test_opt_out_is_honoured_only_where_the_namespace_allows_it() -> None:
    opted_out = pod(labels={POD_OPT_OUT_LABEL: "false"})
    allowed, message = GUARD.admit(opted_out)
    assert not allowed
    assert 'gpufence.io/inject="false"' in message and '"team-a" does not allow' in message
    assert "gpufence.io/allow-opt-out" in message
    assert not GUARD.admit(opted_out, namespace_annotations={"gpufence.io/allow-opt-out": "false"})[0]
    assert GUARD.admit(opted_out, namespace_annotations={"gpufence.io/allow-opt-out": "true"}) == (True, "allowed")
    # Any other value of the label does not opt out (same as the webhook).
    labelled = pod(labels={POD_OPT_OUT_LABEL: "true"})
    assert not GUARD.admit(labelled, namespace_annotations={"gpufence.io/allow-opt-out": "true"})[0]
    # A pod that requests no GPU is never the guard's business, opted out or not.
    assert GUARD.admit(pod(gpu_in=None, labels={POD_OPT_OUT_LABEL: "false"})) == (True, "allowed")


def test_the_cluster_wide_opt_out_is_read_from_the_policy_configmap() -> None:
    assert SHIPPED_POLICY["allow-opt-out"] == "false"  # the safe default, like the webhook's
    widened = Guard(POLICY, {**SHIPPED_POLICY, "allow-opt-out": "true"})
    opted_out = pod(labels={POD_OPT_OUT_LABEL: "false"})
    assert widened.admit(opted_out) == (True, "allowed")
    # The namespace's own "false" still wins over the cluster-wide default.
    assert not widened.admit(opted_out, namespace_annotations={"gpufence.io/allow-opt-out": "false"})[0]


def test_mirror_pods_are_excluded_by_a_match_condition_when_a_node_creates_them() -> None:
    allowed, why = GUARD.admit(pod(annotations={MIRROR_POD_ANNOTATION: "abc"}), username="system:node:gpu-1")
    assert allowed and why.startswith("matchCondition")
    assert not GUARD.admit(pod(annotations={"example.com/other": "x"}), username="system:node:gpu-1")[0]


@pytest.mark.parametrize("username", [TENANT_USER, "system:nodes", "alice", "system:node", "x:system:node:gpu-1"])
def test_a_mirror_annotation_from_anyone_but_a_node_exempts_nothing(username: str) -> None:
    allowed, message = GUARD.admit(pod(annotations={MIRROR_POD_ANNOTATION: "abc"}), username=username)
    assert not allowed and "has no gpufence-enforcer sidecar" in message


@pytest.mark.parametrize(
    ("namespace", "labels"),
    [
        ("team-b", {}),
        ("team-b", {INJECTION_LABEL: "disabled"}),
        ("gpufence", {INJECTION_LABEL: INJECTION_ENABLED}),
        ("kube-system", {INJECTION_LABEL: INJECTION_ENABLED}),
        ("kube-node-lease", {INJECTION_LABEL: INJECTION_ENABLED}),
    ],
)
def test_namespaces_not_opted_in_or_excluded_are_not_selected(namespace: str, labels: dict[str, str]) -> None:
    assert GUARD.admit(pod(), namespace=namespace, namespace_labels=labels) == (True, "not selected")


def test_gpu_resource_names_are_read_from_the_policy_configmap() -> None:
    assert SHIPPED_POLICY["gpu-resource-name"] == ",".join(InjectionSettings().gpu_resource_names)
    other = pod(resource="amd.com/gpu")
    other["spec"]["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert GUARD.admit(other)[0]
    widened = Guard(POLICY, {**SHIPPED_POLICY, "gpu-resource-name": f"{DEFAULT_GPU_RESOURCE}, amd.com/gpu"})
    assert not widened.admit(other)[0]
    assert not widened.admit(pod())[0]


def test_policy_scope_matches_the_webhook_configuration() -> None:
    """The guard must select exactly the pods the webhook is asked to mutate."""
    (config,) = [d for d in _docs(WEBHOOK_CONFIG_FILE) if d["kind"] == "MutatingWebhookConfiguration"]
    (webhook,) = config["webhooks"]
    constraints = POLICY["spec"]["matchConstraints"]
    assert constraints["namespaceSelector"] == webhook["namespaceSelector"]
    assert "objectSelector" not in constraints and "objectSelector" not in webhook  # opt-out is decided inside
    # The webhook's UPDATE rule (pods/ephemeralcontainers) is the protect policy's scope
    # (tests/unit/protect/test_protect_policy.py); pod creation is the guard's.
    assert constraints["resourceRules"] == [r for r in webhook["rules"] if r["operations"] == ["CREATE"]]
    assert POLICY["spec"]["failurePolicy"] == "Fail"
    (binding,) = [d for d in _docs(POLICY_FILE) if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == POLICY["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_the_guard_reads_the_policy_configmap_and_refuses_without_it() -> None:
    """One source: the binding's params are the ConfigMap the webhook reads; missing, it fails closed."""
    assert POLICY["spec"]["paramKind"] == {"apiVersion": "v1", "kind": "ConfigMap"}
    (binding,) = [d for d in _docs(POLICY_FILE) if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    metadata = POLICY_CONFIGMAP["metadata"]
    assert binding["spec"]["paramRef"] == {"name": metadata["name"], "namespace": metadata["namespace"],
                                           "parameterNotFoundAction": "Deny"}
    assert (metadata["namespace"], metadata["name"]) == ("gpufence", "gpufence-policy")


def test_a_pod_mutated_by_the_webhook_passes_the_guard() -> None:
    """Contract between gpufence/webhook/admission.py and the policy: mutation output satisfies the guard."""
    import jsonpatch

    from gpufence.webhook import admission, client
    from gpufence.webhook.settings import AllNamespacesOptedIn, InjectionSettings

    original = pod()
    original["metadata"]["annotations"] = {"gpufence.io/memory": "4Gi"}
    payload = client.pod_admission_review(
        copy.deepcopy(original), uid="0b0c7c1e-0000-4000-8000-000000000001", namespace="team-a", username="alice"
    )
    for settings in (InjectionSettings(), InjectionSettings(native_sidecar=False)):
        result = admission.review(copy.deepcopy(payload), settings, AllNamespacesOptedIn())
        response = result.review["response"]
        assert response["allowed"] is True
        assert result.outcome == "mutated", result.outcome
        patch = json.loads(base64.b64decode(response["patch"]))
        mutated = jsonpatch.apply_patch(copy.deepcopy(original), patch)
        assert Guard(POLICY, policy_data_for(settings)).admit(mutated) == (True, "allowed")


# --- the guard and the webhook on the same inputs ---------------------------------------------


def _golden_cases() -> list[str]:
    from tests.unit.webhook.test_golden import CASES

    return CASES


@pytest.mark.parametrize("case", _golden_cases())
def test_the_guard_agrees_with_the_webhook_on_every_golden_case(case: str) -> None:
    """What the webhook mutates passes the guard, and the same pod sent unmutated (the webhook down)
    is denied (a GPU pod for want of the sidecar, any other for want of its NVIDIA_VISIBLE_DEVICES=void);
    what it admits unmutated in an opted-in namespace the guard admits too; what it denies, the guard
    denies."""
    from tests.unit.webhook.test_golden import GOLDEN, load_case, username_of

    pod_in, settings, lookup, operation = load_case(case)
    username = username_of(case)
    expected = yaml.safe_load((GOLDEN / f"{case}.out.yaml").read_text())
    info = lookup.get(pod_in["metadata"].get("namespace", ""))
    if operation != "CREATE" or info is None or not info.opted_in:
        return  # outside the guard's scope (it matches CREATE in opted-in namespaces only)
    guard = Guard(POLICY, policy_data_for(settings))
    namespace, labels, ns_annotations = info.name, dict(info.labels), dict(info.annotations)
    outcome = expected["outcome"]
    unmutated = guard.admit(pod_in, namespace, labels, ns_annotations, username)
    if outcome == "mutated":
        output = guard.admit(expected["pod"], namespace, labels, ns_annotations, username)
        assert output[0], f"the output fails the guard: {output[1]}"
        assert not unmutated[0], "the pod the webhook mutates passes the guard unmutated"
    elif outcome in ("unchanged", "skipped"):
        assert unmutated[0], f"the guard denies what the webhook admits: {unmutated[1]}"
    else:
        assert not unmutated[0], "the guard admits what the webhook denies"


@pytest.mark.parametrize("label", [None, "false", "true"])
@pytest.mark.parametrize("ns_annotations", [{}, {"gpufence.io/allow-opt-out": "true"},
                                            {"gpufence.io/allow-opt-out": "false"}])
@pytest.mark.parametrize("gpu", [True, False])
def test_the_guard_and_the_webhook_agree_on_opt_out(label: str | None, ns_annotations: dict[str, str],
                                                    gpu: bool) -> None:
    """A pod the webhook skips is admitted by the guard unmutated; one it denies, the guard denies."""
    from gpufence.webhook import admission, client
    from gpufence.webhook.settings import InjectionSettings, NamespaceInfo

    class Lookup:
        def get(self, name: str) -> NamespaceInfo:
            return NamespaceInfo(name=name, labels={INJECTION_LABEL: INJECTION_ENABLED}, annotations=ns_annotations)

    candidate = pod(gpu_in="limits" if gpu else None, labels={POD_OPT_OUT_LABEL: label} if label else None,
                    annotations={"gpufence.io/memory": "4Gi"})
    payload = client.pod_admission_review(copy.deepcopy(candidate), uid="u", namespace="team-a")
    outcome = admission.review(payload, InjectionSettings(), Lookup()).outcome
    allowed, message = GUARD.admit(candidate, namespace_annotations=ns_annotations)
    if outcome in ("skipped", "unchanged"):
        assert allowed, message
    elif outcome == "denied":
        assert not allowed and "gpufence.io/inject" in message
    else:
        # Unmutated (the webhook down): a GPU pod is refused, and so is one without GPUs, for want of
        # the NVIDIA_VISIBLE_DEVICES=void the webhook would have added.
        assert outcome == "mutated" and not allowed


@pytest.mark.parametrize(
    ("gpu", "container", "entry", "denied"),
    [
        (False, "app", {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, True),
        (False, "app", {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}, False),
        (False, "app", {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "none"}, False),
        (False, "app", {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}, True),
        (False, "app", {"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
         True),
        (True, "train", {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0,1,2,3"}, True),
        (False, SIDECAR_NAME, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}, True),  # no GPU pod, no exception
        (False, "app", {"name": "OTHER", "value": "all"}, False),
    ],
)
def test_the_guard_and_the_webhook_close_the_nvidia_side_door(gpu: bool, container: str, entry: dict[str, Any],
                                                               denied: bool) -> None:
    from gpufence.webhook import admission, client
    from gpufence.webhook.settings import AllNamespacesOptedIn, InjectionSettings

    candidate = pod(gpu_in="limits" if gpu else None, annotations={"gpufence.io/memory": "4Gi"})
    candidate["spec"]["containers"].append({"name": container, "image": "cuda:12", "env": [entry]})
    if gpu and container == "train":
        candidate["spec"]["containers"] = [candidate["spec"]["containers"][0]]
        candidate["spec"]["containers"][0]["env"] = [entry]
    payload = client.pod_admission_review(copy.deepcopy(candidate), uid="u", namespace="team-a")
    result = admission.review(payload, InjectionSettings(), AllNamespacesOptedIn())
    allowed, message = GUARD.admit(candidate)
    if denied:
        assert result.outcome == "denied"
        webhook_message = result.review["response"]["status"]["message"]
        for text in (webhook_message, message):
            assert f'container "{container}"' in text and entry["name"][:10] in text and '"void"' in text
        assert not allowed
    else:
        assert result.outcome != "denied"
        # A GPU pod sent unmutated is refused for want of the sidecar, any other for want of the
        # void in each container (unless the container sets NVIDIA_VISIBLE_DEVICES=void itself).
        assert allowed == (not gpu and entry["name"] == "NVIDIA_VISIBLE_DEVICES")
    if gpu and not denied:
        patch = json.loads(base64.b64decode(result.review["response"]["patch"]))
        import jsonpatch

        assert GUARD.admit(jsonpatch.apply_patch(candidate, patch)) == (True, "allowed")


def test_the_sidecar_of_a_mutated_pod_keeps_its_nvml_access() -> None:
    """The injected sidecar sets NVIDIA_VISIBLE_DEVICES=all; in a GPU pod that is the one exception."""
    import jsonpatch

    from gpufence.webhook import admission, client
    from gpufence.webhook.settings import AllNamespacesOptedIn, InjectionSettings

    original = pod(annotations={"gpufence.io/memory": "4Gi"})
    payload = client.pod_admission_review(copy.deepcopy(original), uid="u", namespace="team-a")
    result = admission.review(payload, InjectionSettings(), AllNamespacesOptedIn())
    mutated = jsonpatch.apply_patch(original, json.loads(base64.b64decode(result.review["response"]["patch"])))
    assert GUARD.admit(mutated) == (True, "allowed")
    again = admission.review(client.pod_admission_review(mutated, uid="u", namespace="team-a"),
                             InjectionSettings(), AllNamespacesOptedIn())
    assert again.outcome == "unchanged"


_namespace_variants = st.sampled_from([
    {}, {"gpufence.io/allow-opt-out": "true"}, {"gpufence.io/allow-audit": "true"},
    {"gpufence.io/max-memory": "25%", "gpufence.io/mode": "audit"},
    {"gpufence.io/max-memory": "20Gi", "gpufence.io/max-compute": "50"},
    {"gpufence.io/max-memory": "30%", "gpufence.io/default-compute": "25%"},
    {"gpufence.io/default-memory": "4Gi", "gpufence.io/allow-audit": "true"},
])
_label_variants = st.sampled_from([None, {POD_OPT_OUT_LABEL: "false"}, {POD_OPT_OUT_LABEL: "true"}, {"app": "x"}])


@hypothesis_settings(max_examples=200)
@given(good_pods, _namespace_variants, _label_variants)
# An author's container under the sidecar's name after a GPU init container: the webhook kept it
# there (behind the GPU init container, which the guard refuses); it denies the pod now.
@example(
    candidate={"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {
        "containers": [{"name": "a", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        "initContainers": [{"name": "i1", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                           {"name": SIDECAR_NAME, "image": "i", "resources": {"limits": {"nvidia.com/gpu": "0"}}}]}},
    ns_annotations={}, labels=None,
)
def test_the_guard_agrees_with_the_webhook_on_generated_pods(candidate: dict[str, Any], ns_annotations: dict[str, str],
                                                             labels: dict[str, str] | None) -> None:
    """What the webhook admits as is the guard admits; what it mutates passes the guard; a pod it
    would mutate is refused by the guard when sent unmutated (the webhook down); what it denies,
    the guard denies."""
    import jsonpatch

    from gpufence.webhook import admission, client
    from gpufence.webhook.settings import InjectionSettings, NamespaceInfo

    class Lookup:
        def get(self, name: str) -> NamespaceInfo:
            return NamespaceInfo(name=name, labels={INJECTION_LABEL: INJECTION_ENABLED}, annotations=ns_annotations)

    if labels is not None:
        candidate["metadata"]["labels"] = labels
    payload = client.pod_admission_review(copy.deepcopy(candidate), uid="u", namespace="team-a")
    result = admission.review(payload, InjectionSettings(), Lookup())
    event(result.outcome)
    unmutated, _ = GUARD.admit(candidate, namespace_annotations=ns_annotations)
    if result.outcome in ("skipped", "unchanged"):
        assert unmutated, "the guard refuses a pod the webhook admits as it is"
    elif result.outcome == "mutated":
        patch = json.loads(base64.b64decode(result.review["response"]["patch"]))
        mutated = jsonpatch.apply_patch(candidate, patch)
        assert GUARD.admit(mutated, namespace_annotations=ns_annotations)[0], "the webhook's output fails the guard"
        assert not unmutated, "a pod the webhook mutates passes the guard unmutated"
    else:
        assert not unmutated, "the guard admits a pod the webhook denies"
