"""The desired pod: the submitted pod as gpufence wants it, from the pod and the share plan (pure).

``desired_pod`` is idempotent by construction: every field it writes is either fully determined
by the settings and the plan (the sidecar, the volumes, the status annotation, the enforcer
config, the GPU containers' hard-limit variables) or added only when absent (the rest of the GPU
containers' environment), so ``desired_pod`` of its
own output equals that output and the patch between them is empty (reinvocation).

Copy-on-write: the desired pod shares every untouched subtree with the input (no deep copy), which
keeps a review cheap and lets ``webhook.core.patch.diff`` skip shared subtrees by identity. The input
is never modified.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any, NamedTuple

from gpufence.contract import ANNOTATION_STATUS, SIDECAR_NAME, ContainerShare
from gpufence.webhook.core.container_env import InjectedContainer, ShareLimits, gpu_container, void_container
from gpufence.webhook.core.denial import Denial, quote
from gpufence.webhook.core.driver_limits import DriverLimitPlan, NodeLabels, plan_driver_limits
from gpufence.webhook.core.frameworks import device_memory, pytorch_cap_enabled, recorded_warnings
from gpufence.webhook.core.gpu_paths import PodGpuPaths
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import SharePlan
from gpufence.webhook.core.sidecar import (
    api_defaulted,
    build_sidecar,
    pod_volumes,
    preload_library_path,
    sidecar_reaches_root,
    sidecar_user,
    status_annotation,
    without_privilege_escalation,
)


def desired_pod(pod: dict[str, Any], plan: SharePlan, settings: InjectionSettings,
                pod_security: str | None = None,
                namespace_annotations: Mapping[str, object] | None = None,
                nodes: NodeLabels | None = None,
                paths: PodGpuPaths | None = None) -> tuple[dict[str, Any], list[str]]:
    """The injected pod (sharing untouched subtrees with ``pod``) and warnings; raises Denial.

    ``pod_security``: the namespace's enforced Pod Security level (its label), None if unlabelled.
    ``namespace_annotations``: the Namespace's (its opt-in to PyTorch's allocator cap).
    ``nodes``: the known nodes' labels (driver limits under ``auto``), None where none are known.
    ``paths``: the pod's GPU paths as the review decided them (built here where none are given).

    The pod's shape must have been checked (``podshape.check_shape``): dicts and lists where
    this function reads them.
    """
    spec = pod["spec"]
    _check_process_namespace(spec)
    paths = paths if paths is not None else PodGpuPaths(spec, settings)
    # The driver's memory limit, where it applies to this pod, needs each share in bytes: the plan
    # (and through it the enforcer config) gets percentages resolved first.
    limits = _driver_limits(plan, spec, settings, nodes)
    plan = limits.plan
    shares = dict(plan.containers)
    edited = _edited_containers(spec, limits, settings, paths, pod_security,
                                pytorch_cap_enabled(namespace_annotations or {}, settings))
    fixed_port, port_warnings = _metrics_port(spec, edited.port_taken_by, settings.metrics_port)
    user, user_warnings = sidecar_user(spec, shares, pod_security)
    # Warnings about the pod and its enforcer: also recorded in the status annotation, for the
    # enforcer's Events (warnings reach only whoever created the pod: for a Deployment its
    # ReplicaSet controller).
    warnings = [*([limits.warning] if limits.warning is not None else []), *port_warnings, *user_warnings,
                *(() if settings.native_sidecar else plain_sidecar_warnings(spec, shares))]
    recorded = recorded_warnings([*plan.warnings, *warnings])
    sidecar = build_sidecar(plan, settings, user=user, pod_security=pod_security,
                            fixed_port=fixed_port, status_warnings=bool(recorded))
    sidecar = with_service_account_token(sidecar, edited.previous_sidecar, spec)
    sidecar = with_claims(sidecar, paths.sidecar_claims([name for name, _ in plan.containers]))
    if edited.previous_sidecar is not None and edited.previous_sidecar == api_defaulted(sidecar):
        # A reinvocation: ours as the API server defaulted it. Taken back as it is stored, or the
        # patch would remove the defaults only for the API server to write them again.
        sidecar = edited.previous_sidecar
    new_spec = dict(spec)
    new_spec["shareProcessNamespace"] = True
    new_spec.update(edited.lists)
    sidecar_key = "initContainers" if settings.native_sidecar else "containers"
    new_spec[sidecar_key] = _placed(sidecar, new_spec.get(sidecar_key) or (), edited.sidecar_at, shares,
                                    settings.native_sidecar)
    new_spec["volumes"] = _with_volumes(spec, settings)
    metadata = dict(pod.get("metadata") or {})
    metadata["annotations"] = {**(metadata.get("annotations") or {}),
                               ANNOTATION_STATUS: status_annotation(plan, recorded)}
    # The GPU containers' own warnings (their frameworks' caps, their driver limits) and those about
    # the author's values of gpufence's variables go to the admission response only: they concern
    # what the container's spec shows, and a reinvocation no longer sees the replaced values.
    return {**pod, "spec": new_spec, "metadata": metadata}, [*edited.warnings, *warnings, *edited.replaced]


def _check_process_namespace(spec: Mapping[str, Any]) -> None:
    """Denial where the pod's process namespace settings conflict with the enforcer's shared one."""
    if spec.get("hostPID") is True:
        raise Denial(
            "gpufence needs spec.shareProcessNamespace, which Kubernetes does not allow together with "
            'spec.hostPID: true; remove hostPID, or, where the namespace allows opt-out, label the pod '
            'gpufence.io/inject="false"'
        )
    if spec.get("shareProcessNamespace") is False:
        raise Denial(
            "spec.shareProcessNamespace: false conflicts with gpufence, whose enforcer must see the GPU "
            "containers' processes; remove the field (gpufence sets it to true), or, where the namespace "
            'allows opt-out, label the pod gpufence.io/inject="false"'
        )


def _driver_limits(plan: SharePlan, spec: Mapping[str, Any], settings: InjectionSettings,
                   nodes: NodeLabels | None) -> DriverLimitPlan:
    """``plan_driver_limits`` with each container's GPU memory read from the pod."""
    by_name = {c["name"]: c for key in ("initContainers", "containers") for c in spec.get(key) or ()}
    return plan_driver_limits(plan, spec, settings,
                              lambda name: device_memory(spec, by_name.get(name, {}), settings), nodes)


