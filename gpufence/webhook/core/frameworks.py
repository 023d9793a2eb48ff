"""Allocation-time caps through each framework's own settings, and share-aware warnings (pure).

The enforcer acts after the fact; a framework told its share caps its own allocator, so the
greedy process gets an out-of-memory error on its own allocation and its neighbours never see
one. Every cap here is a fraction of the device's total memory. Framework facts, checked in the
frameworks' sources:

* JAX / XLA (``jaxlib/xla_client.py``, ``generate_pjrt_gpu_plugin_options``): jaxlib 0.4.30 reads
  only ``XLA_PYTHON_CLIENT_MEM_FRACTION``; jaxlib 0.5.0 to 0.10.2 (the newest checked) read
  ``XLA_CLIENT_MEM_FRACTION``, fall back to ``XLA_PYTHON_CLIENT_MEM_FRACTION``, and raise
  ``ValueError`` when both are set. So gpufence sets the old name (read by every version) and
  neither name when the user set either. The fraction sizes XLA's BFC allocator
  (``xla/pjrt/gpu/gpu_helpers.cc``, ``CreateBFCAllocator``: total memory x fraction, with
  ``allow_growth = !preallocate``), so it caps a growing allocator too; without it the default is
  0.75 of the device. ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` has no pool and so no cap (reported).
* PyTorch: ``per_process_memory_fraction`` in the caching allocator's config is new in PyTorch
  2.10 (pytorch#161035, in the 2.10.0 release notes); 2.9 and older stop CUDA initialisation
  with "Unrecognized CachingAllocator option", hence opt-in. In 2.10
  ``c10/cuda/CUDAAllocatorConfig.h`` (``instance()``) reads ``PYTORCH_CUDA_ALLOC_CONF`` and only
  when it is absent ``PYTORCH_ALLOC_CONF``, so the key is merged into whichever the user set.
  ``PYTORCH_NO_CUDA_MEMORY_CACHING`` bypasses the caching allocator (and its cap); older
  ``c10/cuda/CUDACachingAllocator.cpp`` (``forceUncachedAllocator``: ``getenv(...) != nullptr``)
  takes any value, even "0", as on, newer ones ``check_env``'s true values, so any value is reported.
* Text Generation Inference: ``CUDA_MEMORY_FRACTION`` is the launcher's ``--cuda-memory-fraction``
  (default 1.0; "the allowed value equals the total visible memory multiplied by
  cuda-memory-fraction", docs/source/basic_tutorials/launcher.md); its shards pass it to
  ``torch.cuda.set_per_process_memory_fraction`` and size the KV cache from it. A flag given in
  the command line wins over the variable (clap).
* TensorFlow has no variable that caps its allocator; ``TF_FORCE_GPU_ALLOW_GROWTH`` only stops it
  from taking everything up front.

A percentage share maps to its fraction directly. A byte share needs the device's memory: the
pod's ``nvidia.com/gpu.memory`` node selector (GPU Feature Discovery, MiB, taken from NVML) or the
webhook flag ``--gpu-memory`` for the container's GPU resource. Where the memory is known, the
headroom (``--framework-memory-headroom``) is taken off first: the CUDA context and library
workspaces live outside each framework's allocator, but NVML, and so the enforcer, count them.
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from typing import Any

from gpufence.contract import MAX_STATUS_WARNINGS, NAMESPACE_PYTORCH_MEMORY_FRACTION, MemoryShare
from gpufence.quantity import QuantityError, parse_bytes
from gpufence.webhook.core.denial import quote
from gpufence.webhook.core.gpu_paths import shared_gpu_resource
from gpufence.webhook.core.settings import InjectionSettings

ENV_XLA_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # every jaxlib reads it
ENV_XLA_FRACTION_NEW = "XLA_CLIENT_MEM_FRACTION"  # jaxlib >= 0.5.0; an error together with the old name
ENV_XLA_ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
ENV_TGI_FRACTION = "CUDA_MEMORY_FRACTION"
ENV_TORCH_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ENV_TORCH_ALLOC_CONF_NEW = "PYTORCH_ALLOC_CONF"  # read by the CUDA allocator only without the above
ENV_TORCH_NO_CACHING = "PYTORCH_NO_CUDA_MEMORY_CACHING"
TORCH_FRACTION_KEY = "per_process_memory_fraction"
GFD_MEMORY_LABEL = "nvidia.com/gpu.memory"  # GPU Feature Discovery: the GPU's memory in MiB

MiB = 1 << 20
GiB = 1 << 30
_STEP = Decimal("0.0001")  # fractions are written with at most 4 decimals, rounded down


@dataclass(frozen=True)
class DeviceMemory:
    bytes: int
    origin: str  # for messages: 'node selector nvidia.com/gpu.memory="81559"'


@dataclass(frozen=True)
class Cap:
    """A container's allocation-time cap: a fraction of the device's total memory."""

    fraction: Decimal
    text: str  # the fraction as written into variables and messages, e.g. "0.25"


@dataclass(frozen=True)
class FrameworkResult:
    """What ``framework_env`` decided for one container."""

    set_env: list[tuple[str, str]]  # variables to add (absent from the container)
    replace_env: list[tuple[str, str]]  # variables whose value gpufence extends (an alloc conf)
    warnings: list[str]


def human_bytes(num: int) -> str:
    if num % GiB == 0:
        return f"{num // GiB}Gi"
    if num % MiB == 0:
        return f"{num // MiB}Mi"
    return str(num)


def describe_share(memory: MemoryShare) -> str:
    if memory.bytes is not None and memory.percent is not None:  # two units
        return f"the smaller of {human_bytes(memory.bytes)} and {memory.percent:g}%"
    return human_bytes(memory.bytes) if memory.bytes is not None else memory.describe()


def device_memory(spec: Mapping[str, Any], container: Mapping[str, Any],
                  settings: InjectionSettings) -> DeviceMemory | None:
    """The memory of the GPU the container will get, when the pod or the operator says it.

    The node selector comes first: the scheduler only places the pod on nodes carrying that
    label, so it is the node's own GFD reading, whatever the pool. The flag is the operator's word
    for a homogeneous pool of one GPU resource.
    """
    selector = spec.get("nodeSelector")
    if isinstance(selector, dict):
        value = selector.get(GFD_MEMORY_LABEL)
        if isinstance(value, str) and value.isdigit() and 0 < int(value) < (1 << 40):
            return DeviceMemory(int(value) * MiB, f"node selector {GFD_MEMORY_LABEL}={quote(value)}")
    if not settings.gpu_memory:
        return None  # no pool's memory given: the container's resource need not be looked up
    resource = shared_gpu_resource(container, settings)
    for name, num_bytes in settings.gpu_memory:
        if name == resource:
            return DeviceMemory(num_bytes, f"webhook flag --gpu-memory {name}={human_bytes(num_bytes)}")
    return None


def _fraction_text(value: Decimal) -> str:
    text = format(value.quantize(_STEP, rounding=ROUND_DOWN).normalize(), "f")
    return text


def memory_cap(memory: MemoryShare, device: DeviceMemory | None, headroom_bytes: int) -> Cap | None:
    """The fraction a framework may allocate for ``memory`` (rounded down), or None when it cannot
    be computed (a byte share on a GPU of unknown memory) or leaves nothing after the headroom."""
    if device is None:
        # A share in two units: the percentage is an upper bound of the smaller of the two.
        if memory.percent is None:
            return None
        fraction = (Decimal(repr(memory.percent)) / 100).quantize(_STEP, rounding=ROUND_DOWN)
    else:
        share = memory.limit_bytes(device.bytes)
        allowed = min(share, device.bytes) - headroom_bytes
        if allowed <= 0:
            return None
        fraction = (Decimal(allowed) / Decimal(device.bytes)).quantize(_STEP, rounding=ROUND_DOWN)
    if fraction <= 0:
        return None
    return Cap(fraction=fraction, text=_fraction_text(fraction))


def pytorch_cap_enabled(namespace_annotations: Mapping[str, object], settings: InjectionSettings) -> bool:
    """Whether PyTorch's allocator cap is injected: the Namespace's annotation, else the flag."""
    if NAMESPACE_PYTORCH_MEMORY_FRACTION in namespace_annotations:
        return namespace_annotations[NAMESPACE_PYTORCH_MEMORY_FRACTION] == "true"
    return settings.pytorch_memory_fraction


def _as_fraction(text: object) -> Decimal | None:
    if not isinstance(text, str) or len(text) > 32:
        return None
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def alloc_conf_value(conf: str, key: str) -> str | None:
    """The value of ``key`` in a PyTorch allocator config ("k:v,k:v"); the last one counts."""
    found = None
    for item in conf.split(","):
        name, sep, value = item.partition(":")
        if sep and name.strip() == key:
            found = value.strip()
    return found


def framework_env(name: str, memory: MemoryShare | None, env: Mapping[str, Mapping[str, Any]],
                  device: DeviceMemory | None, settings: InjectionSettings, pytorch: bool) -> FrameworkResult:
    """The framework caps of container ``name`` for its memory share.

    ``env``: the container's variables by name (the effective, last entry of each). A variable the
    user set is never overwritten; one whose value allows more than the share is reported. The
    result depends only on the inputs, so the webhook's own output gives the same result
    (reinvocation).
    """
    warnings = _uncapped_allocators(name, memory, env)
    if memory is None:
        return FrameworkResult(set_env=[], replace_env=[], warnings=warnings)
    cap = memory_cap(memory, device, settings.framework_memory_headroom_bytes)
    if cap is None:
        return FrameworkResult(set_env=[], replace_env=[],
                               warnings=[*warnings, _no_cap(name, memory, device, settings)])
    set_env: list[tuple[str, str]] = []
    # JAX: one name only, whichever the user chose.
    user_xla = [var for var in (ENV_XLA_FRACTION, ENV_XLA_FRACTION_NEW) if var in env]
    if not user_xla:
        set_env.append((ENV_XLA_FRACTION, cap.text))
    for var in user_xla:
        # Our own cap, seen again on reinvocation, is not reported.
        if env[var].get("value") != cap.text or "valueFrom" in env[var]:
            warnings += _above(name, memory, cap, var, env[var].get("value"))
    # Text Generation Inference.
    if ENV_TGI_FRACTION not in env:
        set_env.append((ENV_TGI_FRACTION, cap.text))
    elif env[ENV_TGI_FRACTION].get("value") != cap.text or "valueFrom" in env[ENV_TGI_FRACTION]:
        warnings += _above(name, memory, cap, ENV_TGI_FRACTION, env[ENV_TGI_FRACTION].get("value"))
    result = FrameworkResult(set_env=set_env, replace_env=[], warnings=warnings)
    return _pytorch(name, memory, cap, env, result) if pytorch else result


def _uncapped_allocators(name: str, memory: MemoryShare | None, env: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The warnings for variables that take a framework's allocator out of any cap."""
    warnings = []
    if ENV_TORCH_NO_CACHING in env:
        value = env[ENV_TORCH_NO_CACHING].get("value", "")
        warnings.append(
            f"container {quote(name)} sets {ENV_TORCH_NO_CACHING}={quote(value)}: PyTorch then bypasses its "
            "caching allocator and any memory cap, so only the enforcer's termination bounds it; remove it "
            "outside cuda-memcheck runs"
        )
    if memory is None:
        return warnings
    allocator = env.get(ENV_XLA_ALLOCATOR, {}).get("value")
    if isinstance(allocator, str) and allocator.strip().lower() == "platform":
        warnings.append(
            f"container {quote(name)} sets {ENV_XLA_ALLOCATOR}={quote(allocator)}: JAX then allocates on demand "
            f"without a pool, so no memory fraction caps it; remove it to let {ENV_XLA_FRACTION} apply"
        )
    return warnings


