"""End to end in real PID namespaces (root only).

The enforcer and the pod's workloads run inside ``unshare --pid --fork --mount-proc`` (a stand-in
for the pod's shared PID namespace), started by a small launcher that is the namespace's PID 1.
The test, outside, writes the simulated driver's state with the workloads' *outer* PIDs
(``SimProcess.for_pid``) plus an OUTSIDE process (another pod, in the host namespace) that holds
the same device file, claims the same container name and uses far more memory than any share.
In every mode the outside process is never signalled and the inner over-share one is SIGTERMed
under its inner PID:

* ``namespace_aware`` driver — NVML shows the enforcer only its namespace's processes, inner PIDs;
* ``legacy`` driver (host PIDs) in the local PID mode — host PIDs mean nothing inside; the outside
  process's host PID is made to collide with a local process (``ns_last_pid``) that does not hold
  the device: it is ignored;
* ``legacy`` driver with the outer /proc bind-mounted where the enforcer expects the host's
  (``--host-proc``) — attribution maps host PIDs through NSpid and checks the namespace, so even a
  colliding local process that *does* hold the device is left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gpufence.simnvml import SimProcess
from tests.support.enforcer_harness import REPO_ROOT, WORKLOAD, Enforcer, LineReader
from tests.support.prerequisites import needs

GIB = 1 << 30


def _pidns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for unshare --pid --mount-proc"
    if shutil.which("unshare") is None:
        return "unshare(1) not installed"
    try:
        probe = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --pid --fork --mount-proc failed: {exc}"
    if probe.returncode != 0:
        return f"unshare --pid --fork --mount-proc failed: {probe.stderr.strip()}"
    return None


_REASON = _pidns_unavailable()
pytestmark = [pytest.mark.root, needs(_REASON is None, reason=_REASON or "")]

# Runs as PID 1 of the new namespace. Protocol on stdout (one JSON object a line, interleaved with
# the enforcer's own JSON log, which inherits this stdout): {"launcher": "ready", ...} once the
# workloads run, {"workload": name, "line": ...} for each line a workload prints. On stdin:
# "start" launches the enforcer, "quit" (or EOF) ends everything.
LAUNCHER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, threading

    spec = json.loads(sys.argv[1])
    out_lock = threading.Lock()

    def say(**obj):
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\\n")
            sys.stdout.flush()

    def pump(name, stream):
        for line in stream:
            say(workload=name, line=line.rstrip("\\n"))

    procs = {}
    pids = {}
    for w in spec["workloads"]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFENCE_")}
        if w.get("container"):
            env["GPUFENCE_CONTAINER"] = w["container"]
        if w.get("pid"):
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(w["pid"] - 1))
        p = subprocess.Popen([sys.executable, spec["workload"], w["device"]], env=env,
                             stdout=subprocess.PIPE, text=True)
        first = p.stdout.readline()
        assert first.startswith("ready "), first
        procs[w["name"]] = p
        pids[w["name"]] = p.pid
        threading.Thread(target=pump, args=(w["name"], p.stdout), daemon=True).start()
    say(launcher="ready", pids=pids, pidns=os.stat("/proc/self/ns/pid").st_ino, self_pid=os.getpid())

    enforcer = None
    for line in sys.stdin:
        if line.strip() == "start":
            enforcer = subprocess.Popen(spec["enforcer"], env={**os.environ, **spec["enforcer_env"]},
                                        cwd=spec["cwd"])
            say(launcher="enforcer", pid=enforcer.pid)
        elif line.strip() == "quit":
            break
    if enforcer is not None and enforcer.poll() is None:
        enforcer.send_signal(signal.SIGTERM)
        say(launcher="enforcer_exit", rc=enforcer.wait(10))
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait()
    """
)


