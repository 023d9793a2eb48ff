"""The desired pod, the sidecar and each GPU container's part of the injection."""

from __future__ import annotations

import copy
import json

import jsonpatch
import pytest

from gpufence.contract import (
    ANNOTATION_STATUS,
    DEFAULT_STATE_DIR,
    SIDECAR_NAME,
    SIDECAR_PORT_NAME,
    ContainerShare,
    EnforcerConfig,
    MemoryShare,
    Mode,
)
from gpufence.webhook.core import sidecar as sidecar_module
from gpufence.webhook.core.admission import injection_patch
from gpufence.webhook.core.denial import Denial
from gpufence.webhook.core.desired import desired_pod
from gpufence.webhook.core.patch import diff, dumps
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import SharePlan
from gpufence.webhook.core.sidecar import (
    PRELOAD_VOLUME,
    api_defaulted,
    build_sidecar,
    config_json,
    default_pull_policy,
    enforcer_config,
    preload_library_path,
    sidecar_user,
    status_annotation,
)

PLAN = SharePlan(
    containers=(("train", ContainerShare(MemoryShare(bytes=8 * 2**30), 50.0)),),
    mode=Mode.ENFORCE,
    grace_period_seconds=10.0,
)


def gpu_pod(**spec_extra) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {
            "containers": [{"name": "train", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            **spec_extra,
        },
    }


DEFAULT = InjectionSettings()


def apply(pod: dict, settings: InjectionSettings = DEFAULT, plan: SharePlan = PLAN) -> dict:
    new, _ = desired_pod(pod, plan, settings)
    ops = diff(pod, new)
    patched = jsonpatch.apply_patch(pod, ops)
    assert patched == new
    return patched


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_desired_pod_does_not_mutate_its_input() -> None:
    pod = gpu_pod(initContainers=[{"name": "x", "image": "i"}])
    frozen = copy.deepcopy(pod)
    desired_pod(pod, PLAN, InjectionSettings(preload_library_host_path="/l/libvgpu.so", mount_host_proc=True))
    assert pod == frozen


def test_sidecar_contract() -> None:
    sidecar = build_sidecar(PLAN, InjectionSettings(mount_host_proc=True))
    assert sidecar["name"] == SIDECAR_NAME and sidecar["restartPolicy"] == "Always"
    assert sidecar["command"] == ["gpufence-enforcer"]
    assert sidecar["securityContext"]["runAsUser"] == 0 and "runAsNonRoot" not in sidecar["securityContext"]
    shared = build_sidecar(PLAN, InjectionSettings(), user={"runAsUser": 1000})["securityContext"]
    assert shared["runAsUser"] == 1000 and "runAsNonRoot" not in shared
    capabilities = sidecar["securityContext"]["capabilities"]
    assert capabilities == {"drop": ["ALL"], "add": ["DAC_READ_SEARCH", "KILL", "SYS_PTRACE"]}
    env = env_of(sidecar)
    assert EnforcerConfig.from_json(env["GPUFENCE_CONFIG"]) == EnforcerConfig(
        containers=dict(PLAN.containers), mode=Mode.ENFORCE, grace_period_seconds=10.0
    )
    # The pod's identity is the service-account token's (gpufence/enforcer/observe/pod_identity.py).
    assert not {"GPUFENCE_POD_NAME", "GPUFENCE_POD_NAMESPACE", "GPUFENCE_POD_UID"} & env.keys()
    assert env["GPUFENCE_HOST_PROC"] == "/host/proc"
    # The enforcer's and the probe's defaults: the state volume's mount, the default port, no warnings.
    assert not {"GPUFENCE_STATE_DIR", "GPUFENCE_METRICS_PORT", "GPUFENCE_POD_STATUS"} & set(env)
    assert {"name": "gpufence-state", "mountPath": DEFAULT_STATE_DIR} in sidecar["volumeMounts"]
    assert sidecar["ports"][0]["name"] == SIDECAR_PORT_NAME and len(SIDECAR_PORT_NAME) <= 15
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"gpufence-state", "gpufence-host-proc"}
    assert "restartPolicy" not in build_sidecar(PLAN, InjectionSettings(native_sidecar=False))