def _no_cap(name: str, memory: MemoryShare, device: DeviceMemory | None, settings: InjectionSettings) -> str:
    """Why a container with a memory share gets no framework cap."""
    if device is None:
        return (f"container {quote(name)}: memory share {describe_share(memory)} is in bytes and the GPU's memory "
                f"is unknown, so no framework cap ({ENV_XLA_FRACTION}, {ENV_TGI_FRACTION}) is set; use a "
                f"percentage, node selector {GFD_MEMORY_LABEL} or flag --gpu-memory")
    return (f"container {quote(name)}: the memory share {describe_share(memory)} leaves nothing after the "
            f"{human_bytes(settings.framework_memory_headroom_bytes)} headroom on a GPU of "
            f"{human_bytes(device.bytes)} ({device.origin}), so no framework cap is set")


def _above(name: str, memory: MemoryShare, cap: Cap, var: str, value: object, shown: str | None = None) -> list[str]:
    """The warning where a user's fraction ``value`` of ``var`` allows more than the share's cap."""
    given = _as_fraction(value)
    if given is None or given <= cap.fraction:
        return []
    return [f"container {quote(name)} sets {shown or var}={quote(value)}, more than its memory share "
            f"{describe_share(memory)} allows; gpufence keeps it, so the enforcer may terminate the "
            f"container: use at most {cap.text}"]


