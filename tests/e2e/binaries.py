"""Build (once) and find the control-plane binaries the end-to-end tests run.

The recipe is the pinned Go modules beside this file (``gomod/k8s-<version>``, ``gomod/etcd``):
their go.sum fixes every dependency. Binaries go to a cache outside the work tree, keyed by the
module directory's name and a hash of its go.mod and go.sum, so a clean clone reuses them and a
pin change rebuilds. ``python -m tests.e2e.binaries`` builds everything and prints the paths and
what each build cost.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

GOMOD = Path(__file__).resolve().parent / "gomod"
# The oldest Kubernetes we support and the newest stable release the Go module proxy served
# when this was pinned (2026-12-03).
KUBERNETES_VERSIONS = ("v1.30.14", "v1.37.2")
ETCD_VERSION = "v3.5.35"
K8S_TOOLS = ("kube-apiserver", "kube-controller-manager")
# The real kube-scheduler places DRA claims by consumable capacity (tests/e2e/test_dra_capacity.py),
# which 1.30 does not have: only 1.37 builds it, from the same pinned module (its go.sum already
# covers it), into the same cache directory, so the other binaries' cache keys do not change.
SCHEDULER_VERSIONS = ("v1.37.2",)


def cache_root() -> Path:
    base = os.environ.get("GPUFENCE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpufence"
    )
    return Path(base) / "e2e"


class GoMissing(RuntimeError):
    """Go (or the module proxy) is not available: the e2e tests skip with this reason."""


@dataclass(frozen=True)
class BuildRecipe:
    module_dir: Path
    packages: tuple[str, ...]  # import paths of main packages
    ldflags: str
    cgo: bool = False  # the NVIDIA hook binds libnvidia-ml through cgo; the Kubernetes binaries are static
    tags: str = ""  # go build -tags (Prometheus: which service discoveries it links)

    @property
    def key(self) -> str:
        digest = hashlib.sha256()
        for name in ("go.mod", "go.sum", "main.go"):
            path = self.module_dir / name
            if path.exists():
                digest.update(path.read_bytes())
        digest.update(self.ldflags.encode())
        if self.cgo:  # only then, so the existing binaries' keys (and caches) stay as they were
            digest.update(b"cgo")
        if self.tags:
            digest.update(f"tags={self.tags}".encode())
        return f"{self.module_dir.name}-{digest.hexdigest()[:12]}"

    def outputs(self) -> dict[str, Path]:
        return {pkg.rsplit("/", 1)[-1]: cache_root() / self.key / pkg.rsplit("/", 1)[-1]
                for pkg in self.packages}


def kubernetes_recipe(version: str) -> BuildRecipe:
    major, minor, _ = version.lstrip("v").split(".")
    # What hack/lib/version.sh stamps: 1.31+ derives its emulation version from gitVersion.
    stamp = " ".join(
        f"-X {pkg}.{var}={val}"
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for var, val in (("gitVersion", version), ("gitMajor", major), ("gitMinor", minor),
                         ("gitTreeState", "clean"), ("buildDate", "1970-01-01T00:00:00Z"))
    )
    tools = K8S_TOOLS + (("kube-scheduler",) if version in SCHEDULER_VERSIONS else ())
    return BuildRecipe(
        GOMOD / f"k8s-{version}",
        tuple(f"k8s.io/kubernetes/cmd/{tool}" for tool in tools),
        f"-s -w {stamp}",
    )


def etcd_recipe() -> BuildRecipe:
    return BuildRecipe(GOMOD / "etcd", ("gpufence.test/e2e/etcd",), "-s -w")


def refwebhook_recipe() -> BuildRecipe:
    """The benchmark's reference peer: a minimal Go webhook (standard library only)."""
    return BuildRecipe(GOMOD / "refwebhook", ("gpufence.test/e2e/refwebhook",), "-s -w")


# NVIDIA Container Toolkit: the first release with the `apply-cuda-memory-limits` CDI hook is v1.20.1;
# v1.20.2 was the newest the module proxy served when this was pinned (2026-12-04).
NVIDIA_TOOLKIT_VERSION = "v1.20.2"
_TOOLKIT = "github.com/NVIDIA/nvidia-container-toolkit"


def nvidia_cdi_hook_recipe() -> BuildRecipe:
    """``nvidia-cdi-hook``, the binary the toolkit's generated CDI specs name in their hooks.

    The link flags are the toolkit's own Makefile's: its version stamp, and lazy binding with
    unresolved symbols allowed, which is how go-nvml calls whatever the installed
    libnvidia-ml.so.1 has (a symbol the driver lacks fails only when called)."""
    extld = "-Wl,--export-dynamic -Wl,--unresolved-symbols=ignore-in-object-files -Wl,-z,lazy"
    return BuildRecipe(
        GOMOD / "nvidia-cdi-hook", (f"{_TOOLKIT}/cmd/nvidia-cdi-hook",),
        f"-s -w '-extldflags={extld}' -X {_TOOLKIT}/internal/info.version={NVIDIA_TOOLKIT_VERSION.lstrip('v')}",
        cgo=True,
    )


def nvidia_cdi_hook() -> Path:
    return build(nvidia_cdi_hook_recipe())["nvidia-cdi-hook"]


# Prometheus with Kubernetes service discovery, for the monitoring scenario on the node test bed
# (tests/e2e/node/test_node_monitoring.py): Debian's build leaves that discovery out. Prometheus's
# plugins/ files take build tags: remove_all_sd drops every discovery, enable_<name>_sd brings one
# back, so the binary links client-go's but not the clouds' SDKs.
PROMETHEUS_TAGS = "remove_all_sd,enable_kubernetes_sd"


