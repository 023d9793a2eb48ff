"""The desired pod, computed from the pod as submitted, and the JSON Patch between them (pure).

``desired_pod`` is idempotent by construction: every field it writes is either fully determined
by the settings and the share plan (the sidecar, the volumes, the status annotation, the enforcer
config) or added only when absent (the GPU containers' environment), so ``desired_pod`` of its
own output changes nothing and ``diff`` yields no operation on reinvocation.

The API server applies defaults to the patched pod before a reinvocation, so every object the
webhook owns spells out the values defaulting would add (probe timings, ``protocol: TCP``,
``fieldRef.apiVersion``, ``terminationMessagePath``, ``hostPath.type``...); otherwise the second
pass would see a "different" sidecar and patch again.

Copy-on-write: the desired pod shares every untouched subtree with the input (no deep copy), which
keeps a review cheap and lets ``diff`` skip shared subtrees by identity. For the same reason
``injection_patch`` splices the sidecar's JSON, cached per settings, into the patch's text
instead of encoding it anew (the output is byte for byte ``json.dumps``'s).
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
import secrets
from collections.abc import Callable, Container
from importlib import metadata
from operator import is_
from types import MappingProxyType
from typing import Any

from enforcer.config import (
    DEFAULT_STATE_DIR,
    ENV_CONFIG,
    ENV_CONTAINER,
    ENV_HOST_PROC,
    ENV_MEMORY_LIMIT,
    ENV_METRICS_PORT,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_POD_UID,
    ENV_STATE_DIR,
    ContainerShare,
    EnforcerConfig,
    Mode,
)
from webhook.quantity import is_positive_quantity, mebibytes_floor
from webhook.settings import ANNOTATION_STATUS, SIDECAR_NAME, SIDECAR_PORT_NAME, InjectionSettings
from webhook.shares import SharePlan, quote

try:
    GPUFENCE_VERSION = metadata.version("gpufence")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    GPUFENCE_VERSION = "unknown"

STATE_VOLUME = "gpufence-state"
HOST_PROC_VOLUME = "gpufence-host-proc"
PRELOAD_VOLUME = "gpufence-preload"
DEFAULT_PRELOAD_LIBRARY = "libvgpu.so"

ENV_TF_ALLOW_GROWTH = "TF_FORCE_GPU_ALLOW_GROWTH"
ENV_XLA_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ENV_MPS_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_HAMI_MEMORY = "CUDA_DEVICE_MEMORY_LIMIT"
ENV_HAMI_SM = "CUDA_DEVICE_SM_LIMIT"
ENV_LD_PRELOAD = "LD_PRELOAD"
# Variables whose user-set value the webhook keeps but reports when it differs from the share.
_LIMIT_VARIABLES = frozenset({ENV_MEMORY_LIMIT, ENV_MPS_MEM_LIMIT, ENV_MPS_THREADS, ENV_HAMI_MEMORY, ENV_HAMI_SM})
_RESERVED_VOLUMES = (STATE_VOLUME, HOST_PROC_VOLUME, PRELOAD_VOLUME)
_MISSING = object()
# Per-plan texts (status annotation, enforcer config) are cached only for plans whose container
# names total at most this many characters (Kubernetes allows 63 per name), so cache entries stay small.
_MAX_CACHED_NAMES = 1024


class MutationError(ValueError):
    """The pod cannot be injected as it is; the message is for the user (a denial)."""


# --- reading a pod ----------------------------------------------------------------------------


def container_requests_gpu(container: Any, resource_names: tuple[str, ...]) -> bool:
    """Whether a container asks for a positive amount of one of the GPU resources (tolerant of garbage)."""
    if not isinstance(container, dict):
        return False
    resources = container.get("resources")
    if not isinstance(resources, dict):
        return False
    for section in ("limits", "requests"):
        amounts = resources.get(section)
        if isinstance(amounts, dict):
            for name in resource_names:
                if name in amounts and is_positive_quantity(amounts[name]):
                    return True
    return False


def preload_library_path(settings: InjectionSettings) -> str | None:
    """Where GPU containers see the preload library, or None when the flag is off.

    ``preload_library_host_path`` names the library *file* on the node (e.g.
    ``/usr/local/vgpu/libvgpu.so``). It is mounted as a hostPath of ``type: File`` at
    ``<preload_library_mount_dir>/<file name>``: a node without the library then fails the pod at
    start instead of silently running it without the in-process limiter (the dynamic loader only
    warns about a missing ``LD_PRELOAD`` entry).
    """
    host_path = settings.preload_library_host_path
    if not host_path:
        return None
    name = posixpath.basename(host_path.rstrip("/")) or DEFAULT_PRELOAD_LIBRARY
    return posixpath.join(settings.preload_library_mount_dir, name)


# --- what the webhook adds --------------------------------------------------------------------


def enforcer_config(plan: SharePlan, settings: InjectionSettings) -> EnforcerConfig:
    return EnforcerConfig(
        containers=dict(plan.containers),
        mode=plan.mode,
        grace_period_seconds=plan.grace_period_seconds,
        poll_interval_seconds=settings.poll_interval_seconds,
    )


# json.dumps with arguments builds a new encoder per call; these are built once.
_encode_sorted = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def status_annotation(plan: SharePlan) -> str:
    # Cached on the names, the mode and the version (a module global, which tests replace).
    names = tuple(name for name, _ in plan.containers)
    if sum(map(len, names)) <= _MAX_CACHED_NAMES:
        return _status_annotation(names, plan.mode, GPUFENCE_VERSION)
    return _status_annotation.__wrapped__(names, plan.mode, GPUFENCE_VERSION)


@functools.lru_cache(maxsize=256)
def _status_annotation(names: tuple[str, ...], mode: Mode, version: str) -> str:
    return _encode_sorted({"containers": list(names), "mode": mode.value, "sidecar": SIDECAR_NAME, "version": version})


def _config_json(plan: SharePlan, settings: InjectionSettings) -> str:
    """``enforcer_config(plan, settings).to_json()``, cached: pods repeat a handful of share plans.

    The key is the plan's small parsed values (container names and shares, mode, grace period)
    and the poll interval, never the request; plans naming long containers are not cached.
    """
    key = (plan.containers, plan.mode, plan.grace_period_seconds, settings.poll_interval_seconds)
    if sum(len(name) for name, _ in plan.containers) <= _MAX_CACHED_NAMES:
        return _config_json_cached(key)
    return _config_json_cached.__wrapped__(key)


@functools.lru_cache(maxsize=256)
def _config_json_cached(key: tuple[Any, ...]) -> str:
    containers, mode, grace, poll = key
    return EnforcerConfig(containers=dict(containers), mode=mode, grace_period_seconds=grace,
                          poll_interval_seconds=poll).to_json()


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}}}


def _probe(path: str, port: int, *, period: int = 10, failures: int = 3) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port, "scheme": "HTTP"},
        "periodSeconds": period,
        "timeoutSeconds": 1,
        "successThreshold": 1,
        "failureThreshold": failures,
    }


# Which user the enforcer runs as. It must signal (KILL) the GPU containers' processes and read
# their /proc/<pid>/environ (SYS_PTRACE to read another user's). The image's user is uid 65532, and
# Kubernetes puts added capabilities in a non-root process's bounding set only, never its effective
# set, so a sidecar running as 65532 could act on uid-65532 processes only: not on the root
# processes of most CUDA images. Hence:
# * a pod-level runAsUser is inherited: the sidecar shares the workloads' user and needs no
#   capability for them (kill(2) and ptrace read access compare real/effective/saved ids; reading
#   environ also needs the same group). A GPU container that sets another runAsUser or runAsGroup
#   of its own is out of a non-root sidecar's reach: warned about, as nothing else can be done;
# * otherwise the sidecar runs as uid 0 with every capability dropped but KILL and SYS_PTRACE
#   (no DAC_OVERRIDE, SETUID, ...), which reaches processes of any user;
# * except under a pod-level runAsNonRoot: true, where uid 0 would keep the pod from starting; the
#   sidecar then runs as its image's user, and the pod is admitted with a warning.
_ROOT_USER = MappingProxyType({"runAsUser": 0, "runAsNonRoot": False})


def sidecar_runs_as_root(spec: dict[str, Any], gpu_containers: Container[str], warnings: list[str]) -> bool:
    """Whether the sidecar sets ``runAsUser: 0`` (``_ROOT_USER``); appends warnings (pure).

    ``gpu_containers`` holds the names of the GPU containers; ``spec`` has been shape-checked
    (``admission._check_shape``).
    """
    pod_context = spec.get("securityContext") or {}
    pod_user = pod_context.get("runAsUser")
    if pod_user is None:
        if pod_context.get("runAsNonRoot") is True:
            warnings.append(
                "gpufence: the pod sets runAsNonRoot but no runAsUser, so the enforcer runs as its image's "
                "user (uid 65532) and can only stop and attribute processes of that user; set "
                "spec.securityContext.runAsUser to the user the GPU containers run as"
            )
            return False
        return True
    if pod_user != 0:
        pod_group = pod_context.get("runAsGroup")
        for key in ("initContainers", "containers"):
            for container in spec.get(key) or ():
                if container["name"] not in gpu_containers:
                    continue
                context = container.get("securityContext") or {}
                user, group = context.get("runAsUser", pod_user), context.get("runAsGroup", pod_group)
                if user != pod_user or group != pod_group:
                    what = f"runAsUser {user}" if user != pod_user else f"runAsGroup {group}"
                    warnings.append(
                        f"container {quote(container['name'])} sets {what}, but the gpufence enforcer runs as "
                        f"the pod's runAsUser {pod_user} without capabilities (non-root), so it cannot stop or "
                        "attribute that container's processes; set the user and group at pod level only"
                    )
    return False


def build_sidecar(plan: SharePlan, settings: InjectionSettings, *, run_as_root: bool = True) -> dict[str, Any]:
    """The enforcer container; ``run_as_root`` from ``sidecar_runs_as_root`` (see there why)."""
    return _sidecar(settings, run_as_root, _config_json(plan, settings))


def _sidecar(settings: InjectionSettings, run_as_root: bool, config_json: str) -> dict[str, Any]:
    # Everything but ``config_json`` comes from the settings and ``run_as_root``: the key under
    # which ``_sidecar_json_parts`` caches the JSON around it.
    port = settings.metrics_port
    env = [
        {"name": ENV_CONFIG, "value": config_json},
        _field_env(ENV_POD_NAME, "metadata.name"),
        _field_env(ENV_POD_NAMESPACE, "metadata.namespace"),
        _field_env(ENV_POD_UID, "metadata.uid"),
        {"name": ENV_METRICS_PORT, "value": str(port)},
        {"name": ENV_STATE_DIR, "value": DEFAULT_STATE_DIR},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": settings.nvidia_visible_devices},
        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": settings.nvidia_driver_capabilities},
    ]
    mounts: list[dict[str, Any]] = [{"name": STATE_VOLUME, "mountPath": DEFAULT_STATE_DIR}]
    if settings.mount_host_proc:
        env.append({"name": ENV_HOST_PROC, "value": settings.host_proc_mount_path})
        mounts.append({"name": HOST_PROC_VOLUME, "mountPath": settings.host_proc_mount_path, "readOnly": True})
    sidecar: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.sidecar_image_pull_policy,
        "command": ["gpufence-enforcer"],
    }
    if settings.native_sidecar:
        sidecar["restartPolicy"] = "Always"
    sidecar.update(
        {
            "env": env,
            "ports": [{"containerPort": port, "name": SIDECAR_PORT_NAME, "protocol": "TCP"}],
            "resources": {
                "requests": {"cpu": settings.sidecar_cpu_request, "memory": settings.sidecar_memory_request},
                "limits": {"memory": settings.sidecar_memory_limit},
            },
            # /healthz answers while the process and its poll loop live, even with NVML down (that
            # degraded state shows in metrics and alerts). No readinessProbe on purpose: the pod's
            # Ready condition counts sidecars, and an enforcer that lost NVML must not take a serving
            # pod out of its Service. The startupProbe makes a native sidecar hold the workload
            # containers back until the enforcer is up (up to 60 s), so enforcement starts first.
            "startupProbe": _probe("/healthz", port, period=1, failures=60),
            "livenessProbe": _probe("/healthz", port),
            # KILL: signal the other containers' processes; SYS_PTRACE: read /proc/<pid>/environ of
            # processes running as another user. Effective only when the sidecar runs as root.
            "securityContext": {
                **(_ROOT_USER if run_as_root else {}),
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"], "add": ["KILL", "SYS_PTRACE"]},
            },
            "volumeMounts": mounts,
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
    )
    return sidecar


# The JSON of a patch, as json.dumps(patch, separators=(",", ":")) writes it. The sidecar, most of
# a patch's bytes, is spliced in from its cached JSON rather than encoded value by value.
_encode_compact = json.JSONEncoder(separators=(",", ":")).encode
# Stands for the sidecar while the rest of a patch is encoded. Unguessable, so no string from the
# pod equals it; the splice still checks that it occurs exactly once.
_PLACEHOLDER = f"gpufence-placeholder-{secrets.token_hex(16)}"
_PLACEHOLDER_JSON = _encode_compact(_PLACEHOLDER)


@functools.lru_cache(maxsize=16)
def _sidecar_json_parts(settings: InjectionSettings, run_as_root: bool) -> tuple[str, str] | None:
    """The sidecar's JSON before and after the GPUFENCE_CONFIG value (settings-only, so cached)."""
    text = _encode_compact(_sidecar(settings, run_as_root, _PLACEHOLDER))
    if text.count(_PLACEHOLDER_JSON) != 1:  # pragma: no cover - a setting containing the placeholder
        return None
    before, _, after = text.partition(_PLACEHOLDER_JSON)
    return before, after