def _pytorch(name: str, memory: MemoryShare, cap: Cap, env: Mapping[str, Mapping[str, Any]],
             result: FrameworkResult) -> FrameworkResult:
    """``result`` with PyTorch's allocator cap: its alloc conf variable set or extended, or a warning."""
    entry_name = ENV_TORCH_ALLOC_CONF
    if ENV_TORCH_ALLOC_CONF not in env and ENV_TORCH_ALLOC_CONF_NEW in env:
        entry_name = ENV_TORCH_ALLOC_CONF_NEW  # the user's choice; a new variable would shadow it
    setting = f"{TORCH_FRACTION_KEY}:{cap.text}"
    entry = env.get(entry_name)
    if entry is None:
        return FrameworkResult([*result.set_env, (entry_name, setting)], result.replace_env, result.warnings)
    if "valueFrom" in entry:
        return FrameworkResult(result.set_env, result.replace_env, [
            *result.warnings, f"container {quote(name)} takes {entry_name} from valueFrom, so gpufence cannot add "
            f"{setting} and PyTorch's allocator is not capped"])
    conf = (entry.get("value") or "").strip().rstrip(",")
    current = alloc_conf_value(conf, TORCH_FRACTION_KEY)
    if current is None:
        return FrameworkResult(result.set_env, [(entry_name, f"{conf},{setting}" if conf else setting)],
                               result.warnings)
    if current != cap.text:
        return FrameworkResult(result.set_env, result.replace_env, [
            *result.warnings, *_above(name, memory, cap, entry_name, current, f"{entry_name} {TORCH_FRACTION_KEY}")])
    return result