class EditedContainers(NamedTuple):
    """The pod's (init) containers as gpufence wants them, ours left out, and what the pass found."""

    lists: dict[str, list[Any]]  # "initContainers"/"containers" -> the containers, where the pod has any
    sidecar_at: int | None  # where ours already is in its list (a reinvocation)
    previous_sidecar: dict[str, Any] | None
    port_taken_by: str | None  # a container of the pod that declares the metrics port
    warnings: tuple[str, ...]  # the GPU containers' own (InjectedContainer.warnings)
    replaced: tuple[str, ...]  # the author's values of gpufence's variables (InjectedContainer.replaced)


def _edited_containers(spec: Mapping[str, Any], limits: DriverLimitPlan, settings: InjectionSettings,
                       paths: PodGpuPaths, pod_security: str | None, pytorch: bool) -> EditedContainers:
    shares = dict(limits.plan.containers)
    library = preload_library_path(settings)
    port = settings.metrics_port
    sidecar_key = "initContainers" if settings.native_sidecar else "containers"
    sidecar_at: int | None = None
    previous_sidecar: dict[str, Any] | None = None
    port_taken_by: str | None = None
    lists: dict[str, list[Any]] = {}
    warnings: list[str] = []
    replaced: list[str] = []
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        if not containers:
            continue
        updated: list[Any] = []
        for i, container in enumerate(containers):
            if container.get("name") == SIDECAR_NAME:
                # Ours (a reinvocation, or a copied pod): rebuilt by the caller. In the list it belongs
                # to it keeps its index, so that another injector's containers added since (Istio,
                # Linkerd, Vault Agent put theirs first) are never moved or rewritten into ours.
                if key == sidecar_key and sidecar_at is None:
                    sidecar_at, previous_sidecar = len(updated), container
                continue
            if any(isinstance(d, dict) and d.get("containerPort") == port for d in container.get("ports") or ()):
                port_taken_by = port_taken_by or container["name"]
            share = shares.get(container["name"])
            if share is not None:
                injected = _gpu_container(container, share, spec, limits, settings, library, pytorch)
                container = injected.container
                warnings += injected.warnings
                replaced += injected.replaced
                if not sidecar_reaches_root(pod_security):
                    container = without_privilege_escalation(container, f"spec.{key}[{i}]", pod_security)
            elif settings.void_non_gpu_containers:
                container = void_container(container, paths)
            updated.append(container)
        lists[key] = updated
    return EditedContainers(lists, sidecar_at, previous_sidecar, port_taken_by, tuple(warnings), tuple(replaced))