def _encode_patch(ops: list[dict[str, Any]], sidecar: dict[str, Any], sidecar_json: str) -> str:
    """``ops`` as compact JSON, byte for byte what ``_encode_compact(ops)`` gives.

    ``sidecar_json`` is the JSON of ``sidecar``; wherever an operation's value is that very object
    (or a list holding it), the cached text is spliced in instead of encoding the object again.
    """
    swapped: list[dict[str, Any]] = []
    found = 0
    for op in ops:
        value = op.get("value", _MISSING)
        if value is sidecar:
            op = {**op, "value": _PLACEHOLDER}
            found += 1
        elif type(value) is list and any(item is sidecar for item in value):
            op = {**op, "value": [_PLACEHOLDER if item is sidecar else item for item in value]}
            found += 1
        swapped.append(op)
    if found != 1:
        return _encode_compact(ops)
    text = _encode_compact(swapped)
    if text.count(_PLACEHOLDER_JSON) != 1:  # pragma: no cover - the placeholder is unguessable
        return _encode_compact(ops)
    return text.replace(_PLACEHOLDER_JSON, sidecar_json)


def pod_volumes(settings: InjectionSettings) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": STATE_VOLUME, "emptyDir": {}}]
    if settings.mount_host_proc:
        volumes.append({"name": HOST_PROC_VOLUME, "hostPath": {"path": "/proc", "type": "Directory"}})
    if settings.preload_library_host_path:
        volumes.append(
            {"name": PRELOAD_VOLUME, "hostPath": {"path": settings.preload_library_host_path, "type": "File"}}
        )
    return volumes


