"""Ending a CUDA MPS client through its control daemon before the signals (issue 38).

Under MPS every client's work runs in the MPS server's one GPU context. KAI's gpu-fractioning
CHANGELOG reports that killing a client with work in flight made the other clients of that GPU fail
(``cudaErrorIllegalAddress``) and later ones hang in CUDA initialisation (CUDA 13.5 and before), and
it drains a client through the control daemon's ``terminate_client`` before stopping its container.
NVIDIA's documentation gives no reason to think a kill is safe: a fatal exception of one client is
contained only to the clients of the same GPU, which all receive it; and of ``terminate_client``
its troubleshooting guide says the cleanup it starts "does not affect other connected clients"
(docs/policy.md, "CUDA MPS", with the sources).

So, for a process whose environment holds the MPS per-client limit the webhook sets
(``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, policy ``mps-limits``), the terminator first asks the control
daemon to end it, as ``echo terminate_client SERVER CLIENT | nvidia-cuda-mps-control`` does: through
the pipe directory the client itself uses (its ``CUDA_MPS_PIPE_DIRECTORY``, which the device plugin
mounts into the GPU containers, reached through ``/proc/<pid>/root``), the server being the one
whose ``get_client_list`` names the client's PID as NVML reports it. Every exchange is bounded
(``CALL_TIMEOUT_SECONDS``, ``DRAIN_TIMEOUT_SECONDS`` in all); whatever the answer, the SIGTERM and
the SIGKILL after the grace period follow as for any process. Where the control program is missing,
the directory unreachable or no server lists the PID (the daemon counts PIDs in its own namespace),
the signals come at once and the log line says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from gpufence.contract import ENV_MPS_MEMORY_LIMIT
from gpufence.enforcer.observe.procfs import read_environ
from gpufence.enforcer.report.decision_log import DecisionLog

MPS_CONTROL = "nvidia-cuda-mps-control"
ENV_MPS_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
# MPS's own default when a client's environment names no pipe directory.
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
# One exchange with the control daemon, and the whole drain of one process: the poll loop waits
# for them, so they are short; past them the signals go as if MPS were not there.
CALL_TIMEOUT_SECONDS = 2.0
DRAIN_TIMEOUT_SECONDS = 5.0
_NAMES = frozenset({ENV_MPS_MEMORY_LIMIT, ENV_MPS_PIPE_DIRECTORY})


class DrainOutcome(StrEnum):
    TERMINATED = "terminated"      # the daemon took terminate_client for the client
    NOT_A_CLIENT = "not_a_client"  # no MPS server lists its PID
    UNAVAILABLE = "unavailable"    # no control program, or its pipe directory unreachable
    FAILED = "failed"              # an exchange failed or ran past its time


@dataclass(frozen=True)
class MpsClient:
    """A process the webhook made an MPS client: where its control daemon listens, as the
    enforcer reaches it."""

    pid: int       # in the enforcer's namespace (for /proc)
    nvml_pid: int  # as NVML reports it: the PID the daemon is asked about
    pipe_directory: str  # through /proc/<pid>/root


class MpsDrain:
    def __init__(
        self,
        log: DecisionLog,
        *,
        proc_root: str = "/proc",
        control: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._proc_root = proc_root
        self._control = control
        self._clock = clock

    def client(self, pid: int, nvml_pid: int) -> MpsClient | None:
        """The process as an MPS client, None when the webhook set it no MPS limit."""
        env = read_environ(pid, _NAMES, self._proc_root)
        if not env.get(ENV_MPS_MEMORY_LIMIT, "").strip():
            return None
        directory = env.get(ENV_MPS_PIPE_DIRECTORY, "").strip() or DEFAULT_PIPE_DIRECTORY
        return MpsClient(pid, nvml_pid, f"{self._proc_root}/{pid}/root{directory}")

    def drain(self, client: MpsClient, container: str | None) -> DrainOutcome:
        """Ask the control daemon to terminate ``client``'s work (bounded); logged either way."""
        began = self._clock()
        outcome, server, detail = self._drain(client, began + DRAIN_TIMEOUT_SECONDS)
        level = "info" if outcome in (DrainOutcome.TERMINATED, DrainOutcome.NOT_A_CLIENT) else "warning"
        self._log.emit(
            "mps_terminate_client", level=level, outcome=outcome, pid=client.pid, nvml_pid=client.nvml_pid,
            server_pid=server, container=container, detail=detail,
            seconds=round(self._clock() - began, 3),
            reason="an MPS client is ended through its control daemon before its signals, so the other "
            "clients of the GPU keep running; the signals follow in any case",
        )
        return outcome

    def _drain(self, client: MpsClient, deadline: float) -> tuple[DrainOutcome, int | None, str | None]:
        control = self._control or shutil.which(MPS_CONTROL)
        if control is None:
            return DrainOutcome.UNAVAILABLE, None, f"{MPS_CONTROL} not found on PATH"
        if not os.path.isdir(client.pipe_directory):
            return DrainOutcome.UNAVAILABLE, None, f"no pipe directory at {client.pipe_directory}"
        servers = self._ask(control, client, "get_server_list", deadline)
        if isinstance(servers, str):
            return DrainOutcome.FAILED, None, servers
        for server in _pids(servers):
            clients = self._ask(control, client, f"get_client_list {server}", deadline)
            if isinstance(clients, str):
                return DrainOutcome.FAILED, server, clients
            if client.nvml_pid not in _pids(clients):
                continue
            answer = self._ask(control, client, f"terminate_client {server} {client.nvml_pid}", deadline)
            if isinstance(answer, str):
                return DrainOutcome.FAILED, server, answer
            return DrainOutcome.TERMINATED, server, " ".join(answer) or None
        return DrainOutcome.NOT_A_CLIENT, None, f"servers {_pids(servers)} do not list pid {client.nvml_pid}"

    def _ask(self, control: str, client: MpsClient, command: str, deadline: float) -> list[str] | str:
        """The daemon's answer's lines, or why there is none."""
        timeout = min(CALL_TIMEOUT_SECONDS, deadline - self._clock())
        if timeout <= 0:
            return f"{command}: no time left of {DRAIN_TIMEOUT_SECONDS:g}s"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), ENV_MPS_PIPE_DIRECTORY: client.pipe_directory}
        try:
            done = subprocess.run([control], input=command + "\n", env=env, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return f"{command}: no answer within {timeout:.1f}s"
        except OSError as exc:
            return f"{command}: {type(exc).__name__}: {exc}"
        if done.returncode != 0:
            return f"{command}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[:200]}"
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def _pids(lines: list[str]) -> list[int]:
    """The PIDs of a get_server_list or get_client_list answer (one a line; anything else skipped)."""
    return [int(word) for line in lines for word in line.split() if word.isdigit()]
