"""The node guardian's test bed on this machine: real cgroups laid out as the kubelet lays out a pod's
(``.../kubepods/burstable/pod<uid>/<container id>``, under a unique prefix so a kubelet on the same
machine is never disturbed), real processes started inside them, the pods the API server would hold
in a pods file, the simulated NVML listing the processes, and the real ``gpufence-node`` process.

Both cgroup versions where the machine has them: v1 (the ``freezer`` and ``pids`` hierarchies) and
v2 (the cgroup2 mount: ``/sys/fs/cgroup`` on a v2 host, ``/sys/fs/cgroup/unified`` on a hybrid one).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from gpufence.contract import EnforcerConfig
from tests.support.enforcer_harness import REPO_ROOT, WORKLOAD, Enforcer, GpuSandbox, LineReader, Workload
from tests.support.prerequisites import missing

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
V1_HIERARCHIES = ("freezer", "pids")


def cgroup2_mount() -> pathlib.Path | None:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return CGROUP_ROOT
    if (CGROUP_ROOT / "unified" / "cgroup.controllers").exists():
        return CGROUP_ROOT / "unified"
    return None


def v1_available() -> bool:
    return all((CGROUP_ROOT / h / "cgroup.procs").exists() for h in V1_HIERARCHIES)


class Container:
    """One container's cgroup, in every hierarchy of its version."""

    def __init__(self, pod: FakePod, name: str) -> None:
        self.pod = pod
        self.name = name
        self.id = uuid.uuid4().hex + uuid.uuid4().hex  # 64 hex digits, as containerd writes them
        self.path = f"{pod.path}/{self.id}"
        self.dirs = [top / self.path.lstrip("/") for top in pod.bed.tops]
        for d in self.dirs:
            d.mkdir(parents=True)

    @property
    def freezer_state(self) -> str:
        if self.pod.bed.version == "v2":
            # cgroup.events says whether every task is frozen (cgroup.freeze only what was asked).
            events = dict(line.split() for line in (self.dirs[0] / "cgroup.events").read_text().splitlines())
            return "FROZEN" if events.get("frozen") == "1" else "THAWED"
        return (self.dirs[0] / "freezer.state").read_text().strip()

    def pids(self) -> set[int]:
        return {int(p) for d in self.dirs for p in (d / "cgroup.procs").read_text().split()}

    def enter_command(self) -> str:
        return "; ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in self.dirs)

    def spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """Any command started inside this cgroup (killed with the bed)."""
        return subprocess.Popen(["sh", "-c", f"{self.enter_command()}; exec {shlex.join(argv)}"])

    def start(self, gpu: GpuSandbox, *, ignore_term: bool = False, wrap: tuple[str, ...] = (),
              script: str | None = None) -> Workload:
        """The test workload (tests/support/workload.py, or ``script``) started inside this cgroup."""
        argv = [sys.executable, script or str(WORKLOAD), str(gpu.device)] + (["--ignore-term"] if ignore_term else [])
        shell = f"{self.enter_command()}; exec {shlex.join([*wrap, *argv])}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFENCE_")}
        env["GPUFENCE_CONTAINER"] = self.name  # what the webhook sets: the sidecar's claim, never the guardian's
        proc = subprocess.Popen(["sh", "-c", shell], env=env, stdout=subprocess.PIPE, text=True)
        w = Workload(proc, self.name)
        gpu.workloads.append(w)
        return w


class FakePod:
    def __init__(self, bed: CgroupBed, namespace: str, name: str) -> None:
        self.bed = bed
        self.uid = str(uuid.uuid4())
        self.namespace = namespace
        self.name = name
        self.path = f"{bed.prefix}/kubepods/burstable/pod{self.uid}"
        self.containers: list[Container] = []
        self.claims: dict[str, str] = {}  # container name -> the ResourceClaim it uses (DRA)
        self.annotations: dict[str, str] = {}

    def container(self, name: str) -> Container:
        c = Container(self, name)
        self.containers.append(c)
        return c

    def object(self, config: EnforcerConfig | None) -> dict[str, Any]:
        """The pod as the API server serves it: the sidecar's config in the spec, the IDs in the status."""
        spec: dict[str, Any] = {"containers": [
            {"name": c.name, "image": "cuda",
             **({"resources": {"claims": [{"name": f"c-{c.name}"}]}} if c.name in self.claims else {})}
            for c in self.containers
        ]}
        if self.claims:
            spec["resourceClaims"] = [{"name": f"c-{name}", "resourceClaimName": claim}
                                      for name, claim in self.claims.items()]
        if config is not None:
            spec["initContainers"] = [{"name": "gpufence-enforcer", "image": "gpufence", "restartPolicy": "Always",
                                       "env": [{"name": "GPUFENCE_CONFIG", "value": config.to_json()}]}]
        return {
            "metadata": {"uid": self.uid, "namespace": self.namespace, "name": self.name,
                         "annotations": self.annotations},
            "spec": spec,
            "status": {"containerStatuses": [{"name": c.name, "containerID": f"containerd://{c.id}"}
                                             for c in self.containers]},
        }