# --- the desired pod --------------------------------------------------------------------------


def desired_pod(pod: dict[str, Any], plan: SharePlan, settings: InjectionSettings) -> tuple[dict[str, Any], list[str]]:
    """The injected pod (sharing untouched subtrees with ``pod``) and warnings; raises MutationError.

    The pod's shape must have been checked (``admission._check_shape``): dicts and lists where
    this function reads them.
    """
    new_pod, warnings, _ = _desired(pod, plan, settings)
    return new_pod, warnings


def injection_patch(pod: dict[str, Any], plan: SharePlan, settings: InjectionSettings) -> tuple[str | None, list[str]]:
    """``diff(pod, desired_pod(...))`` as compact JSON (None when empty) and the warnings.

    The same text as ``json.dumps(ops, separators=(",", ":"))``, but the sidecar's JSON comes
    mostly from a per-settings cache. Raises MutationError.

    A pod's first injection (the common case) takes ``_first_injection_patch``, which writes the
    same operations without building the desired pod; anything else takes the general path.
    """
    fast = _first_injection_patch(pod, plan, settings)
    if fast is not None:
        return fast
    return _general_injection_patch(pod, plan, settings)


def _general_injection_patch(
    pod: dict[str, Any], plan: SharePlan, settings: InjectionSettings
) -> tuple[str | None, list[str]]:
    """``injection_patch`` for any pod: ``diff`` of the pod and the desired pod."""
    new_pod, warnings, (sidecar, sidecar_json) = _desired(pod, plan, settings, _shared_sidecar)
    ops = diff(pod, new_pod)
    if not ops:
        return None, warnings
    if sidecar_json is None:  # pragma: no cover - a setting containing the placeholder
        return _encode_compact(ops), warnings
    return _encode_patch(ops, sidecar, sidecar_json), warnings


