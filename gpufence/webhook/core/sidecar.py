"""What the injection adds to a pod from the settings and the share plan alone (pure): the
enforcer sidecar, the pod volumes it needs, the enforcer config and the status annotation.

The sidecar leaves out what the API server's defaulting fills in (probe timings at their
defaults, ``protocol: TCP``, ``fieldRef.apiVersion``, ``terminationMessagePath``, an
``imagePullPolicy`` that is the image's default) and the variables whose values are the enforcer's
own defaults: every GPU pod carries the sidecar, and bytes in a pod cost the API server, etcd and
every watcher. ``api_defaulted`` writes those defaults back, as the API server does before
validation sees the pod and before a reinvocation: on a reinvocation the stored sidecar is kept when it
is ours after defaulting (desired.py), so the webhook does not patch its own output again.
"""

from __future__ import annotations

import functools
import json
import posixpath
from collections.abc import Container, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

from gpufence import __version__
from gpufence.contract import (
    ANNOTATION_STATUS,
    DEFAULT_METRICS_PORT,
    DEFAULT_STATE_DIR,
    ENFORCER_COMMAND,
    ENV_CONFIG,
    ENV_HOST_PROC,
    ENV_METRICS_PORT,
    ENV_POD_STATUS,
    POST_START_COMMAND,
    PROBE_COMMAND,
    SIDECAR_NAME,
    SIDECAR_PORT_NAME,
    EnforcerConfig,
    Mode,
    status_document,
)
from gpufence.webhook.core.denial import Denial, quote
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import SharePlan

# The one version source (gpufence/__init__.py), also right in a bare checkout.
GPUFENCE_VERSION = __version__

STATE_VOLUME = "gpufence-state"
# The enforcer's state directory is a tmpfs: it survives a restart of the sidecar within the pod
# (what its files are for) and costs no disk I/O on the SIGSTOP/SIGCONT that rewrite them. Its pages
# count against the sidecar's memory, hence the small limit; the files of 10,000 stopped processes
# and as many pending SIGKILLs fit in it twice (tests/unit/enforcer/test_state_files.py).
STATE_VOLUME_SIZE_LIMIT = "16Mi"
HOST_PROC_VOLUME = "gpufence-host-proc"
PRELOAD_VOLUME = "gpufence-preload"
RESERVED_VOLUMES = (STATE_VOLUME, HOST_PROC_VOLUME, PRELOAD_VOLUME)
DEFAULT_PRELOAD_LIBRARY = "libvgpu.so"
# Per-plan texts (status annotation, enforcer config) are cached only for plans whose container
# names total at most this many characters (Kubernetes allows 63 per name), so entries stay small.
_MAX_CACHED_NAMES = 1024


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


def pod_volumes(settings: InjectionSettings) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": STATE_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": STATE_VOLUME_SIZE_LIMIT}}
    ]
    if settings.mount_host_proc:
        volumes.append({"name": HOST_PROC_VOLUME, "hostPath": {"path": "/proc", "type": "Directory"}})
    if settings.preload_library_host_path:
        volumes.append(
            {"name": PRELOAD_VOLUME, "hostPath": {"path": settings.preload_library_host_path, "type": "File"}}
        )
    return volumes


# --- texts derived from the plan (byte-exact: a reinvocation compares them as strings) ---------


def enforcer_config(plan: SharePlan, settings: InjectionSettings) -> EnforcerConfig:
    return EnforcerConfig(
        containers=dict(plan.containers),
        mode=plan.mode,
        grace_period_seconds=plan.grace_period_seconds,
        poll_interval_seconds=settings.poll_interval_seconds,
    )


