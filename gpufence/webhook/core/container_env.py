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
from collections.abc import Sequence
from typing import Any, NamedTuple

from gpufence.contract import (
    ENV_CONTAINER,
    ENV_DRIVER_MEMORY_LIMIT,
    ENV_DRIVER_MEMORY_REQUEST,
    ENV_LD_PRELOAD,
    ENV_MEMORY_LIMIT,
    ENV_MPS_MEMORY_LIMIT,
    ENV_PRELOAD_MEMORY_LIMIT,
    ContainerShare,
    MemoryShare,
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


def share_env(
    name: str,
    share: ContainerShare,
    settings: InjectionSettings,
    library: str | None,
    framework_caps: Sequence[tuple[str, str]] = (),
    *,
    driver_limits: bool = False,
    resolved: bool = False,
    limiters: bool = True,
) -> tuple[list[tuple[str, str]], list[str]]:
    """The variables a GPU container gets for its share, in the order they are added, and the
    warnings the limits cause. LD_PRELOAD is left to ``gpu_container``: it appends to a user's value
    rather than adding a variable. ``framework_caps``: the allocation-time caps
    ``webhook.core.frameworks.framework_env`` chose (variables the container lacks). ``driver_limits``:
    the pod gets the driver's limit (``webhook.core.driver_limits``); ``resolved``: the share's byte part
    is its percentage on the GPU's known memory, so no limiter leaves a percentage part aside.
    ``limiters``: False where another runtime holds the container's limit (KAI's NvFractions): then
    no driver, MPS or preload variables."""
    memory = share.memory
    variables = [(ENV_CONTAINER, name)]
    if memory is not None:
        variables.append((ENV_MEMORY_LIMIT, memory.describe()))
    driver_mib = driver_limit_mib(memory)
    if limiters and driver_limits and driver_mib is not None:
        variables += [(ENV_DRIVER_MEMORY_LIMIT, str(driver_mib)), (ENV_DRIVER_MEMORY_REQUEST, str(driver_mib))]
    variables += [(ENV_TF_ALLOW_GROWTH, "true"), (ENV_XLA_PREALLOCATE, "false"), *framework_caps]
    compute = None if share.compute_percent is None else str(max(1, int(share.compute_percent)))
    warnings: list[str] = []
    if limiters and settings.mps_limits:
        mps, said = _limiter_env(name, memory, resolved, "MPS", ENV_MPS_MEMORY_LIMIT, "0={}M")
        variables += [*mps, *([(ENV_MPS_THREADS, compute)] if compute is not None else [])]
        warnings += said
    if limiters and library is not None:
        preload, said = _limiter_env(name, memory, resolved, "the preload limiter", ENV_PRELOAD_MEMORY_LIMIT, "{}m")
        variables += [*preload, *([(ENV_HAMI_SM, compute)] if compute is not None else [])]
        warnings += said
    return variables, warnings


def _limiter_env(name: str, memory: MemoryShare | None, resolved: bool, limiter: str, var: str,
                 form: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The memory variable of one in-container limiter (MPS, the preload limiter), whole MiB of the
    share's byte part, and its warnings: none where the share has no byte part or less than 1 MiB."""
    if memory is None:
        return [], []
    if memory.bytes is None:
        return [], [f"container {quote(name)}: {limiter} needs an absolute memory limit, so the percentage "
                    f"share {memory.describe()} is enforced by the gpufence enforcer only"]
    mib = mebibytes_floor(memory.bytes)
    if mib < 1:
        return [], [f"container {quote(name)}: the memory share is below 1Mi, too small for {limiter}"]
    left = [_percent_part_left(name, limiter, memory.describe())] if memory.two_units and not resolved else []
    return [(var, form.format(mib))], left


def _percent_part_left(name: str, limiter: str, share: str) -> str:
    return (f"container {quote(name)}: {limiter} takes the byte part of the share {share}; its percentage "
            "part, where it is the smaller, is enforced by the gpufence enforcer only")


class ShareLimits(NamedTuple):
    """How a GPU container's share reaches it (``share_env``'s flags): the driver's limit applies to
    the pod (``driver_limits``), the share's bytes are its percentage resolved (``resolved``), no other
    runtime holds its limit (``limiters``), and whether KAI hands it its legacy fraction."""

    driver_limits: bool = False
    resolved: bool = False
    limiters: bool = True
    kai_fraction: bool = False


NO_LIMITS = ShareLimits()


class InjectedContainer(NamedTuple):
    """A GPU container as gpufence wants it, and what to tell its author: ``warnings`` about its
    limits and frameworks, ``replaced`` about the author's values of gpufence's variables that the
    webhook replaced or removed (for the pod's creator only: a reinvocation no longer sees them)."""

    container: dict[str, Any]
    warnings: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()


class _EnvEdit:
    """A container's env being edited: one entry per variable of gpufence's (the effective one, at
    its place), appends at the end, and what gpufence wrote to the variables the author had set."""

    def __init__(self, env: list[dict[str, Any]]) -> None:
        # The author's entries of gpufence's variables, all of them (duplicates included): every one
        # that is not exactly what gpufence writes is reported once the share's values are known.
        by_name: dict[str, list[dict[str, Any]]] = {}
        for entry in env:  # one pass: a container can carry hundreds of variables
            if entry.get("name") in _OWNED:
                by_name.setdefault(entry["name"], []).append(entry)
        self.authored = {var: by_name[var] for var in OWNED_VARIABLES if var in by_name}
        self.env = env
        if any(len(entries) > 1 for entries in self.authored.values()):
            # One entry per variable, at the place of the last (the effective one).
            last = {entry["name"]: i for i, entry in enumerate(env) if entry.get("name") in self.authored}
            self.env = [e for i, e in enumerate(env) if e.get("name") not in self.authored or last[e["name"]] == i]
        self.index = {entry["name"]: i for i, entry in enumerate(self.env)}  # the last duplicate is effective
        self.changed = len(self.env) != len(env)
        self.written: dict[str, str] = {}  # gpufence's variables the author set, and the values written

    def effective(self) -> dict[str, dict[str, Any]]:
        return {var: self.env[i] for var, i in self.index.items()}

    def set_value(self, var: str, value: str) -> None:
        """The existing entry of ``var`` with ``value`` (its other fields kept)."""
        self.env[self.index[var]] = {**self.env[self.index[var]], "value": value}
        self.changed = True

    def add(self, var: str, value: str) -> None:
        """``var=value`` where the container lacks ``var``; an author's value of gpufence's is replaced."""
        if var in self.authored:
            self.written[var] = value
        if var in self.index:
            wanted = {"name": var, "value": value}
            if var in self.authored and self.env[self.index[var]] != wanted:
                self.env[self.index[var]] = wanted  # in place: a reinvocation finds it where it was
                self.changed = True
            return
        self.env.append({"name": var, "value": value})
        self.index[var] = len(self.env) - 1
        self.changed = True

    def drop_unwritten(self, name: str, kai_fraction: bool) -> list[str]:
        """Removes the author's entries of gpufence's variables that gpufence wrote no value for;
        the warnings for every author's entry that is not exactly what gpufence writes."""
        authored = dict(self.authored)
        if kai_fraction and ENV_PRELOAD_MEMORY_LIMIT in authored and ENV_PRELOAD_MEMORY_LIMIT not in self.written \
                and all(_from_config_map(e) for e in authored[ENV_PRELOAD_MEMORY_LIMIT]):
            # KAI's HamiCore mode: HAMi-core's limit from KAI's ConfigMap, filled by KAI's binder.
            del authored[ENV_PRELOAD_MEMORY_LIMIT]
        if any(var not in self.written for var in authored):
            self.env = [e for e in self.env if e.get("name") not in authored or e["name"] in self.written]
            self.changed = True
        return [_replaced(name, var, entries, self.written.get(var)) for var, entries in authored.items()
                if entries != [{"name": var, "value": self.written.get(var)}]]


def gpu_container(
    container: dict[str, Any],
    share: ContainerShare,
    settings: InjectionSettings,
    library: str | None,
    *,
    device: DeviceMemory | None = None,
    pytorch: bool = False,
    limits: ShareLimits = NO_LIMITS,
) -> InjectedContainer:
    """``container`` with its share's variables (and the preload mount) added (``container`` itself
    when it has them all), and its warnings; ``library`` from ``sidecar.preload_library_path``;
    ``device`` and ``pytorch`` for the framework caps (``webhook.core.frameworks``); ``limits`` as in
    ``share_env`` (``limiters`` False: no preload library either). ``kai_fraction``: the container KAI
    hands its legacy fraction, whose ``CUDA_DEVICE_MEMORY_LIMIT`` from a ConfigMap key (what KAI's
    HamiCore admission plugin writes for HAMi-core) is kept where gpufence writes none. Raises
    ``Denial`` when the container sets GPUFENCE_CONTAINER to another value or takes a mount
    gpufence reserves."""
    name = container["name"]
    edit = _EnvEdit(list(container.get("env") or ()))
    frameworks = framework_env(name, share.memory, edit.effective(), device, settings, pytorch)
    warnings = frameworks.warnings + server_warnings(name, container, share.memory, device, settings)
    for var, value in frameworks.replace_env:  # the user's alloc conf, with gpufence's key appended
        edit.set_value(var, value)
    _check_container_variable(name, edit)
    library = library if limits.limiters else None
    variables, limit_warnings = share_env(name, share, settings, library, frameworks.set_env,
                                          driver_limits=limits.driver_limits, resolved=limits.resolved,
                                          limiters=limits.limiters)
    warnings += limit_warnings
    for var, value in variables:
        edit.add(var, value)
    if library is not None:
        warnings += _preload(name, library, edit)
        container = _with_preload_mount(container, library)
    replaced = edit.drop_unwritten(name, limits.kai_fraction)
    if edit.changed:
        container = {**container, "env": edit.env}
    return InjectedContainer(container, tuple(warnings), tuple(replaced))


def _check_container_variable(name: str, edit: _EnvEdit) -> None:
    """The enforcer attributes processes to containers by GPUFENCE_CONTAINER: a wrong value would
    charge this container's GPU use to another one."""
    if ENV_CONTAINER not in edit.index:
        return
    entry = edit.env[edit.index[ENV_CONTAINER]]
    if entry.get("value") != name or "valueFrom" in entry:
        raise Denial(
            f"container {quote(name)} sets {ENV_CONTAINER}={quote(entry.get('value', ''))}; gpufence sets "
            f"it to the container's name to attribute GPU use, so remove it or set it to {quote(name)}"
        )


def _preload(name: str, library: str, edit: _EnvEdit) -> list[str]:
    """LD_PRELOAD with ``library`` added (appended to a user's value); the warning where it cannot be."""
    if ENV_LD_PRELOAD not in edit.index:
        edit.add(ENV_LD_PRELOAD, library)
        return []
    entry = edit.env[edit.index[ENV_LD_PRELOAD]]
    if "valueFrom" in entry:
        return [f"container {quote(name)} takes LD_PRELOAD from valueFrom, so gpufence cannot append "
                f"{library} and the in-process limiter is not loaded"]
    value = entry.get("value") or ""
    if library not in re.split(r"[: ]", value):
        edit.set_value(ENV_LD_PRELOAD, f"{value}:{library}" if value else library)
    return []


def _with_preload_mount(container: dict[str, Any], library: str) -> dict[str, Any]:
    """``container`` with the preload library mounted read-only; Denial where it mounts either itself."""
    mounts = list(container.get("volumeMounts") or ())
    wanted = {"name": PRELOAD_VOLUME, "mountPath": library, "readOnly": True}
    clash = [m for m in mounts if m.get("name") == PRELOAD_VOLUME or m.get("mountPath") == library]
    if not clash:
        return {**container, "volumeMounts": [*mounts, wanted]}
    if clash != [wanted]:
        raise Denial(
            f"container {quote(container['name'])} already mounts volume {PRELOAD_VOLUME} or path {library}, "
            "both reserved by gpufence"
        )
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
