"""Libraries against the enforcer's own code: psutil for process facts, the standard library's HTTP server.

    python -m bench.dependencies [--counts 1,64,256] [--ticks 30] [--rounds 3] [--only rss|calls|tick|http] [--no-write]

1. **psutil's resident memory**: the enforcer (``python -m gpufence.enforcer --simulate``, 64 GPU
   processes, 0.5 s interval) started through one launcher that first imports the modules named
   on its command line: nothing, or ``psutil``. VmRSS and RssAnon of /proc/<pid>/status, the
   largest of 6 samples over 3 s once it logged ``started``; ``--rounds`` alternating starts each.
2. **Per-call cost** of the facts a tick reads, for 1, 64 and 256 live processes: ``procfs.read_stat``
   (state, parent, start time) against ``psutil.Process(pid)`` under ``oneshot()`` (status, ppid,
   create_time), fresh objects and cached ones; the container claim from /proc/<pid>/environ against
   ``psutil.Process(pid).environ()``. psutil has no call for the rest (cgroup, descriptors as
   (device, inode), NSpid and namespace inodes, capabilities).
3. **The tick with psutil swapped in** for the one fact it covers (``read_stat``), 64 processes:
   ``Enforcer.tick()`` median as bench/enforcer_tick.py measures it, alternating with the original.
4. **HTTP servers** in a child interpreter serving the enforcer's routes (``make_app``): ours
   (gpufence/enforcer/report/http_server.py), ``http.server.ThreadingHTTPServer``, and
   prometheus_client's ``start_http_server`` (wsgiref with ThreadingMixIn; /metrics only). Threads
   and VmRSS at rest, with 100 and 500 idle connections; whether a GET still answers with them
   open; how long a client sending its head one byte every 0.5 s is kept (up to 8 s); the answer to
   a 16 KiB head and to a 1 MiB one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, table, write_section
from bench.enforcer_tick import config_doc, gpu_processes, measure_ticks, sim_state
from tests.support.server_process import child_env
from tests.support.stats import median

# Imports the modules named in argv[1] (comma-separated, may be empty), then runs the enforcer.
_LAUNCH = ("import runpy, sys\n"
           "for name in filter(None, sys.argv.pop(1).split(',')): __import__(name)\n"
           "runpy.run_module('gpufence.enforcer', run_name='__main__', alter_sys=True)\n")


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
            out[key] = int(value.split()[0])
    return out


# --- 1. resident memory -----------------------------------------------------------------------------
@contextlib.contextmanager
def enforcer(root: Path, preload: str) -> Iterator[subprocess.Popen[str]]:
    from gpufence import simnvml

    state, cfg = root / "sim-state", root / "config.json"
    cfg.write_text(json.dumps(config_doc()))
    (root / "state-dir").mkdir(exist_ok=True)
    env = child_env()
    env.update(simnvml.simulated_env(simnvml.build_library(), state))
    argv = [sys.executable, "-c", _LAUNCH, preload, "--simulate", str(state), "--config", str(cfg),
            "--nvidia-device-prefix", str(root / "dev" / "nvidia"), "--metrics-port", "0",
            "--bind-address", "127.0.0.1", "--state-dir", str(root / "state-dir")]
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    started = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if '"started"' in line:
                started.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not started.wait(60):
            raise RuntimeError("the enforcer did not start")
        yield proc
    finally:
        proc.terminate()
        proc.wait(15)


def measure_rss(root: Path, rounds: int) -> dict[str, list[dict[str, int]]]:
    from gpufence import simnvml

    out: dict[str, list[dict[str, int]]] = {"": [], "psutil": []}
    with gpu_processes(64, root / "dev" / "nvidia0") as pids:
        simnvml.write_state(root / "sim-state", sim_state(pids))
        for _ in range(rounds):
            for preload in out:
                with enforcer(root, preload) as proc:
                    samples = []
                    for _ in range(6):
                        time.sleep(0.5)
                        samples.append(_status(proc.pid))
                    out[preload].append({k: max(s[k] for s in samples) for k in ("VmRSS", "RssAnon", "RssFile")})
                    print(f"rss preload={preload or '-'}: {out[preload][-1]}", flush=True)
    return out


# --- 2. per-call cost -------------------------------------------------------------------------------
def _per_process_us(fn: Callable[[int], object], pids: list[int], repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for pid in pids:
            fn(pid)
        times.append((time.perf_counter() - t) / len(pids))
    return median(times) * 1e6


def measure_calls(root: Path, counts: list[int]) -> list[dict[str, Any]]:
    import psutil

    from gpufence.enforcer.observe import procfs

    def ps_stat(pid: int) -> tuple[str, int, float]:
        p = psutil.Process(pid)
        with p.oneshot():
            return p.status(), p.ppid(), p.create_time()

    def ps_claim(pid: int) -> str | None:
        return psutil.Process(pid).environ().get("GPUFENCE_CONTAINER")

    rows = []
    for n in counts:
        with gpu_processes(n, root / "dev" / "nvidia0") as pids:
            cached = {pid: psutil.Process(pid) for pid in pids}

            def ps_stat_cached(pid: int, cached: dict[int, psutil.Process] = cached) -> tuple[str, int, float]:
                p = cached[pid]
                with p.oneshot():
                    return p.status(), p.ppid(), p.create_time()

            rows.append({
                "n": n,
                "procfs_stat_us": _per_process_us(procfs.read_stat, pids),
                "psutil_stat_us": _per_process_us(ps_stat, pids),
                "psutil_stat_cached_us": _per_process_us(ps_stat_cached, pids),
                "procfs_claim_us": _per_process_us(procfs.read_claim, pids),
                "psutil_claim_us": _per_process_us(ps_claim, pids),
            })
            print(f"calls: {rows[-1]}", flush=True)
    return rows


# --- 3. the tick with read_stat from psutil ---------------------------------------------------------
def measure_swapped_tick(root: Path, ticks: int, rounds: int) -> dict[str, list[float]]:
    import psutil

    from gpufence.enforcer.observe import attribution, procfs

    boot, hz = psutil.boot_time(), os.sysconf("SC_CLK_TCK")
    original = procfs.read_stat

    def ps_read_stat(pid: int | str, proc_root: str = "/proc") -> procfs.ProcStat | None:
        try:
            p = psutil.Process(int(pid))
            with p.oneshot():
                status, ppid, created = p.status(), p.ppid(), p.create_time()
        except (psutil.Error, ValueError):
            return None
        state = {"zombie": "Z", "dead": "X", "stopped": "T"}.get(status, "S")
        return procfs.ProcStat(state=state, ppid=ppid, start_time_ticks=round((created - boot) * hz))

    out: dict[str, list[float]] = {"procfs": [], "psutil": []}
    try:
        for _ in range(rounds):
            for name, fn in (("procfs", original), ("psutil", ps_read_stat)):
                procfs.read_stat = attribution.read_stat = fn  # type: ignore[assignment]
                (row,) = measure_ticks(root, [64], ticks)
                out[name].append(row["tick_ms"])
    finally:
        procfs.read_stat = attribution.read_stat = original  # type: ignore[assignment]
    return out


# --- 4. HTTP servers ---------------------------------------------------------------------------------
_SERVER = r"""
import sys, threading
from gpufence.enforcer.report.health import Health, make_app
from gpufence.enforcer.report.metrics import EnforcerMetrics
health = Health(0.5); health.tick_completed()
metrics = EnforcerMetrics("ns", "pod"); metrics.declare_containers(["trainer"])
routes = make_app(metrics, health)
kind = sys.argv[1]
if kind == "ours":
    from gpufence.enforcer.report.http_server import start_server
    server, port = start_server(routes, "127.0.0.1", 0)