# json.dumps with arguments builds a new encoder per call; this one is built once.
_encode_sorted = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def status_annotation(plan: SharePlan, warnings: Sequence[str] = ()) -> str:
    """What gpufence did, as one JSON object: the GPU containers, the mode, the version and, when
    there are any, the share-aware warnings (``warnings``, which the enforcer can turn into an
    Event)."""
    names = tuple(name for name, _ in plan.containers)
    if warnings:
        return _encode_sorted(status_document(names, plan.mode, GPUFENCE_VERSION, warnings))
    # Cached on the names, the mode and the version (read at call time: tests replace it).
    if sum(map(len, names)) <= _MAX_CACHED_NAMES:
        return _status_annotation(names, plan.mode, GPUFENCE_VERSION)
    return _status_annotation.__wrapped__(names, plan.mode, GPUFENCE_VERSION)


@functools.lru_cache(maxsize=256)
def _status_annotation(names: tuple[str, ...], mode: Mode, version: str) -> str:
    return _encode_sorted(status_document(names, mode, version))


def config_json(plan: SharePlan, settings: InjectionSettings) -> str:
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


# --- the sidecar ---------------------------------------------------------------------------------

# The namespace's enforced Pod Security level (its label's value, facts.POD_SECURITY_LABEL; unlabelled:
# `privileged`, as Kubernetes treats it) decides the sidecar's user and capabilities.
PRIVILEGED = "privileged"
RESTRICTED = "restricted"

# Which user the enforcer runs as. It must signal the GPU containers' processes and read their
# /proc/<pid>/fd and environ. kill(2) needs the target's uid or CAP_KILL; reading those files needs
# ptrace read access, which the kernel grants a process of the same uid and gid whose capabilities
# include the target's, or one holding CAP_SYS_PTRACE. Kubernetes puts the capabilities a non-root
# container adds in its bounding set only, never its effective set, so only a root sidecar holds
# them. The sidecar is the admin's container, not the author's: its user never follows the pod's
# runAsUser or runAsNonRoot (a tenant who set them apart from a GPU container's user used to leave
# the enforcer unable to read or signal that container's processes). By the namespace's enforced
# Pod Security level:
# * `privileged` or unlabelled: uid 0 with KILL, SYS_PTRACE and DAC_READ_SEARCH reaches every user,
#   so the sidecar sets runAsUser: 0, and runAsNonRoot: false where the pod sets runAsNonRoot: true;
# * `baseline` (and a level this version does not know): no SYS_PTRACE, so the sidecar runs as the
#   GPU containers' one user and group (uid 0 where they set none: the image's user, most often
#   root; as root it still signals any user by CAP_KILL). GPU containers of different users or groups
#   cannot all be reached: denied, naming the field;
# * `restricted`: no root and no capability at all, so the same, and besides a GPU container must
#   run as a stated non-root user: one whose user is the image's (unknown here) is denied.
# A process the enforcer still cannot inspect (one granted more capabilities than the sidecar holds)
# is charged to the pod's budget by the enforcer, not skipped.
_USER_KEYS = ("runAsUser", "runAsGroup")
ROOT_USER = MappingProxyType({"runAsUser": 0})


