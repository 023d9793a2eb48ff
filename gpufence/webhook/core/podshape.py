
"""What the submitted pod is (pure): whether the fields the injection reads have the JSON types it
expects, and which containers ask the NVIDIA toolkit for GPUs through its variables (which
containers get a GPU by a scheduled path is ``webhook.core.gpu_paths``).

The API server decodes pods into typed objects before admission, so a malformed shape only comes
from hand-made requests; checking it once here keeps the rest of the core free of type checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Any

from gpufence.webhook.core.denial import Denial, quote

# Variables through which the NVIDIA container toolkit (with its default
# accept-nvidia-visible-devices-envvar-when-unprivileged = true) hands a container GPUs and driver
# capabilities without the device plugin: NVIDIA_VISIBLE_DEVICES=all in a pod spec is every GPU
# of the node, outside the scheduler's count and gpufence's shares. Only these values are inert.
NVIDIA_TOOLKIT_VARIABLES = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")
NVIDIA_INERT_VALUES = ("void", "none")


def nvidia_side_door(spec: Any, exempt: str | None, gpu_resource: str, kai_container: str | None = None) -> str | None:
    """The denial for the first container (``exempt`` aside: the sidecar of a GPU pod, which the
    injection rebuilds) that sets a toolkit variable to anything but void/none, else None. The
    denial advises requesting ``gpu_resource`` (the first configured GPU resource name).

    ``kai_container``: the container KAI-Scheduler hands a GPU fraction (``webhook.core.kai``), whose
    ``NVIDIA_VISIBLE_DEVICES`` from ``valueFrom.configMapKeyRef`` is how KAI hands it the GPU it
    reserved: accepted there, in that form only (a GPU container, held to its share and GPU count).

    Tolerant of garbage: the pod may be any pod of an opted-in namespace, not shape-checked.
    """
    if not isinstance(spec, dict):
        return None
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        if not isinstance(containers, list):
            continue
        for container in containers:
            if not isinstance(container, dict) or container.get("name") == exempt:
                continue
            env = container.get("env")
            for entry in env if isinstance(env, list) else ():
                if not isinstance(entry, dict) or entry.get("name") not in NVIDIA_TOOLKIT_VARIABLES:
                    continue
                value = entry.get("value")
                if "valueFrom" not in entry and value in NVIDIA_INERT_VALUES:
                    continue
                if kai_container is not None and container.get("name") == kai_container and _kai_form(entry):
                    continue
                how = "from valueFrom" if "valueFrom" in entry else f"to {quote(value if value is not None else '')}"
                return (
                    f"container {quote(container.get('name'))} sets {entry['name']} {how}: in this namespace only "
                    f'"void" or "none" is accepted, because the NVIDIA container toolkit would hand the container '
                    "GPUs of the node without the device plugin, outside the scheduler's count and gpufence's "
                    f'shares; remove the variable and request GPUs with resources.limits["{gpu_resource}"]'
                )
    return None


def _kai_form(entry: dict[str, Any]) -> bool:
    """``NVIDIA_VISIBLE_DEVICES`` as KAI-Scheduler's admission webhook writes it: from a ConfigMap key."""
    source = entry.get("valueFrom")
    return (entry.get("name") == "NVIDIA_VISIBLE_DEVICES" and not entry.get("value") and isinstance(source, dict)
            and isinstance(source.get("configMapKeyRef"), dict))