def _sidecar_and_json(
    settings: InjectionSettings, run_as_root: bool, config_json: str
) -> tuple[dict[str, Any], str | None]:
    """The sidecar and its compact JSON (None when a setting defeats the splice)."""
    sidecar = _sidecar(settings, run_as_root, config_json)
    try:
        parts = _sidecar_json_parts(settings, run_as_root)
    except TypeError:  # pragma: no cover - settings built with an unhashable field (a list)
        parts = _sidecar_json_parts.__wrapped__(settings, run_as_root)
    if parts is None:  # pragma: no cover - a setting containing the placeholder
        return sidecar, None
    return sidecar, parts[0] + _encode_compact(config_json) + parts[1]


_cached_sidecar_and_json = functools.lru_cache(maxsize=64)(_sidecar_and_json)


def _shared_sidecar(
    settings: InjectionSettings, run_as_root: bool, config_json: str
) -> tuple[dict[str, Any], str | None]:
    """``_sidecar_and_json``, cached per (settings, run_as_root, config JSON).

    The dict is shared between reviews, so only ``injection_patch`` uses it: it never mutates it
    and never lets it escape (the patch is text).
    """
    if len(config_json) <= 4 * _MAX_CACHED_NAMES:
        try:
            return _cached_sidecar_and_json(settings, run_as_root, config_json)
        except TypeError:  # pragma: no cover - settings built with an unhashable field (a list)
            pass
    return _sidecar_and_json(settings, run_as_root, config_json)