def sidecar_user(spec: dict[str, Any], gpu_containers: Container[str],
                 pod_security: str | None) -> tuple[dict[str, Any], list[str]]:
    """The user fields of the sidecar's securityContext (``runAsUser``, and ``runAsGroup`` and
    ``runAsNonRoot`` where the pod's would be wrong for it) and the warnings; raises ``Denial`` where
    no user the namespace's Pod Security level allows the sidecar can act on every GPU container.

    ``gpu_containers`` holds the names of the GPU containers; ``spec`` has been shape-checked
    (``podshape.check_shape``); ``pod_security`` as for ``sidecar_security_context``.
    """
    pod_context = spec.get("securityContext") or {}
    pod_non_root = pod_context.get("runAsNonRoot") is True
    if pod_security in (None, PRIVILEGED):
        return {"runAsUser": 0, **({"runAsNonRoot": False} if pod_non_root else {})}, []
    level = pod_security
    first = _gpu_containers_user(spec, gpu_containers, level)
    user, group = (first.user, first.group) if first is not None else (None, None)
    if first is not None and user == 0 and level == RESTRICTED:
        raise Denial(
            f"{first.fields[0]} is 0 (container {quote(first.name)}): Pod Security {quote(level)} admits no "
            "root container, and the gpufence enforcer must run as the GPU containers' user; run them as a "
            "non-root user, e.g. spec.securityContext.runAsUser: 1000"
        )
    warnings = []
    if first is not None and first.non_root_image:
        warnings.append(
            "gpufence: the GPU containers run as their image's user (runAsNonRoot without runAsUser); the "
            f"enforcer (root, no SYS_PTRACE under {level}) stops them but charges their GPU use to the "
            "pod, not a container; set spec.securityContext.runAsUser"
        )
    own: dict[str, Any] = {"runAsUser": 0 if user is None else user}
    if group is not None and group != pod_context.get("runAsGroup"):
        own["runAsGroup"] = group
    if own["runAsUser"] == 0 and pod_non_root:
        own["runAsNonRoot"] = False
    elif level == RESTRICTED and not pod_non_root:
        own["runAsNonRoot"] = True  # restricted requires it of every container where the pod does not say it
    return own, warnings


class _ContainerUser(NamedTuple):
    """The first GPU container's name, user and group, the fields they come from, and whether it
    runs as its image's (non-root) user."""

    name: str
    user: int | None
    group: int | None
    fields: tuple[str, str]
    non_root_image: bool


def _gpu_containers_user(spec: dict[str, Any], gpu_containers: Container[str], level: str) -> _ContainerUser | None:
    """The GPU containers' one user and group (the first's); Denial where under ``level`` one runs as
    its image's unknown user, or two differ: the sidecar can act on one user's processes only."""
    pod_context = spec.get("securityContext") or {}
    first: _ContainerUser | None = None
    for key in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(key) or ()):
            if container["name"] not in gpu_containers:
                continue
            context = container.get("securityContext") or {}
            user, group = (context.get(k, pod_context.get(k)) for k in _USER_KEYS)
            where = f"spec.{key}[{i}].securityContext"
            if user is None and level == RESTRICTED:
                raise Denial(
                    f"container {quote(container['name'])} sets no runAsUser ({where}.runAsUser) and neither does the "
                    "pod (spec.securityContext.runAsUser), so it runs as its image's user, which gpufence cannot know: "
                    f"under Pod Security {quote(level)} the gpufence enforcer must run as the GPU containers' own user "
                    "to stop or terminate their processes; set the user at pod level, e.g. "
                    "spec.securityContext.runAsUser: 1000"
                )
            fields = tuple(f"{where}.{k}" if k in context else f"spec.securityContext.{k}" for k in _USER_KEYS)
            if first is None:
                non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot") is True) is True
                first = _ContainerUser(container["name"], user, group, (fields[0], fields[1]),
                                       user is None and non_root)
                continue
            for n, (value, wanted) in enumerate(zip((user, group), (first.user, first.group), strict=True)):
                if value != wanted:
                    raise Denial(
                        f"container {quote(container['name'])} runs with {_USER_KEYS[n]} {_shown(value)} "
                        f"({fields[n]}), container {quote(first.name)} with {_shown(wanted)} ({first.fields[n]}): "
                        f"under Pod Security {quote(level)} the gpufence "
                        "enforcer has no capability to act on another user's processes, so it runs as the GPU "
                        "containers' one user and group; give every GPU container the same runAsUser and runAsGroup, "
                        "e.g. at pod level only: spec.securityContext.runAsUser: 1000"
                    )
    return first


def sidecar_reaches_root(pod_security: str | None) -> bool:
    """Whether the sidecar can signal and inspect a root process of a GPU container: only as uid 0
    with KILL and SYS_PTRACE, i.e. where Pod Security is `privileged` or unset. Elsewhere it runs as
    the GPU containers' user (``sidecar_user``), which a process that becomes root leaves behind."""
    return pod_security in (None, PRIVILEGED)


