"""Soak: mixed valid/invalid reviews at a fixed rate over TLS, with two certificate rotations.

``python -m gpufence.webhook`` serves a Kubernetes-style Secret volume (``..data`` symlink swaps) and
checks it every 0.2 s; the load generator (``tests.support.loadgen``, its own process, verifying the
certificate against the CA) sends the ``mixed_bodies`` mix (mutated, denied, skipped, malformed JSON,
wrong apiVersion) at ``rate`` and reconnects every ``reconnect_every`` requests so that new
handshakes meet the rotated certificates. The volume is rotated at 1/3 and 2/3 of the run. The
hardening test runs it briefly; ``python -m bench.soak`` runs it for the record.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from tests.support.server_process import REPO_ROOT, child_env, cpu_plan, gpufence_server, pin
from tests.support.tlsutil import make_pki


def soak(duration: float, rate: float, reconnect_every: int = 50, *, pin_cpus: bool = True,
         warmup: float = 1.0) -> dict[str, Any]:
    server_cpus, gen_cpus = cpu_plan() if pin_cpus else (None, None)
    with tempfile.TemporaryDirectory(prefix="gpufence-soak-") as tmp:
        pki = make_pki(Path(tmp) / "pki")
        serials = [format(pki.serial, "x")]
        with gpufence_server(pki, cpus=server_cpus, reload_interval="200ms",
                             log_path=Path(tmp) / "server.log") as (server, port):
            ps = psutil.Process(server.pid)
            rss_start_before_load = ps.memory_info().rss
            gen = subprocess.Popen(
                [sys.executable, "-m", "tests.support.loadgen", "--port", str(port), "--ca", str(pki.ca_file),
                 "--mixed", "--rate", str(rate), "--duration", str(duration), "--warmup", str(warmup),
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