def _fresh_sidecar(settings: InjectionSettings, run_as_root: bool, config_json: str) -> tuple[dict[str, Any], None]:
    return _sidecar(settings, run_as_root, config_json), None


def _desired(
    pod: dict[str, Any],
    plan: SharePlan,
    settings: InjectionSettings,
    make_sidecar: Any = _fresh_sidecar,
) -> tuple[dict[str, Any], list[str], tuple[dict[str, Any], str | None]]:
    warnings: list[str] = []
    shares = dict(plan.containers)
    spec = dict(pod["spec"])
    new_pod = dict(pod)
    new_pod["spec"] = spec

    metadata_ = dict(pod.get("metadata") or {})
    annotations = dict(metadata_.get("annotations") or {})
    annotations[ANNOTATION_STATUS] = status_annotation(plan)
    metadata_["annotations"] = annotations
    new_pod["metadata"] = metadata_

    if spec.get("hostPID") is True:
        raise MutationError(
            "gpufence needs spec.shareProcessNamespace, which Kubernetes does not allow together with "
            'spec.hostPID: true; remove hostPID, or label the pod gpufence.io/inject="false" to opt it out'
        )
    if spec.get("shareProcessNamespace") is False:
        raise MutationError(
            "spec.shareProcessNamespace: false conflicts with gpufence, whose enforcer must see the GPU "
            "containers' processes; remove the field (gpufence sets it to true), or label the pod "
            'gpufence.io/inject="false" to opt it out'
        )
    spec["shareProcessNamespace"] = True

    library = preload_library_path(settings)
    port = settings.metrics_port
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        if not containers:
            continue
        updated = []
        for container in containers:
            if container.get("name") == SIDECAR_NAME:
                continue  # ours (reinvocation, or a copied pod): rebuilt below at its place
            for declared in container.get("ports") or ():
                if isinstance(declared, dict) and declared.get("containerPort") == port:
                    warnings.append(
                        f"container {quote(container['name'])} declares port {port}, which the gpufence "
                        "enforcer uses for its metrics in the same network namespace"
                    )
            share = shares.get(container["name"])
            if share is not None:
                container = _gpu_container(container, share, settings, library, warnings)
            updated.append(container)
        spec[key] = updated

    run_as_root = sidecar_runs_as_root(pod["spec"], shares, warnings)
    sidecar, sidecar_json = make_sidecar(settings, run_as_root, _config_json(plan, settings))
    if settings.native_sidecar:
        spec["initContainers"] = [sidecar, *(spec.get("initContainers") or ())]
    else:
        spec["containers"] = [*(spec.get("containers") or ()), sidecar]
        _warn_plain_sidecar(spec, shares, warnings)

    volumes = list(spec.get("volumes") or ())
    existing = {v["name"]: v for v in volumes if isinstance(v.get("name"), str)}
    for volume in pod_volumes(settings):
        present = existing.get(volume["name"])
        if present is None:
            volumes.append(volume)
        elif present != volume:
            raise MutationError(f"volume name {quote(volume['name'])} is reserved by gpufence; rename the pod's volume")
    spec["volumes"] = volumes
    return new_pod, warnings, (sidecar, sidecar_json)


def _warn_plain_sidecar(spec: dict[str, Any], shares: Container[str], warnings: list[str]) -> None:
    """What a regular-container enforcer (native sidecars off) cannot do, said to the user."""
    if spec.get("restartPolicy") in ("Never", "OnFailure"):
        warnings.append(
            "the gpufence enforcer runs as a regular container (native sidecars are disabled), so this "
            "pod keeps running after its other containers finish (a Job would not complete)"
        )
    for container in spec.get("initContainers") or ():
        if container["name"] in shares:
            warnings.append(
                f"init container {quote(container['name'])} requests a GPU but runs before the enforcer "
                "starts (native sidecars are disabled), so its share is not enforced"
            )


def _add_share_env(
    name: str,
    share: ContainerShare,
    settings: InjectionSettings,
    library: str | None,
    warnings: list[str],
    add: Callable[[str, str], None],
) -> None:
    """Adds through ``add``, in this order, the variables a GPU container gets for its share, and
    appends the warnings the limits cause. Both injection paths (the general desired-pod + diff and
    the first-injection fast path) call it, so their env order and warnings cannot drift apart.
    LD_PRELOAD is left to the callers: appending to a user's value is path-specific."""
    add(ENV_CONTAINER, name)
    memory = share.memory
    if memory is not None:
        add(ENV_MEMORY_LIMIT, memory.describe())
    add(ENV_TF_ALLOW_GROWTH, "true")
    add(ENV_XLA_PREALLOCATE, "false")
    compute = None if share.compute_percent is None else max(1, int(share.compute_percent))

    if settings.mps_limits:
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
                add(ENV_MPS_MEM_LIMIT, f"0={mib}M")
        if compute is not None:
            add(ENV_MPS_THREADS, str(compute))

    if library is not None:
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
                add(ENV_HAMI_MEMORY, f"{mebibytes_floor(memory.bytes)}m")
        if compute is not None:
            add(ENV_HAMI_SM, str(compute))


