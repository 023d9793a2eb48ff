"""Which pod the enforcer runs in, read from what the kubelet gives the sidecar, not from its spec.

The pod's namespace, name and uid label every decision record and metric and name the pod in its
Events. The webhook used to write them into the sidecar as three downward-API variables, about 260
bytes in every GPU pod. The kubelet already hands the sidecar all three: the projected
service-account token it mounts (the same file the Events client authenticates with) is a JWT
whose ``kubernetes.io`` claim names the namespace and, being bound to the pod, the pod's name and
uid. The API server signed it for this pod, so reading it without checking the signature is safe
for what it is used for here: an Event about any other pod would be refused for a forged token,
and a tenant who mounts a token of their own over the path only mislabels their own pod's records
(the log collector and Prometheus label those by the pod they come from anyway).

Without a token (``automountServiceAccountToken: false``) the namespace comes from the
service-account directory's ``namespace`` file when present and the name from the hostname, which
the kubelet sets to the pod's name unless the pod sets ``hostname``; Events are then off anyway.
The ``GPUFENCE_POD_*`` variables win over all of this: the enforcer run outside a pod (the demo,
tests, a host) names itself with them. The webhook never puts them on a sidecar in a pod (one
that has them is rebuilt, or refused at validation).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpufence.contract import ENV_POD_NAME, ENV_POD_NAMESPACE, ENV_POD_UID

__all__ = ["PodIdentity", "from_token", "identify"]

_MAX_TOKEN_BYTES = 64 * 1024  # a projected token is about 1 KiB; never read more than this


@dataclass(frozen=True)
class PodIdentity:
    namespace: str | None
    name: str | None
    uid: str | None
    source: str  # where the identity came from, for the "pod_identity" record


def from_token(token: str) -> tuple[str | None, str | None, str | None]:
    """(namespace, pod name, pod uid) from a service-account JWT's ``kubernetes.io`` claim; Nones
    for what it lacks (a legacy Secret token names no pod) or when it is not such a JWT."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        return None, None, None
    try:
        payload = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4))
        claims = json.loads(payload)
    except (binascii.Error, ValueError):
        return None, None, None
    scope = claims.get("kubernetes.io") if isinstance(claims, dict) else None
    if not isinstance(scope, dict):
        return None, None, None
    pod = scope.get("pod")
    if not isinstance(pod, dict):
        pod = {}
    return _text(scope.get("namespace")), _text(pod.get("name")), _text(pod.get("uid"))


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _read(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            return f.read(_MAX_TOKEN_BYTES).decode("utf-8", "replace")
    except OSError:
        return None


def identify(service_account_dir: Path, env: Mapping[str, str] | None = None) -> PodIdentity:
    """The pod's identity: the ``GPUFENCE_POD_*`` variables, else the token's claims, else the
    ``namespace`` file and the hostname (see the module's docstring)."""
    env = os.environ if env is None else env
    namespace = env.get(ENV_POD_NAMESPACE) or None
    name = env.get(ENV_POD_NAME) or None
    uid = env.get(ENV_POD_UID) or None
    if namespace and name:
        return PodIdentity(namespace, name, uid, "environment")
    token = _read(service_account_dir / "token")
    claimed = from_token(token) if token else (None, None, None)
    if claimed[0] and claimed[1]:
        return PodIdentity(namespace or claimed[0], name or claimed[1], uid or claimed[2], "service-account token")
    namespace = namespace or claimed[0] or (_read(service_account_dir / "namespace") or "").strip() or None
    return PodIdentity(namespace, name or os.uname().nodename or None, uid, "hostname")