class Namespace:
    """One launched PID namespace: its launcher, the inner PIDs, and their outer PIDs."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.out = LineReader(proc.stdout, "pidns")
        _, line = self.out.wait_for(lambda s: '"launcher": "ready"' in s, 20)
        ready = json.loads(line)
        self.inner: dict[str, int] = ready["pids"]
        self.pidns: int = ready["pidns"]
        self.outer = {name: _outer_pid(self.pidns, pid) for name, pid in self.inner.items()}
        # The enforcer's JSON log shares the launcher's stdout: the usual helper on the same reader.
        self.enforcer = Enforcer(proc, Path(os.devnull), out=self.out)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def workload_said(self, name: str, text: str) -> bool:
        for line in self.out.snapshot():
            if line.startswith('{"workload"'):
                record = json.loads(line)
                if record["workload"] == name and record["line"].startswith(text):
                    return True
        return False

    def wait_workload(self, name: str, text: str, timeout: float) -> None:
        def pred(line: str) -> bool:
            if not line.startswith('{"workload"'):
                return False
            record = json.loads(line)
            return record["workload"] == name and record["line"].startswith(text)

        self.out.wait_for(pred, timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(15)
                if self.enforcer.started is not None:
                    _, line = self.out.wait_for(lambda s: '"launcher": "enforcer_exit"' in s, 1)
                    assert json.loads(line)["rc"] == 0, "the enforcer did not exit cleanly"
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()  # --kill-child: the namespace's init (and so everything in it) dies too
                self.proc.wait(5)


def _outer_pid(pidns: int, inner_pid: int) -> int:
    """Find, from outside, the PID of the process that is ``inner_pid`` in namespace ``pidns``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/pid").st_ino != pidns:
                continue
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:") and int(line.split()[-1]) == inner_pid:
                return int(entry)
    raise AssertionError(f"no process with inner pid {inner_pid} in pid namespace {pidns}")