def sidecar_resource_use(spec: dict[str, Any], exempt: str, port: int, port_name: str,
                         own_volumes: Sequence[str], read_only_volumes: Sequence[str]) -> str | None:
    """The denial for the first container but ``exempt`` (the sidecar, which the injection rebuilds)
    that uses what is the enforcer's alone in a GPU pod, else None: a mount of one of ``own_volumes``
    (its state directory, the host's /proc), a writable mount of one of ``read_only_volumes`` (the
    preload library, a file of the node), or a declared ``port`` or port named ``port_name``.

    A workload that can write the enforcer's state directory can change which processes it
    resumes and which port its probe asks; one that declares the metrics port made the enforcer
    fall back to an exec probe that a workload process could answer. The volume names need not
    exist in the submitted pod: the injection adds them before the API server validates the pod,
    so a mount of ``gpufence-state`` in the submitted pod would otherwise mount the injected volume.
    The pod's shape must have been checked (``check_shape``).
    """
    for key in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(key) or ()):
            name = container["name"]
            if name == exempt:
                continue
            for j, mount in enumerate(container.get("volumeMounts") or ()):
                volume = mount.get("name")
                if volume not in own_volumes and volume not in read_only_volumes:
                    continue  # nearly every mount: no message to format
                where = f"spec.{key}[{i}].volumeMounts[{j}]"
                if volume in own_volumes:
                    return (
                        f"container {quote(name)} mounts volume {quote(volume)} ({where}): the volumes "
                        f"{', '.join(map(quote, own_volumes))} are the gpufence enforcer's alone, because a "
                        "container that can write its state could change what it enforces; remove the mount "
                        '(for a scratch directory, declare a volume of your own, e.g. an emptyDir named "scratch")'
                    )
                if volume in read_only_volumes and mount.get("readOnly") is not True:
                    return (
                        f"container {quote(name)} mounts volume {quote(volume)} writable ({where}): it is a file "
                        "of the node that gpufence mounts, so it may only be mounted with readOnly: true"
                    )
            for j, declared in enumerate(container.get("ports") or ()):
                if not isinstance(declared, dict):
                    continue
                if declared.get("containerPort") == port or declared.get("name") == port_name:
                    return (
                        f"container {quote(name)} declares port {declared.get('containerPort')} "
                        f"({quote(str(declared.get('name') or ''))}) at spec.{key}[{i}].ports[{j}]: in a GPU pod port "
                        f"{port} and the port name {quote(port_name)} are the gpufence enforcer's, where it serves "
                        f"its metrics; use another port, e.g. {port + 1}"
                    )
    return None


_DICT = frozenset({dict})
_STR = frozenset({str})
_STR_OR_NONE = frozenset({str, type(None)})


def _plain_env(env: Any) -> bool:
    """A fast, exact-type check of a container's env (JSON-decoded dicts with string names/values)."""
    return (
        type(env) is list
        and set(map(type, env)) <= _DICT
        and set(map(type, map(dict.get, env, repeat("name")))) <= _STR
        and set(map(type, map(dict.get, env, repeat("value")))) <= _STR_OR_NONE
    )


def check_shape(pod: dict[str, Any]) -> list[str]:
    """All container names; raises ``Denial`` when a field the rules or the injection read
    or write has the wrong JSON type (the message names the field), so ``desired_pod`` needs no type
    checks and no rule can fail on a type (HTTP 500). A rule that reads a new field checks it here."""
    _check_metadata(pod.get("metadata"))
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise _bad("spec", "an object")
    share = spec.get("shareProcessNamespace")
    if share is not None and not isinstance(share, bool):
        raise _bad("spec.shareProcessNamespace", "a boolean")
    _check_user(spec.get("securityContext"), "spec.securityContext")
    _check_volumes(spec.get("volumes"))
    _check_pod_claims(spec.get("resourceClaims"))
    names: list[str] = []
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        if containers is None:
            continue
        if not isinstance(containers, list):
            raise _bad(f"spec.{key}", "a list")
        names += [_check_container(container, f"spec.{key}[{i}]") for i, container in enumerate(containers)]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise Denial(f"the pod is malformed: container name {quote(name)} is used more than once")
        seen.add(name)
    return names


# Messages name the offending field; they are formatted only on the way to a denial.
def _bad(where: str, what: str) -> Denial:
    return Denial(f"the pod is malformed: {where} must be {what}")


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise _bad("metadata", "an object")
    for key in ("annotations", "labels"):
        values = metadata.get(key)
        if values is None:
            continue
        if not isinstance(values, dict):
            raise _bad(f"metadata.{key}", "an object")
        if not set(map(type, values.values())) <= _STR:
            for name, value in values.items():
                if not isinstance(value, str):
                    raise _bad(f"metadata.{key}[{quote(name)}]", "a string")