def without_privilege_escalation(container: dict[str, Any], where: str, pod_security: str | None) -> dict[str, Any]:
    """GPU container ``container`` (at ``where``, e.g. ``spec.containers[0]``) with
    ``allowPrivilegeEscalation: false``, where the sidecar cannot reach a root process
    (``sidecar_reaches_root``); raises ``Denial`` where the container asks for it explicitly.

    The kernel's no_new_privs: a setuid-root binary in the image (or one with file capabilities)
    then runs with its caller's uid and capabilities, so no process of the container becomes a
    user the sidecar cannot signal; the exec itself still succeeds. Kubernetes refuses the field
    beside ``privileged: true`` (refused in opted-in namespaces anyway) or an added SYS_ADMIN,
    which Pod Security `baseline` and `restricted` forbid.
    """
    context = container.get("securityContext") or {}
    value = context.get("allowPrivilegeEscalation")
    if value is False:
        return container
    fix = ("remove the field (gpufence sets it to false), or run the pod in a namespace whose Pod "
           "Security level is privileged, where the enforcer runs as root")
    if value is True:
        raise Denial(
            f"container {quote(container['name'])} sets allowPrivilegeEscalation: true "
            f"({where}.securityContext.allowPrivilegeEscalation): under Pod Security {quote(pod_security)} the "
            "gpufence enforcer runs as the GPU containers' user, and a process that becomes root through a "
            f"setuid binary would be out of its reach, free to exceed its share; {fix}"
        )
    capabilities = context.get("capabilities")
    added = capabilities.get("add") if isinstance(capabilities, dict) else None
    if isinstance(added, list) and any(c in ("SYS_ADMIN", "CAP_SYS_ADMIN") for c in added):
        raise Denial(
            f"container {quote(container['name'])} adds capability SYS_ADMIN "
            f"({where}.securityContext.capabilities.add), which Kubernetes refuses beside the "
            "allowPrivilegeEscalation: false that gpufence sets on GPU containers under Pod Security "
            f"{quote(pod_security)}; remove SYS_ADMIN"
        )
    return {**container, "securityContext": {**context, "allowPrivilegeEscalation": False}}


def _shown(value: int | None) -> str:
    return "unset" if value is None else str(value)


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


# How long the kubelet waits after SIGTERM before SIGKILL when a probe fails, instead of the pod's
# terminationGracePeriodSeconds (often minutes for training jobs): a SIGSTOPped enforcer ignores
# SIGTERM, and every second until SIGKILL is a second without enforcement. Ten seconds cover the
# enforcer's own shutdown (it continues what it stopped first, then waits for the poll thread).
PROBE_KILL_GRACE_SECONDS = 10


# What the API server writes into a probe that leaves these out (Kubernetes' SetDefaults_Probe).
PROBE_DEFAULTS = MappingProxyType({"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1,
                                   "failureThreshold": 3})


def _probe() -> dict[str, Any]:
    """The exec probe of the enforcer's heartbeat (``gpufence.enforcer.probe``), never its HTTP
    port: any container of the pod can take the port or answer on it. The kubelet's timeout covers
    the interpreter's start-up in a CPU-limited sidecar (the check itself reads two small files).
    Timings at the API server's defaults (period 10 s, 3 failures) are left to it."""
    return {"exec": {"command": list(PROBE_COMMAND)}, "timeoutSeconds": 5,
            "terminationGracePeriodSeconds": PROBE_KILL_GRACE_SECONDS}


def default_pull_policy(image: str) -> str:
    """The ``imagePullPolicy`` the API server gives a container that sets none: Always for the tag
    ``latest`` or no tag and no digest, else IfNotPresent (Kubernetes' SetDefaults_Container)."""
    name, _, digest = image.partition("@")
    tag = name.rsplit("/", 1)[-1].partition(":")[2]
    return "Always" if tag == "latest" or (not tag and not digest) else "IfNotPresent"