elif kind == "stdlib":
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            route = routes.get(self.path.split("?", 1)[0])
            status, ctype, body = route() if route else (404, "text/plain", b"not found\n")
            self.send_response(status); self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
        def log_message(self, *args): pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port = server.server_port
    threading.Thread(target=server.serve_forever, daemon=True).start()
else:
    import prometheus_client
    server, _ = prometheus_client.start_http_server(0, addr="127.0.0.1")
    port = server.server_port
print(port, flush=True)
threading.Event().wait()
"""


def _get(port: int, path: str = "/metrics") -> tuple[int, float]:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]) if data else 0, (time.perf_counter() - t) * 1e3


def _connect(port: int, n: int) -> list[socket.socket]:
    """Up to ``n`` idle connections; stops at the first that is not accepted within 3 s."""
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=3))
        except OSError:
            break
    return socks


def _send_head(port: int, head: bytes) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(head)
            data = s.recv(256)
        except OSError as exc:
            return type(exc).__name__
    return data.split(b"\r\n", 1)[0].decode() if data else "closed"


def _slow_client(port: int, limit: float = 8.0) -> float:
    """Seconds the server keeps a client that sends its head one byte every 0.5 s (``limit``: not closed)."""
    head = b"GET /healthz HTTP/1.1\r\nX-Slow: " + b"a" * 1000
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        for byte in head:
            if time.monotonic() - t > limit:
                return limit
            try:
                s.sendall(bytes([byte]))
                if s.recv(256) == b"":
                    break
                break  # an answer (408): the server is done with it
            except TimeoutError:
                continue
            except OSError:
                break
    return time.monotonic() - t


def measure_http(kinds: tuple[str, ...] = ("ours", "stdlib", "prometheus_client")) -> dict[str, dict[str, Any]]:
    out = {}
    for kind in kinds:
        proc = subprocess.Popen([sys.executable, "-c", _SERVER, kind], cwd=REPO_ROOT, env=child_env(),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            port = int(proc.stdout.readline())
            path = "/metrics"
            _get(port, path)
            time.sleep(0.5)
            row: dict[str, Any] = {"rest": _status(proc.pid)}
            for idle in (100, 500):
                socks = _connect(port, idle)
                time.sleep(1.0)
                status, ms = _get(port, path)
                print(f"  {kind}: {idle} idle, GET {status}", flush=True)
                row[idle] = {**_status(proc.pid), "get": status, "get_ms": ms, "connected": len(socks)}
                for s in socks:
                    s.close()
                time.sleep(1.0)
            time.sleep(2.0)
            row["after"] = _status(proc.pid)
            row["slow_s"] = _slow_client(port)
            row["head_16k"] = _send_head(port, b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 16384 + b"\r\n\r\n")
            big = b"".join(b"X-Pad-%d: " % i + b"a" * 52000 + b"\r\n" for i in range(20))
            row["head_1m"] = _send_head(port, b"GET /metrics HTTP/1.1\r\n" + big + b"\r\n")
            out[kind] = row
            print(f"http {kind}: {row}", flush=True)
        finally:
            proc.kill()
            proc.wait()
    return out


def render(m: dict[str, Any]) -> str:
    def mib(kib: float) -> str:
        return f"{kib / 1024:.1f}"

    def code(line: str) -> str:
        parts = line.split(" ", 2)
        return parts[1] if len(parts) > 1 and parts[1].isdigit() else line

    rss = m["rss"]
    base, ps = rss[""], rss["psutil"]
    d_rss = median([b["VmRSS"] for b in ps]) - median([b["VmRSS"] for b in base])
    d_anon = median([b["RssAnon"] for b in ps]) - median([b["RssAnon"] for b in base])
    tick = {name: median(xs) for name, xs in m["tick"].items()}
    slower = tick["psutil"] / tick["procfs"]
    c64 = next(r for r in m["calls"] if r["n"] == 64)
    http = m["http"]
    rss_ok = "met" if d_rss <= 3072 else "missed"
    # Measurable: the swapped tick's median is above every round of the original's.
    tick_ok = "missed" if tick["psutil"] > max(m["tick"]["procfs"]) else "met"
    std = http["stdlib"]
    std_added = mib(std[500]["VmRSS"] - std["rest"]["VmRSS"])
    text = (
        "**psutil: not a runtime dependency** (a test one: the tests and benchmarks use it to look at process "
        "trees and sockets). The rule (issue 33): psutil for the enforcer's process facts if it adds at most "
        f"3 MiB resident and no measurable tick time. It adds {mib(d_rss)} MiB ({rss_ok}), "
        f"but with only `read_stat` taken from it the tick at 64 processes goes from {tick['procfs']:.2f} to "
        f"{tick['psutil']:.2f} ms ({slower:.1f}x: {tick_ok}): a `psutil.Process` reads /proc/<pid>/stat and more to "
        f"build itself, {c64['psutil_stat_us'] / c64['procfs_stat_us']:.0f}x the cost of `procfs.read_stat` per "
        "process. And it covers two of the facts the tick needs (state, parent and start time; the "
        "environment); it has no call for the cgroup, the descriptors and mappings as (device, inode), NSpid "
        "and the namespace inodes, or the capabilities, so gpufence/enforcer/observe/procfs.py stays either way.\n\n"
        "**The HTTP endpoint: ours stays** (gpufence/enforcer/report/http_server.py). The standard library's "
        "`ThreadingHTTPServer` and prometheus_client's `start_http_server` (wsgiref with the same `ThreadingMixIn`) "
        "add nothing to import (prometheus_client loads `http.server`), but they cannot keep the bounds: a thread "
        f"per connection ({std[500]['Threads']} threads, +{std_added} MiB "
        "for 500 idle connections, and the sidecar's limit is 256Mi: a neighbour container can open enough to "
        "have it killed), no deadline on the request head (a client sending a byte every 0.5 s is kept "
        "indefinitely; ours answers 408 after 5 s) and heads up to 100 lines of 64 KiB (a 1 MiB head is "
        "answered; ours refuses over 8 KiB with 431). Ours holds its one thread and its memory whatever the "
        "clients do.\n\n"
    )
    text += table(["enforcer started with", "VmRSS MiB (median)", "RssAnon MiB", "RssFile MiB", "starts"], [
        [name or "nothing else", mib(median([b["VmRSS"] for b in rows])), mib(median([b["RssAnon"] for b in rows])),
         mib(median([b["RssFile"] for b in rows])), len(rows)] for name, rows in (("", base), ("import psutil", ps))
    ]) + f"\n\n`import psutil` adds {mib(d_rss)} MiB resident ({mib(d_anon)} MiB of it anonymous).\n\n"
    text += table(["processes", "procfs.read_stat µs", "psutil oneshot (new Process) µs",
                   "psutil oneshot (cached Process) µs", "procfs.read_claim µs", "psutil environ() µs"], [
        [r["n"], f"{r['procfs_stat_us']:.1f}", f"{r['psutil_stat_us']:.1f}", f"{r['psutil_stat_cached_us']:.1f}",
         f"{r['procfs_claim_us']:.1f}", f"{r['psutil_claim_us']:.1f}"] for r in m["calls"]
    ]) + "\n\nPer process, median of 15 passes over all of them.\n\n"
    text += table(["tick at 64 processes, read_stat from", "median ms (per round)", "median of rounds"], [
        [name, ", ".join(f"{x:.2f}" for x in xs), f"{median(xs):.2f}"] for name, xs in m["tick"].items()
    ]) + "\n\n"
    rows = []
    for kind, r in http.items():
        rows.append([kind, r["rest"]["Threads"], mib(r["rest"]["VmRSS"]),
                     f"{r[100]['Threads']} / {mib(r[100]['VmRSS'])}", f"{r[500]['Threads']} / {mib(r[500]['VmRSS'])}",
                     f"{r[500]['get']} in {r[500]['get_ms']:.0f} ms", mib(r["after"]["VmRSS"]),
                     f"{r['slow_s']:.1f}" + (" (still open)" if r["slow_s"] >= 8 else ""), code(r["head_16k"]),
                     code(r["head_1m"])])
    text += table(["server", "threads at rest", "VmRSS MiB at rest", "100 idle connections: threads / MiB",
                   "500 idle: threads / MiB", "GET with 500 idle open", "MiB after they closed",
                   "slow head (1 byte / 0.5 s) kept s", "16 KiB head", "1 MiB head (20 lines)"], rows)
    return text + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("rss", "calls", "tick", "http"), action="append")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    only = set(args.only or ("rss", "calls", "tick", "http"))
    m: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpufence-bench-") as tmp:
        root = Path(tmp)
        (root / "dev").mkdir()
        (root / "dev" / "nvidia0").write_bytes(b"")
        if "http" in only:
            m["http"] = measure_http()
        if "calls" in only:
            m["calls"] = measure_calls(root, args.counts)
        if "tick" in only:
            m["tick"] = measure_swapped_tick(root, args.ticks, args.rounds)
        if "rss" in only:
            m["rss"] = measure_rss(root, args.rounds)
    print(json.dumps(m, default=str))
    if only == {"rss", "calls", "tick", "http"}:
        text = render(m)
        print(text)
        if not args.no_write:
            write_section("dependencies", "Libraries against the enforcer's own code: psutil, the HTTP server", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
