"""Soak: mixed valid/invalid reviews at a fixed rate over TLS, with two certificate rotations.

    python -m bench.soak [--duration 60] [--rate 300] [--reconnect-every 50] [--no-write]

``python -m webhook`` serves a Kubernetes-style Secret volume (``..data`` symlink swaps) and checks
it every 0.2 s; the load generator (``tests.support.loadgen``, its own process, verifying the certificate
against the CA) sends the ``tests.support.sample_pods.mixed_bodies`` mix (mutated, denied, skipped, malformed
JSON, wrong apiVersion) at ``--rate`` and reconnects every ``--reconnect-every`` requests so that
new handshakes meet the rotated certificates. The volume is rotated at 1/3 and 2/3 of the run.
Pass: zero failed requests, zero 5xx, zero failed handshakes, all three certificates seen.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common import table, write_section
from tests.support.soak import soak


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
