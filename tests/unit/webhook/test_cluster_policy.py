"""The cluster policy ConfigMap, pure: parsing with the flags' converters and reloading a version
(gpufence/webhook/cluster/policy.py). What the server does with it, and the watch against a small
fake API server: tests/integration/webhook/test_cluster_policy_server.py; against the real
kube-apiserver: tests/e2e/test_policy_reload.py.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufence.webhook.cli import POLICY_FLAGS, parse_args, settings_from_args
from gpufence.webhook.cluster.policy import ClusterPolicy, PolicyError, parse_policy
from gpufence.webhook.core.settings import InjectionSettings

TLS = ["--tls-cert-file", "c.crt", "--tls-private-key-file", "c.key"]
SOURCE = "gpufence/gpufence-policy"
EVENT_ATTRIBUTE = "gpufence_event"  # where gpufence.logs.log_event puts the event name on the record

# A non-default value for every InjectionSettings field, as ConfigMap data (repeatable flags comma-separated).
EVERY_KEY = {
    "sidecar-image": "img:2", "sidecar-image-pull-policy": "Always",
    "gpu-resource-name": "nvidia.com/gpu, nvidia.com/mig-1g.10gb", "sidecar-mode": "container",
    "exclusive-gpu-resource-name": "nvidia.com/mig-3g.40gb, example.com/fpga-*", "non-gpu-resource-claims": "nic,fpga",
    "dra-gpu-driver-name": "gpu.nvidia.com, gpu.example.com",
    "sidecar-metrics-port": "9500", "sidecar-cpu-request": "20m", "sidecar-cpu-limit": "1",
    "sidecar-memory-request": "96Mi", "sidecar-memory-limit": "384Mi", "default-memory": "25%",
    "default-compute": "50", "max-memory": "40Gi", "max-compute": "25", "default-mode": "audit",
    "allow-audit": "true", "allow-opt-out": "yes", "default-grace-period": "30s", "sidecar-poll-interval": "250ms",
    "sidecar-nvidia-visible-devices": "void", "sidecar-nvidia-driver-capabilities": "utility,compute",
    "sidecar-mount-host-proc": "true", "sidecar-host-proc-mount-path": "/hp", "void-non-gpu-containers": "false",
    "mps-limits": "true", "preload-library": "/opt/libvgpu.so", "preload-library-mount-dir": "/pre",
    "gpu-memory": "nvidia.com/gpu=80Gi,nvidia.com/mig-1g.10gb=10Gi", "pytorch-memory-fraction": "true",
    "framework-memory-headroom": "1Gi", "admin-groups": "platform:gpu-admins, system:masters",
    "driver-memory-limits": "on",
    "kai-scheduler-name": "kai-scheduler, team-kai", "device-access-namespaces": "gpu-operator, monitoring",
    "other-namespace-gpu-processes": "terminate", "host-gpu-processes": "report",
}


def configmap(data: dict[str, str] | None, rv: int = 1) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": "gpufence-policy", "namespace": "gpufence", "resourceVersion": str(rv)}}
    if data is not None:
        obj["data"] = data
    return obj


# --- parsing ---------------------------------------------------------------------------------------


def test_every_policy_flag_is_a_key_and_parses_as_the_flag_does() -> None:
    assert set(EVERY_KEY) == {f.name for f in POLICY_FLAGS}
    from_configmap = parse_policy(EVERY_KEY)
    argv = [f"--{key}={item.strip()}" for key, value in EVERY_KEY.items()
            for item in (value.split(",") if next(f for f in POLICY_FLAGS if f.name == key).repeat else [value])]
    assert from_configmap == settings_from_args(parse_args(TLS + argv, environ={}))
    defaults = InjectionSettings()
    assert [f.name for f in dataclasses.fields(InjectionSettings)
            if getattr(from_configmap, f.name) == getattr(defaults, f.name)] == []


def test_absent_and_empty_keys_are_the_defaults() -> None:
    assert parse_policy(None) == parse_policy({}) == InjectionSettings()
    assert parse_policy(dict.fromkeys(EVERY_KEY, "")) == InjectionSettings()
    assert parse_policy({"max-memory": "25%", "default-memory": ""}) == InjectionSettings(max_memory="25%")


@pytest.mark.parametrize(("data", "needles"), [
    ({"max-memory": "lots"}, ['key "max-memory"', "'lots'", "quantity", 'e.g. max-memory: "25%"']),
    ({"allow-audit": "maybe"}, ['key "allow-audit"', "'maybe'", '"true" or "false"', 'e.g. allow-audit: "false"']),
    ({"sidecar-poll-interval": "1ms"}, ["'1ms'", "between 0.05s and 60s", 'e.g. sidecar-poll-interval: "500ms"']),
    ({"gpu-resource-name": "nvidia.com/gpu,,x"}, ['key "gpu-resource-name"', "(comma-separated)",
                                                  "use an extended resource name",
                                                  'e.g. gpu-resource-name: "nvidia.com/gpu,nvidia.com/gpu.*,']),
    ({"exclusive-gpu-resource-name": "nvidia.com/*mig"},
     ['key "exclusive-gpu-resource-name"', 'only a trailing "*"',
      'e.g. exclusive-gpu-resource-name: "nvidia.com/mig-3g.40gb"']),
    ({"non-gpu-resource-claims": "NIC"}, ['key "non-gpu-resource-claims"', "ResourceClaimTemplate",
                                          'e.g. non-gpu-resource-claims: "nic-claim"']),
    ({"kai-scheduler-name": "KAI"}, ['key "kai-scheduler-name"', "'KAI'", 'e.g. kai-scheduler-name: "kai-scheduler"']),
    ({"gpu-memory": "80Gi"}, ["RESOURCE=QUANTITY", 'e.g. gpu-memory: "nvidia.com/gpu=80Gi"']),
    ({"default-mode": "Audit"}, ["'Audit'", "use one of enforce, audit", 'e.g. default-mode: "enforce"']),
    ({"other-namespace-gpu-processes": "deny"},
     ['key "other-namespace-gpu-processes"', "'deny'", "use one of allow, report, terminate",
      'e.g. other-namespace-gpu-processes: "terminate"']),
    ({"host-gpu-processes": "terminate"},
     ['key "host-gpu-processes"', "'terminate'", "a host process is never terminated", "use allow or report",
      'e.g. host-gpu-processes: "report"']),
    ({"host-gpu-processes": "Report"}, ["'Report'", "use one of allow, report", 'e.g. host-gpu-processes: "report"']),
    ({"max-mem": "25%"}, ['unknown key "max-mem"', 'did you mean "max-memory"?', "--help"]),
    ({"poll-interval": "1s"}, ['"poll-interval" is the old name of "sidecar-poll-interval"']),
    ({"port": "9443"}, ['"port" is a server flag', "(--port)"]),
    ({"policy-configmap": "a/b"}, ['"policy-configmap" is a server flag']),
    ({"allow-audit": False}, ['key "allow-audit" is not a string']),  # a YAML boolean written unquoted
])
def test_bad_keys_and_values_name_the_key_the_value_the_rule_and_an_example(data: dict[str, Any],
                                                                             needles: list[str]) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(data)
    message = str(raised.value)
    assert message.startswith(f"ConfigMap {SOURCE}: ")
    for needle in needles:
        assert needle in message, message


@given(st.sampled_from(sorted(EVERY_KEY)), st.text(max_size=40))
def test_any_text_in_any_key_is_a_policy_or_a_policy_error(key: str, text: str) -> None:
    """Whatever an admin writes, the webhook gets settings or a message, never a traceback."""
    try:
        parse_policy({key: text})
    except PolicyError as exc:
        assert f'key "{key}"' in str(exc)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy({"max-memory": "lots", "max-compute": "150", "colour": "blue"}, binary_keys=("blob",))
    message = str(raised.value)
    for key in ("max-memory", "max-compute", "colour", "blob"):
        assert f'"{key}"' in message, message
    assert "binaryData" in message


# --- reloading --------------------------------------------------------------------------------------


def events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int]]:
    return [(getattr(r, EVENT_ATTRIBUTE, ""), r.levelno) for r in caplog.records if r.name.endswith("cluster.policy")]


def test_a_valid_version_is_swapped_in_whole_and_an_invalid_one_keeps_the_last(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    policy = ClusterPolicy(source=SOURCE)
    assert policy.current is None and not policy.valid
    assert "has not been read yet" in (policy.not_ready_reason() or "")

    assert policy.offer(configmap({"max-memory": "20Gi"}, rv=5))
    first = policy.current
    assert first is not None and first.max_memory == "20Gi" and policy.valid and policy.not_ready_reason() is None
    assert policy.offer(configmap({"max-memory": "8Gi"}, rv=6))
    assert policy.current is not first and policy.current.max_memory == "8Gi" and first.max_memory == "20Gi"
    assert (policy.successes, policy.failures, policy.applied_version) == (2, 0, "6")

    kept = policy.current
    assert not policy.offer(configmap({"max-memory": "lots"}, rv=7))
    assert policy.current is kept and not policy.valid and "'lots'" in (policy.problem or "")
    assert policy.not_ready_reason() is None  # still serving the last valid version
    assert not policy.offer(None)  # deleted
    assert policy.current is kept and "does not exist" in (policy.problem or "")
    assert (policy.successes, policy.failures) == (2, 2)

    assert policy.offer(configmap({"max-memory": "8Gi"}, rv=9))  # fixed: the same policy, valid again
    assert policy.valid and policy.successes == 3
    assert policy.offer(configmap({"max-memory": "8Gi"}, rv=9))  # a relist of the same version: no news
    assert policy.successes == 3
    assert events(caplog) == [("policy_loaded", logging.INFO), ("policy_loaded", logging.INFO),
                              ("policy_invalid", logging.ERROR), ("policy_missing", logging.ERROR),
                              ("policy_loaded", logging.INFO)]
    invalid = next(r for r in caplog.records if getattr(r, EVENT_ATTRIBUTE, "") == "policy_invalid")
    assert "keeping the last valid version (resourceVersion 6)" in invalid.getMessage()


def test_an_invalid_first_version_leaves_no_policy_and_says_why() -> None:
    policy = ClusterPolicy(source=SOURCE)
    assert not policy.offer(configmap({"max-compute": "150"}))
    assert policy.current is None
    reason = policy.not_ready_reason() or ""
    assert reason.startswith("no valid cluster policy yet:") and 'key "max-compute"' in reason


