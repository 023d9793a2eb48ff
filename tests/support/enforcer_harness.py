"""The enforcer runtime harness: real child processes (tests/support/workload.py), the real
enforcer as a subprocess, and the simulated NVML loaded by the real pynvml through LD_LIBRARY_PATH.

``GpuSandbox`` (the ``gpu`` fixture of tests/conftest.py) holds a fake device file and the
simulated driver's state and starts workloads and enforcers; ``LineReader`` waits on a pipe's lines
with a deadline, so the tests synchronise on what the processes say instead of on sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKLOAD = pathlib.Path(__file__).resolve().parent / "workload.py"


class LineReader:
    """Collects a pipe's lines on a thread; ``wait_for`` blocks on new lines up to a deadline."""

    def __init__(self, stream: Any, name: str) -> None:
        self.name = name
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        for raw in iter(stream.readline, ""):
            with self._cond:
                self.lines.append(raw.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[str], bool], timeout: float, start: int = 0) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        index = start
        with self._cond:
            while True:
                while index < len(self.lines):
                    if predicate(self.lines[index]):
                        return index, self.lines[index]
                    index += 1
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._eof:
                    tail = "\n".join(self.lines[-40:])
                    why = "EOF" if self._eof else f"{timeout}s"
                    raise AssertionError(f"{self.name}: no matching line after {why}; last lines:\n{tail}")
                self._cond.wait(remaining)

    def snapshot(self) -> list[str]:
        with self._cond:
            return list(self.lines)


class Workload:
    def __init__(self, proc: subprocess.Popen[str], container: str | None) -> None:
        self.proc = proc
        self.container = container
        self.out = LineReader(proc.stdout, f"workload[{container}]")
        _, line = self.out.wait_for(lambda s: s.startswith("ready "), 15)
        self.pid = int(line.split()[1])
        assert self.pid == proc.pid

    def wait_line(self, text: str, timeout: float, start: int = 0) -> tuple[int, str]:
        return self.out.wait_for(lambda s: s.startswith(text), timeout, start)

    def said(self, text: str) -> bool:
        return any(s.startswith(text) for s in self.out.snapshot())

    def state(self) -> str | None:
        return proc_state(self.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, T, Z ...), None if gone."""
    try:
        data = pathlib.Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def wait_state(pid: int, predicate: Callable[[str | None], bool], timeout: float, poll: float = 0.002) -> float:
    """Poll /proc/<pid>/stat until predicate(state) holds; returns the seconds it took."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        state = proc_state(pid)
        if predicate(state):
            return time.monotonic() - start
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid}: state {state!r} after {timeout}s")
        time.sleep(poll)