def _gpu_container(container: dict[str, Any], share: ContainerShare, spec: Mapping[str, Any],
                   limits: DriverLimitPlan, settings: InjectionSettings, library: str | None,
                   pytorch: bool) -> InjectedContainer:
    name = container["name"]
    plan = limits.plan
    return gpu_container(container, share, settings, library, device=device_memory(spec, container, settings),
                         pytorch=pytorch,
                         limits=ShareLimits(driver_limits=limits.applies, resolved=name in limits.resolved,
                                            limiters=name not in plan.runtime_limited,
                                            kai_fraction=name == plan.kai_fraction))


def _metrics_port(spec: Mapping[str, Any], port_taken_by: str | None, port: int) -> tuple[bool, list[str]]:
    """Whether the enforcer's metrics port is fixed, and the warning where it is not.

    The metrics port is fixed unless the pod's network namespace may already hold it: with
    hostNetwork every GPU pod on the node shares one (a second pod's enforcer could not bind it),
    and a container of the pod may declare it. Only metrics depend on it: the probes do not."""
    host_network = spec.get("hostNetwork") is True
    if not (host_network or port_taken_by):
        return True, []
    why = "the pod uses the host's network" if host_network else (
        f"container {quote(port_taken_by or '')} declares port {port}")
    return False, [
        f"gpufence: {why}, so the enforcer serves its metrics on a free port it picks at start and "
        "Prometheus does not scrape it; its decisions still reach the log and the pod's Events"
    ]


def _placed(sidecar: dict[str, Any], others: Sequence[Any], sidecar_at: int | None, shares: Container[str],
            native: bool) -> list[Any]:
    """``others`` (the containers of the sidecar's list) with ``sidecar`` in its place: where ours
    was (a reinvocation), else first (native: the enforcer is up before the workload starts) or last."""
    placed = list(others)
    if sidecar_at is not None:
        if native:
            # Never after a GPU init container: that one would run before enforcement starts.
            first_gpu = next((i for i, c in enumerate(placed) if c.get("name") in shares), sidecar_at)
            sidecar_at = min(sidecar_at, first_gpu)
        placed.insert(sidecar_at, sidecar)
    elif native:
        placed.insert(0, sidecar)
    else:
        placed.append(sidecar)
    return placed


def _with_volumes(spec: Mapping[str, Any], settings: InjectionSettings) -> list[Any]:
    """The pod's volumes with gpufence's added; Denial where the pod has another under one's name."""
    volumes = list(spec.get("volumes") or ())
    existing = {v["name"]: v for v in volumes if isinstance(v.get("name"), str)}
    for volume in pod_volumes(settings):
        present = existing.get(volume["name"])
        if present is None:
            volumes.append(volume)
        elif present != volume:
            raise Denial(f"volume name {quote(volume['name'])} is reserved by gpufence; rename the pod's volume")
    return volumes


def with_claims(sidecar: dict[str, Any], claims: list[str]) -> dict[str, Any]:
    """Our sidecar holding the pod's GPU claims (DRA): the runtime hands a container only the devices
    of the claims it names (through CDI, not NVIDIA_VISIBLE_DEVICES), and the enforcer needs NVML
    on those GPUs to see the workload's processes. A claim is allocated once per pod, so naming it
    again takes nothing from the workload."""
    if not claims:
        return sidecar
    return {**sidecar, "resources": {**sidecar["resources"], "claims": [{"name": n} for n in claims]}}


