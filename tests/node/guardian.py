"""The node guardian (``gpufence-node``) on the node test bed's host, as its DaemonSet would run it.

The real ``gpufence-node`` process, started on the host: the host's PID namespace and ``/proc``,
the host's cgroupfs (``--cgroup-root /sys/fs/cgroup``), the simulated driver's state file that the
node's pods see (``--simulate``), and its pod watch against the test control plane's kube-apiserver
with a bound token of its own ServiceAccount under the RBAC of ``k8s/components/node-guardian``
(what ``k8s/overlays/node-guardian`` installs). What the DaemonSet adds around it (the container,
its hostPath mounts) is not run here. Its Events stay off: it has no in-cluster credentials on the
host (it logs ``events_disabled``); its decision log is the record the tests read.

Stopping it: SIGTERM (it thaws what it froze), SIGKILL after a deadline; then no cgroup of the
node's pods is left frozen (thawed and reported if one is).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import apply_objects, service_account_kubeconfig
from tests.node.node import Node

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = ROOT / "k8s" / "components" / "node-guardian"
NAMESPACE = "gpufence-node"
ACCOUNT = "gpufence-node"
CGROUP_ROOT = Path("/sys/fs/cgroup")
POLL_INTERVAL = 0.5
UNACCOUNTED_GRACE = 5.0
STOP_TIMEOUT = 15.0


def apply_rbac(cp: ControlPlane) -> None:
    """The component's namespace, ServiceAccount, read-only RBAC and Event policy (not its DaemonSet)."""
    # gpufence's namespace first: the guardian's Role on the policy ConfigMap lives there.
    files = [COMPONENT.parents[1] / "base" / "namespace.yaml", COMPONENT / "namespace.yaml", COMPONENT / "rbac.yaml",
             COMPONENT / "protect-events.yaml"]
    apply_objects(cp, [o for path in files for o in yaml.safe_load_all(path.read_text())])


@dataclass
class GuardianProcess:
    process: subprocess.Popen[bytes]
    log_path: Path
    state_dir: Path

    def records(self) -> list[dict[str, Any]]:
        """Its decision log: one JSON object a line."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"gpufence-node exited {self.process.returncode}:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_record(self, predicate: Callable[[dict[str, Any]], bool], what: str,
                    timeout: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            self.check_alive()
            return next((r for r in self.records() if predicate(r)), None)
        try:
            return kube.wait_for(found, what, timeout, interval=0.2)
        except AssertionError:
            raise AssertionError(f"no guardian record: {what}; its log:\n{self.tail()}") from None


def frozen_pod_cgroups() -> list[Path]:
    """Cgroups of the node's pods that a freezer holds (the guardian must leave none): v1
    ``freezer.state``, and ``cgroup.freeze`` of the v2 tree (where this hybrid host's runc places
    every container too, and which the guardian uses when it has the container there)."""
    found = []
    v1 = CGROUP_ROOT / "freezer" / "kubepods"
    if v1.is_dir():
        found += [p for p in v1.rglob("freezer.state") if p.read_text().strip() != "THAWED"]
    for v2 in (CGROUP_ROOT / "kubepods", CGROUP_ROOT / "unified" / "kubepods"):
        if (v2 / "cgroup.procs").exists():
            found += [p for p in v2.rglob("cgroup.freeze") if p.read_text().strip() != "0"]
    return found


@contextlib.contextmanager
def running_guardian(cp: ControlPlane, node: Node, workdir: Path, *extra: str) -> Iterator[GuardianProcess]:
    apply_rbac(cp)
    kubeconfig = service_account_kubeconfig(cp, NAMESPACE, ACCOUNT, workdir / "gpufence-node.kubeconfig")
    state_dir = workdir / "gpufence-node-state"
    log_path = workdir / "gpufence-node.log"
    command = [sys.executable, "-m", "gpufence.node", "--node-name", node.name, "--kubeconfig", str(kubeconfig),
               "--simulate", str(node.state_file), "--cgroup-root", str(CGROUP_ROOT), "--proc-root", "/proc",
               "--state-dir", str(state_dir), "--metrics-port", "-1", "--poll-interval", str(POLL_INTERVAL),
               "--unaccounted-grace", str(UNACCOUNTED_GRACE), "--log-level", "debug", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                   start_new_session=True)
    guardian = GuardianProcess(process, log_path, state_dir)
    try:
        guardian.wait_record(lambda r: r.get("event") == "started", "gpufence-node started", 60)
        yield guardian
    finally:
        _stop(guardian)


def _stop(guardian: GuardianProcess) -> None:
    process = guardian.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    left = frozen_pod_cgroups()
    for control in left:  # never leave a pod frozen, whatever went wrong
        with contextlib.suppress(OSError):
            control.write_text("THAWED" if control.name == "freezer.state" else "0")
    assert not left, f"gpufence-node left frozen cgroups: {left}\n{guardian.tail()}"