def sidecar_context(pod: dict, pod_security: str | None = None) -> tuple[dict, list[str]]:
    # The GPU's memory is known, so PLAN's byte share adds no framework warning to the sidecar's.
    new, warnings = desired_pod(pod, PLAN, InjectionSettings(gpu_memory=(("nvidia.com/gpu", 80 << 30),)),
                                pod_security)
    (sidecar,) = [c for c in new["spec"]["initContainers"] if c["name"] == SIDECAR_NAME]
    return sidecar["securityContext"], warnings


USER_KEYS = ("runAsUser", "runAsGroup", "runAsNonRoot")


@pytest.mark.parametrize(
    ("pod_context", "container_context", "user"),
    [
        (None, None, {"runAsUser": 0}),
        ({}, {"runAsUser": 1000}, {"runAsUser": 0}),  # root with KILL/SYS_PTRACE reaches any user
        ({"runAsNonRoot": False}, None, {"runAsUser": 0}),
        # Issue 32 row 3: the sidecar never follows the pod's user, whatever the GPU container's is.
        ({"runAsUser": 1000, "runAsNonRoot": True}, None, {"runAsUser": 0, "runAsNonRoot": False}),
        ({"runAsUser": 1000}, {"runAsUser": 0}, {"runAsUser": 0}),
        ({"runAsUser": 1000, "runAsGroup": 1}, {"runAsGroup": 2}, {"runAsUser": 0}),
        ({"runAsNonRoot": True}, None, {"runAsUser": 0, "runAsNonRoot": False}),
    ],
)
def test_sidecar_user_where_root_reaches_every_user(pod_context, container_context, user: dict) -> None:
    """Unlabelled (Kubernetes' `privileged`): the sidecar is root with SYS_PTRACE, no warning."""
    pod = gpu_pod(**({} if pod_context is None else {"securityContext": pod_context}))
    if container_context is not None:
        pod["spec"]["containers"][0]["securityContext"] = container_context
    for level in (None, "privileged"):
        context, warnings = sidecar_context(pod, level)
        assert {k: context[k] for k in USER_KEYS if k in context} == user
        assert context["capabilities"] == {"drop": ["ALL"], "add": ["DAC_READ_SEARCH", "KILL", "SYS_PTRACE"]}
        assert warnings == []
    # Idempotent: the injected pod gets the same sidecar again.
    injected = apply(pod)
    assert diff(injected, desired_pod(injected, PLAN, InjectionSettings())[0]) == []


@pytest.mark.parametrize(
    ("level", "pod_context", "container_context", "user"),
    [
        ("baseline", None, None, {"runAsUser": 0}),  # the image's user: root, which signals any user
        ("baseline", {"runAsUser": 1000}, None, {"runAsUser": 1000}),
        ("baseline", {"runAsUser": 1000, "runAsGroup": 1000}, {"runAsUser": 0}, {"runAsUser": 0}),
        ("baseline", {"runAsUser": 1000, "runAsNonRoot": True}, {"runAsGroup": 5},
         {"runAsUser": 1000, "runAsGroup": 5}),
        ("baseline", {"runAsNonRoot": True}, {"runAsNonRoot": False, "runAsUser": 0},
         {"runAsUser": 0, "runAsNonRoot": False}),
        ("restricted", {"runAsUser": 1000, "runAsNonRoot": True}, None, {"runAsUser": 1000}),
        ("restricted", None, {"runAsUser": 1000, "runAsNonRoot": True}, {"runAsUser": 1000, "runAsNonRoot": True}),
    ],
)
def test_sidecar_user_is_the_gpu_containers_where_it_has_no_capability(
        level: str, pod_context, container_context, user: dict) -> None:
    pod = gpu_pod(**({} if pod_context is None else {"securityContext": pod_context}))
    if container_context is not None:
        pod["spec"]["containers"][0]["securityContext"] = container_context
    context, warnings = sidecar_context(pod, level)
    assert {k: context[k] for k in USER_KEYS if k in context} == user
    assert warnings == []


