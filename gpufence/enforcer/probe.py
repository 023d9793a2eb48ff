"""``gpufence-enforcer --probe``: the kubelet's exec probe where the sidecar may not own a fixed port.

In a pod with ``hostNetwork: true`` every pod on the node shares one network namespace, so a
second GPU pod's enforcer could not bind the same port and its probe would never pass; a user
container that declares the sidecar's port collides the same way inside the pod. There the webhook
gives the enforcer port 0 (any free port) and an exec probe instead of an HTTP one: the enforcer
writes the port it bound into its state directory, and this probe asks ``/healthz`` on it, so the
health rule stays the one in ``enforcer.health``.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from pathlib import Path

from gpufence.enforcer.state_files import write_text

PORT_FILE = "http-port"
PROBE_TIMEOUT_SECONDS = 2.0


def write_port(state_dir: str | None, port: int) -> None:
    """Record the bound port for ``probe`` (atomically: a probe never reads half a number)."""
    if not state_dir:
        return
    write_text(Path(state_dir) / PORT_FILE, f"{port}\n")


def probe(state_dir: str | None) -> int:
    """0 when the running enforcer's /healthz answers 200, else 1 with the reason on stderr."""
    if not state_dir:
        print("gpufence-enforcer --probe: no --state-dir (or GPUFENCE_STATE_DIR) to find the port in",
              file=sys.stderr)
        return 1
    try:
        port = int((Path(state_dir) / PORT_FILE).read_text().strip())
    except (OSError, ValueError) as exc:
        print(f"gpufence-enforcer --probe: enforcer not serving yet ({exc})", file=sys.stderr)
        return 1
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=PROBE_TIMEOUT_SECONDS) as resp:
            return 0 if resp.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"gpufence-enforcer --probe: /healthz answered {exc.code}: {exc.read()[:200]!r}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"gpufence-enforcer --probe: /healthz on port {port} unreachable: {exc}", file=sys.stderr)
        return 1