def api_defaulted(container: dict[str, Any]) -> dict[str, Any]:
    """``container`` (one ``build_sidecar`` made) with the fields the API server's defaulting fills
    where the sidecar leaves them out: what the stored pod, and so a reinvocation and ``/validate``,
    show. Only those fields: everything else the sidecar spells out itself."""
    defaulted = {"terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                 "imagePullPolicy": default_pull_policy(container.get("image", "")), **container}
    if "livenessProbe" in defaulted:
        defaulted["livenessProbe"] = {**PROBE_DEFAULTS, **defaulted["livenessProbe"]}
    if "ports" in defaulted:
        defaulted["ports"] = [{"protocol": "TCP", **port} for port in defaulted["ports"]]
    if "env" in defaulted:
        defaulted["env"] = [
            {**e, "valueFrom": {"fieldRef": {"apiVersion": "v1", **e["valueFrom"]["fieldRef"]}}}
            if "fieldRef" in e.get("valueFrom", {}) else e for e in defaulted["env"]]
    return defaulted


# The namespace's Pod Security level decides the sidecar's capabilities (its user: ``sidecar_user``).
# Reading /proc/<pid>/environ and /proc/<pid>/fd needs ptrace read access: the kernel grants it
# when the reader holds every capability the target holds, or CAP_SYS_PTRACE. Pod Security
# `baseline` forbids adding SYS_PTRACE but allows KILL and the runtime's default set, so there the
# root sidecar keeps the runtime's defaults (the set a default workload holds) and adds KILL: it
# reads and signals workloads with default capabilities; one granted more (IPC_LOCK, SYS_ADMIN) is
# reported as out of reach by the enforcer (process_uninspectable). Only a namespace that enforces
# `privileged` explicitly gets the narrower and stronger "drop everything, add KILL, SYS_PTRACE
# and DAC_READ_SEARCH", which reaches every process. `restricted` allows no root sidecar: it
# runs as the GPU containers' non-root user (``sidecar_user``), drop ALL, RuntimeDefault seccomp.


def sidecar_security_context(user: Mapping[str, Any], pod_security: str | None) -> dict[str, Any]:
    """The sidecar's securityContext for its user (``sidecar_user``'s fields) and the namespace's
    enforced Pod Security level (the label's value; None when unlabelled, which Kubernetes treats as
    `privileged`)."""
    context: dict[str, Any] = {**user, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True}
    if pod_security in (None, PRIVILEGED):
        # SYS_PTRACE passes the ptrace check on /proc/<pid>/fd and environ; DAC_READ_SEARCH passes the
        # file mode (0500/0400, owned by the process's uid): without it a root sidecar cannot list the
        # fds of a workload running as another user (seen on the real node: image-user workloads).
        context["capabilities"] = {"drop": ["ALL"], "add": ["DAC_READ_SEARCH", "KILL", "SYS_PTRACE"]}
    elif pod_security == RESTRICTED:
        # Only a non-root sidecar can pass: it has the GPU containers' user and needs no capability.
        context["capabilities"] = {"drop": ["ALL"]}
        context["seccompProfile"] = {"type": "RuntimeDefault"}
    else:  # baseline, or a level this version does not know: the runtime's defaults and KILL
        context["capabilities"] = {"add": ["KILL"]}
        context["seccompProfile"] = {"type": "RuntimeDefault"}
    return context


def _sidecar_env(plan: SharePlan, settings: InjectionSettings, port: int,
                 status_warnings: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The enforcer's variables and volume mounts."""
    env = [
        # No pod name, namespace or uid: the enforcer reads them from the service-account token the
        # kubelet mounts (gpufence/enforcer/observe/pod_identity.py), which saves every pod three variables.
        {"name": ENV_CONFIG, "value": config_json(plan, settings)},
    ]
    if status_warnings:
        # Admission warnings reach only the pod's creator (a Deployment's controller); the enforcer
        # turns the ones recorded in the status annotation into Events on the pod.
        env.append(_field_env(ENV_POD_STATUS, f"metadata.annotations['{ANNOTATION_STATUS}']"))
    if port != DEFAULT_METRICS_PORT:
        env.append({"name": ENV_METRICS_PORT, "value": str(port)})
    env += [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": settings.nvidia_visible_devices},
        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": settings.nvidia_driver_capabilities},
    ]
    mounts: list[dict[str, Any]] = [{"name": STATE_VOLUME, "mountPath": DEFAULT_STATE_DIR}]
    if settings.mount_host_proc:
        env.append({"name": ENV_HOST_PROC, "value": settings.host_proc_mount_path})
        mounts.append({"name": HOST_PROC_VOLUME, "mountPath": settings.host_proc_mount_path, "readOnly": True})
    return env, mounts


def build_sidecar(plan: SharePlan, settings: InjectionSettings, *, user: Mapping[str, Any] = ROOT_USER,
                  pod_security: str | None = None, fixed_port: bool = True,
                  status_warnings: bool = False) -> dict[str, Any]:
    """The enforcer container; ``user`` from ``sidecar_user`` (see there why),
    ``pod_security`` the namespace's enforced Pod Security level (see ``sidecar_security_context``);
    ``fixed_port`` False where the pod's network namespace may already hold the metrics port (host
    network, or a container declaring it): the enforcer then serves its metrics on any free port (0)
    and is not scraped. The port matters for metrics only: the probes read the heartbeat.
    ``status_warnings``: whether the status annotation records warnings for the enforcer's Events."""
    port = settings.metrics_port if fixed_port else 0
    env, mounts = _sidecar_env(plan, settings, port, status_warnings)
    sidecar: dict[str, Any] = {"name": SIDECAR_NAME, "image": settings.sidecar_image}
    if settings.sidecar_image_pull_policy != default_pull_policy(settings.sidecar_image):
        sidecar["imagePullPolicy"] = settings.sidecar_image_pull_policy
    sidecar["command"] = [ENFORCER_COMMAND]
    if settings.native_sidecar:
        sidecar["restartPolicy"] = "Always"
    sidecar.update(
        {
            "env": env,
            "ports": [{"containerPort": port, "name": SIDECAR_PORT_NAME}],
            "resources": {
                "requests": {"cpu": settings.sidecar_cpu_request, "memory": settings.sidecar_memory_request},
                "limits": {
                    **({"cpu": settings.sidecar_cpu_limit} if settings.sidecar_cpu_limit is not None else {}),
                    "memory": settings.sidecar_memory_limit,
                },
            },
            # The heartbeat passes while the process and its poll loop live, even with NVML down
            # (that degraded state shows in metrics and alerts), and fails within seconds for a
            # stopped enforcer. No readinessProbe on purpose: the pod's Ready condition counts
            # sidecars, and an enforcer that lost NVML must not take a serving pod out of its Service.
            "livenessProbe": _probe(),
            # The postStart hook makes a native sidecar hold the workload containers back until the
            # enforcer is up (up to 60 s), so enforcement starts first: the kubelet starts the next
            # container once the hook returns, not on its next one-second probe tick as a
            # startupProbe would (gpufence/enforcer/probe.py).
            "lifecycle": {"postStart": {"exec": {"command": list(POST_START_COMMAND)}}},
            "securityContext": sidecar_security_context(user, pod_security),
            "volumeMounts": mounts,
            # No terminationMessagePolicy: the enforcer writes why it exited into the kubelet's
            # /dev/termination-log itself (gpufence/enforcer/cli.py).
        }
    )
    if not fixed_port:
        del sidecar["ports"]  # nothing to name for the PodMonitor: this enforcer is not scraped
    return sidecar