def _gpu_container(
    container: dict[str, Any],
    share: ContainerShare,
    settings: InjectionSettings,
    library: str | None,
    warnings: list[str],
) -> dict[str, Any]:
    name = container["name"]
    env = list(container.get("env") or ())
    index = {entry["name"]: i for i, entry in enumerate(env)}  # the last duplicate is the effective one
    changed = False

    def add(var: str, value: str) -> None:
        nonlocal changed
        if var in index:
            entry = env[index[var]]
            if var in _LIMIT_VARIABLES and entry.get("value") != value:
                warnings.append(
                    f"container {quote(name)} sets {var} itself; gpufence keeps it instead of {quote(value)}"
                )
            return
        env.append({"name": var, "value": value})
        index[var] = len(env) - 1
        changed = True

    if ENV_CONTAINER in index:
        entry = env[index[ENV_CONTAINER]]
        if entry.get("value") != name or "valueFrom" in entry:
            # The enforcer attributes processes to containers by this variable: a wrong value would
            # charge this container's GPU use to another one.
            raise MutationError(
                f"container {quote(name)} sets {ENV_CONTAINER}={quote(entry.get('value', ''))}; gpufence sets "
                f"it to the container's name to attribute GPU use, so remove it or set it to {quote(name)}"
            )
    _add_share_env(name, share, settings, library, warnings, add)
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
            raise MutationError(
                f"container {quote(name)} already mounts volume {PRELOAD_VOLUME} or path {library}, "
                "both reserved by gpufence"
            )

    if changed:
        container = {**container, "env": env}
    return container


# --- JSON Patch ----------------------------------------------------------------------------


def escape(token: str) -> str:
    """An RFC 6901 reference token."""
    if "~" in token or "/" in token:
        return token.replace("~", "~0").replace("/", "~1")
    return token


def diff(old: Any, new: Any, path: str = "") -> list[dict[str, Any]]:
    """RFC 6902 operations turning ``old`` into ``new``; minimal for the shapes ``desired_pod`` makes.

    Recursion follows ``new`` only where it differs from ``old`` (shared subtrees are skipped by
    identity), so its depth is bounded by the webhook's own objects, not by the user's.
    """
    ops: list[dict[str, Any]] = []
    _diff(old, new, path, ops)
    return ops


def _diff(old: Any, new: Any, path: str, ops: list[dict[str, Any]]) -> None:
    if old is new:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key in old:
            if key not in new:
                ops.append({"op": "remove", "path": f"{path}/{escape(key)}"})
        get = old.get
        for key, value in new.items():
            previous = get(key, _MISSING)
            if previous is value:
                continue  # shared with the input (the common case): nothing below can differ
            if previous is _MISSING:
                ops.append({"op": "add", "path": f"{path}/{escape(key)}", "value": value})
            else:
                _diff(previous, value, f"{path}/{escape(key)}", ops)
        return
    if isinstance(old, list) and isinstance(new, list):
        _diff_list(old, new, path, ops)
        return
    if type(old) is not type(new) or old != new:
        ops.append({"op": "replace", "path": path, "value": new})


def _names(items: list[Any]) -> list[str] | None:
    names = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        names.append(item["name"])
    return names if len(set(names)) == len(names) else None


def _diff_list(old: list[Any], new: list[Any], path: str, ops: list[dict[str, Any]]) -> None:
    n = len(old)
    if len(new) >= n and all(map(is_, old, new)):
        # Appended to (a GPU container's env, the pod's volumes): the named and the positional
        # alignments below both reduce to adding the tail.
        for i in range(n, len(new)):
            ops.append({"op": "add", "path": f"{path}/{i}", "value": new[i]})
        return
    old_names, new_names = _names(old), _names(new)
    if old_names is not None and new_names is not None:
        # Align named entries (containers, env, volumes): removals, then insertions and updates.
        new_set, old_set = set(new_names), set(old_names)
        kept = [n for n in old_names if n in new_set]
        if kept == [n for n in new_names if n in old_set]:
            for i in range(len(old) - 1, -1, -1):
                if old_names[i] not in new_set:
                    ops.append({"op": "remove", "path": f"{path}/{i}"})
            by_name = dict(zip(old_names, old, strict=True))
            for i, (name, item) in enumerate(zip(new_names, new, strict=True)):
                if name in old_set:
                    _diff(by_name[name], item, f"{path}/{i}", ops)
                else:
                    ops.append({"op": "add", "path": f"{path}/{i}", "value": item})
            return
    # Positional: update the common part in place, then append or trim the tail.
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        _diff(a, b, f"{path}/{i}", ops)
    for i in range(len(old), len(new)):
        ops.append({"op": "add", "path": f"{path}/{i}", "value": new[i]})
    for i in range(len(old) - 1, len(new) - 1, -1):
        ops.append({"op": "remove", "path": f"{path}/{i}"})


