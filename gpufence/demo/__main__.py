"""The local demo: the whole of gpufence on one machine, with no cluster and no GPU.

    make demo            (or: .venv/bin/python -m gpufence.demo)

1. Generates a throwaway CA and serving certificate.
2. Starts the real webhook (``python -m gpufence.webhook``) on localhost over TLS.
3. Sends it a GPU pod as the API server would (AdmissionReview over HTTPS, chain verified against
   the demo CA), prints what it injected, shows that a repeat review gives no patch and that a bad
   share is denied with a clear message.
4. Runs the real enforcer (``python -m gpufence.enforcer --simulate``) against the simulated NVIDIA driver
   (a fake libnvidia-ml.so.1 loaded by the real pynvml) with three real workload processes that
   carry the environment the webhook injected: ``steady`` stays inside its memory share, ``greedy``
   grows beyond it and is terminated, ``hog`` uses more SM than its compute share and is throttled
   on a SIGSTOP/SIGCONT duty cycle. Decisions are shown as they happen, then a summary.

It ends by itself in well under a minute and leaves nothing running (every child is stopped in a
``finally``; the enforcer continues every process it stopped when it exits).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import jsonpatch  # a runtime dependency: the patch applied by an implementation other than the webhook's

from gpufence.certs.pki import make_ca, make_serving_cert
from gpufence.contract import ENV_CONFIG, ENV_CONTAINER, ENV_POD_NAME, ENV_POD_NAMESPACE, ENV_POD_UID
from gpufence.simnvml import SimDevice, SimProcess, SimState, build_library, write_state
from gpufence.webhook.client import decode_patch, pod_admission_review

GIB = 1024**3
DEVICE_UUID = "GPU-6a1f0c2e-5d3b-4b1d-9d7c-0000000000aa"
DEVICE_TOTAL = 141 * GIB
RUN_SECONDS = 14.0
STARTUP_TIMEOUT = 20.0

SAMPLE_POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "generateName": "trainer-",
        "namespace": "ml-team",
        "annotations": {
            "gpufence.io/memory": "4Gi",
            "gpufence.io/compute.hog": "30",
            "gpufence.io/grace-period": "2",
        },
    },
    "spec": {
        "containers": [
            {"name": name, "image": "nvcr.io/nvidia/pytorch:24.08-py3",
             "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            for name in ("steady", "greedy", "hog")
        ],
    },
}


# -- output ---------------------------------------------------------------------------------

def say(text: str = "") -> None:
    print(text, flush=True)


def heading(text: str) -> None:
    say()
    say(f"== {text} " + "=" * max(0, 74 - len(text)))


def gib(n: int | float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f} GiB"


# -- 1 + 2: certificates and the webhook ----------------------------------------------------

def make_certs(tmp: Path) -> tuple[Path, Path, Path]:
    ca = make_ca("gpufence-demo-ca", days=1)
    serving = make_serving_cert(ca, ["localhost", "127.0.0.1"], days=1)
    paths = tmp / "ca.crt", tmp / "tls.crt", tmp / "tls.key"
    paths[0].write_bytes(ca.cert_pem)
    paths[1].write_bytes(serving.cert_pem)
    fd = os.open(paths[2], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(serving.key_pem)
    return paths


def start_webhook(cert: Path, key: Path, procs: list[subprocess.Popen[str]]) -> int:
    """Starts ``python -m gpufence.webhook`` on a free port and returns the port it logged."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufence.webhook", "--port", "0", "--bind-address", "127.0.0.1",
         "--shutdown-delay", "0",
         "--tls-cert-file", str(cert), "--tls-private-key-file", str(key), "--sidecar-poll-interval", "0.2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    procs.append(proc)
    for record in JsonLines(proc.stderr).until(time.monotonic() + STARTUP_TIMEOUT):
        if record.get("message") == "serving" or record.get("event") == "serving":
            return int(record["port"])
    raise RuntimeError("the webhook did not start; run `python -m gpufence.webhook --help` to check the environment")