# Where the API server's ServiceAccount admission plugin mounts the pod's token.
SERVICE_ACCOUNT_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def is_service_account_token_volume(volume: Any) -> bool:
    """Whether ``volume`` holds the pod's own service-account token: projected, with a
    ``serviceAccountToken`` source at path ``token`` for the API server's audience, as the
    ServiceAccount plugin makes it. The enforcer names its pod by that token's claims
    (gpufence/enforcer/observe/pod_identity.py)."""
    projected = volume.get("projected") if isinstance(volume, dict) else None
    sources = projected.get("sources") if isinstance(projected, dict) else None
    return isinstance(sources, list) and any(
        isinstance(source, dict) and isinstance(source.get("serviceAccountToken"), dict)
        and source["serviceAccountToken"].get("path") == "token"
        and not source["serviceAccountToken"].get("audience")
        for source in sources)


def _token_mount(container: Any) -> dict[str, Any] | None:
    for mount in (container.get("volumeMounts") or ()) if isinstance(container, dict) else ():
        if isinstance(mount, dict) and mount.get("mountPath") == SERVICE_ACCOUNT_MOUNT_PATH:
            return mount
    return None


def with_service_account_token(built: dict[str, Any], previous: dict[str, Any] | None,
                               spec: dict[str, Any]) -> dict[str, Any]:
    """Our sidecar with the pod's ServiceAccount token mounted, as the API server mounts it elsewhere.

    The API server's ServiceAccount plugin runs before the webhooks and mounts the token into every
    container; after a webhook adds one it runs again for the newcomer, and then reinvokes every
    ``IfNeeded`` webhook. Rebuilding the sidecar on that reinvocation removed the mount (the
    enforcer lost its credentials for Events). Giving the sidecar the same mount the other
    containers already have keeps it, and spares the API server the second plugin run and the
    reinvocation (one webhook call per pod instead of two). Nothing else a pod brings under our
    sidecar's name survives: a tenant must not add arguments or mount files over the enforcer's code,
    and a read-only mount at the token path can do neither.
    """
    ours = {m.get("name") for m in built.get("volumeMounts") or ()}
    volumes = {v.get("name"): v for v in spec.get("volumes") or () if isinstance(v, dict)}
    # The previous sidecar's mount first (a reinvocation keeps it as it was), then the other
    # containers': the first that is the pod's own token, read-only. A previous mount of anything
    # else (a file of the author's at the token's path would name another pod) is passed over, not
    # the end of the search, so that the webhook's output is its own fixed point.
    candidates = [_token_mount(previous) if previous is not None else None, *(
        _token_mount(container) for key in ("initContainers", "containers") for container in spec.get(key) or ()
        if isinstance(container, dict) and container.get("name") != SIDECAR_NAME)]
    token = next((t for t in candidates if t is not None and t.get("readOnly") is True
                  and is_service_account_token_volume(volumes.get(t.get("name")))), None)
    if token is None or token.get("name") in ours:
        return built
    mount = {"name": token["name"], "readOnly": True, "mountPath": SERVICE_ACCOUNT_MOUNT_PATH}
    return {**built, "volumeMounts": [*(built.get("volumeMounts") or ()), mount]}


def plain_sidecar_warnings(spec: Mapping[str, Any], shares: Container[str]) -> list[str]:
    """What a regular-container enforcer (native sidecars off) cannot do, said to the user."""
    warnings = []
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
    return warnings


def desired_plain_pod(pod: dict[str, Any], settings: InjectionSettings,
                      paths: PodGpuPaths | None = None) -> dict[str, Any]:
    """A pod without a shared GPU as gpufence wants it: every container that gets no device with
    ``NVIDIA_VISIBLE_DEVICES=void`` (``--void-non-gpu-containers``), nothing else. Copy-on-write;
    the pod's shape must have been checked (``podshape.check_shape``); ``paths`` as in ``desired_pod``."""
    spec = dict(pod["spec"])
    paths = paths if paths is not None else PodGpuPaths(spec, settings)
    for key in ("initContainers", "containers"):
        if spec.get(key):
            spec[key] = [void_container(container, paths) for container in spec[key]]
    return {**pod, "spec": spec}