# --- the first injection, written directly ----------------------------------------------------
#
# ``_first_injection_patch`` answers what ``_general_injection_patch`` answers for a pod that
# carries no part of the injection yet (no status annotation, no sidecar, no reserved volume, no
# GPUFENCE_CONTAINER), without building the desired pod and diffing it: it lists the operations
# ``diff`` would find, in ``diff``'s order (the pod's key order, then the keys ``_desired`` adds, in
# the order it adds them), and encodes them the same way. On anything else (reinvocation, a field
# that is null, a value the general path would replace or reject) it declines (None) and the
# general path answers; tests/test_fast_path.py checks that both give byte-identical answers.

_STATUS_PATH_TOKEN = escape(ANNOTATION_STATUS)


def _add(path: str, value: Any) -> dict[str, Any]:
    return {"op": "add", "path": path, "value": value}


def _first_injection_patch(
    pod: dict[str, Any], plan: SharePlan, settings: InjectionSettings
) -> tuple[str, list[str]] | None:
    """``_general_injection_patch(pod, plan, settings)`` for a first injection, or None (declined)."""
    if type(pod) is not dict:
        return None
    metadata_ = pod.get("metadata", _MISSING)
    annotations: Any = _MISSING
    if metadata_ is not _MISSING:
        if type(metadata_) is not dict:
            return None
        annotations = metadata_.get("annotations", _MISSING)
        if annotations is not _MISSING and (type(annotations) is not dict or ANNOTATION_STATUS in annotations):
            return None
    spec = pod.get("spec")
    if type(spec) is not dict or spec.get("hostPID") is True:
        return None
    share_process_namespace = spec.get("shareProcessNamespace", _MISSING)
    if share_process_namespace is not _MISSING and share_process_namespace is not True:
        return None

    warnings: list[str] = []
    shares = dict(plan.containers)
    library = preload_library_path(settings)
    port = settings.metrics_port
    native = settings.native_sidecar
    sidecar_key = "initContainers" if native else "containers"
    # The operations under spec.initContainers and spec.containers, by key; None: the key is absent.
    list_ops: dict[str, list[dict[str, Any]] | None] = {"initContainers": None, "containers": None}
    lengths = {"initContainers": 0, "containers": 0}
    seen: set[str] = set()
    for key in ("initContainers", "containers"):
        containers = spec.get(key, _MISSING)
        if containers is _MISSING:
            continue
        if type(containers) is not list:
            return None
        # Native: the sidecar goes first, so ``diff`` aligns by name and the others' indices shift.
        offset = 1 if key == sidecar_key and native else 0
        ops: list[dict[str, Any]] = []
        for i, container in enumerate(containers):
            if type(container) is not dict:
                return None
            name = container.get("name")
            if type(name) is not str or name == SIDECAR_NAME or name in seen:
                return None
            seen.add(name)
            for declared in container.get("ports") or ():
                if isinstance(declared, dict) and declared.get("containerPort") == port:
                    warnings.append(
                        f"container {quote(name)} declares port {port}, which the gpufence "
                        "enforcer uses for its metrics in the same network namespace"
                    )
            share = shares.get(name)
            if share is not None and not _first_gpu_container_ops(
                container, name, share, settings, library, warnings, f"/spec/{key}/{i + offset}", ops
            ):
                return None
        list_ops[key] = ops
        lengths[key] = len(containers)

    volumes = spec.get("volumes", _MISSING)
    if volumes is not _MISSING:
        if type(volumes) is not list:
            return None
        for volume in volumes:
            if type(volume) is not dict or volume.get("name") in _RESERVED_VOLUMES:
                return None

    run_as_root = sidecar_runs_as_root(spec, shares, warnings)
    _, sidecar_json = _shared_sidecar(settings, run_as_root, _config_json(plan, settings))
    if sidecar_json is None:  # pragma: no cover - a setting containing the placeholder
        return None
    if not native:
        _warn_plain_sidecar(spec, shares, warnings)

    # The sidecar's operation (its value stands in for the sidecar until the splice below).
    present = list_ops[sidecar_key]
    if present is None:
        sidecar_op = _add(f"/spec/{sidecar_key}", [_PLACEHOLDER])
    elif native:
        present.insert(0, _add("/spec/initContainers/0", _PLACEHOLDER))
    else:
        present.append(_add(f"/spec/containers/{lengths['containers']}", _PLACEHOLDER))

    ops = []
    for key in pod:
        if key == "metadata":
            if annotations is _MISSING:
                ops.append(_add("/metadata/annotations", {ANNOTATION_STATUS: status_annotation(plan)}))
            else:
                ops.append(_add(f"/metadata/annotations/{_STATUS_PATH_TOKEN}", status_annotation(plan)))
        elif key == "spec":
            for spec_key in spec:
                if spec_key == "initContainers" or spec_key == "containers":
                    ops.extend(list_ops[spec_key] or ())
                elif spec_key == "volumes":
                    n = len(volumes)
                    ops.extend(_add(f"/spec/volumes/{n + j}", v) for j, v in enumerate(pod_volumes(settings)))
            # The keys ``_desired`` adds, in its order.
            if share_process_namespace is _MISSING:
                ops.append(_add("/spec/shareProcessNamespace", True))
            if present is None:
                ops.append(sidecar_op)
            if volumes is _MISSING:
                ops.append(_add("/spec/volumes", pod_volumes(settings)))
    if metadata_ is _MISSING:
        ops.append(_add("/metadata", {"annotations": {ANNOTATION_STATUS: status_annotation(plan)}}))

    text = _encode_compact(ops)
    if text.count(_PLACEHOLDER_JSON) != 1:  # pragma: no cover - the placeholder is unguessable
        return None
    return text.replace(_PLACEHOLDER_JSON, sidecar_json), warnings


