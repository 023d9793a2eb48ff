"""Soak: mixed valid/invalid reviews at a fixed rate over TLS, with two certificate rotations.

    python -m bench.soak [--duration 60] [--rate 300] [--reconnect-every 50] [--no-write]

``python -m webhook`` serves a Kubernetes-style Secret volume (``..data`` symlink swaps) and checks
it every 0.2 s; the load generator (``bench.loadgen``, its own process, verifying the certificate
against the CA) sends the ``bench.common.mixed_bodies`` mix (mutated, denied, skipped, malformed
JSON, wrong apiVersion) at ``--rate`` and reconnects every ``--reconnect-every`` requests so that
new handshakes meet the rotated certificates. The volume is rotated at 1/3 and 2/3 of the run.
Pass: zero failed requests, zero 5xx, zero failed handshakes, all three certificates seen.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, Pki, child_env, cpu_plan, gpufence_server, pin, table, write_section


def soak(duration: float, rate: float, reconnect_every: int = 50, *, pin_cpus: bool = True,
         warmup: float = 1.0) -> dict[str, Any]:
    import json

    import psutil

    server_cpus, gen_cpus = cpu_plan() if pin_cpus else (None, None)
    with tempfile.TemporaryDirectory(prefix="gpufence-soak-") as tmp:
        pki = Pki.create(Path(tmp) / "pki")
        serials = [format(pki.serial, "x")]
        with gpufence_server(pki, cpus=server_cpus, reload_interval="200ms",
                             log_path=Path(tmp) / "server.log") as (server, port):
            ps = psutil.Process(server.pid)
            rss_start_before_load = ps.memory_info().rss
            gen = subprocess.Popen(
                [sys.executable, "-m", "bench.loadgen", "--port", str(port), "--ca", str(pki.ca_file), "--mixed",
                 "--rate", str(rate), "--duration", str(duration), "--warmup", str(warmup),
                 "--reconnect-every", str(reconnect_every), "--connections", "8"],
                cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            pin(gen.pid, gen_cpus)
            out: list[bytes] = []
            reader = threading.Thread(target=lambda: out.extend(gen.communicate(timeout=duration + warmup + 120)))
            reader.start()
            t0 = time.monotonic()
            time.sleep(warmup + 0.5)
            rss_warm = ps.memory_info().rss
            rss_max = rss_warm
            rotations = []
            for frac in (1 / 3, 2 / 3):
                while time.monotonic() - t0 < warmup + duration * frac:
                    rss_max = max(rss_max, ps.memory_info().rss)
                    time.sleep(0.25)
                pki.rotate()
                serials.append(format(pki.serial, "x"))
                rotations.append(round(time.monotonic() - t0, 2))
            while reader.is_alive():
                rss_max = max(rss_max, ps.memory_info().rss)
                reader.join(0.25)
            rss_end = ps.memory_info().rss
            server_log = (Path(tmp) / "server.log").read_text(errors="replace")
        if gen.returncode != 0:
            raise RuntimeError(f"load generator failed: {out[1].decode()[-2000:] if len(out) > 1 else ''}")
        result = json.loads(out[0].decode().strip().splitlines()[-1])
    result.update({
        "rss_idle_mb": rss_start_before_load / 1e6, "rss_warm_mb": rss_warm / 1e6, "rss_end_mb": rss_end / 1e6,
        "rss_max_mb": rss_max / 1e6, "rotations_at_s": rotations, "serials_written": serials,
        "serials_seen": [s for s in serials if result["serials"].get(s)],
        "server_errors_logged": sum(1 for line in server_log.splitlines() if '"level": "error"' in line
                                    or '"level": "critical"' in line),
    })
    return result


def render(r: dict[str, Any]) -> str:
    ok = r["failed"] == 0 and r["status_5xx"] == 0 and r["handshake_failures"] == 0 and len(r["serials_seen"]) == 3
    rows = [
        ["requests (sent / answered)", f"{r['sent']} / {r['completed']}"],
        ["achieved rate", f"{r['rps']:.1f} req/s"],
        ["answers by status", ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))],
        ["failed requests", r["failed"]],
        ["5xx", r["status_5xx"]],
        ["TLS handshakes / failed", f"{r['handshakes']} / {r['handshake_failures']}"],
        ["certificate rotations at (s)", ", ".join(map(str, r["rotations_at_s"]))],
        ["certificates seen by new handshakes", f"{len(r['serials_seen'])} of {len(r['serials_written'])}"],
        ["latency p50 / p99 / max", f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} / {r['max_ms']:.1f} ms"],
        ["server RSS idle / after warm-up / end / max", f"{r['rss_idle_mb']:.1f} / {r['rss_warm_mb']:.1f} / "
                                                       f"{r['rss_end_mb']:.1f} / {r['rss_max_mb']:.1f} MB"],
        ["server error log lines", r["server_errors_logged"]],
    ]
    text = table(["measure", "value"], rows)
    if r["errors"]:
        text += "\n\nErrors: " + "; ".join(f"{k} x{v}" for k, v in r["errors"].items())
    return text + f"\n\nResult: **{'pass' if ok else 'FAIL'}**\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--reconnect-every", type=int, default=50)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    r = soak(args.duration, args.rate, args.reconnect_every)
    text = render(r)
    print(text)
    if not args.no_write:
        write_section("soak", f"Soak: {args.duration:g} s at {args.rate:g} req/s with two certificate rotations", text)
    ok = r["failed"] == 0 and r["status_5xx"] == 0 and r["handshake_failures"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