@pytest.mark.parametrize(
    ("level", "pod_context", "contexts", "field"),
    [
        # Issue 32 row 3 where the sidecar may hold no capability: one GPU container of another user.
        ("restricted", {"runAsUser": 1000}, [None, {"runAsUser": 2000}],
         "spec.containers[1].securityContext.runAsUser"),
        ("baseline", {"runAsUser": 1000}, [None, {"runAsUser": 0}], "spec.containers[1].securityContext.runAsUser"),
        ("baseline", {"runAsGroup": 1}, [None, {"runAsGroup": 0}], "spec.containers[1].securityContext.runAsGroup"),
        ("baseline", None, [{"runAsUser": 0}, None], "spec.securityContext.runAsUser"),
        ("restricted", None, [None], "spec.containers[0].securityContext.runAsUser"),  # the image's user
        ("restricted", {"runAsUser": 0}, [None], "spec.securityContext.runAsUser"),
    ],
)
def test_gpu_containers_the_sidecar_cannot_act_on_are_denied(level: str, pod_context, contexts, field: str) -> None:
    pod = gpu_pod(**({} if pod_context is None else {"securityContext": pod_context}))
    second = copy.deepcopy(pod["spec"]["containers"][0]) | {"name": "eval"}
    pod["spec"]["containers"] = [pod["spec"]["containers"][0], second][: len(contexts)]
    for container, context in zip(pod["spec"]["containers"], contexts, strict=True):
        if context is not None:
            container["securityContext"] = context
    plan = SharePlan(containers=tuple((c["name"], PLAN.containers[0][1]) for c in pod["spec"]["containers"]),
                     mode=PLAN.mode, grace_period_seconds=PLAN.grace_period_seconds)
    with pytest.raises(Denial) as raised:
        desired_pod(pod, plan, DEFAULT, level)
    message = str(raised.value)
    assert field in message and f'Pod Security "{level}"' in message
    assert "spec.securityContext.runAsUser: 1000" in message


def test_a_non_root_image_user_under_baseline_is_warned_about() -> None:
    context, warnings = sidecar_context(gpu_pod(securityContext={"runAsNonRoot": True}), "baseline")
    assert context["runAsUser"] == 0 and context["runAsNonRoot"] is False
    assert len(warnings) == 1 and "set spec.securityContext.runAsUser" in warnings[0] and len(warnings[0]) <= 256


def test_sidecar_user_ignores_non_gpu_containers() -> None:
    spec = gpu_pod(securityContext={"runAsUser": 1000})["spec"]
    spec["containers"].append({"name": "proxy", "image": "i", "securityContext": {"runAsUser": 101}})
    assert sidecar_user(spec, {"train"}, "restricted") == ({"runAsUser": 1000, "runAsNonRoot": True}, [])
    with pytest.raises(Denial, match='"proxy"'):
        sidecar_user(spec, {"train", "proxy"}, "restricted")


# --- no way to root beside a non-root sidecar (issue 38 row 2) ---------------------------------------


def gpu_contexts(pod: dict) -> list:
    return [c.get("securityContext") for c in pod["spec"]["containers"] if c["name"] != SIDECAR_NAME]


@pytest.mark.parametrize("level", ["baseline", "restricted", "some-future-level"])
def test_gpu_containers_get_no_new_privs_where_the_sidecar_cannot_reach_root(level: str) -> None:
    pod = gpu_pod(securityContext={"runAsUser": 1000})
    pod["spec"]["containers"][0]["securityContext"] = {"capabilities": {"drop": ["ALL"]}}
    pod["spec"]["containers"].append({"name": "logger", "image": "i"})  # no GPU: left as it is
    new, _ = desired_pod(pod, PLAN, DEFAULT, level)
    assert gpu_contexts(new) == [{"capabilities": {"drop": ["ALL"]}, "allowPrivilegeEscalation": False}, None]
    assert desired_pod(new, PLAN, DEFAULT, level)[0] == new  # a fixed point


@pytest.mark.parametrize("level", [None, "privileged"])
def test_where_the_root_sidecar_reaches_root_the_container_is_left_as_it_is(level: str | None) -> None:
    pod = gpu_pod(securityContext={"runAsUser": 1000})
    pod["spec"]["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": True}
    new, _ = desired_pod(pod, PLAN, DEFAULT, level)
    assert gpu_contexts(new) == [{"allowPrivilegeEscalation": True}]


