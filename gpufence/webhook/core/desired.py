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

from collections.abc import Container, Mapping
from typing import Any

from gpufence.contract import ANNOTATION_STATUS, SIDECAR_NAME
from gpufence.webhook.core.container_env import FrameworkRecord, gpu_container, void_container
from gpufence.webhook.core.denial import Denial, quote
from gpufence.webhook.core.driver_limits import NodeLabels, plan_driver_limits
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
                nodes: NodeLabels | None = None) -> tuple[dict[str, Any], list[str]]:
    """The injected pod (sharing untouched subtrees with ``pod``) and warnings; raises Denial.

    ``pod_security``: the namespace's enforced Pod Security level (its label), None if unlabelled.
    ``namespace_annotations``: the Namespace's (its opt-in to PyTorch's allocator cap).
    ``nodes``: the known nodes' labels (driver limits under ``auto``), None where none are known.

    The pod's shape must have been checked (``podshape.check_shape``): dicts and lists where
    this function reads them.
    """
    # Warnings about a GPU container's own settings (its frameworks' caps, its driver limits) go to
    # the admission response only: they concern what the container's spec shows. Those about the
    # pod and its enforcer are also recorded in the status annotation, for the enforcer's Events.
    container_warnings: list[str] = []
    warnings: list[str] = []
    shares = dict(plan.containers)
    spec = dict(pod["spec"])
    new_pod = dict(pod)
    new_pod["spec"] = spec

    metadata = dict(pod.get("metadata") or {})
    annotations = dict(metadata.get("annotations") or {})
    metadata["annotations"] = annotations
    new_pod["metadata"] = metadata
    record = FrameworkRecord()
    pytorch = pytorch_cap_enabled(namespace_annotations or {}, settings)

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
    spec["shareProcessNamespace"] = True

    # The driver's memory limit, where it applies to this pod, needs each share in bytes: the plan
    # (and through it the enforcer config) gets percentages resolved first.
    by_name = {c["name"]: c for key in ("initContainers", "containers") for c in spec.get(key) or ()}
    limits = plan_driver_limits(plan, pod["spec"], settings,
                                lambda name: device_memory(pod["spec"], by_name.get(name, {}), settings), nodes)
    plan = limits.plan
    shares = dict(plan.containers)
    if limits.warning is not None:
        warnings.append(limits.warning)
    # Warnings about an author's values of gpufence's variables, which the webhook replaced: for the
    # pod's creator only, not the status annotation, because a reinvocation no longer sees those
    # values and would rewrite the annotation without them (a patch where there must be none).
    replaced: list[str] = []
    library = preload_library_path(settings)
    paths = PodGpuPaths(pod["spec"], settings)
    port = settings.metrics_port
    sidecar_key = "initContainers" if settings.native_sidecar else "containers"
    sidecar_at: int | None = None  # where ours already is in its list (a reinvocation)
    previous_sidecar: dict[str, Any] | None = None
    port_taken_by: str | None = None  # a container of the pod that declares the metrics port
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        if not containers:
            continue
        updated: list[Any] = []
        for i, container in enumerate(containers):
            if container.get("name") == SIDECAR_NAME:
                # Ours (a reinvocation, or a copied pod): rebuilt below. In the list it belongs to
                # it keeps its index, so that another injector's containers added since (Istio,
                # Linkerd, Vault Agent put theirs first) are never moved or rewritten into ours.
                if key == sidecar_key and sidecar_at is None:
                    sidecar_at = len(updated)
                    previous_sidecar = container
                continue
            for declared in container.get("ports") or ():
                if isinstance(declared, dict) and declared.get("containerPort") == port:
                    port_taken_by = port_taken_by or container["name"]
            share = shares.get(container["name"])
            if share is not None:
                container = gpu_container(container, share, settings, library, container_warnings,
                                          device=device_memory(pod["spec"], container, settings),
                                          pytorch=pytorch, record=record, driver_limits=limits.applies,
                                          resolved=container["name"] in limits.resolved, replaced=replaced,
                                          limiters=container["name"] not in plan.runtime_limited,
                                          kai_fraction=container["name"] == plan.kai_fraction)
                if not sidecar_reaches_root(pod_security):
                    container = without_privilege_escalation(container, f"spec.{key}[{i}]", pod_security)
            elif settings.void_non_gpu_containers:
                container = void_container(container, paths)
            updated.append(container)
        spec[key] = updated

    # The metrics port is fixed unless the pod's network namespace may already hold it: with
    # hostNetwork every GPU pod on the node shares one (a second pod's enforcer could not bind it),
    # and a container of the pod may declare it. Only metrics depend on it: the probes do not.
    host_network = spec.get("hostNetwork") is True
    fixed_port = not (host_network or port_taken_by)
    if not fixed_port:
        why = "the pod uses the host's network" if host_network else (
            f"container {quote(port_taken_by or '')} declares port {port}")
        warnings.append(
            f"gpufence: {why}, so the enforcer serves its metrics on a free port it picks at start and "
            "Prometheus does not scrape it; its decisions still reach the log and the pod's Events"
        )
    user = sidecar_user(pod["spec"], shares, pod_security, warnings)
    if not settings.native_sidecar:
        _warn_plain_sidecar(spec, shares, warnings)
    # Warnings reach only whoever created the pod (for a Deployment its ReplicaSet controller), so
    # the enforcer turns those about the pod and itself into Events on the pod.
    recorded = recorded_warnings([*plan.warnings, *warnings])
    sidecar = build_sidecar(plan, settings, user=user, pod_security=pod_security,
                            fixed_port=fixed_port, status_warnings=bool(recorded))
    sidecar = with_service_account_token(sidecar, previous_sidecar, pod["spec"])
    sidecar = with_claims(sidecar, paths.sidecar_claims([name for name, _ in plan.containers]))
    if previous_sidecar is not None and previous_sidecar == api_defaulted(sidecar):
        # A reinvocation: ours as the API server defaulted it. Taken back as it is stored, or the
        # patch would remove the defaults only for the API server to write them again.
        sidecar = previous_sidecar
    others = list(spec.get(sidecar_key) or ())
    if sidecar_at is not None:
        if settings.native_sidecar:
            # Never after a GPU init container: that one would run before enforcement starts.
            first_gpu = next((i for i, c in enumerate(others) if c.get("name") in shares), sidecar_at)
            sidecar_at = min(sidecar_at, first_gpu)
        others.insert(sidecar_at, sidecar)
    elif settings.native_sidecar:
        others.insert(0, sidecar)  # first: the enforcer is up before the workload starts
    else:
        others.append(sidecar)
    spec[sidecar_key] = others

    volumes = list(spec.get("volumes") or ())
    existing = {v["name"]: v for v in volumes if isinstance(v.get("name"), str)}
    for volume in pod_volumes(settings):
        present = existing.get(volume["name"])
        if present is None:
            volumes.append(volume)
        elif present != volume:
            raise Denial(f"volume name {quote(volume['name'])} is reserved by gpufence; rename the pod's volume")
    spec["volumes"] = volumes
    annotations[ANNOTATION_STATUS] = status_annotation(plan, recorded)
    return new_pod, [*container_warnings, *warnings, *replaced]



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


def desired_plain_pod(pod: dict[str, Any], settings: InjectionSettings) -> dict[str, Any]:
    """A pod without a shared GPU as gpufence wants it: every container that gets no device with
    ``NVIDIA_VISIBLE_DEVICES=void`` (``--void-non-gpu-containers``), nothing else. Copy-on-write;
    the pod's shape must have been checked (``podshape.check_shape``)."""
    spec = dict(pod["spec"])
    paths = PodGpuPaths(spec, settings)
    for key in ("initContainers", "containers"):
        if spec.get(key):
            spec[key] = [void_container(container, paths) for container in spec[key]]
    return {**pod, "spec": spec}
