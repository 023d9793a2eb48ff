"""The desired pod and the JSON Patch diff."""

from __future__ import annotations

import copy
import json

import jsonpatch
import pytest
from hypothesis import given
from hypothesis import strategies as st

from enforcer.config import ContainerShare, EnforcerConfig, MemoryShare, Mode
from webhook.mutate import (
    PRELOAD_VOLUME,
    SIDECAR_PORT_NAME,
    MutationError,
    build_sidecar,
    desired_pod,
    diff,
    escape,
    preload_library_path,
)
from webhook.settings import SIDECAR_NAME, InjectionSettings
from webhook.shares import SharePlan

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


def test_escape_rfc6901() -> None:
    assert escape("gpufence.io/status") == "gpufence.io~1status"
    assert escape("a~b/c") == "a~0b~1c"
    ops = diff({"a/b": {"~x": 1}}, {"a/b": {"~x": 2}})
    assert ops == [{"op": "replace", "path": "/a~1b/~0x", "value": 2}]
    assert jsonpatch.apply_patch({"a/b": {"~x": 1}}, ops) == {"a/b": {"~x": 2}}


def test_desired_pod_does_not_mutate_its_input() -> None:
    pod = gpu_pod(initContainers=[{"name": "x", "image": "i"}])
    frozen = copy.deepcopy(pod)
    desired_pod(pod, PLAN, InjectionSettings(preload_library_host_path="/l/libvgpu.so", mount_host_proc=True))
    assert pod == frozen


def test_sidecar_contract() -> None:
    sidecar = build_sidecar(PLAN, InjectionSettings(mount_host_proc=True))
    assert sidecar["name"] == SIDECAR_NAME and sidecar["restartPolicy"] == "Always"
    assert sidecar["command"] == ["gpufence-enforcer"]
    assert "runAsUser" not in sidecar["securityContext"]
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]}
    env = env_of(sidecar)
    assert EnforcerConfig.from_json(env["GPUFENCE_CONFIG"]) == EnforcerConfig(
        containers=dict(PLAN.containers), mode=Mode.ENFORCE, grace_period_seconds=10.0
    )
    assert env["GPUFENCE_POD_UID"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}
    assert env["GPUFENCE_HOST_PROC"] == "/host/proc"
    assert env["GPUFENCE_STATE_DIR"] == "/var/run/gpufence"
    assert sidecar["ports"][0]["name"] == SIDECAR_PORT_NAME and len(SIDECAR_PORT_NAME) <= 15
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"gpufence-state", "gpufence-host-proc"}
    assert "restartPolicy" not in build_sidecar(PLAN, InjectionSettings(native_sidecar=False))


def test_user_env_is_never_overwritten() -> None:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["env"] = [
        {"name": "TF_FORCE_GPU_ALLOW_GROWTH", "value": "false"},
        {"name": "GPUFENCE_MEMORY_LIMIT", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}},
    ]
    new, warnings = desired_pod(pod, PLAN, InjectionSettings())
    env = env_of(new["spec"]["containers"][1 - 1])
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"
    assert env["GPUFENCE_MEMORY_LIMIT"] == {"configMapKeyRef": {"name": "c", "key": "k"}}
    assert env["GPUFENCE_CONTAINER"] == "train"
    assert any("GPUFENCE_MEMORY_LIMIT" in w for w in warnings)


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
    with pytest.raises(MutationError, match="reserved"):
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
    ("old", "new"),
    [
        ([1, 2, 3], [1, 3]),
        ([], [{"name": "a"}]),
        ([{"name": "a"}, {"name": "b"}], [{"name": "s"}, {"name": "a"}, {"name": "b", "x": 1}]),
        ([{"name": "a"}, {"name": "b"}], [{"name": "b"}, {"name": "a"}]),
        ({"a": True}, {"a": 1}),
        ({"a": None}, {"a": {"b": []}}),
        ({"a": [1]}, {"b": [1]}),
    ],
)
def test_diff_applies(old, new) -> None:
    assert jsonpatch.apply_patch(old, diff(old, new)) == new
    assert json.dumps(jsonpatch.apply_patch(old, diff(old, new))) == json.dumps(new)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
)
named_lists = st.lists(
    st.fixed_dictionaries({"name": st.sampled_from("abcdef")}, optional={"v": json_values}), max_size=5
)


@given(json_values | named_lists, json_values | named_lists)
def test_diff_is_correct_for_any_json(old, new) -> None:
    assert jsonpatch.apply_patch(old, diff(old, new)) == new
