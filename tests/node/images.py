"""Container images for the node tests, built without a registry or a Docker engine.

* ``pause``: our own tiny static program (``pause.c``, ``gcc -static``): PID 1 of every pod's
  shared PID namespace, reaping orphans, exiting on SIGTERM/SIGINT.
* ``gpufence``: a Debian bookworm root filesystem (``debootstrap --variant=minbase`` with python3)
  holding, like the Dockerfile, a virtualenv at ``/opt/gpufence`` with the project installed
  from ``requirements/runtime.lock`` (its versions and hashes). The same image runs the sidecar and the test workloads
  (python3 is all a workload needs to hold the stand-in device open), and a setuid-root copy of
  python3 (``SETUID_ROOT_PYTHON``) for the tenant's setuid attacks.

Each is written as an OCI image layout tarball (one layer: the root filesystem as a tar, a config,
a manifest, an index) with Python's tarfile and json, and imported with
``ctr -n k8s.io images import``. Everything is cached under ``${GPUFENCE_CACHE:-~/.cache/gpufence}/node/``
keyed by a hash of its inputs: the Debian root filesystem by the lock file (minutes, once), the
final image by the project's sources (seconds).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpufence.webhook.core.settings import DEFAULT_SIDECAR_IMAGE

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PAUSE_IMAGE = "registry.k8s.io/pause:3.9"  # the name the kubelet and containerd ask for by default
GPUFENCE_IMAGE = DEFAULT_SIDECAR_IMAGE  # the install's and the webhook's default name (one version source)
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("GPUFENCE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What the project's image needs besides its virtualenv: python3 (+ venv to create it).
DEBIAN_PACKAGES = ("python3", "python3-venv")
def _project_sources() -> tuple[str, ...]:
    """What the wheel is built from: pyproject's packages (one list, not a copy kept here by hand)."""
    with open(REPO / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return ("pyproject.toml", "README.md", *(pattern.rstrip("*") for pattern in include))


PROJECT_SOURCES = _project_sources()


class ImageBuildUnavailable(RuntimeError):
    """A tool the image build needs is missing: the node tests skip with this reason."""


def cache_root() -> Path:
    base = os.environ.get("GPUFENCE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpufence"
    )
    return Path(base) / "node"


def _digest_files(paths: Iterable[Path], extra: bytes = b"") -> str:
    digest = hashlib.sha256(extra)
    for root in paths:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            if "__pycache__" in path.parts:
                continue
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise ImageBuildUnavailable(f"{tool} is not installed (scripts/install_system_deps.sh installs it)")
    return path


@dataclass(frozen=True)
class OciImage:
    name: str
    tarball: Path


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Reproducible layers: no build-time owners or times leak in (a rebuild gives the same digest).
    info.mtime = 0
    return info


def write_oci_tarball(out: Path, name: str, layer_root: Path, *, cmd: list[str], env: list[str],
                      user: str = "", workdir: str = "/") -> Path:
    """An OCI image layout tarball of one layer (``layer_root`` as the image's root filesystem)."""
    tmp = out.with_suffix(".tmp")
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(layer_root.iterdir()):
            tar.add(entry, arcname=entry.name, filter=_reset)
    layer_bytes = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    compressed = gzip.compress(layer_bytes, compresslevel=1, mtime=0)
    layer_digest = hashlib.sha256(compressed).hexdigest()
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": cmd, "Env": env, "User": user, "WorkingDir": workdir},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "tests/node/images.py"}],
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_digest = hashlib.sha256(config_bytes).hexdigest()
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": f"sha256:{config_digest}", "size": len(config_bytes)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": f"sha256:{layer_digest}", "size": len(compressed)}],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = hashlib.sha256(manifest_bytes).hexdigest()
    index = {
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": manifest["mediaType"], "digest": f"sha256:{manifest_digest}",
                       "size": len(manifest_bytes),
                       # What `ctr images import` names the image by.
                       "annotations": {"io.containerd.image.name": name,
                                       "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}}],
    }
    with tarfile.open(tmp, "w") as tar:
        def put(path: str, data: bytes) -> None:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        put("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        put("index.json", json.dumps(index).encode())
        put(f"blobs/sha256/{config_digest}", config_bytes)
        put(f"blobs/sha256/{manifest_digest}", manifest_bytes)
        put(f"blobs/sha256/{layer_digest}", compressed)
    os.replace(tmp, out)
    return out


class _Locked:
    """An exclusive lock on a cache directory: a second test process waits for the first build."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._file = open(directory / ".lock", "w")  # noqa: SIM115 - closed in __exit__

    def __enter__(self) -> None:
        fcntl.flock(self._file, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _record_cost(directory: Path, started: float, what: str) -> None:
    (directory / "BUILD-COST").write_text(f"{what} wall_s={time.monotonic() - started:.0f} cores={os.cpu_count()}\n")


def pause_image() -> OciImage:
    source = HERE / "pause.c"
    key = _digest_files([source])
    directory = cache_root() / f"pause-{key}"
    tarball = directory / "pause.oci.tar"
    if tarball.exists():
        return OciImage(PAUSE_IMAGE, tarball)
    with _Locked(directory):
        if not tarball.exists():
            started = time.monotonic()
            rootfs = directory / "rootfs"
            shutil.rmtree(rootfs, ignore_errors=True)
            rootfs.mkdir()
            subprocess.run([_need("gcc"), "-static", "-Os", "-s", "-o", str(rootfs / "pause"), str(source)],
                           check=True, capture_output=True, text=True)
            write_oci_tarball(tarball, PAUSE_IMAGE, rootfs, cmd=["/pause"], env=[], user="65535:65535")
            _record_cost(directory, started, "pause")
    return OciImage(PAUSE_IMAGE, tarball)


# Every file of a layer has mtime 0 (``_reset``), so a timestamp-checked .pyc never matches its
# source in the container: with a read-only root and PYTHONDONTWRITEBYTECODE, every start compiled
# each module it imported again (the sidecar: about 0.6 s of CPU more to start, under its CPU limit).
# The image's bytecode is therefore compiled against hashes and not checked at import: its sources
# never change. The Dockerfile does the same.
COMPILE_PYC = ("-m", "compileall", "-q", "-f", "--invalidation-mode", "unchecked-hash")


def _unchecked_pycs(directory: Path, rootfs: Path) -> None:
    """Compile the base's standard library and dependencies once (Debian's .pyc are timestamp-checked)."""
    marker = directory / "PYC-UNCHECKED-HASH"
    if marker.exists():
        return
    with _Locked(directory):
        if marker.exists():
            return
        started = time.monotonic()
        subprocess.run(["chroot", str(rootfs), "/opt/gpufence/bin/python", *COMPILE_PYC, "/usr/lib/python3.11",
                        "/opt/gpufence/lib"], check=True, capture_output=True)
        _record_cost(directory, started, "bytecode")
        marker.touch()


def _debian_rootfs() -> Path:
    """debootstrap'd bookworm with python3 and /opt/gpufence's dependencies (keyed by the lock file)."""
    lock = REPO / "requirements" / "runtime.lock"
    key = _digest_files([lock, REPO / "pyproject.toml"],
                        f"{DEBIAN_SUITE} {' '.join(DEBIAN_PACKAGES)}".encode())
    directory = cache_root() / f"debian-{key}"
    rootfs = directory / "rootfs"
    done = directory / "DONE"
    if done.exists():
        _unchecked_pycs(directory, rootfs)
        return rootfs
    with _Locked(directory):
        if done.exists():
            return rootfs
        started = time.monotonic()
        debootstrapped = directory / "DEBOOTSTRAPPED"
        if not debootstrapped.exists():
            debootstrap = _need("debootstrap")
            shutil.rmtree(rootfs, ignore_errors=True)
            result = subprocess.run(
                [debootstrap, "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", DEBIAN_SUITE,
                 str(rootfs), DEBIAN_MIRROR], capture_output=True, text=True)
            if result.returncode != 0:
                # Almost always the Debian mirror out of reach: a missing prerequisite, said as such.
                raise ImageBuildUnavailable(
                    f"debootstrap {DEBIAN_SUITE} from {DEBIAN_MIRROR} failed: {(result.stdout + result.stderr)[-600:]}")
            debootstrapped.touch()
        # The wheels come through the host's own pip (its index and certificates); the image's pip
        # then installs them offline. Both are CPython 3.11 on glibc 2.36 (bookworm), so the same
        # wheels fit.
        wheels = rootfs / "tmp" / "wheels"
        shutil.rmtree(wheels, ignore_errors=True)
        (rootfs / "tmp" / "runtime.lock").write_bytes(lock.read_bytes())
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--only-binary=:all:", "--require-hashes", "-r", str(lock), "-d", str(wheels)],
            capture_output=True, text=True)
        if result.returncode != 0:
            raise ImageBuildUnavailable(f"pip download of the runtime dependencies failed: {result.stderr[-600:]}")
        for argv in (["python3", "-m", "venv", "/opt/gpufence"],
                     ["/opt/gpufence/bin/pip", "install", "--quiet", "--disable-pip-version-check",
                      "--no-cache-dir", "--no-index", "--find-links", "/tmp/wheels", "--require-hashes",
                      "-r", "/tmp/runtime.lock"]):
            result = subprocess.run(["chroot", str(rootfs), *argv], capture_output=True, text=True,
                                    env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})
            if result.returncode != 0:
                raise RuntimeError(f"{argv} in the image root failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
        shutil.rmtree(wheels)
        # Shrink: apt lists and caches are not needed at run time.
        for junk in ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        (rootfs / "tmp" / "runtime.lock").unlink()
        _record_cost(directory, started, "debootstrap+deps")
        done.touch()
    _unchecked_pycs(directory, rootfs)
    return rootfs


# A setuid-root binary, as a tenant's GPU image may hold one (issue 38 row 2): a copy of the image's
# python3, owned by root with the setuid bit, so whoever runs it gets effective uid 0 unless the
# kernel's no_new_privs holds (``allowPrivilegeEscalation: false``). The node tests' workloads use
# this image; the sidecar runs it with no_new_privs always, and the project's Dockerfile has none.
SETUID_ROOT_PYTHON = "/usr/bin/python3-setuid-root"


def _add_setuid_root_python(rootfs: Path) -> None:
    target = rootfs / SETUID_ROOT_PYTHON.lstrip("/")
    shutil.copyfile(rootfs / "usr" / "bin" / "python3.11", target)
    os.chown(target, 0, 0)
    target.chmod(0o4755)  # after the chown, which clears the setuid bit


def gpufence_image() -> OciImage:
    base = _debian_rootfs()
    key = _digest_files([REPO / p for p in PROJECT_SOURCES],
                        f"{base} {' '.join(COMPILE_PYC)} {SETUID_ROOT_PYTHON}".encode())
    directory = cache_root() / f"gpufence-{key}"
    tarball = directory / "gpufence.oci.tar"
    if tarball.exists():
        return OciImage(GPUFENCE_IMAGE, tarball)
    with _Locked(directory):
        if not tarball.exists():
            started = time.monotonic()
            rootfs = directory / "rootfs"
            shutil.rmtree(rootfs, ignore_errors=True)
            subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(rootfs)], check=True)
            src = rootfs / "tmp" / "src"
            src.mkdir()
            for name in PROJECT_SOURCES:
                path = REPO / name
                if path.is_dir():
                    shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so*"))
                else:
                    shutil.copy(path, src / name)
            # No build isolation (it would fetch setuptools from an index the chroot cannot reach):
            # the wheel is built on the host, installed offline in the image.
            wheel_dir = rootfs / "tmp" / "wheel"
            result = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
                 "-w", str(wheel_dir), str(src)], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building the gpufence wheel failed:\n{result.stderr[-2000:]}")
            result = subprocess.run(
                ["chroot", str(rootfs), "sh", "-c", "/opt/gpufence/bin/pip install --quiet --no-deps --no-index "
                 "--disable-pip-version-check --no-cache-dir /tmp/wheel/*.whl"],
                capture_output=True, text=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"})
            if result.returncode != 0:
                raise RuntimeError(f"installing gpufence into the image failed:\n{result.stderr[-2000:]}")
            shutil.rmtree(src)
            shutil.rmtree(wheel_dir)
            subprocess.run(["chroot", str(rootfs), "/opt/gpufence/bin/python", *COMPILE_PYC,
                            "/opt/gpufence/lib/python3.11/site-packages/gpufence"], check=True)
            _add_setuid_root_python(rootfs)
            write_oci_tarball(
                tarball, GPUFENCE_IMAGE, rootfs, cmd=["gpufence-webhook", "--help"], user="65532:65532",
                workdir="/tmp",
                env=["PATH=/opt/gpufence/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                     "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"])
            shutil.rmtree(rootfs)
            _record_cost(directory, started, "gpufence image")
    return OciImage(GPUFENCE_IMAGE, tarball)


def import_image(ctr: list[str], image: OciImage) -> None:
    """``ctr -n k8s.io images import`` (``ctr`` is the command prefix with ``--address``)."""
    result = subprocess.run([*ctr, "-n", "k8s.io", "images", "import", "--no-unpack=false",
                             str(image.tarball)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ctr images import {image.tarball} failed:\n{result.stderr}")


def main() -> int:
    for build in (pause_image, gpufence_image):
        try:
            image = build()
        except ImageBuildUnavailable as exc:
            print(f"node: not building images, the node tests will skip: {exc}", file=sys.stderr)
            return 0
        cost = image.tarball.parent / "BUILD-COST"
        print(image.name, image.tarball, cost.read_text().strip() if cost.exists() else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