class JsonLines:
    """The JSON objects a child writes, one per line, read by a thread so a quiet child never
    blocks the demo past a deadline (and a chatty one never blocks on a full pipe)."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._ended = False

        def read() -> None:
            for line in stream:
                self._lines.put(line)
            self._lines.put(None)

        threading.Thread(target=read, daemon=True).start()

    def until(self, deadline: float) -> Iterator[dict[str, Any]]:
        while not self._ended and (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                return
            if line is None:
                self._ended = True
                return
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if isinstance(record, dict):
                    yield record


def post_review(port: int, ca_file: Path, pod: dict[str, Any], uid: str) -> dict[str, Any]:
    review = pod_admission_review(pod, uid=uid, namespace=pod["metadata"]["namespace"])
    context = ssl.create_default_context(cafile=str(ca_file))  # verifies the chain and the host name
    request = urllib.request.Request(
        f"https://localhost:{port}/mutate", data=json.dumps(review).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        return json.loads(response.read())["response"]


def apply_response(pod: dict[str, Any], response: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    ops = decode_patch(response) or []
    return jsonpatch.apply_patch(pod, ops), ops


def show_injection(mutated: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    say(f"patch: {len(ops)} JSON Patch operations")
    for op in ops:
        say(f"  {op['op']:<8}{op['path']}")
    spec = mutated["spec"]
    sidecar = next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "gpufence-enforcer")
    env = {e["name"]: e.get("value", "(from " + next(iter(e.get("valueFrom", {"?": 0}))) + ")") for e in sidecar["env"]}
    config = json.loads(env["GPUFENCE_CONFIG"])
    say(f"shareProcessNamespace: {spec.get('shareProcessNamespace')}")
    say(f"sidecar: {sidecar['name']} image={sidecar['image']} restartPolicy={sidecar.get('restartPolicy', '-')}")
    say(f"  capabilities: {sidecar['securityContext']['capabilities']}")
    say("  GPUFENCE_CONFIG = " + json.dumps(config, indent=2).replace("\n", "\n  "))
    for container in spec["containers"]:
        injected = [e for e in container.get("env", []) if e["name"].startswith(("GPUFENCE_", "TF_", "XLA_"))]
        say(f"container {container['name']}: " + ", ".join(f"{e['name']}={e.get('value')}" for e in injected))
    say(f"annotation gpufence.io/status: {mutated['metadata']['annotations'].get('gpufence.io/status')}")
    return config


# -- 4: the enforcer on the simulated driver -------------------------------------------------

@dataclass
class Workload:
    name: str
    proc: subprocess.Popen[str]
    memory: int
    sm_demand: int = 5
    heartbeats: int = 0
    got_sigterm: bool = False
    states: deque[str] = field(default_factory=lambda: deque(maxlen=10))
    stopped_samples: int = 0
    peak_memory: int = 0

    def watch_output(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("step"):
                    self.heartbeats += 1
                elif line.startswith("got SIGTERM"):
                    self.got_sigterm = True
        threading.Thread(target=read, daemon=True).start()

    def proc_state(self) -> str:
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return "gone"
        return stat.rsplit(")", 1)[1].split()[0]

    def running_fraction(self) -> float:
        """Share of recent samples in which the process was not stopped (what the GPU would see)."""
        if not self.states:
            return 1.0
        return sum(s not in ("T", "t") for s in self.states) / len(self.states)


def start_workload(name: str, memory: int, container_env: dict[str, str], device: Path,
                   procs: list[subprocess.Popen[str]]) -> Workload:
    env = {**os.environ, **container_env}
    proc = subprocess.Popen([sys.executable, "-m", "gpufence.demo.workload", str(device)],
                            stdout=subprocess.PIPE, text=True, env=env)
    procs.append(proc)
    assert proc.stdout is not None
    if not proc.stdout.readline().startswith("ready"):
        raise RuntimeError(f"workload {name} did not start")
    workload = Workload(name=name, proc=proc, memory=memory)
    workload.watch_output()
    return workload


def describe(record: dict[str, Any], t0: float) -> str | None:
    event = record.get("event", "?")
    if event in {"log", "throttle_update", "memory_under_share"}:
        return None
    parts = [f"+{time.monotonic() - t0:5.2f}s", f"{event:<20}"]
    for key in ("container", "pid", "action", "mode", "pid_mode", "driver_version"):
        if key in record and record[key] is not None:
            parts.append(f"{key}={record[key]}")
    if "used_bytes" in record:
        parts.append(f"used={gib(record['used_bytes'])} limit={gib(record.get('limit_bytes'))}")
    if "sm_utilization" in record:
        parts.append(f"sm={record['sm_utilization']} share={record.get('compute_share')}")
    if "run_fraction" in record:
        parts.append(f"run_fraction={record['run_fraction']}")
    return "  " + " ".join(str(p) for p in parts)


class _SimulatedGpu:
    """The simulated driver's view of the demo's workloads, rewritten as they change."""

    def __init__(self, workloads: dict[str, Workload], state_file: Path) -> None:
        self.workloads = workloads
        self.state_file = state_file
        self._lock = threading.Lock()

    def publish(self) -> None:
        with self._lock:
            processes = []
            for w in self.workloads.values():
                w.states.append(w.proc_state())
                w.stopped_samples += w.states[-1] in ("T", "t")
                if w.proc.poll() is None:
                    w.peak_memory = max(w.peak_memory, w.memory)
                    sm = round(w.sm_demand * w.running_fraction())
                    processes.append(SimProcess(pid=w.proc.pid, used_memory_bytes=w.memory, sm_util=sm))
            write_state(self.state_file, SimState(devices=(SimDevice(
                uuid=DEVICE_UUID, total_memory_bytes=DEVICE_TOTAL, processes=tuple(processes)),)))

    def drive(self, stop: threading.Event) -> None:
        """Until ``stop``: greedy allocates 0.25 GiB every 0.5 s; SM use follows the duty cycle."""
        last_growth = time.monotonic()
        while not stop.wait(0.05):
            if time.monotonic() - last_growth >= 0.5:
                last_growth = time.monotonic()
                self.workloads["greedy"].memory += GIB // 4
            self.publish()


def _start_enforcer(config: dict[str, Any], state_file: Path, device: Path, tmp: Path) -> subprocess.Popen[str]:
    """The real enforcer on the simulated driver, as the demo pod's sidecar."""
    env = {**os.environ, ENV_CONFIG: json.dumps(config), ENV_POD_NAME: "trainer-x7k2p",
           ENV_POD_NAMESPACE: "ml-team", ENV_POD_UID: "5f8e1c1a-0000-4000-8000-000000000001"}
    return subprocess.Popen(
        [sys.executable, "-m", "gpufence.enforcer", "--simulate", str(state_file), "--metrics-port", "0",
         "--bind-address", "127.0.0.1", "--nvidia-device-prefix", str(device.parent / "nvidia"),
         "--state-dir", str(tmp / "state"), "--compute-window", "2", "--compute-period", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )


def _narrate(records: Iterable[dict[str, Any]], t0: float) -> None:
    for record in records:
        if line := describe(record, t0):
            say(line)


def run_enforcer(config: dict[str, Any], injected_env: dict[str, dict[str, str]], tmp: Path,
                 procs: list[subprocess.Popen[str]]) -> dict[str, Workload]:
    state_file = tmp / "nvml-state.txt"
    device = tmp / "dev" / "nvidia0"
    device.parent.mkdir()
    device.write_bytes(b"")
    build_library()  # compile the simulated driver once, before the clock starts

    plan = {"steady": 3 * GIB, "greedy": 1 * GIB, "hog": 2 * GIB}
    workloads = {name: start_workload(name, memory, injected_env[name], device, procs) for name, memory in plan.items()}
    workloads["hog"].sm_demand = 90
    gpu = _SimulatedGpu(workloads, state_file)
    gpu.publish()
    enforcer = _start_enforcer(config, state_file, device, tmp)
    procs.append(enforcer)

    stop = threading.Event()
    t0 = time.monotonic()
    driver = threading.Thread(target=gpu.drive, args=(stop,), daemon=True)
    driver.start()
    records = JsonLines(enforcer.stdout)
    try:
        _narrate(records.until(t0 + RUN_SECONDS), t0)
    finally:
        stop.set()
        driver.join()
        enforcer.send_signal(signal.SIGTERM)
        _narrate(records.until(time.monotonic() + 10), t0)
        try:
            enforcer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            enforcer.kill()
            enforcer.wait()
    return workloads


def summarize(workloads: dict[str, Workload], config: dict[str, Any]) -> bool:
    heading("summary")
    say(f"{'container':<10}{'memory share':>14}{'peak used':>12}{'compute share':>15}  outcome")
    ok = True
    for name, w in workloads.items():
        share = config["containers"].get(name, {})
        mem_share = gib(share["memoryBytes"]) if "memoryBytes" in share else "-"
        compute = f"{share['computePercent']}%" if "computePercent" in share else "-"
        state = w.proc_state()
        if w.proc.poll() is not None:
            outcome = f"terminated (SIGTERM received: {w.got_sigterm}, exit code {w.proc.returncode})"
        else:
            outcome = f"running, {w.heartbeats} heartbeats"
            if w.stopped_samples:
                outcome += f", throttled ({w.stopped_samples} samples stopped), now state {state}"
        say(f"{name:<10}{mem_share:>14}{gib(w.peak_memory):>12}{compute:>15}  {outcome}")
    expectations = {
        "greedy went over its share and was terminated": workloads["greedy"].proc.poll() is not None,
        "steady stayed in its share and kept running": workloads["steady"].proc.poll() is None,
        "hog was throttled while over its compute share": workloads["hog"].stopped_samples > 0,
        "nothing was left stopped after the enforcer exited": workloads["hog"].proc_state() not in ("T", "t"),
    }
    say()
    for text, passed in expectations.items():
        say(f"  [{'ok' if passed else 'FAILED'}] {text}")
        ok &= passed
    return ok


def stop_all(procs: list[subprocess.Popen[str]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    procs: list[subprocess.Popen[str]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpufence-demo-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            heading("1/4 certificates")
            ca_file, cert_file, key_file = make_certs(tmp)
            say(f"CA and serving certificate (ECDSA P-256, SANs localhost, 127.0.0.1) in {tmp}")

            heading("2/4 webhook")
            port = start_webhook(cert_file, key_file, procs)
            say(f"python -m gpufence.webhook is serving https://localhost:{port}/mutate (TLS >= 1.2)")

            heading("3/4 admission review of a GPU pod")
            say("pod trainer-* in namespace ml-team: containers steady, greedy, hog (1 GPU each);")
            say("annotations: " + json.dumps(SAMPLE_POD["metadata"]["annotations"]))
            response = post_review(port, ca_file, SAMPLE_POD, "demo-1")
            say(f"allowed={response['allowed']} warnings={response.get('warnings', [])}")
            mutated, ops = apply_response(SAMPLE_POD, response)
            config = show_injection(mutated, ops)
            again = post_review(port, ca_file, mutated, "demo-2")
            say(f"re-review of the mutated pod (reinvocation): patch={'patch' in again} -> idempotent")
            bad = json.loads(json.dumps(SAMPLE_POD))
            bad["metadata"]["annotations"]["gpufence.io/memory"] = "lots"
            denied = post_review(port, ca_file, bad, "demo-3")
            say(f"a pod with gpufence.io/memory=lots: allowed={denied['allowed']}")
            say(f"  message: {denied.get('status', {}).get('message')}")

            heading("4/4 enforcer on the simulated NVIDIA driver")
            injected_env = {
                c["name"]: {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
                for c in mutated["spec"]["containers"]
            }
            assert all(env.get(ENV_CONTAINER) == name for name, env in injected_env.items())
            say("steady holds 3 GiB (share 4 GiB); greedy grows by 0.25 GiB every 0.5 s; "
                "hog wants 90% SM (share 30%)")
            workloads = run_enforcer(config, injected_env, tmp, procs)
            ok = summarize(workloads, config)
        finally:
            stop_all(procs)
    say(f"\ndemo finished in {time.monotonic() - started:.1f} s; no process left running")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
