"""The framework caps and share-aware warnings (gpufence/webhook/core/frameworks.py), as pure functions."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufence.contract import MemoryShare
from gpufence.webhook.core.frameworks import (
    ENV_TGI_FRACTION,
    ENV_TORCH_ALLOC_CONF,
    ENV_TORCH_ALLOC_CONF_NEW,
    ENV_XLA_FRACTION,
    ENV_XLA_FRACTION_NEW,
    DeviceMemory,
    alloc_conf_value,
    device_memory,
    framework_env,
    memory_cap,
    pytorch_cap_enabled,
    server_warnings,
)
from gpufence.webhook.core.settings import InjectionSettings
from tests.support.examples import examples

GiB = 1 << 30
MiB = 1 << 20
GPU_80 = DeviceMemory(80 * GiB, "test")


def env_of(*pairs: tuple[str, str]) -> dict[str, dict[str, Any]]:
    return {name: {"name": name, "value": value} for name, value in pairs}


@pytest.mark.parametrize(("memory", "device", "headroom", "expected"), [
    (MemoryShare(percent=12.5), None, 512 * MiB, "0.125"),  # a percentage maps directly
    (MemoryShare(percent=33.33333), None, 0, "0.3333"),  # rounded down, never up
    (MemoryShare(bytes=8 * GiB), None, 512 * MiB, None),  # bytes on a GPU of unknown memory
    (MemoryShare(bytes=8 * GiB), GPU_80, 512 * MiB, "0.0937"),  # (8Gi - 512Mi) / 80Gi = 0.09375
    (MemoryShare(bytes=8 * GiB), GPU_80, 0, "0.1"),
    (MemoryShare(percent=25), GPU_80, 1 * GiB, "0.2375"),  # (20Gi - 1Gi) / 80Gi
    (MemoryShare(bytes=200 * GiB), GPU_80, 0, "1"),  # a share above the GPU caps at the GPU
    (MemoryShare(bytes=256 * MiB), GPU_80, 512 * MiB, None),  # nothing left after the headroom
])
def test_memory_cap(memory: MemoryShare, device: DeviceMemory | None, headroom: int, expected: str | None) -> None:
    cap = memory_cap(memory, device, headroom)
    assert (cap.text if cap is not None else None) == expected


@given(share=st.integers(min_value=1, max_value=200 * GiB), device=st.integers(min_value=GiB, max_value=200 * GiB),
       headroom=st.integers(min_value=0, max_value=2 * GiB))
@settings(max_examples=examples(300), deadline=None)
def test_memory_cap_never_allows_more_than_the_share_minus_headroom(share: int, device: int, headroom: int) -> None:
    cap = memory_cap(MemoryShare(bytes=share), DeviceMemory(device, "test"), headroom)
    if cap is None:
        assert min(share, device) - headroom < device // 10000 + 1
        return
    assert Decimal(cap.text) == cap.fraction
    assert 0 < cap.fraction <= 1
    assert cap.fraction * device <= min(share, device) - headroom


def test_device_memory_node_selector_then_flag() -> None:
    container = {"name": "c", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}}
    flags = InjectionSettings(gpu_resource_names=("nvidia.com/gpu", "nvidia.com/gpu.shared"),
                              gpu_memory=(("nvidia.com/gpu", 80 * GiB), ("nvidia.com/gpu.shared", 40 * GiB)))
    assert device_memory({}, container, flags) == DeviceMemory(40 * GiB, "webhook flag --gpu-memory "
                                                                         "nvidia.com/gpu.shared=40Gi")
    spec = {"nodeSelector": {"nvidia.com/gpu.memory": "81559"}}
    assert device_memory(spec, container, flags).bytes == 81559 * MiB
    # A label that is not a MiB count is not a reading.
    assert device_memory({"nodeSelector": {"nvidia.com/gpu.memory": "80Gi"}}, container, flags).bytes == 40 * GiB
    assert device_memory({}, container, InjectionSettings()) is None


@pytest.mark.parametrize(("annotations", "flag", "expected"), [
    ({}, False, False), ({}, True, True),
    ({"gpufence.io/pytorch-memory-fraction": "true"}, False, True),
    ({"gpufence.io/pytorch-memory-fraction": "false"}, True, False),  # the namespace's admin decides
    ({"gpufence.io/pytorch-memory-fraction": "yes"}, True, False),  # only "true" opts in
])
def test_pytorch_cap_opt_in(annotations: dict[str, str], flag: bool, expected: bool) -> None:
    assert pytorch_cap_enabled(annotations, InjectionSettings(pytorch_memory_fraction=flag)) is expected


def test_alloc_conf_value_last_one_counts() -> None:
    assert alloc_conf_value("per_process_memory_fraction:0.5, expandable_segments:True,"
                            "per_process_memory_fraction: 0.3", "per_process_memory_fraction") == "0.3"
    assert alloc_conf_value("expandable_segments:True", "per_process_memory_fraction") is None


QUARTER = MemoryShare(percent=25)


def test_both_jax_names_are_never_set() -> None:
    for user in (ENV_XLA_FRACTION, ENV_XLA_FRACTION_NEW):
        result = framework_env("c", QUARTER, env_of((user, "0.1")), None, InjectionSettings(), False)
        assert {ENV_XLA_FRACTION, ENV_XLA_FRACTION_NEW}.isdisjoint(var for var, _ in result.set_env)
        assert result.warnings == []  # 0.1 is within the share


def test_alloc_conf_from_value_from_is_reported_not_touched() -> None:
    env = {ENV_TORCH_ALLOC_CONF: {"name": ENV_TORCH_ALLOC_CONF, "valueFrom": {"configMapKeyRef": {"name": "x",
                                                                                                "key": "y"}}}}
    result = framework_env("c", QUARTER, env, None, InjectionSettings(), True)
    assert result.replace_env == [] and ENV_TORCH_ALLOC_CONF not in dict(result.set_env)
    assert any("valueFrom" in w and ENV_TORCH_ALLOC_CONF in w for w in result.warnings)


ENV_NAMES = st.sampled_from([ENV_XLA_FRACTION, ENV_XLA_FRACTION_NEW, ENV_TGI_FRACTION, ENV_TORCH_ALLOC_CONF,
                             ENV_TORCH_ALLOC_CONF_NEW, "PYTORCH_NO_CUDA_MEMORY_CACHING", "OTHER"])
ENV_VALUES = st.sampled_from(["0.1", "0.9", "1.0", "", "expandable_segments:True",
                              "per_process_memory_fraction:0.9", "per_process_memory_fraction:0.25", "junk"])


@given(pairs=st.lists(st.tuples(ENV_NAMES, ENV_VALUES), max_size=6),
       percent=st.floats(min_value=1, max_value=100), pytorch=st.booleans())
@settings(max_examples=examples(300), deadline=None)
def test_user_values_are_never_overwritten_and_reinvocation_changes_nothing(
        pairs: list[tuple[str, str]], percent: float, pytorch: bool) -> None:
    env = env_of(*pairs)
    memory = MemoryShare(percent=percent)
    first = framework_env("c", memory, env, None, InjectionSettings(), pytorch)
    assert not {var for var, _ in first.set_env} & set(env)
    for var, value in first.replace_env:  # only an alloc conf, extended, never rewritten
        assert var in (ENV_TORCH_ALLOC_CONF, ENV_TORCH_ALLOC_CONF_NEW)
        assert value.startswith(env[var]["value"].strip().rstrip(","))
    after = dict(env)
    after.update(env_of(*first.set_env, *first.replace_env))
    second = framework_env("c", memory, after, None, InjectionSettings(), pytorch)
    assert second.set_env == [] and second.replace_env == []
    assert second.warnings == first.warnings


def vllm(*args: str, image: str = "vllm/vllm-openai:v0.11.0") -> dict[str, Any]:
    return {"name": "llm", "image": image, "args": list(args)}


@pytest.mark.parametrize(("container", "needle"), [
    (vllm(), "--gpu-memory-utilization (default 0.9) takes more than the memory share 25%; "
             "use --gpu-memory-utilization=0.25"),
    (vllm("--gpu-memory-utilization", "0.5"), "--gpu-memory-utilization=0.5 takes"),
    (vllm("--gpu-memory-utilization=0.5"), "--gpu-memory-utilization=0.5 takes"),
    (vllm("--gpu_memory_utilization=0.5"), "--gpu-memory-utilization=0.5 takes"),
    ({"name": "llm", "image": "python", "command": ["bash", "-lc"],
      "args": ["pip list && exec vllm serve m --gpu-memory-utilization 0.95"]}, "=0.95 takes"),
    ({"name": "llm", "image": "python", "args": ["python", "-m", "sglang.launch_server", "--model-path", "m"]},
     "SGLang --mem-fraction-static (default"),
    ({"name": "tgi", "image": "ghcr.io/huggingface/text-generation-inference:3", "args": ["--cuda-memory-fraction",
                                                                                         "0.3"]},
     "TGI --cuda-memory-fraction=0.3 takes"),
])
def test_server_warnings_name_the_flag_and_a_fitting_value(container: dict[str, Any], needle: str) -> None:
    (warning,) = server_warnings("llm", container, QUARTER, None, InjectionSettings())
    assert needle in warning and len(warning) <= 256


@pytest.mark.parametrize("container", [
    vllm("--gpu-memory-utilization", "0.25"),
    vllm("--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", "1Gi"),
    {"name": "web", "image": "nginx", "args": ["serve", "--port", "80"]},
    {"name": "tgi", "image": "ghcr.io/huggingface/text-generation-inference:3"},  # CUDA_MEMORY_FRACTION is set
    {"name": "train", "image": "python", "command": ["python", "train.py", "--note", "vllm"]},
])
def test_no_server_warning_where_the_settings_fit(container: dict[str, Any]) -> None:
    assert server_warnings("x", container, QUARTER, None, InjectionSettings()) == []


def test_byte_share_of_unknown_gpu_warns_with_the_rule_for_defaults_only() -> None:
    share = MemoryShare(bytes=8 * GiB)
    (warning,) = server_warnings("llm", vllm(), share, None, InjectionSettings())
    assert "may take more than the memory share 8Gi" in warning and "divided by the GPU's memory" in warning
    # A value the webhook cannot judge is not reported.
    assert server_warnings("llm", vllm("--gpu-memory-utilization", "0.1"), share, None, InjectionSettings()) == []
    fits = server_warnings("llm", vllm("--gpu-memory-utilization", "0.5"), share, GPU_80, InjectionSettings())
    assert len(fits) == 1 and "use --gpu-memory-utilization=0.0937" in fits[0]


def test_jax_platform_allocator_is_reported() -> None:
    result = framework_env("c", QUARTER, env_of(("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")), None,
                           InjectionSettings(), False)
    (warning,) = result.warnings
    assert 'XLA_PYTHON_CLIENT_ALLOCATOR="platform"' in warning and len(warning) <= 256
    assert framework_env("c", QUARTER, env_of(("XLA_PYTHON_CLIENT_ALLOCATOR", "bfc")), None,
                         InjectionSettings(), False).warnings == []


def test_huge_command_lines_are_scanned_in_bounded_time() -> None:
    import time

    container = vllm("vllm serve " + "a " * 500_000 + "'unterminated quote")
    started = time.perf_counter()
    warnings = server_warnings("llm", container, QUARTER, None, InjectionSettings())
    assert time.perf_counter() - started < 0.5
    assert len(warnings) == 1  # still a vLLM container with the default utilisation
