"""An MPS client over its share is ended through its control daemon before its signals (issue 38):
killing a client with work in flight can fail the other clients of its GPU (docs/policy.md, "CUDA
MPS").

The control daemon is the boundary here, like the simulated driver: ``nvidia-cuda-mps-control`` on
the enforcer's PATH is a small script that answers ``get_server_list`` and ``get_client_list`` as the
real one does (one PID a line) and records every command it is given in the pipe directory it was
pointed at, which is the client's own ``CUDA_MPS_PIPE_DIRECTORY`` reached through the client's root.
The real enforcer, the real workload process and its signals are as everywhere else."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpufence.simnvml import SimProcess

GIB = 1 << 30
SERVER = 4242

FAKE_CONTROL = f"""#!/bin/sh
# Stands in for NVIDIA's nvidia-cuda-mps-control: one command on stdin, the answer on stdout.
read -r command
echo "$command" >> "$CUDA_MPS_PIPE_DIRECTORY/requests"
case "$command" in
  get_server_list) echo {SERVER} ;;
  "get_client_list {SERVER}") cat "$CUDA_MPS_PIPE_DIRECTORY/clients" ;;
  terminate_client*) ;;
  *) echo "unknown command" >&2; exit 1 ;;
esac
"""


def _requests(pipe: Path) -> list[str]:
    path = pipe / "requests"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("daemon", ["lists the client", "lists other clients", "no control program"])
def test_an_mps_client_is_ended_through_its_control_daemon_before_its_sigterm(gpu, make_config, tmp_path: Path,
                                                                               monkeypatch, daemon: str):
    pipe = tmp_path / "mps-pipe"
    pipe.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if daemon != "no control program":
        control = bin_dir / "nvidia-cuda-mps-control"
        control.write_text(FAKE_CONTROL)
        control.chmod(control.stat().st_mode | stat.S_IXUSR)
    # As the webhook (mps-limits) and the device plugin set them in an MPS client's container.
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=2048M")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    client = gpu.workload("mps")
    monkeypatch.delenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    plain = gpu.workload("plain")  # no MPS limit: never asked about
    (pipe / "clients").write_text(f"{client.pid}\n" if daemon == "lists the client" else "7\n8\n")
    gpu.write(gpu.device_with(SimProcess.for_pid(client.pid, 3 * GIB, kind="mps"),
                              SimProcess.for_pid(plain.pid, 3 * GIB)))
    config = make_config({"mps": {"memoryBytes": 2 * GIB}, "plain": {"memoryBytes": 2 * GIB}}, grace=30)
    enforcer = gpu.enforcer(config, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})

    drained = enforcer.wait_event("mps_terminate_client", 10, pid=client.pid)
    client.wait_line("got SIGTERM", 10)
    assert client.proc.wait(10) == 0
    plain.wait_line("got SIGTERM", 10)
    assert plain.proc.wait(10) == 0
    records = enforcer.records()
    asked = records.index(drained)
    term = next(i for i, r in enumerate(records) if r.get("event") == "sigterm" and r.get("pid") == client.pid)
    assert asked < term, "the daemon is asked before the SIGTERM"
    assert records[term]["outcome"] == "sent" and records[term]["reason"] == "memory_over_share"
    assert enforcer.events("mps_terminate_client", pid=plain.pid) == []
    if daemon == "lists the client":
        assert drained["outcome"] == "terminated" and drained["server_pid"] == SERVER, drained
        assert _requests(pipe) == ["get_server_list", f"get_client_list {SERVER}",
                                   f"terminate_client {SERVER} {client.pid}"]
    elif daemon == "lists other clients":
        assert drained["outcome"] == "not_a_client", drained
        assert _requests(pipe) == ["get_server_list", f"get_client_list {SERVER}"]
    else:
        assert drained["outcome"] == "unavailable" and "not found" in drained["detail"], drained
        assert _requests(pipe) == []
    assert enforcer.events("sigkill") == []
    assert enforcer.stop() == 0