def _check_user(context: Any, where: str) -> None:
    if context is None:
        return
    if type(context) is not dict and not isinstance(context, dict):
        raise _bad(where, "an object")
    for key in ("runAsUser", "runAsGroup"):
        value = context.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise _bad(f"{where}.{key}", "an integer")
    for key in ("runAsNonRoot", "privileged", "allowPrivilegeEscalation"):
        value = context.get(key)
        if value is not None and not isinstance(value, bool):
            raise _bad(f"{where}.{key}", "a boolean")
    capabilities = context.get("capabilities")
    if capabilities is not None:
        if not isinstance(capabilities, dict):
            raise _bad(f"{where}.capabilities", "an object")
        added = capabilities.get("add")
        if added is not None and not (isinstance(added, list) and all(isinstance(c, str) for c in added)):
            raise _bad(f"{where}.capabilities.add", "a list of strings")


def _check_strings(obj: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise _bad(f"{where}.{key}", "a string")


def _check_list(value: Any, where: str) -> list[Any]:
    """``value`` as a list (None: empty); Denial where it is something else."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad(where, "a list")
    return value


def _check_volumes(volumes: Any) -> None:
    for i, volume in enumerate(_check_list(volumes, "spec.volumes")):
        if not isinstance(volume, dict):
            raise _bad(f"spec.volumes[{i}]", "an object")
        if not isinstance(volume.get("name"), str):
            raise _bad(f"spec.volumes[{i}].name", "a string")
        host = volume.get("hostPath")
        if host is not None:
            if not isinstance(host, dict):
                raise _bad(f"spec.volumes[{i}].hostPath", "an object")
            _check_strings(host, ("path", "type"), f"spec.volumes[{i}].hostPath")


def _check_pod_claims(claims: Any) -> None:
    for i, claim in enumerate(_check_list(claims, "spec.resourceClaims")):
        if not isinstance(claim, dict) or not isinstance(claim.get("name"), str):
            raise _bad(f"spec.resourceClaims[{i}]", "an object with a string name")
        _check_strings(claim, ("resourceClaimName", "resourceClaimTemplateName"), f"spec.resourceClaims[{i}]")


def _check_container(container: Any, where: str) -> str:
    """A container's shape; its name."""
    if not isinstance(container, dict):
        raise _bad(where, "an object")
    name = container.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.name", "a non-empty string")
    env = container.get("env")
    if env is not None and not _plain_env(env):  # the common case skips the loop
        _check_env(env, where)
    _check_mounts(container.get("volumeMounts"), f"{where}.volumeMounts")
    for j, declared in enumerate(_check_list(container.get("ports"), f"{where}.ports")):
        if not isinstance(declared, dict):
            raise _bad(f"{where}.ports[{j}]", "an object")
    _check_resources(container.get("resources"), f"{where}.resources")
    if "securityContext" in container:
        context = container["securityContext"]
        if context is not None:
            _check_user(context, f"{where}.securityContext")
    return name


def _check_env(env: Any, where: str) -> None:
    for j, entry in enumerate(_check_list(env, f"{where}.env")):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise _bad(f"{where}.env[{j}]", "an object with a string name")
        value = entry.get("value")
        if value is not None and not isinstance(value, str):
            raise _bad(f"{where}.env[{j}].value", "a string")


def _check_mounts(mounts: Any, where: str) -> None:
    for j, mount in enumerate(_check_list(mounts, where)):
        if type(mount) is dict:  # the decoder's types, checked without formatting a field's name
            name, path, read_only = mount.get("name"), mount.get("mountPath"), mount.get("readOnly")
            if (name is None or type(name) is str) and (path is None or type(path) is str) \
                    and (read_only is None or type(read_only) is bool):
                continue
        if not isinstance(mount, dict):
            raise _bad(f"{where}[{j}]", "an object")
        _check_strings(mount, ("name", "mountPath"), f"{where}[{j}]")
        if mount.get("readOnly") is not None and not isinstance(mount["readOnly"], bool):
            raise _bad(f"{where}[{j}].readOnly", "a boolean")


def _check_resources(resources: Any, where: str) -> None:
    if resources is None:
        return
    if not isinstance(resources, dict):
        raise _bad(where, "an object")
    for key in ("limits", "requests"):
        if resources.get(key) is not None and not isinstance(resources[key], dict):
            raise _bad(f"{where}.{key}", "an object")
    for j, claim in enumerate(_check_list(resources.get("claims"), f"{where}.claims")):
        if not isinstance(claim, dict) or not isinstance(claim.get("name"), str):
            raise _bad(f"{where}.claims[{j}]", "an object with a string name")
