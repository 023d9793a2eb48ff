"""One source of the cluster policy: the guard reads ConfigMap gpufence-policy as the webhook parses it.

The guard's variables that read the ConfigMap (k8s/base/guard-policy.yaml, its ``params``) are
evaluated with cel-python (tests/unit/guard/test_policy.py's harness) and compared with what the
webhook's own parser (gpufence/webhook/cluster_policy.py, which runs the flags' converters) makes of
the same data: the defaults where a key is absent or empty, and the spellings the webhook accepts.
The real kube-apiserver reads the same ConfigMap in tests/e2e/test_policy_reload.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celpy import celtypes
from hypothesis import assume, given
from hypothesis import strategies as st

from gpufence.webhook.cli import POLICY_FLAGS
from gpufence.webhook.cluster_policy import PolicyError, parse_policy
from gpufence.webhook.settings import InjectionSettings
from tests.unit.guard.test_policy import GUARD, POLICY, POLICY_CONFIGMAP, SHIPPED_POLICY, Guard, pod, policy_data_for

# guard variable -> (the ConfigMap key it reads, the InjectionSettings value it must hold)
GUARD_READS: dict[str, tuple[str, Callable[[InjectionSettings], Any]]] = {
    "gpuResourceNames": ("gpu-resource-name", lambda s: list(s.gpu_resource_names)),
    "exclusiveGpuResourceNames": ("exclusive-gpu-resource-name", lambda s: list(s.exclusive_gpu_resource_names)),
    "nonGpuResourceClaims": ("non-gpu-resource-claims", lambda s: list(s.non_gpu_resource_claims)),
    "kaiSchedulerNames": ("kai-scheduler-name", lambda s: list(s.kai_scheduler_names)),
    "sidecarImage": ("sidecar-image", lambda s: s.sidecar_image),
    "clusterAllowsOptOut": ("allow-opt-out", lambda s: s.allow_opt_out),
    "clusterDefaultMode": ("default-mode", lambda s: s.default_mode),
    "clusterAllowsAudit": ("allow-audit", lambda s: s.allow_audit),
    "clusterMaxMemory": ("max-memory", lambda s: s.max_memory or ""),
    "clusterMaxCompute": ("max-compute", lambda s: s.max_compute or ""),
    "clusterDefaultMemory": ("default-memory", lambda s: s.default_memory or ""),
    "clusterDefaultCompute": ("default-compute", lambda s: s.default_compute or ""),
    "sidecarPollIntervalSeconds": ("sidecar-poll-interval", lambda s: s.poll_interval_seconds),
    "sidecarVisibleDevices": ("sidecar-nvidia-visible-devices", lambda s: s.nvidia_visible_devices),
    "sidecarNative": ("sidecar-mode", lambda s: s.native_sidecar),
    "sidecarPullPolicy": ("sidecar-image-pull-policy", lambda s: s.sidecar_image_pull_policy),
    "sidecarDriverCapabilities": ("sidecar-nvidia-driver-capabilities", lambda s: s.nvidia_driver_capabilities),
    "sidecarMountsHostProc": ("sidecar-mount-host-proc", lambda s: s.mount_host_proc),
    "sidecarHostProcPath": ("sidecar-host-proc-mount-path", lambda s: s.host_proc_mount_path),
    "sidecarPort": ("sidecar-metrics-port", lambda s: s.metrics_port),
    # Quantities as written in the ConfigMap; the guard compares them with quantity(), so a
    # spelling the webhook canonicalises ("0.01" for "10m") is the same value (checked below).
    "sidecarCpuRequest": ("sidecar-cpu-request", lambda s: s.sidecar_cpu_request),
    "sidecarCpuLimit": ("sidecar-cpu-limit", lambda s: s.sidecar_cpu_limit or ""),
    "sidecarMemoryRequest": ("sidecar-memory-request", lambda s: s.sidecar_memory_request),
    "sidecarMemoryLimit": ("sidecar-memory-limit", lambda s: s.sidecar_memory_limit),
    "voidNonGpuContainers": ("void-non-gpu-containers", lambda s: s.void_non_gpu_containers),
    "driverMemoryLimits": ("driver-memory-limits", lambda s: s.driver_memory_limits),
    "mpsLimits": ("mps-limits", lambda s: s.mps_limits),
    "preloadLibrary": ("preload-library", lambda s: s.preload_library_host_path or ""),
}


def _python(value: Any) -> Any:
    """A CEL value as the Python value it stands for, keeping its kind (a CEL double stays a float)."""
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    if isinstance(value, celtypes.DoubleType | float):  # celpy's arithmetic on doubles gives plain floats
        return float(value)
    if isinstance(value, celtypes.ListType):
        return [_python(v) for v in value]
    if isinstance(value, celtypes.StringType):
        return str(value)
    if isinstance(value, celtypes.IntType | int):
        return int(value)
    raise AssertionError(f"unexpected CEL value {value!r}")


def guard_reads(guard: Guard) -> dict[str, Any]:
    variables = guard.variables_for(pod())
    return {name: _python(variables[name]) for name in GUARD_READS}


def webhook_holds(settings: InjectionSettings) -> dict[str, Any]:
    return {name: value_of(settings) for name, (_, value_of) in GUARD_READS.items()}


def test_every_key_the_guard_reads_is_a_policy_flag_and_shipped() -> None:
    expressions = " ".join(v["expression"] for v in POLICY["spec"]["variables"])
    read = set(re.findall(r"variables\.clusterPolicy\['([a-z-]+)'\]", expressions))
    assert read == {key for key, _ in GUARD_READS.values()}
    assert read <= {f.name for f in POLICY_FLAGS}
    # The base ships the keys an admin sets most; the sidecar's own (mode, port, resources, ...) are
    # left to the webhook's defaults, which the guard falls back to alike (tested below). The protect
    # policy reads admin-groups only.
    protect = (Path(__file__).resolve().parents[3] / "k8s" / "base" / "protect-policy.yaml").read_text()
    read_by_protect = set(re.findall(r"variables\.clusterPolicy\['([a-z-]+)'\]", protect))
    assert read_by_protect == {"admin-groups"}
    assert set(SHIPPED_POLICY) <= read | read_by_protect


@pytest.mark.parametrize("data", [None, {}, dict.fromkeys(SHIPPED_POLICY, "")],
                         ids=["no data", "empty data", "every key empty"])
def test_the_guards_defaults_are_the_webhooks(data: dict[str, str] | None) -> None:
    """Where the ConfigMap says nothing, the guard falls back to exactly InjectionSettings' defaults."""
    params: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": POLICY_CONFIGMAP["metadata"]}
    if data is not None:
        params["data"] = data
    defaults = InjectionSettings()
    assert parse_policy(data) == defaults
    guard = Guard(POLICY, params=params)
    assert guard_reads(guard) == webhook_holds(defaults)
    assert isinstance(guard.variables_for(pod())["sidecarPollIntervalSeconds"], float)  # a CEL double


