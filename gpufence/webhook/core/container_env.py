"""Each GPU container's part of the injection (pure): the variables that carry its share and the
framework hints, and the preload limiter's mount.

A hint the user set (TF_FORCE_GPU_ALLOW_GROWTH, a framework's own fraction) is kept. The
variables that carry a hard limit (``OWNED_VARIABLES``: the driver's, MPS's, the preload
limiter's, GPUFENCE_MEMORY_LIMIT) are gpufence's: a value the author set is replaced by the share's
(a ``valueFrom`` entry becomes a plain value), or removed where gpufence writes none for that
variable, with a warning naming the container, the variable and the value dropped. Replaced rather
than denied: the pod still runs, under the admin's policy, and a Deployment whose template carries
an old value does not get stuck; the validating webhook (``/validate``) refuses such a pod where
a later mutating step put the value back. ``envFrom`` needs nothing: an explicit ``env`` entry wins over it.

Copy-on-write: a container is copied only when something is added, and its untouched fields stay
shared with the input, so ``webhook.core.patch.diff`` skips them by identity.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpufence.contract import (
    ENV_CONTAINER,
    ENV_DRIVER_MEMORY_LIMIT,
    ENV_DRIVER_MEMORY_REQUEST,
    ENV_LD_PRELOAD,
    ENV_MEMORY_LIMIT,
    ENV_MPS_MEMORY_LIMIT,
    ENV_PRELOAD_MEMORY_LIMIT,
    ContainerShare,
)
from gpufence.quantity import mebibytes_floor
from gpufence.webhook.core.denial import Denial, quote
from gpufence.webhook.core.driver_limits import driver_limit_mib
from gpufence.webhook.core.frameworks import DeviceMemory, framework_env, server_warnings
from gpufence.webhook.core.gpu_paths import PodGpuPaths
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.sidecar import PRELOAD_VOLUME

ENV_TF_ALLOW_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
ENV_XLA_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ENV_MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_HAMI_SM = "CUDA_DEVICE_SM_LIMIT"
ENV_NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# The variables that carry a GPU container's hard limits: gpufence's alone (the module's docstring).
# GPUFENCE_MEMORY_LIMIT only says the share to a person (or program) reading the container's
# environment; the others are limits some layer enforces.
OWNED_VARIABLES = (ENV_MEMORY_LIMIT, ENV_DRIVER_MEMORY_LIMIT, ENV_DRIVER_MEMORY_REQUEST, ENV_MPS_MEMORY_LIMIT,
                   ENV_MPS_THREADS, ENV_PRELOAD_MEMORY_LIMIT, ENV_HAMI_SM)
_OWNED = frozenset(OWNED_VARIABLES)


def add_share_env(
    name: str,
    share: ContainerShare,
    settings: InjectionSettings,
    library: str | None,
    warnings: list[str],
    add: Callable[[str, str], None],
    framework_caps: Sequence[tuple[str, str]] = (),
    *,
    driver_limits: bool = False,
    resolved: bool = False,
    limiters: bool = True,
) -> None:
    """Adds through ``add``, in this order, the variables a GPU container gets for its share, and
    appends the warnings the limits cause. LD_PRELOAD is left to ``gpu_container``: it appends to
    a user's value rather than adding a variable. ``framework_caps``: the allocation-time caps
    ``webhook.core.frameworks.framework_env`` chose (variables the container lacks). ``driver_limits``:
    the pod gets the driver's limit (``webhook.core.driver_limits``); ``resolved``: the share's byte part
    is its percentage on the GPU's known memory, so no limiter leaves a percentage part aside.
    ``limiters``: False where another runtime holds the container's limit (KAI's NvFractions): then
    no driver, MPS or preload variables."""
    add(ENV_CONTAINER, name)
    memory = share.memory
    if memory is not None:
        add(ENV_MEMORY_LIMIT, memory.describe())
    driver_mib = driver_limit_mib(memory)
    if limiters and driver_limits and driver_mib is not None:
        add(ENV_DRIVER_MEMORY_LIMIT, str(driver_mib))
        add(ENV_DRIVER_MEMORY_REQUEST, str(driver_mib))
    add(ENV_TF_ALLOW_GROWTH, "true")
    add(ENV_XLA_PREALLOCATE, "false")
    for var, value in framework_caps:
        add(var, value)
    compute = None if share.compute_percent is None else max(1, int(share.compute_percent))

    if limiters and settings.mps_limits:
        if memory is not None:
            mib = mebibytes_floor(memory.bytes) if memory.bytes is not None else 0
            if memory.bytes is None:
                warnings.append(
                    f"container {quote(name)}: MPS needs an absolute memory limit, so the percentage share "
                    f"{memory.describe()} is enforced by the gpufence enforcer only"
                )
            elif mib < 1:
                warnings.append(f"container {quote(name)}: the memory share is below 1Mi, too small for MPS")
            else:
                add(ENV_MPS_MEMORY_LIMIT, f"0={mib}M")
                if memory.two_units and not resolved:
                    warnings.append(_percent_part_left(name, "MPS", memory.describe()))
        if compute is not None:
            add(ENV_MPS_THREADS, str(compute))

    if limiters and library is not None:
        if memory is not None:
            if memory.bytes is None:
                warnings.append(
                    f"container {quote(name)}: the preload limiter needs an absolute memory limit, so the "
                    f"percentage share {memory.describe()} is enforced by the gpufence enforcer only"
                )
            elif mebibytes_floor(memory.bytes) < 1:
                warnings.append(
                    f"container {quote(name)}: the memory share is below 1Mi, too small for the preload limiter"
                )
            else:
                add(ENV_PRELOAD_MEMORY_LIMIT, f"{mebibytes_floor(memory.bytes)}m")
                if memory.two_units and not resolved:
                    warnings.append(_percent_part_left(name, "the preload limiter", memory.describe()))
        if compute is not None:
            add(ENV_HAMI_SM, str(compute))


def _percent_part_left(name: str, limiter: str, share: str) -> str:
    return (f"container {quote(name)}: {limiter} takes the byte part of the share {share}; its percentage "
            "part, where it is the smaller, is enforced by the gpufence enforcer only")


@dataclass
class FrameworkRecord:
    """What the framework rules warned about, across the pod's GPU containers, for the status
    annotation (and, through it, the enforcer's Event)."""

    warnings: list[str] = field(default_factory=list)


def gpu_container(
    container: dict[str, Any],
    share: ContainerShare,
    settings: InjectionSettings,
    library: str | None,
    warnings: list[str],
    *,
    device: DeviceMemory | None = None,
    pytorch: bool = False,
    record: FrameworkRecord | None = None,
    driver_limits: bool = False,
    resolved: bool = False,
    replaced: list[str] | None = None,
    limiters: bool = True,
    kai_fraction: bool = False,
) -> dict[str, Any]:
    """``container`` with its share's variables (and the preload mount) added, or ``container``
    itself when it has them all; ``library`` from ``sidecar.preload_library_path``; ``device``
    and ``pytorch`` for the framework caps (``webhook.core.frameworks``), whose decisions go to
    ``record``; ``driver_limits`` and ``resolved`` as in ``add_share_env``; ``replaced`` gets the warnings about
    the author's values of gpufence's variables (default: ``warnings``). ``limiters``: as in
    ``add_share_env`` (False: no preload library either). ``kai_fraction``: the container KAI hands
    its legacy fraction, whose ``CUDA_DEVICE_MEMORY_LIMIT`` from a ConfigMap key (what KAI's HamiCore
    admission plugin writes for HAMi-core) is kept where gpufence writes none. Raises
    ``Denial`` when the container sets GPUFENCE_CONTAINER to another value or takes a mount
    gpufence reserves."""
    name = container["name"]
    env = list(container.get("env") or ())
    # The author's entries of gpufence's variables, all of them (duplicates included): every one that
    # is not exactly what gpufence writes is reported once the share's values are known.
    by_name: dict[str, list[dict[str, Any]]] = {}
    for entry in env:  # one pass: a container can carry hundreds of variables
        if entry.get("name") in _OWNED:
            by_name.setdefault(entry["name"], []).append(entry)
    authored = {var: by_name[var] for var in OWNED_VARIABLES if var in by_name}
    if any(len(entries) > 1 for entries in authored.values()):
        # One entry per variable, at the place of the last (the effective one).
        last = {entry["name"]: i for i, entry in enumerate(env) if entry.get("name") in authored}
        env = [e for i, e in enumerate(env) if e.get("name") not in authored or last[e["name"]] == i]
    index = {entry["name"]: i for i, entry in enumerate(env)}  # the last duplicate is the effective one
    changed = len(env) != len(container.get("env") or ())
    written: dict[str, str] = {}  # gpufence's variables and the values it writes

    frameworks = framework_env(name, share.memory, {var: env[i] for var, i in index.items()}, device,
                               settings, pytorch)
    found = frameworks.warnings + server_warnings(name, container, share.memory, device, settings)
    warnings.extend(found)
    if record is not None:
        record.warnings.extend(found)
    for var, value in frameworks.replace_env:  # the user's alloc conf, with gpufence's key appended
        env[index[var]] = {**env[index[var]], "value": value}
        changed = True

    def add(var: str, value: str) -> None:
        nonlocal changed
        if var in authored:
            written[var] = value
        if var in index:
            wanted = {"name": var, "value": value}
            if var in authored and env[index[var]] != wanted:
                env[index[var]] = wanted  # in place: a reinvocation finds it where it was
                changed = True
            return
        env.append({"name": var, "value": value})
        index[var] = len(env) - 1
        changed = True

    if ENV_CONTAINER in index:
        entry = env[index[ENV_CONTAINER]]
        if entry.get("value") != name or "valueFrom" in entry:
            # The enforcer attributes processes to containers by this variable: a wrong value would
            # charge this container's GPU use to another one.
            raise Denial(
                f"container {quote(name)} sets {ENV_CONTAINER}={quote(entry.get('value', ''))}; gpufence sets "
                f"it to the container's name to attribute GPU use, so remove it or set it to {quote(name)}"
            )
    if not limiters:
        library = None
    add_share_env(name, share, settings, library, warnings, add, frameworks.set_env,
                  driver_limits=driver_limits, resolved=resolved, limiters=limiters)
    if library is not None:
        if ENV_LD_PRELOAD not in index:
            add(ENV_LD_PRELOAD, library)
        else:
            i = index[ENV_LD_PRELOAD]
            entry = env[i]
            if "valueFrom" in entry:
                warnings.append(
                    f"container {quote(name)} takes LD_PRELOAD from valueFrom, so gpufence cannot append "
                    f"{library} and the in-process limiter is not loaded"
                )
            else:
                value = entry.get("value") or ""
                if library not in re.split(r"[: ]", value):
                    env[i] = {**entry, "value": f"{value}:{library}" if value else library}
                    changed = True
        mounts = list(container.get("volumeMounts") or ())
        wanted = {"name": PRELOAD_VOLUME, "mountPath": library, "readOnly": True}
        clash = [m for m in mounts if m.get("name") == PRELOAD_VOLUME or m.get("mountPath") == library]
        if not clash:
            mounts.append(wanted)
            container = {**container, "volumeMounts": mounts}
        elif clash != [wanted]:
            raise Denial(
                f"container {quote(name)} already mounts volume {PRELOAD_VOLUME} or path {library}, "
                "both reserved by gpufence"
            )

    if kai_fraction and ENV_PRELOAD_MEMORY_LIMIT in authored and ENV_PRELOAD_MEMORY_LIMIT not in written \
            and all(_from_config_map(e) for e in authored[ENV_PRELOAD_MEMORY_LIMIT]):
        # KAI's HamiCore mode: HAMi-core's limit from KAI's ConfigMap, filled by KAI's binder.
        del authored[ENV_PRELOAD_MEMORY_LIMIT]
    if any(var not in written for var in authored):
        env = [e for e in env if e.get("name") not in authored or e["name"] in written]
        changed = True
    (warnings if replaced is None else replaced).extend(
        _replaced(name, var, entries, written.get(var)) for var, entries in authored.items()
        if entries != [{"name": var, "value": written.get(var)}])
    if changed:
        container = {**container, "env": env}
    return container


def _from_config_map(entry: dict[str, Any]) -> bool:
    source = entry.get("valueFrom")
    return not entry.get("value") and isinstance(source, dict) and isinstance(source.get("configMapKeyRef"), dict)


def _replaced(name: str, var: str, entries: list[dict[str, Any]], value: str | None) -> str:
    """The warning for the author's entries of one of gpufence's variables (short: the API server's
    limit on a warning's length)."""
    last = entries[-1]
    dropped = f"{var} from valueFrom" if "valueFrom" in last else f"{var}={quote(last.get('value', ''))}"
    if len(entries) > 1:
        dropped += f" (and {len(entries) - 1} earlier entr{'y' if len(entries) == 2 else 'ies'})"
    if value is None:
        return f"container {quote(name)}: gpufence removes {dropped}: it writes none for this share"
    return f"container {quote(name)}: gpufence replaces {dropped} with {quote(value)}, the share's value"


def void_container(container: dict[str, Any], paths: PodGpuPaths) -> dict[str, Any]:
    """A container with ``NVIDIA_VISIBLE_DEVICES=void`` unless it sets the variable itself (to void
    or none: any other value was denied, ``podshape.nvidia_side_door``) or gets a device by any path
    (``paths.gets_device``: a GPU or exclusive resource, or a DRA claim), which is returned as it is.

    An explicit env entry wins over the image's ENV (CUDA base images carry
    ``NVIDIA_VISIBLE_DEVICES=all``) and over ``envFrom``, so the NVIDIA container toolkit hands this
    container no GPU however it was built. It also wins over the device plugin's: the kubelet appends
    the container's own env after the variables of the plugin's Allocate, and the runtime keeps the
    last, so on a container that got a device (a MIG slice, a renamed shared GPU) ``void`` would take
    the device away. Hence never on those.
    """
    if paths.gets_device(container):
        return container
    return with_void(container)


def with_void(container: dict[str, Any]) -> dict[str, Any]:
    """``container`` with ``NVIDIA_VISIBLE_DEVICES=void`` unless it sets the variable itself: the part
    of ``void_container`` for a container known to get no device."""
    env = container.get("env") or ()
    if any(entry.get("name") == ENV_NVIDIA_VISIBLE_DEVICES for entry in env):
        return container
    return {**container, "env": [*env, {"name": ENV_NVIDIA_VISIBLE_DEVICES, "value": "void"}]}