def _first_gpu_container_ops(
    container: dict[str, Any],
    name: str,
    share: ContainerShare,
    settings: InjectionSettings,
    library: str | None,
    warnings: list[str],
    path: str,
    ops: list[dict[str, Any]],
) -> bool:
    """Appends the operations ``diff`` finds for ``_gpu_container``'s changes; False: declined."""
    env = container.get("env", _MISSING)
    if env is _MISSING:
        entries: list[Any] = []
    elif type(env) is list:
        entries = env
    else:
        return False
    try:
        index = {entry["name"]: i for i, entry in enumerate(entries)}  # the last duplicate is the effective one
    except (TypeError, KeyError):
        return False
    if ENV_CONTAINER in index:
        return False
    added: list[dict[str, Any]] = []

    def add(var: str, value: str) -> None:
        if var in index:
            if var in _LIMIT_VARIABLES and entries[index[var]].get("value") != value:
                warnings.append(
                    f"container {quote(name)} sets {var} itself; gpufence keeps it instead of {quote(value)}"
                )
            return
        added.append({"name": var, "value": value})

    _add_share_env(name, share, settings, library, warnings, add)
    mount: dict[str, Any] | None = None
    mounts: Any = _MISSING
    if library is not None:
        if ENV_LD_PRELOAD not in index:
            add(ENV_LD_PRELOAD, library)
        else:
            entry = entries[index[ENV_LD_PRELOAD]]
            if "valueFrom" in entry:
                warnings.append(
                    f"container {quote(name)} takes LD_PRELOAD from valueFrom, so gpufence cannot append "
                    f"{library} and the in-process limiter is not loaded"
                )
            elif library not in re.split(r"[: ]", entry.get("value") or ""):
                return False  # the entry would be rewritten in place: the general path's business
        mounts = container.get("volumeMounts", _MISSING)
        if mounts is not _MISSING:
            if type(mounts) is not list:
                return False
            for m in mounts:
                if type(m) is not dict or m.get("name") == PRELOAD_VOLUME or m.get("mountPath") == library:
                    return False
        mount = {"name": PRELOAD_VOLUME, "mountPath": library, "readOnly": True}

    env_ops: list[dict[str, Any]] = []
    if added:
        if env is _MISSING:
            env_ops.append(_add(f"{path}/env", added))
        else:
            n = len(entries)
            env_ops.extend(_add(f"{path}/env/{n + j}", entry) for j, entry in enumerate(added))
    if mount is None:
        ops.extend(env_ops)
        return True
    if mounts is _MISSING:
        mount_op = _add(f"{path}/volumeMounts", [mount])
    else:
        mount_op = _add(f"{path}/volumeMounts/{len(mounts)}", mount)
    # ``diff`` follows the new container's keys: the pod's, then volumeMounts, then env.
    if env is not _MISSING and (mounts is _MISSING or _key_before(container, "env", "volumeMounts")):
        ops.extend(env_ops)
        ops.append(mount_op)
    else:
        ops.append(mount_op)
        ops.extend(env_ops)
    return True


def _key_before(mapping: dict[str, Any], first: str, second: str) -> bool:
    for key in mapping:
        if key == first:
            return True
        if key == second:
            return False
    return False  # pragma: no cover - both keys are present