def recorded_warnings(warnings: Sequence[str]) -> list[str]:
    """The warnings kept in the status annotation (for the enforcer's Event): the first few."""
    return list(dict.fromkeys(warnings))[:MAX_STATUS_WARNINGS]


# --- inference servers that size themselves from the GPU's total memory ---------------------------

_SPACE = re.compile(r"\s")
_MAX_WORDS = 4096  # command-line words scanned for flags: real server command lines have far fewer
_MAX_SHELL_SPLIT = 4096  # characters of one command/args item parsed with shlex (pure Python, per character)
# A container none of whose words or image contains one of these is no inference server we know.
_SERVER_MARKERS = ("vllm", "sglang", "text-generation", "--gpu-memory-utilization", "--gpu_memory_utilization",
                   "--mem-fraction-static", "--mem_fraction_static", "--cuda-memory-fraction", "--kv-cache-memory")

def _tokens(container: Mapping[str, Any]) -> list[str]:
    """command + args as words; an item with spaces (``sh -c "vllm serve ..."``) is split like a shell."""
    words: list[str] = []
    for key in ("command", "args"):
        items = container.get(key)
        if not isinstance(items, list):
            continue
        for item in items:
            if not isinstance(item, str):
                continue
            if _SPACE.search(item) and len(item) <= _MAX_SHELL_SPLIT:
                try:
                    words.extend(shlex.split(item))
                except ValueError:
                    words.extend(item.split())
            elif _SPACE.search(item):
                words.extend(item.split())  # too long to parse like a shell within a review's budget
            else:
                words.append(item)
    return words


def _flag(words: Sequence[str], flag: str) -> str | None:
    """The last value of ``--flag value`` / ``--flag=value`` (underscores accepted, as vLLM does)."""
    found = None
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        head, sep, value = word.partition("=")
        if head.replace("_", "-") != flag:
            continue
        if sep:
            found = value
        elif i + 1 < len(words):
            found = words[i + 1]
    return found


def _has(words: Sequence[str], *needles: str) -> bool:
    return any(needle in word for word in words for needle in needles)


def _pair(words: Sequence[str], first: str, second: str) -> bool:
    return any(a.endswith(first) and b == second for a, b in itertools.pairwise(words))