def prometheus_recipe() -> BuildRecipe:
    return BuildRecipe(GOMOD / "prometheus", ("github.com/prometheus/prometheus/cmd/prometheus",), "-s -w",
                       tags=PROMETHEUS_TAGS)


def prometheus_with_kubernetes_sd() -> Path:
    return build(prometheus_recipe())["prometheus"]


def go_binary() -> str:
    go = shutil.which("go")
    if go is None:
        raise GoMissing("the Go toolchain is not installed (needed to build kube-apiserver)")
    return go


def build(recipe: BuildRecipe, log=sys.stderr) -> dict[str, Path]:
    outputs = recipe.outputs()
    if all(path.exists() for path in outputs.values()):
        return outputs
    go = go_binary()
    target = cache_root() / recipe.key
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second test process waits for the first build
        if all(path.exists() for path in outputs.values()):
            return outputs
        env = {**os.environ, "CGO_ENABLED": "1" if recipe.cgo else "0", "GOFLAGS": "-mod=readonly"}
        started = time.monotonic()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        # Only what is missing: a binary added to a recipe (kube-scheduler) builds alone.
        missing = [pkg for pkg in recipe.packages if not outputs[pkg.rsplit("/", 1)[-1]].exists()]
        for pkg in missing:
            out = outputs[pkg.rsplit("/", 1)[-1]]
            print(f"building {pkg} into {out} (first time only)", file=log, flush=True)
            result = subprocess.run(
                [go, "build", "-trimpath", "-ldflags", recipe.ldflags,
                 *(("-tags", recipe.tags) if recipe.tags else ()), "-o", f"{out}.tmp", pkg],
                cwd=recipe.module_dir, env=env, capture_output=True, text=True,
            )
            if result.returncode != 0:
                tail = result.stderr[-3000:]
                if "proxy.golang.org" in tail or "dial tcp" in tail or "lookup" in tail:
                    raise GoMissing(f"the Go module proxy is not reachable: {tail.strip()[-300:]}")
                raise RuntimeError(f"go build {pkg} failed:\n{tail}")
            os.replace(f"{out}.tmp", out)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime
        # ru_maxrss is the largest single descendant (the compiler or linker), in KiB.
        cost = (f"wall_s={time.monotonic() - started:.0f} cpu_s={cpu:.0f} max_rss_mib={usage.ru_maxrss // 1024} "
                f"cores={os.cpu_count()}\n")
        if len(missing) < len(recipe.packages):  # added to an earlier build: said apart, that one's kept
            names = " ".join(pkg.rsplit("/", 1)[-1] for pkg in missing)
            with open(target / "BUILD-COST", "a") as file:
                file.write(f"{names}: {cost}")
        else:
            (target / "BUILD-COST").write_text(cost)
    return outputs


# CRDs the install's overlays need, from the projects' own published Go modules (the module proxy
# serves each repository's files, and go.sum's checksum database verifies them).
CRD_SOURCES = {
    "prometheus-operator": ("github.com/prometheus-operator/prometheus-operator", "v0.85.0",
                            "example/prometheus-operator-crd",
                            ("monitoring.coreos.com_podmonitors.yaml", "monitoring.coreos.com_prometheusrules.yaml",
                             "monitoring.coreos.com_servicemonitors.yaml")),
    "cert-manager": ("github.com/cert-manager/cert-manager", "v1.21.2", "deploy/crds",
                     ("cert-manager.io_certificates.yaml", "cert-manager.io_issuers.yaml",
                      "cert-manager.io_clusterissuers.yaml", "cert-manager.io_certificaterequests.yaml")),
}


def crd_files(name: str) -> list[Path]:
    """The pinned CRD manifests of ``name`` (a key of CRD_SOURCES), fetched once into Go's module cache."""
    module, version, subdir, files = CRD_SOURCES[name]
    result = subprocess.run([go_binary(), "mod", "download", "-json", f"{module}@{version}"],
                            capture_output=True, text=True, cwd=GOMOD)
    if result.returncode != 0:
        raise GoMissing(f"cannot fetch {module}@{version}: {result.stdout[-300:]}{result.stderr[-300:]}")
    directory = Path(json.loads(result.stdout)["Dir"]) / subdir
    return [directory / f for f in files]


@dataclass(frozen=True)
class ControlPlaneBinaries:
    version: str
    kube_apiserver: Path
    kube_controller_manager: Path
    etcd: Path
    kube_scheduler: Path | None = None  # SCHEDULER_VERSIONS only


def control_plane(version: str) -> ControlPlaneBinaries:
    k8s = build(kubernetes_recipe(version))
    etcd = build(etcd_recipe())
    return ControlPlaneBinaries(
        version, k8s["kube-apiserver"], k8s["kube-controller-manager"], etcd["etcd"], k8s.get("kube-scheduler")
    )


def main(argv: list[str]) -> int:
    versions = argv or list(KUBERNETES_VERSIONS)
    try:
        for v in versions:
            bins = control_plane(v)
            for path in (bins.kube_apiserver, bins.kube_controller_manager, bins.kube_scheduler, bins.etcd):
                if path is None:
                    continue
                cost = path.parent / "BUILD-COST"
                print(path, cost.read_text().strip() if cost.exists() else "")
        if not argv:  # the node tests' real NVIDIA hook (cgo: needs a C compiler) and Prometheus
            for binary in (nvidia_cdi_hook(), prometheus_with_kubernetes_sd()):
                cost = binary.parent / "BUILD-COST"
                print(binary, cost.read_text().strip() if cost.exists() else "")
    except GoMissing as exc:
        # Not a failure: the e2e tests skip with this same reason, printed in pytest's summary.
        print(f"e2e: not building the control plane, the end-to-end tests will skip: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
