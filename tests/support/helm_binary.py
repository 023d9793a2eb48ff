"""The ``helm`` binary the chart tests use, built from its Go module and cached.

tests/support/helm/go.mod pins ``helm.sh/helm/v3`` (a ``tool`` directive, so go.sum covers every
dependency of ``cmd/helm``); the binary is built with ``GOFLAGS=-mod=mod`` into
``${GPUFENCE_CACHE:-${XDG_CACHE_HOME:-~/.cache}/gpufence}/helm-<version>-<key>/helm``, where the key hashes go.mod,
go.sum, the Go version and the link flags, so a changed pin builds a new binary and an unchanged
one is built once per machine. ``build.json`` beside it records how long the build took.

The link flags are those of helm's own Makefile: its version, and the Kubernetes version it
assumes (from the pinned k8s.io/client-go, major + 1) for ``helm lint`` and ``helm template``.

``python -m tests.support.helm_binary`` builds it (if needed) and prints its path: CI can build it before
pytest, so no test waits minutes for a cold Go build.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODULE_DIR = Path(__file__).resolve().parent / "helm"
PACKAGE = "helm.sh/helm/v3/cmd/helm"
BUILD_TIMEOUT_SECONDS = 3600


def _required(module: str) -> str:
    text = (MODULE_DIR / "go.mod").read_text()
    match = re.search(rf"^\s*{re.escape(module)} (v\S+)", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{MODULE_DIR / 'go.mod'} does not require {module}")
    return match.group(1)


def helm_version() -> str:
    return _required("helm.sh/helm/v3")


def ldflags() -> str:
    client_go = re.fullmatch(r"v0\.(\d+)\.\d+.*", _required("k8s.io/client-go"))
    if client_go is None:
        raise RuntimeError("unexpected k8s.io/client-go version in tests/support/helm/go.mod")
    major, minor = "1", client_go.group(1)
    flags = ["-s", "-w", f"-X helm.sh/helm/v3/internal/version.version={helm_version()}"]
    for package in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
        flags += [f"-X {package}.k8sVersionMajor={major}", f"-X {package}.k8sVersionMinor={minor}"]
    return " ".join(flags)


def cache_root() -> Path:
    # The same root as the e2e binaries (tests/e2e/binaries.py).
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("GPUFENCE_CACHE") or Path(xdg) / "gpufence")


def missing_reason() -> str | None:
    """Why the binary cannot be built here (None: it can)."""
    if shutil.which("go") is None:
        return f"go not installed: cannot build helm {helm_version()} from its module ({PACKAGE})"
    return None


def _go_version() -> str:
    result = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.strip()


def binary_path() -> Path:
    digest = hashlib.sha256()
    for part in ((MODULE_DIR / "go.mod").read_bytes(), (MODULE_DIR / "go.sum").read_bytes(),
                 _go_version().encode(), ldflags().encode()):  # fmt: skip
        digest.update(part)
        digest.update(b"\0")
    return cache_root() / f"helm-{helm_version()}-{digest.hexdigest()[:12]}" / "helm"


def ensure_helm() -> Path:
    """Build the binary unless the cache has it; returns its path. Raises on a failed build."""
    path = binary_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One build per machine even when several test sessions (worktrees, CI jobs) start at once.
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        partial = path.with_name("helm.partial")
        env = dict(os.environ)
        env["GOFLAGS"] = f"{env.get('GOFLAGS', '')} -mod=mod".strip()
        started = time.monotonic()
        result = subprocess.run(
            ["go", "build", "-trimpath", "-ldflags", ldflags(), "-o", str(partial), PACKAGE],
            cwd=MODULE_DIR, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS, check=False,
        )
        seconds = time.monotonic() - started
        if result.returncode != 0:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
            raise RuntimeError(f"building helm {helm_version()} failed:\n{result.stderr[-4000:]}")
        partial.replace(path)  # atomic: a concurrent reader sees no binary or a whole one
        (path.parent / "build.json").write_text(json.dumps({
            "helm": helm_version(), "go": _go_version(), "seconds": round(seconds, 1),
            "built_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "ldflags": ldflags(),
        }, indent=2) + "\n")
    return path


def main() -> int:
    reason = missing_reason()
    if reason:
        # Not a failure of `make test`: the helm tests skip with this same reason.
        print(f"helm: not building, the chart tests will skip: {reason}", file=sys.stderr)
        return 0
    path = ensure_helm()
    print(path)
    record = path.parent / "build.json"
    if record.is_file():
        print(record.read_text().strip(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