def test_the_shipped_configmap_holds_the_webhooks_defaults() -> None:
    assert parse_policy(SHIPPED_POLICY) == InjectionSettings()
    assert guard_reads(GUARD) == webhook_holds(InjectionSettings())


SPELLINGS = [
    *(("allow-audit", v) for v in ("true", "TRUE", " yes ", "1", "false", "No", "0")),
    *(("allow-opt-out", v) for v in ("True", "yes", "false", "NO")),
    *(("default-mode", v) for v in ("enforce", "audit")),
    *(("max-memory", v) for v in ("25%", "20Gi", "8589934592", "12.5%")),
    *(("max-compute", v) for v in ("25", "50%")),
    *(("default-memory", v) for v in ("4Gi", "10%")),
    *(("default-compute", v) for v in ("40", "30%")),
    *(("sidecar-poll-interval", v) for v in ("500ms", "300ms", "2s", "1m", "0.25", ".5", "1.", " 2s ", "70ms")),
    *(("sidecar-nvidia-visible-devices", v) for v in ("all", "void")),
    *(("gpu-resource-name", v) for v in ("amd.com/gpu", "nvidia.com/gpu, nvidia.com/mig-1g.10gb", " a/b ,c/d",
                                         "nvidia.com/gpu,nvidia.com/gpu.*", "example.com/*")),
    *(("exclusive-gpu-resource-name", v) for v in ("nvidia.com/mig-3g.40gb", " nvidia.com/mig-7g.* , a/b")),
    *(("non-gpu-resource-claims", v) for v in ("nic", "nic, fpga-template")),
    *(("kai-scheduler-name", v) for v in ("kai-scheduler", " team-kai , kai-scheduler")),
    ("sidecar-image", "registry.example.com/platform/gpufence:0.1.0"),
    *(("sidecar-mode", v) for v in ("native", "container")),
    *(("sidecar-image-pull-policy", v) for v in ("Always", "IfNotPresent", "Never")),
    ("sidecar-nvidia-driver-capabilities", "utility,compute"),
    *(("sidecar-mount-host-proc", v) for v in ("true", " Yes", "0")),
    ("sidecar-host-proc-mount-path", "/hostproc"),
    *(("sidecar-metrics-port", v) for v in ("9401", " 9500 ")),
    *(("sidecar-cpu-limit", v) for v in ("none", "None", "500m", "1")),
    ("sidecar-cpu-request", "20m"),
    ("sidecar-memory-request", "128Mi"),
    ("sidecar-memory-limit", "1Gi"),
    *(("void-non-gpu-containers", v) for v in ("false", "TRUE")),
    *(("driver-memory-limits", v) for v in ("on", "off", "auto")),
    *(("mps-limits", v) for v in ("true", " Yes", "false")),
    ("preload-library", "/usr/local/lib/libvgpu.so"),
]


