"""The injected framework variables, read by the real frameworks in real processes (CPU only).

The webhook injects a pod; each GPU container's environment is handed to a new Python process
that runs the framework's own reader of those variables:

* JAX: ``jaxlib.xla_client.generate_pjrt_gpu_plugin_options()``, the function that turns the
  ``XLA_*`` variables into the CUDA plugin's allocator options (no GPU needed to call it);
* PyTorch: ``torch.cuda.memory._set_allocator_settings``, the caching allocator's config parser
  (a CUDA build of torch parses without a GPU; a CPU-only build has no CUDA allocator).

Neither framework is a dependency of gpufence. The interpreters tried are those listed in
``GPUFENCE_FRAMEWORK_PYTHON`` (separated by ``os.pathsep``), then this one; a framework found in
none of them is skipped with the reason (jaxlib: fails under CI=true; ``make framework-python``
builds the pinned one). E.g.::

    python3 -m venv /tmp/fw && /tmp/fw/bin/pip install jax   # CPU jaxlib, about 100 MB
    GPUFENCE_FRAMEWORK_PYTHON=/tmp/fw/bin/python .venv/bin/python -m pytest \
        tests/integration/webhook/test_framework_env_real.py
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

import jsonpatch
import pytest

from gpufence.webhook.client import decode_patch, pod_admission_review
from gpufence.webhook.core.admission import review
from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings
from tests.support.prerequisites import missing, skip_by_design

ENV_VAR = "GPUFENCE_FRAMEWORK_PYTHON"


def interpreters() -> list[str]:
    listed = [p for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p]
    return [*listed, sys.executable]


@functools.cache
def python_with(module: str) -> str | None:
    for python in interpreters():
        try:
            done = subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=60, env={})
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return python
    return None


def injected_env(env: list[dict[str, str]] | None = None, memory: str = "25%",
                 settings: InjectionSettings | None = None) -> dict[str, str]:
    """The environment the webhook gives the pod's GPU container (plain values only)."""
    container: dict[str, Any] = {"name": "main", "image": "python:3.12",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    if env:
        container["env"] = env
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "team-a", "annotations": {"gpufence.io/memory": memory}},
           "spec": {"containers": [container]}}
    answer = review(pod_admission_review(pod, uid="u", namespace="team-a"), settings or InjectionSettings(),
                    AllNamespacesOptedIn()).review["response"]
    patched = jsonpatch.apply_patch(pod, decode_patch(answer))
    (main,) = [c for c in patched["spec"]["containers"] if c["name"] == "main"]
    return {e["name"]: e["value"] for e in main["env"] if "value" in e}


def run(python: str, script: str, env: dict[str, str]) -> dict[str, Any]:
    # Only the injected variables (and what Python needs to start): nothing of this test's environment.
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**base, **env, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


JAX_READER = """
import json
from jaxlib import xla_client
try:
    options = xla_client.generate_pjrt_gpu_plugin_options()
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"memory_fraction": options.get("memory_fraction"), "preallocate": options.get("preallocate")}))
"""


@pytest.fixture
def jax_python() -> str:
    python = python_with("jaxlib.xla_client")
    if python is None:
        missing(f"no interpreter with jaxlib (tried {interpreters()}): set {ENV_VAR} to a Python with "
                "`pip install jax` (the CPU jaxlib is enough; make framework-python builds one)")
    probe = run(python, "import json; from jaxlib import xla_client; "
                "print(json.dumps(hasattr(xla_client, 'generate_pjrt_gpu_plugin_options')))", {})
    if probe is not True:
        skip_by_design("jaxlib-version",
                       "this jaxlib has no generate_pjrt_gpu_plugin_options (older than the CUDA plugin)")
    return python


def test_jax_reads_the_injected_fraction_and_growth(jax_python: str) -> None:
    env = injected_env()
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.25"
    assert run(jax_python, JAX_READER, env) == {"memory_fraction": 0.25, "preallocate": False}


def reads_newer_name(python: str) -> bool:
    """Whether this jaxlib knows XLA_CLIENT_MEM_FRACTION (0.5.0 and later refuse it next to the old name)."""
    both = {"XLA_CLIENT_MEM_FRACTION": "0.2", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"}
    return "error" in run(python, JAX_READER, both)


def test_jax_keeps_the_users_newer_name_and_starts(jax_python: str) -> None:
    env = injected_env([{"name": "XLA_CLIENT_MEM_FRACTION", "value": "0.2"}])
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
    # jaxlib before 0.5.0 does not know the user's newer name, so there the job runs uncapped (the
    # enforcer remains); adding the old name would break every newer jaxlib, which refuses both.
    expected = 0.2 if reads_newer_name(jax_python) else None
    assert run(jax_python, JAX_READER, env) == {"memory_fraction": expected, "preallocate": False}


def test_jax_refuses_both_names_which_is_why_gpufence_never_adds_the_second(jax_python: str) -> None:
    both = {"XLA_CLIENT_MEM_FRACTION": "0.2", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25"}
    result = run(jax_python, JAX_READER, both)
    if "error" not in result:
        skip_by_design("jaxlib-version", "this jaxlib reads only XLA_PYTHON_CLIENT_MEM_FRACTION (before 0.5.0)")
    assert "XLA_CLIENT_MEM_FRACTION is specified together with XLA_PYTHON_CLIENT_MEM_FRACTION" in result["error"]


def test_jax_byte_share_with_known_gpu_memory(jax_python: str) -> None:
    env = injected_env(memory="8Gi", settings=InjectionSettings(gpu_memory=(("nvidia.com/gpu", 80 << 30),)))
    assert run(jax_python, JAX_READER, env)["memory_fraction"] == pytest.approx(0.0937)


TORCH_READER = """
import json, os, torch
conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
if setter is None:
    print(json.dumps({"skip": f"torch {torch.__version__} is a CPU-only build: no CUDA allocator parser"}))
else:
    try:
        torch.cuda.memory._set_allocator_settings(conf)
    except RuntimeError as exc:
        print(json.dumps({"version": torch.__version__, "error": str(exc)[:300]}))
    else:
        print(json.dumps({"version": torch.__version__, "parsed": conf}))
"""


def test_pytorch_parses_the_merged_alloc_conf() -> None:
    python = python_with("torch")
    if python is None:
        skip_by_design("torch", f"no interpreter with torch (tried {interpreters()}): PyPI's Linux torch is the CUDA "
                       f"build (about 1 GB plus the NVIDIA libraries); set {ENV_VAR} to a Python that has it")
    env = injected_env([{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}],
                       settings=InjectionSettings(pytorch_memory_fraction=True))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,per_process_memory_fraction:0.25"
    result = run(python, TORCH_READER, env)
    if "skip" in result:
        skip_by_design("torch", result["skip"])
    major, minor = (int(part) for part in result["version"].split(".")[:2])
    if (major, minor) >= (2, 10):
        assert result.get("parsed") == env["PYTORCH_CUDA_ALLOC_CONF"], result
    else:  # why the cap is opt-in: older releases refuse the key
        assert "per_process_memory_fraction" in result.get("error", ""), result