@pytest.mark.parametrize(("context", "field"), [
    ({"allowPrivilegeEscalation": True}, "spec.containers[0].securityContext.allowPrivilegeEscalation"),
    ({"capabilities": {"add": ["SYS_ADMIN"]}}, "spec.containers[0].securityContext.capabilities.add"),
])
def test_an_explicit_escalation_is_denied_naming_the_field(context: dict, field: str) -> None:
    pod = gpu_pod(securityContext={"runAsUser": 1000})
    pod["spec"]["containers"][0]["securityContext"] = context
    with pytest.raises(Denial) as denied:
        desired_pod(pod, PLAN, DEFAULT, "baseline")
    assert str(denied.value).startswith('container "train" ') and f"({field})" in str(denied.value)
    assert 'Pod Security "baseline"' in str(denied.value)


def test_a_users_hint_is_kept_and_a_limit_variable_replaced() -> None:
    """TF_FORCE_GPU_ALLOW_GROWTH is the user's to choose; GPUFENCE_MEMORY_LIMIT carries the share."""
    pod = gpu_pod()
    pod["spec"]["containers"][0]["env"] = [
        {"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "false"},
        {"name": "GPUFENCE_MEMORY_LIMIT", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
    ]
    new, warnings = desired_pod(pod, PLAN, InjectionSettings())
    env = new["spec"]["containers"][0]["env"]
    assert env[:2] == [{"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "false"},
                       {"name": "GPUFENCE_MEMORY_LIMIT", "value": str(8 * 2**30)}]  # in place, a plain value
    assert env_of(new["spec"]["containers"][0])["GPUFENCE_CONTAINER"] == "train"
    assert [w for w in warnings if "GPUFENCE_MEMORY_LIMIT" in w] == [
        f'container "train": gpufence replaces GPUFENCE_MEMORY_LIMIT from valueFrom with "{8 * 2**30}", the share\'s '
        "value"]


def test_ld_preload_is_appended_once() -> None:
    settings = InjectionSettings(preload_library_host_path="/node/lib/libvgpu.so", preload_library_mount_dir="/g")
    assert preload_library_path(settings) == "/g/libvgpu.so"
    pod = gpu_pod()
    pod["spec"]["containers"][0]["env"] = [{"name": "LD_PRELOAD", "value": "/a.so /b.so"}]
    once = apply(pod, settings)
    env = env_of(once["spec"]["containers"][0])
    assert env["LD_PRELOAD"] == "/a.so /b.so:/g/libvgpu.so"
    assert env["CUDA_DEVICE_MEMORY_LIMIT"] == "8192m" and env["CUDA_DEVICE_SM_LIMIT"] == "50"
    assert once["spec"]["containers"][0]["volumeMounts"] == [
        {"name": PRELOAD_VOLUME, "mountPath": "/g/libvgpu.so", "readOnly": True}
    ]
    again, _ = desired_pod(once, PLAN, settings)
    assert diff(once, again) == []


def test_mps_env() -> None:
    pod = apply(gpu_pod(), InjectionSettings(mps_limits=True))
    env = env_of(pod["spec"]["containers"][0])
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_reserved_volume_name_conflict_is_denied() -> None:
    pod = gpu_pod(volumes=[{"name": "gpufence-state", "hostPath": {"path": "/tmp"}}])
    with pytest.raises(Denial, match="reserved"):
        desired_pod(pod, PLAN, InjectionSettings())


def test_sidecar_moves_when_the_sidecar_mode_changes() -> None:
    native = apply(gpu_pod(initContainers=[{"name": "init", "image": "i"}]))
    assert [c["name"] for c in native["spec"]["initContainers"]] == [SIDECAR_NAME, "init"]
    plain = apply(native, InjectionSettings(native_sidecar=False))
    assert [c["name"] for c in plain["spec"]["initContainers"]] == ["init"]
    assert [c["name"] for c in plain["spec"]["containers"]] == ["train", SIDECAR_NAME]


def test_stale_sidecar_is_rebuilt() -> None:
    pod = apply(gpu_pod())
    pod["spec"]["initContainers"][0]["image"] = "evil:latest"
    pod["spec"]["initContainers"][0]["args"] = ["--disable"]
    new, _ = desired_pod(pod, PLAN, InjectionSettings())
    ops = diff(pod, new)
    assert {op["op"] for op in ops} == {"replace", "remove"}
    fixed = jsonpatch.apply_patch(pod, ops)
    assert fixed["spec"]["initContainers"][0] == build_sidecar(PLAN, InjectionSettings())


@pytest.mark.parametrize(
    "settings",
    [
        InjectionSettings(),
        InjectionSettings(native_sidecar=False, mount_host_proc=True, mps_limits=True),
        InjectionSettings(preload_library_host_path="/l/libvgpu.so", sidecar_image="r/é:1"),
    ],
)
@pytest.mark.parametrize(
    "pod",
    [
        gpu_pod(),
        gpu_pod(initContainers=[{"name": "init", "image": "i"}], securityContext={"runAsUser": 7}),
        gpu_pod(initContainers=None),
        gpu_pod(securityContext={"runAsNonRoot": True}),
    ],
)
def test_injection_patch_is_the_json_of_the_diff(pod: dict, settings: InjectionSettings) -> None:
    """One path: the patch is the diff of the pod and the desired pod, encoded; a fixed point after."""
    new, warnings = desired_pod(pod, PLAN, settings)
    ops = diff(pod, new)
    text, warnings_ = injection_patch(pod, PLAN, settings)
    assert text == dumps(ops) and json.loads(text) == ops and warnings_ == warnings
    injected = jsonpatch.apply_patch(pod, ops)
    assert injected == new
    assert injection_patch(injected, PLAN, settings) == (None, warnings)
    # A stale sidecar is patched field by field (no whole sidecar in the patch).
    containers = (injected["spec"].get("initContainers") or []) + injected["spec"]["containers"]
    sidecar = next(c for c in containers if c["name"] == SIDECAR_NAME)
    sidecar["image"] = "stale"
    text, _ = injection_patch(injected, PLAN, settings)
    assert text is not None
    (op,) = json.loads(text)
    assert op["op"] == "replace" and op["path"].endswith("/image") and op["value"] == settings.sidecar_image


# --- per-plan caches (status annotation, enforcer config) ----------------------------------


def _uncached_status(plan: SharePlan) -> str:
    doc = {"containers": [n for n, _ in plan.containers], "mode": plan.mode.value,
           "version": sidecar_module.GPUFENCE_VERSION}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


@pytest.mark.parametrize(
    "plan",
    [
        PLAN,
        SharePlan(containers=(("a", ContainerShare(compute_percent=50.0)),), mode=Mode.AUDIT, grace_period_seconds=2.5),
        SharePlan(containers=(("a", ContainerShare(memory=MemoryShare(percent=12.5))), ("b", ContainerShare())),
                  mode=Mode.ENFORCE, grace_period_seconds=30),
        # Names too long to be cached: computed every time, same text.
        SharePlan(containers=(("x" * 2000, ContainerShare(compute_percent=10.0)),), mode=Mode.ENFORCE,
                  grace_period_seconds=0.0),
    ],
)
def test_cached_plan_texts_equal_the_uncached(plan: SharePlan) -> None:
    for settings in (InjectionSettings(), InjectionSettings(poll_interval_seconds=0.25)):
        for _ in range(2):  # a miss, then a hit
            assert config_json(plan, settings) == enforcer_config(plan, settings).to_json()
            assert status_annotation(plan) == _uncached_status(plan)


def test_status_annotation_cache_follows_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    before = status_annotation(PLAN)
    monkeypatch.setattr(sidecar_module, "GPUFENCE_VERSION", "9.9.9-other")
    assert '"version":"9.9.9-other"' in status_annotation(PLAN)
    monkeypatch.undo()
    assert status_annotation(PLAN) == before


def test_reinvocation_keeps_the_service_account_token_mount_and_nothing_else() -> None:
    """What the API server's ServiceAccount plugin adds to our sidecar between two invocations stays;
    a mount of the pod's own volume elsewhere in the enforcer is removed."""
    pod = apply(gpu_pod())
    sidecar = pod["spec"]["initContainers"][0]
    token = {"name": "kube-api-access-x1y2z", "readOnly": True,
             "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
    pod["spec"]["volumes"].append(token_volume("kube-api-access-x1y2z"))
    sidecar["volumeMounts"] = [*sidecar["volumeMounts"], token]
    new, _ = desired_pod(pod, PLAN, InjectionSettings())
    assert diff(pod, new) == []

    sidecar["volumeMounts"] = [*sidecar["volumeMounts"], {"name": "code", "mountPath": "/usr/lib/python3"}]
    new, _ = desired_pod(pod, PLAN, InjectionSettings())
    ops = diff(pod, new)
    fixed = jsonpatch.apply_patch(pod, ops)
    assert fixed["spec"]["initContainers"][0]["volumeMounts"][-1] == token
    assert all(m["name"] != "code" for m in fixed["spec"]["initContainers"][0]["volumeMounts"])


def test_first_injection_mounts_the_token_the_api_server_gave_the_other_containers() -> None:
    """So that the API server's ServiceAccount plugin finds nothing to add to the new sidecar, and
    does not reinvoke the webhooks (one call per pod instead of two)."""
    pod = gpu_pod()
    token = {"name": "kube-api-access-q8r9s", "readOnly": True,
             "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
    pod["spec"]["containers"][0]["volumeMounts"] = [token]
    pod["spec"]["volumes"] = [token_volume("kube-api-access-q8r9s")]
    new, _ = desired_pod(pod, PLAN, InjectionSettings())
    assert new["spec"]["initContainers"][0]["volumeMounts"][-1] == token
    assert diff(new, desired_pod(new, PLAN, InjectionSettings())[0]) == []


def token_volume(name: str, audience: str | None = None) -> dict:
    """The volume the API server's ServiceAccount plugin adds (``audience``: one of the author's)."""
    token = {"expirationSeconds": 3607, "path": "token", **({"audience": audience} if audience else {})}
    return {"name": name, "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": token},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}


@pytest.mark.parametrize("volume", [{"name": "forged", "configMap": {"name": "my-jwt"}},
                                    token_volume("forged", audience="vault"), {"name": "other"}])
def test_a_file_of_the_authors_at_the_token_path_is_not_given_to_the_enforcer(volume: dict) -> None:
    """The enforcer names its pod by the token's claims: only the pod's own token is mounted."""
    pod = gpu_pod()
    pod["spec"]["automountServiceAccountToken"] = False
    pod["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "forged", "readOnly": True, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]
    pod["spec"]["volumes"] = [volume]
    new, _ = desired_pod(pod, PLAN, InjectionSettings())
    assert [m["name"] for m in new["spec"]["initContainers"][0]["volumeMounts"]] == ["gpufence-state"]


# --- what the API server's defaulting fills is left to it ------------------------------------------


@pytest.mark.parametrize(("image", "policy"), [
    ("ghcr.io/gpufence/gpufence:0.1.0", "IfNotPresent"), ("registry:5000/gpufence", "Always"),
    ("registry:5000/gpufence:latest", "Always"), ("gpufence@sha256:" + "a" * 64, "IfNotPresent"),
    ("gpufence:latest@sha256:" + "a" * 64, "Always"), ("registry:5000/team/gpufence:1.2", "IfNotPresent"),
])
def test_default_pull_policy_is_kubernetes(image: str, policy: str) -> None:
    assert default_pull_policy(image) == policy


def test_the_sidecar_leaves_the_api_servers_defaults_out_and_says_which() -> None:
    sidecar = build_sidecar(PLAN, InjectionSettings())
    assert "terminationMessagePath" not in sidecar and "imagePullPolicy" not in sidecar
    assert sidecar["livenessProbe"].keys() == {"exec", "timeoutSeconds", "terminationGracePeriodSeconds"}
    assert "startupProbe" not in sidecar and "protocol" not in sidecar["ports"][0]
    defaulted = api_defaulted(sidecar)
    assert defaulted["imagePullPolicy"] == "IfNotPresent"
    assert defaulted["terminationMessagePath"] == "/dev/termination-log"
    # The enforcer writes its own termination message (gpufence/enforcer/cli.py): the default policy.
    assert defaulted["terminationMessagePolicy"] == "File" and "terminationMessagePolicy" not in sidecar
    assert defaulted["livenessProbe"] == {**sidecar["livenessProbe"], "periodSeconds": 10, "successThreshold": 1,
                                          "failureThreshold": 3}
    assert defaulted["lifecycle"] == sidecar["lifecycle"]  # a hook has no defaults
    assert defaulted["ports"][0]["protocol"] == "TCP"
    status = api_defaulted(build_sidecar(PLAN, InjectionSettings(), status_warnings=True))["env"]
    assert {"name": "GPUFENCE_POD_STATUS", "valueFrom": {"fieldRef": {
        "apiVersion": "v1", "fieldPath": "metadata.annotations['gpufence.io/status']"}}} in status
    # A policy that is not the image's default is written.
    assert build_sidecar(PLAN, InjectionSettings(sidecar_image_pull_policy="Always"))["imagePullPolicy"] == "Always"


def test_a_reinvocation_on_the_defaulted_pod_patches_nothing() -> None:
    """The API server defaults the patched pod before it reinvokes the webhook: the sidecar it sees
    then has every default written out, and must be taken for ours."""
    injected = apply(gpu_pod())
    stored = copy.deepcopy(injected)
    (sidecar,) = stored["spec"]["initContainers"]
    stored["spec"]["initContainers"] = [api_defaulted(sidecar)]
    assert stored != injected
    new, _ = desired_pod(stored, PLAN, DEFAULT)
    assert diff(stored, new) == []
    # A sidecar that differs from ours by more than the defaults is still rebuilt.
    stored["spec"]["initContainers"][0]["livenessProbe"]["failureThreshold"] = 30
    assert diff(stored, desired_pod(stored, PLAN, DEFAULT)[0]) != []


def test_the_status_records_the_pods_warnings_not_the_containers_own() -> None:
    """A GPU container's framework advice goes back with the admission response only; what limits
    the enforcer (here: a GPU container of an unknown non-root user under baseline) is also recorded,
    for its Events, and only then does the sidecar read the status annotation."""
    plain = gpu_pod()
    new, warnings = desired_pod(plain, PLAN, DEFAULT)  # a byte share, the GPU's memory unknown: advice
    assert any("framework cap" in w for w in warnings)
    assert "warnings" not in json.loads(new["metadata"]["annotations"][ANNOTATION_STATUS])
    assert "GPUFENCE_POD_STATUS" not in env_of(new["spec"]["initContainers"][0])

    image_user = gpu_pod(securityContext={"runAsNonRoot": True})
    new, warnings = desired_pod(image_user, PLAN, DEFAULT, "baseline")
    recorded = json.loads(new["metadata"]["annotations"][ANNOTATION_STATUS])["warnings"]
    assert recorded == [w for w in warnings if "framework cap" not in w] and len(recorded) == 1
    assert "runAsNonRoot without runAsUser" in recorded[0]
    assert env_of(new["spec"]["initContainers"][0])["GPUFENCE_POD_STATUS"] == {
        "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_STATUS}']"}}


def test_a_sidecar_brought_after_a_gpu_init_container_is_put_before_it() -> None:
    """Ours keeps its index on a reinvocation, but never after a GPU init container, which would
    run before enforcement starts (the guard refuses that order)."""
    plan = SharePlan(containers=(("warmup", ContainerShare()), ("train", ContainerShare())), mode=Mode.AUDIT,
                     grace_period_seconds=10.0)
    pod = gpu_pod(initContainers=[{"name": "warmup", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
                                  {"name": SIDECAR_NAME, "image": "i"}])
    new, _ = desired_pod(pod, plan, DEFAULT)
    assert [c["name"] for c in new["spec"]["initContainers"]] == [SIDECAR_NAME, "warmup"]