class CgroupBed:
    def __init__(self, version: str, tmp: pathlib.Path) -> None:
        self.version = version
        self.prefix = f"/gpufence-node-test-{uuid.uuid4().hex[:10]}"
        if version == "v2":
            mount = cgroup2_mount()
            assert mount is not None
            self.tops = [mount]
        else:
            self.tops = [CGROUP_ROOT / h for h in V1_HIERARCHIES]
        self.pods: list[FakePod] = []
        self.claims: list[dict[str, Any]] = []  # ResourceClaim objects as the API server serves them
        self.slices: list[dict[str, Any]] = []  # ResourceSlice objects (the DRA driver's devices)
        self.pods_file = tmp / "pods.json"
        self.namespaces: list[dict[str, Any]] = [
            {"metadata": {"name": "team-a", "labels": {"gpufence.io/injection": "enabled"}}},
            {"metadata": {"name": "other"}},
        ]
        self.policy: dict[str, str] | None = None  # the policy ConfigMap's data (None: no policy in the file)

    def pod(self, name: str = "p", namespace: str = "team-a") -> FakePod:
        p = FakePod(self, namespace, name)
        self.pods.append(p)
        return p

    def publish(self, configs: dict[str, EnforcerConfig | None]) -> None:
        """Write the pods file (pod name -> its config, None: admitted without one)."""
        doc = {"pods": [p.object(configs.get(p.name)) for p in self.pods], "namespaces": self.namespaces,
               "resourceClaims": self.claims, "resourceSlices": self.slices}
        if self.policy is not None:
            doc["policy"] = {"metadata": {"name": "gpufence-policy", "namespace": "gpufence"}, "data": self.policy}
        tmp = self.pods_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.pods_file)

    def cleanup(self) -> None:
        dirs = [d for p in self.pods for c in p.containers for d in c.dirs]
        for d in dirs:
            with contextlib.suppress(OSError):
                if self.version == "v2":
                    (d / "cgroup.freeze").write_text("0")
                else:
                    (d / "freezer.state").write_text("THAWED")
            with contextlib.suppress(OSError):
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        for top in self.tops:
            base = top / self.prefix.lstrip("/")
            for d in sorted((p for p in [base, *base.rglob("*")] if p.is_dir()), key=lambda p: -len(p.parts)):
                deadline = time.monotonic() + 10
                while True:
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        # Killed processes leave the cgroup once reaped: wait for that, not a fixed time.
                        assert time.monotonic() < deadline, f"cannot remove {d}"
                        time.sleep(0.01)


@pytest.fixture(params=["v1", "v2"])
def bed(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[CgroupBed]:
    if os.geteuid() != 0:
        missing("needs root to create cgroups and signal processes of other users")
    version = request.param
    if version == "v1" and not v1_available():
        missing("no cgroup v1 freezer and pids hierarchies on this machine")
    if version == "v2" and cgroup2_mount() is None:
        missing("no cgroup2 mount on this machine")
    made = CgroupBed(version, tmp_path)
    try:
        yield made
    finally:
        made.cleanup()


class Guardian(Enforcer):
    """The real ``gpufence-node`` process (its log lines and metrics, as the enforcer harness reads them)."""


def start_guardian(gpu: GpuSandbox, bed: CgroupBed, *args: str, state_dir: pathlib.Path | None = None) -> Guardian:
    argv = [
        sys.executable, "-m", "gpufence.node", "--pods-file", str(bed.pods_file), "--metrics-port", "0",
        "--bind-address", "127.0.0.1", "--state-dir", str(state_dir or gpu.root / "node-state"),
        "--poll-interval", "0.1", *args,
    ]
    stderr_path = gpu.root / f"guardian-{len(gpu.enforcers)}.stderr"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(argv, env=gpu.env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    g = Guardian(proc, stderr_path, LineReader(proc.stdout, "guardian"))
    gpu.enforcers.append(g)  # killed by the sandbox's cleanup
    g.wait_started()
    return g


def wait_polls(g: Guardian, polls: int, timeout: float = 20) -> None:
    name = "gpufence_node_poll_duration_seconds_count"
    first = g.metric(name) or 0
    deadline = time.monotonic() + timeout
    while (g.metric(name) or 0) < first + polls:
        assert time.monotonic() < deadline, f"the guardian did not complete {polls} polls in {timeout}s"
        time.sleep(0.02)