class Enforcer:
    def __init__(self, proc: subprocess.Popen[str], stderr_path: pathlib.Path, out: LineReader | None = None) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.out = out if out is not None else LineReader(proc.stdout, "enforcer")
        self.started: dict[str, Any] | None = None
        self.port: int | None = None

    def wait_started(self, timeout: float = 20) -> dict[str, Any]:
        try:
            self.started = self.wait_event("started", timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nstderr:\n{self.stderr()}") from None
        self.port = self.started.get("metrics_port")  # absent when the port could not be bound
        return self.started

    def stderr(self) -> str:
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text()[-4000:]
        return ""

    def records(self) -> list[dict[str, Any]]:
        result = []
        for line in self.out.snapshot():
            with contextlib.suppress(ValueError):
                result.append(json.loads(line))
        return result

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.records() if (event is None or r.get("event") == event) and _matches(r, match)]

    def wait_event(self, event: str, timeout: float, start: int = 0, **match: Any) -> dict[str, Any]:
        def pred(line: str) -> bool:
            try:
                record = json.loads(line)
            except ValueError:
                return False
            return record.get("event") == event and _matches(record, match)

        _, line = self.out.wait_for(pred, timeout, start)
        return json.loads(line)

    def mark(self) -> int:
        return len(self.out.snapshot())

    def http(self, path: str) -> tuple[int, str]:
        assert self.port is not None, "wait_started() first"
        return enforcer_http(self.port, path)

    def metric(self, name: str, **labels: str) -> float | None:
        assert self.port is not None, "wait_started() first"
        return enforcer_metric(self.port, name, **labels)

    def wait_polls(self, polls: int, timeout: float = 10) -> None:
        assert self.port is not None, "wait_started() first"
        wait_enforcer_polls(self.port, polls, timeout)

    def wait_ready(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status, body = self.http("/readyz")
            if status == 200:
                return
            assert time.monotonic() < deadline, f"/readyz still {status}: {body}"
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def enforcer_http(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def enforcer_metric(port: int, name: str, **labels: str) -> float | None:
    _, text = enforcer_http(port, "/metrics")
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return None


def wait_enforcer_polls(port: int, polls: int, timeout: float = 10) -> None:
    """Wait until the enforcer on ``port`` completed ``polls`` more polls (its poll-duration count)."""
    name = "gpufence_poll_duration_seconds_count"
    first = enforcer_metric(port, name) or 0
    deadline = time.monotonic() + timeout
    while (enforcer_metric(port, name) or 0) < first + polls:
        assert time.monotonic() < deadline, f"the enforcer did not complete {polls} polls in {timeout}s"
        time.sleep(0.02)


def _matches(record: dict[str, Any], match: dict[str, Any]) -> bool:
    return all(record.get(k) == v for k, v in match.items())


class GpuSandbox:
    """A fake device file, a simulated-NVML state file, and factories for workloads and enforcers."""

    def __init__(self, root: pathlib.Path, lib: pathlib.Path) -> None:
        self.root = root
        self.lib = lib
        (root / "dev").mkdir()
        self.device_prefix = str(root / "dev" / "nvidia")
        self.device = root / "dev" / "nvidia0"
        self.device.write_bytes(b"")
        self.state_path = root / "sim-state"
        self.state_dir = root / "state"
        self.workloads: list[Workload] = []
        self.enforcers: list[Enforcer] = []

    # -- simulated driver --------------------------------------------------------------------

    def write(self, *devices: Any, **state: Any) -> None:
        from gpufence.simnvml import SimState, write_state

        write_state(self.state_path, SimState(devices=tuple(devices), **state))

    def device_with(self, *processes: Any, uuid: str = "GPU-0", total: int = 80 << 30, **kwargs: Any) -> Any:
        from gpufence.simnvml import SimDevice

        return SimDevice(uuid, total, tuple(processes), **kwargs)

    @staticmethod
    def proc(workload: Workload | int, used: int | None, sm: int = 0) -> Any:
        from gpufence.simnvml import SimProcess

        pid = workload.pid if isinstance(workload, Workload) else workload
        return SimProcess.for_pid(pid, used, sm_util=sm)

    # -- processes -----------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFENCE_")}
        lib_dir = str(self.lib.parent)
        env["LD_LIBRARY_PATH"] = lib_dir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env["GPUFENCE_SIM_STATE"] = str(self.state_path)
        env["PYTHONPATH"] = str(REPO_ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("KUBERNETES_SERVICE_HOST", None)
        return env

    def workload(self, container: str | None, *, ignore_term: bool = False, wrap: tuple[str, ...] = ()) -> Workload:
        """``wrap``: a command prefix, e.g. ``setpriv`` options giving it a container's credentials."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFENCE_")}
        if container is not None:
            env["GPUFENCE_CONTAINER"] = container
        argv = [*wrap, sys.executable, str(WORKLOAD), str(self.device)] + (["--ignore-term"] if ignore_term else [])
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        w = Workload(proc, container)
        self.workloads.append(w)
        return w

    def enforcer(
        self,
        config: dict[str, Any] | str | None,
        *args: str,
        wait: bool = True,
        env: dict[str, str] | None = None,
        state_dir: bool = True,
        wrap: tuple[str, ...] = (),
    ) -> Enforcer:
        full_env = self.env()
        if config is not None:
            full_env["GPUFENCE_CONFIG"] = config if isinstance(config, str) else json.dumps(config)
        full_env.update(env or {})
        argv = [
            *wrap, sys.executable, "-m", "gpufence.enforcer", "--metrics-port", "0", "--bind-address", "127.0.0.1",
            "--nvidia-device-prefix", self.device_prefix, *args,
        ]
        if state_dir:
            argv += ["--state-dir", str(self.state_dir)]
        stderr_path = self.root / f"enforcer-{len(self.enforcers)}.stderr"
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(argv, env=full_env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        e = Enforcer(proc, stderr_path)
        self.enforcers.append(e)
        if wait:
            e.wait_started()
        return e

    def cleanup(self) -> None:
        for e in self.enforcers:
            if e.proc.poll() is None:
                e.proc.kill()
            with contextlib.suppress(Exception):
                e.proc.wait(5)
        for w in self.workloads:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGCONT)
                    w.proc.kill()
            with contextlib.suppress(Exception):
                w.proc.wait(5)


def enforcer_config(
    containers: dict[str, dict[str, Any]],
    *,
    mode: str = "enforce",
    grace: float = 0.5,
    interval: float = 0.1,
) -> dict[str, Any]:
    return {
        "version": 1, "mode": mode, "gracePeriodSeconds": grace, "pollIntervalSeconds": interval,
        "containers": containers,
    }
