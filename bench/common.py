"""Shared helpers of the benchmarks: environment facts, docs/PERFORMANCE.md sections, the floor
server and the load generator's runs. The sample pods, the test PKI, the server launcher and the
statistics they share with the tests are in tests/support.

Nothing here is imported by the product or by the tests; the benchmarks only.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import re
import shlex
import ssl
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.server_process import child_env, free_port, pin, serve

if TYPE_CHECKING:
    from tests.support.tlsutil import LocalPKI

REPO_ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE_MD = REPO_ROOT / "docs" / "PERFORMANCE.md"
SANS = ["localhost", "127.0.0.1"]


# --- environment and reports -----------------------------------------------------------------------
def environment() -> dict[str, str]:
    import aiohttp

    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()),
        "affinity": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "openssl": ssl.OPENSSL_VERSION,
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def command_line() -> str:
    """The command that reproduces this run (as typed from the repository root)."""
    module = sys.modules["__main__"].__spec__
    prog = f"python -m {module.name}" if module is not None else f"python {sys.argv[0]}"
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    out = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(out)


def write_section(name: str, title: str, body: str, *, command: str | None = None,
                  path: Path = PERFORMANCE_MD) -> None:
    """Replace (or append) the section ``name`` of docs/PERFORMANCE.md, between marker comments."""
    env = environment()
    header = (
        f"## {title}\n\n"
        f"Reproduce: `{command or command_line()}`  \n"
        f"Measured {env['date']}; nproc {env['nproc']}, load average {env['load']}; Python {env['python']}, "
        f"aiohttp {env['aiohttp']}, {env['openssl']}.\n\n"
    )
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{header}{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# gpufence performance\n\n"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    found = pattern.search(text)
    text = pattern.sub(lambda _: block, text) if found else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


# --- servers --------------------------------------------------------------------------------------
@contextlib.contextmanager
def floor_server(pki: LocalPKI, response_file: Path, *, cpus: set[int] | None = None,
                 log_path: Path | None = None,
                 validate_response_file: Path | None = None,
                 event_loop: str = "auto") -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.floor_server", "--port", str(port), "--tls-cert-file",
            str(pki.volume.cert_file), "--tls-private-key-file", str(pki.volume.key_file),
            "--response-file", str(response_file), "--event-loop", event_loop]
    if validate_response_file is not None:
        argv += ["--validate-response-file", str(validate_response_file)]
    with serve(argv, port, cpus, log_path) as proc:
        yield proc, port


def run_loadgen(args: list[str], *, cpus: set[int] | None = None, timeout: float = 600) -> dict[str, Any]:
    """Run ``python -m tests.support.loadgen ARGS`` in its own process (pinned to ``cpus``); its JSON result."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.loadgen", *args], cwd=REPO_ROOT, env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pin(proc.pid, cpus)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise RuntimeError(f"load generator timed out: {err.decode()[-2000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode}): {err.decode()[-2000:]}")
    return json.loads(out.decode().strip().splitlines()[-1])