def _launch(gpu, workloads: list[dict[str, Any]], config: dict[str, Any], *, host_proc: bool) -> Namespace:
    spec_env = gpu.env()
    host_proc_dir = gpu.root / "hostproc"
    enforcer_argv = [
        sys.executable, "-m", "gpufence.enforcer", "--metrics-port", "0", "--bind-address", "127.0.0.1",
        "--nvidia-device-prefix", gpu.device_prefix, "--state-dir", str(gpu.state_dir),
    ]
    if host_proc:
        enforcer_argv += ["--host-proc", str(host_proc_dir)]
    spec = {
        "workload": str(WORKLOAD),
        "workloads": workloads,
        "enforcer": enforcer_argv,
        "enforcer_env": {"GPUFENCE_CONFIG": json.dumps(config)},
        "cwd": str(REPO_ROOT),
    }
    launcher = gpu.root / "launcher.py"
    launcher.write_text(LAUNCHER)
    inner = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    inner += [sys.executable, str(launcher), json.dumps(spec)]
    if host_proc:
        # A private mount namespace first, where the outer /proc is bind-mounted at hostproc; the
        # PID namespace's own mount namespace inherits that mount and gets a fresh /proc.
        host_proc_dir.mkdir()
        argv = [
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", 'mount --bind /proc "$0" && exec "$@"', str(host_proc_dir), *inner,
        ]
    else:
        argv = inner
    proc = subprocess.Popen(argv, env=spec_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        return Namespace(proc)
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise


@pytest.fixture
def namespaces():
    launched: list[Namespace] = []
    yield launched
    for ns in launched:
        ns.close()


def _check_isolation(gpu, ns: Namespace, outside, driver: str) -> Enforcer:
    """Shared scenario: under share first (the outside's usage must not count), then hog over."""
    hog, calm = ns.outer["hog"], ns.outer["calm"]

    def state(hog_used: int) -> None:
        procs = (
            SimProcess.for_pid(hog, hog_used),
            SimProcess.for_pid(calm, GIB),
            SimProcess(outside.pid, 60 * GIB),  # a plain host-namespace entry: another pod
        )
        gpu.write(gpu.device_with(*procs), driver=driver)

    state(GIB)
    ns.send("start")
    enforcer = ns.enforcer
    enforcer.wait_started()
    enforcer.wait_polls(4)
    # The outside process claims container "hog" with 60 GiB: were it counted, hog would be over.
    assert enforcer.events("sigterm") == [] and enforcer.events("memory_over_share") == []

    state(3 * GIB)
    term = enforcer.wait_event("sigterm", 5, outcome="sent")
    assert term["pid"] == ns.inner["hog"] and term["container"] == "hog"
    assert term["used_bytes"] == 3 * GIB
    ns.wait_workload("hog", "got SIGTERM", 5)
    enforcer.wait_polls(3)
    # Only hog was ever signalled; the outside process and calm never.
    assert [r["pid"] for r in enforcer.events("sigterm")] == [ns.inner["hog"]]
    assert enforcer.events("sigkill") == []
    assert outside.alive() and not outside.said("got SIGTERM")
    assert not ns.workload_said("calm", "got SIGTERM")
    return enforcer


CONFIG = {
    "version": 1, "mode": "enforce", "gracePeriodSeconds": 5, "pollIntervalSeconds": 0.1,
    "containers": {"hog": {"memoryBytes": 2 * GIB}, "calm": {"memoryBytes": 2 * GIB}},
}


def test_namespace_aware_driver_inner_pids_only(gpu, namespaces):
    outside = gpu.workload("hog")
    device = str(gpu.device)
    ns = _launch(
        gpu,
        [
            {"name": "hog", "container": "hog", "device": device},
            {"name": "calm", "container": "calm", "device": device},
        ],
        CONFIG,
        host_proc=False,
    )
    namespaces.append(ns)
    assert ns.inner["hog"] != ns.outer["hog"]
    enforcer = _check_isolation(gpu, ns, outside, "namespace_aware")
    assert enforcer.started["pid_mode"] == "local"
    # The namespace_aware driver never showed the enforcer the outside PID at all.
    assert enforcer.events("unattributed_process") == []


def test_legacy_driver_local_mode_ignores_host_pids_even_colliding(gpu, namespaces):
    outside = gpu.workload("hog")
    device = str(gpu.device)
    ns = _launch(
        gpu,
        [
            {"name": "hog", "container": "hog", "device": device},
            {"name": "calm", "container": "calm", "device": device},
            # A local process whose PID equals the outside process's host PID, claiming container
            # "hog" but not holding the GPU device: NVML's host PID must not be read as this one.
            {"name": "collider", "container": "hog", "device": os.devnull, "pid": outside.pid},
        ],
        CONFIG,
        host_proc=False,
    )
    namespaces.append(ns)
    assert ns.inner["collider"] == outside.pid, "ns_last_pid did not give the colliding PID"
    # With a legacy driver the hog's host PID is reported; inside, that number is nobody holding
    # the device, so hog is not attributed either: the local mode cannot enforce, but it never
    # signals the wrong process. Show that first.
    gpu.write(
        gpu.device_with(SimProcess.for_pid(ns.outer["hog"], 3 * GIB), SimProcess(outside.pid, 60 * GIB)),
        driver="legacy",
    )
    ns.send("start")
    enforcer = ns.enforcer
    started = enforcer.wait_started()
    assert started["pid_mode"] == "local"
    enforcer.wait_polls(5)
    assert enforcer.events("sigterm") == [] and enforcer.events("memory_over_share") == []
    assert not ns.workload_said("collider", "got SIGTERM")
    assert not ns.workload_said("hog", "got SIGTERM")
    assert outside.alive() and not outside.said("got SIGTERM")
    assert enforcer.metric("gpufence_container_gpu_memory_used_bytes", container="hog") is None


def test_legacy_driver_with_host_proc_maps_nspid(gpu, namespaces):
    outside = gpu.workload("hog")
    device = str(gpu.device)
    ns = _launch(
        gpu,
        [
            {"name": "hog", "container": "hog", "device": device},
            {"name": "calm", "container": "calm", "device": device},
            # Even a colliding local process that holds the device and claims "hog" is safe here:
            # host PID -> <host proc>/<pid>/ns/pid is the other namespace -> foreign.
            {"name": "collider", "container": "hog", "device": device, "pid": outside.pid},
        ],
        CONFIG,
        host_proc=True,
    )
    namespaces.append(ns)
    assert ns.inner["collider"] == outside.pid
    enforcer = _check_isolation(gpu, ns, outside, "legacy")
    assert enforcer.started["pid_mode"] == "host_proc"
    assert not ns.workload_said("collider", "got SIGTERM")