@pytest.mark.parametrize(("key", "value"), SPELLINGS, ids=[f"{k}={v}" for k, v in SPELLINGS])
def test_the_guard_reads_a_value_as_the_webhook_parses_it(key: str, value: str) -> None:
    data = {**SHIPPED_POLICY, key: value}
    settings = parse_policy(data)
    assert guard_reads(Guard(POLICY, data)) == webhook_holds(settings)


_FRACTIONS = st.sampled_from(["", ".", ".0", ".5", ".25", ".125", ".333", ".1", ".7"])
# Mostly within the webhook's range (50ms to 60s), per unit, so that few draws are thrown away.
_DURATIONS = st.one_of(
    st.builds(lambda n, f: f"{n}{f}ms", st.integers(50, 60_000), _FRACTIONS),
    st.builds(lambda n, f, unit: f"{n}{f}{unit}", st.integers(0, 59), _FRACTIONS, st.sampled_from(["s", ""])),
    st.builds(lambda f: f"0{f}m", _FRACTIONS),
    st.sampled_from([".1", ".25", ".5", ".75"]),
)


@given(_DURATIONS)
def test_the_guard_computes_the_poll_interval_to_the_same_double(text: str) -> None:
    """The guard compares the sidecar's pollIntervalSeconds (the webhook's float) with its own reading:
    the two must be the same double, not merely close."""
    try:
        settings = parse_policy({"sidecar-poll-interval": text})
    except PolicyError:
        assume(False)  # out of the webhook's range: it keeps its last valid policy, nothing to agree on
        raise
    (seconds,) = [v for k, v in guard_reads(Guard(POLICY, {"sidecar-poll-interval": text})).items()
                  if k == "sidecarPollIntervalSeconds"]
    assert seconds == settings.poll_interval_seconds


def test_policy_data_for_gives_the_data_of_each_golden_case() -> None:
    """The harness's settings-to-ConfigMap helper (used for the golden cases) is the parser's inverse."""
    from tests.unit.webhook.test_golden import CASES, load_case

    for case in CASES:
        settings = load_case(case)[1]
        assert webhook_holds(parse_policy(policy_data_for(settings))) == webhook_holds(settings), case


def test_the_sidecars_resources_are_compared_as_quantities_not_spellings() -> None:
    """The webhook writes canonical quantities ("0.01" becomes "10m"); the guard compares values."""
    from tests.unit.guard.test_forged_sidecar import gpu_pod, injected

    data = {**SHIPPED_POLICY, "sidecar-cpu-request": "0.01", "sidecar-memory-limit": "0.25Gi",
            "sidecar-cpu-limit": " NONE "}
    settings = parse_policy(data)
    assert (settings.sidecar_cpu_request, settings.sidecar_memory_limit, settings.sidecar_cpu_limit) == (
        "10m", "256Mi", None)
    pod_ = injected(gpu_pod({"gpufence.io/memory": "4Gi"}), {}, settings)
    assert Guard(POLICY, data).admit(pod_, namespace_annotations={}) == (True, "allowed")
    assert not GUARD.admit(pod_, namespace_annotations={})[0]  # the shipped policy has a CPU limit