def server_warnings(name: str, container: Mapping[str, Any], memory: MemoryShare | None,
                    device: DeviceMemory | None, settings: InjectionSettings) -> list[str]:
    """Warnings for vLLM, SGLang and TGI settings that exceed the container's memory share.

    These servers take a fraction of the GPU's *total* memory at start-up (vLLM
    ``--gpu-memory-utilization``, default 0.9; SGLang ``--mem-fraction-static``, default chosen
    from the GPU's size; TGI ``--cuda-memory-fraction``, default 1.0), so under a share they are
    terminated by the enforcer, or fail, as soon as they start.
    """
    if memory is None:
        return []
    image = container.get("image")
    if not isinstance(image, str):
        image = ""
    raw = [image]
    for key in ("command", "args"):
        items = container.get(key)
        if isinstance(items, list):
            raw.extend(item for item in items if isinstance(item, str))
    text = "\n".join(raw)
    if not any(marker in text for marker in _SERVER_MARKERS):
        return []
    words = _tokens(container)[:_MAX_WORDS]
    server = _Server(name, memory, device, memory_cap(memory, device, settings.framework_memory_headroom_bytes))
    return [*server.vllm(words, image), *server.sglang(words), *server.tgi(words, image)]


@dataclass(frozen=True)
class _Server:
    """One container's memory share, as an inference server's flags are checked against it."""

    name: str
    memory: MemoryShare
    device: DeviceMemory | None
    cap: Cap | None

    def warning(self, server: str, flag: str, value: str | None, default: str) -> str:
        share = describe_share(self.memory)
        shown = f"{flag}={value}" if value is not None else f"{flag} (default {default})"
        if self.cap is not None:
            advice = f"use {flag}={self.cap.text}"
        else:
            advice = f"use at most {share} divided by the GPU's memory (e.g. {flag}=0.1 for 8Gi of 80Gi)"
        verb = "takes" if self.cap is not None else "may take"
        return f"container {quote(self.name)}: {server} {shown} {verb} more than the memory share {share}; {advice}"

    def exceeds(self, value: str | None) -> bool:
        given = _as_fraction(value)
        return given is not None and self.cap is not None and given > self.cap.fraction

    def vllm(self, words: Sequence[str], image: str) -> list[str]:
        if not (_pair(words, "vllm", "serve") or _has(words, "vllm.entrypoints") or "vllm-openai" in image
                or _flag(words, "--gpu-memory-utilization") is not None):
            return []
        kv = _flag(words, "--kv-cache-memory-bytes")
        utilization = _flag(words, "--gpu-memory-utilization")
        if kv is None:
            if utilization is None or self.exceeds(utilization):
                return [self.warning("vLLM", "--gpu-memory-utilization", utilization, "0.9")]
            return []
        # vLLM then sizes the KV cache from this, not from --gpu-memory-utilization.
        try:
            kv_bytes: int | None = parse_bytes(kv.strip())
        except QuantityError:
            kv_bytes = None
        memory, device = self.memory, self.device
        limit = memory.bytes if memory.bytes is not None else (
            int(device.bytes * memory.percent / 100) if device is not None and memory.percent else None)
        if kv_bytes is None or limit is None or kv_bytes < limit:
            return []
        share = describe_share(memory)
        return [f"container {quote(self.name)}: vLLM --kv-cache-memory-bytes={kv} is not less than the memory share "
                f"{share}, which must also hold the model's weights; use less than {share} minus the weights"]

    def sglang(self, words: Sequence[str]) -> list[str]:
        if not (_has(words, "sglang.launch_server") or _pair(words, "sglang", "serve")
                or _flag(words, "--mem-fraction-static") is not None):
            return []
        static = _flag(words, "--mem-fraction-static")
        if static is None or self.exceeds(static):
            return [self.warning("SGLang", "--mem-fraction-static", static, "about 0.8-0.9")]
        return []

    def tgi(self, words: Sequence[str], image: str) -> list[str]:
        if not (_has(words, "text-generation-launcher") or "text-generation-inference" in image
                or _flag(words, "--cuda-memory-fraction") is not None):
            return []
        fraction = _flag(words, "--cuda-memory-fraction")
        # Without the flag TGI reads CUDA_MEMORY_FRACTION, which framework_env sets (or reports).
        if (fraction is not None and self.exceeds(fraction)) or (fraction is None and self.cap is None):
            return [self.warning("TGI", "--cuda-memory-fraction", fraction, "1.0")]
        return []
