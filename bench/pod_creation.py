"""What a user feels: how much gpufence slows pod creation, through the real API server.

    python -m bench.pod_creation [--version v1.37.2] [--pods 3000] [--concurrency 100]

One run, one control plane (tests/e2e's: etcd, kube-apiserver, kube-controller-manager from pinned
Go modules), three phases back to back, each creating ``--pods`` GPU pods (``generateName``) with
``--concurrency`` creates in flight from an aiohttp client:

1. **no webhook**: gpufence not installed (no webhook, no guard policy);
2. **gpufence**: the install as shipped, the webhook as a local process (one replica, one core at
   most on this machine), the guard policy active;
3. **reference**: the same install with the webhook configuration pointed at a minimal Go webhook
   (tests/e2e/gomod/refwebhook) that returns the identical JSON Patch gpufence computed for this
   pod, so the difference between 2 and 3 is gpufence's own cost, and between 1 and 3 the cost of
   any webhook call plus storing the larger pod.

Every process (API server, etcd, webhook, this client) shares the machine's cores; on 2 cores the
webhook's CPU is taken from the API server's, so the ratio is the honest end-to-end one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import ssl
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.common import percentile, table, write_section
from tests.e2e import kube
from tests.e2e.binaries import KUBERNETES_VERSIONS, build, control_plane, refwebhook_recipe
from tests.e2e.controlplane import ControlPlane, free_port, running_control_plane, start
from tests.e2e.gpufence_install import WebhookProcess, point_webhook_at, start_gpufence
from webhook.admission import review
from webhook.client import decode_patch, pod_admission_review
from webhook.settings import AllNamespacesOptedIn, InjectionSettings

TARGET_RATIO = 0.9
TARGET_ADDED_P99_MS = 5.0


@dataclass(frozen=True)
class Phase:
    name: str
    pods: int
    seconds: float
    latencies_ms: list[float]
    failures: int
    webhook_cpu_s: float | None
    namespace: str
    webhook_calls: float | None = None

    @property
    def rate(self) -> float:
        return self.pods / self.seconds

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


def bench_pod(generate_name: str = "bench-") -> dict[str, Any]:
    pod = kube.gpu_pod(generate_name=generate_name, annotations={"gpufence.io/memory": "8Gi"})
    return pod


def pre_injected_pod(cp: ControlPlane) -> dict[str, Any]:
    """The pod as gpufence would store it, computed in process (no webhook involved)."""
    presented = kube.without_server_fields(kube.create_pod(kube.api_client(cp.admin_kubeconfig), "default",
                                                           bench_pod(), dry_run=True).obj)
    answer = review(pod_admission_review(presented, uid="bench"), InjectionSettings(), AllNamespacesOptedIn())
    injected = jsonpatch.apply_patch(presented, decode_patch(answer.review["response"]) or [])
    injected["metadata"].pop("namespace", None)
    injected["metadata"].pop("name", None)
    return injected


async def create_many(cp: ControlPlane, namespace: str, pods: int, concurrency: int,
                      pod: dict[str, Any]) -> tuple[float, list[float], int]:
    ctx: ssl.SSLContext = cp.ssl_context()
    body = json.dumps(pod).encode()
    url = f"{cp.server}/api/v1/namespaces/{namespace}/pods"
    latencies: list[float] = []
    failures = 0
    remaining = pods

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, failures
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                ok = resp.status == 201
            latencies.append((time.perf_counter() - t0) * 1000)
            failures += not ok

    connector = aiohttp.TCPConnector(ssl=ctx, limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        # Warm up connections and the API server's caches outside the measurement.
        await asyncio.gather(*(session.post(url, data=body, headers={"Content-Type": "application/json"})
                               for _ in range(concurrency)))
        start_t = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start_t
    return elapsed, latencies, failures


def run_phase(cp: ControlPlane, name: str, pods: int, concurrency: int, *, expect_mutated: bool,
              webhook_pid: int | None, pod: dict[str, Any] | None = None) -> Phase:
    pod = pod or bench_pod()
    admin = kube.api_client(cp.admin_kubeconfig)
    namespace = kube.create_namespace(admin, "bench-" + re.sub(r"[^a-z0-9]+", "-", name), kube.OPT_IN)
    # The API server picks up configuration changes from its own watch: wait until it acts on them.
    last: list[kube.Created] = []

    def in_effect() -> bool:
        last[:] = [kube.create_pod(admin, namespace, pod, dry_run=True)]
        return last[0].admitted and kube.is_mutated(last[0].obj) == expect_mutated

    try:
        kube.wait_for(in_effect, f"phase {name!r} to take effect", timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last[0].status} {last[0].message}") from None
    cpu_before = _cpu(webhook_pid)
    elapsed, latencies, failures = asyncio.run(create_many(cp, namespace, pods, concurrency, pod))
    cpu_after = _cpu(webhook_pid)
    return Phase(name, pods, elapsed, latencies, failures,
                 None if cpu_before is None or cpu_after is None else cpu_after - cpu_before, namespace)


def _cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=KUBERNETES_VERSIONS[-1])
    parser.add_argument("--pods", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/PERFORMANCE.md alone")
    args = parser.parse_args(argv)

    binaries = control_plane(args.version)
    ref_binary = build(refwebhook_recipe())["refwebhook"]
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory() as tmp, running_control_plane(binaries, Path(tmp) / "cp") as cp:
        phases.append(run_phase(cp, "no webhook", args.pods, args.concurrency, expect_mutated=False,
                                webhook_pid=None))
        # The same store and validation work as gpufence's output, without any webhook call.
        phases.append(run_phase(cp, "no webhook, pre-injected pod", args.pods, args.concurrency,
                                expect_mutated=True, webhook_pid=None, pod=pre_injected_pod(cp)))
        hook: WebhookProcess = start_gpufence(cp, Path(tmp) / "gpufence")
        try:
            assert hook.component is not None
            calls_before = _webhook_calls(hook)
            phases.append(run_phase(cp, "gpufence", args.pods, args.concurrency, expect_mutated=True,
                                    webhook_pid=hook.component.process.pid))
            phases[-1] = dataclasses.replace(phases[-1], webhook_calls=_webhook_calls(hook) - calls_before)
            # The pod as the API server presents it to webhooks: defaulted, with the ServiceAccount
            # plugin's projected token volume (its random name only ever gets appended after).
            presented = kube.without_server_fields(kube.create_pod(
                kube.api_client(cp.admin_kubeconfig), "default", bench_pod(), dry_run=True).obj)
            presented["metadata"]["namespace"] = phases[-1].namespace
            patch = hook.patch_for(phases[-1].namespace, presented)
            assert patch, "gpufence computed no patch for the benchmark pod"
        finally:
            hook.stop()
        patch_file = Path(tmp) / "patch.json"
        patch_file.write_text(json.dumps(patch))
        port = free_port()
        ref = start("refwebhook", [str(ref_binary), "-addr", f"127.0.0.1:{port}", "-cert", str(hook.secret.cert_file),
                                   "-key", str(hook.secret.key_file), "-patch", str(patch_file)], Path(tmp))
        try:
            kube.wait_for(lambda: _ready(port, ref, hook.client_context()), "the reference webhook", timeout=30)
            point_webhook_at(cp, f"https://127.0.0.1:{port}")
            phases.append(run_phase(cp, "reference", args.pods, args.concurrency, expect_mutated=True,
                                    webhook_pid=ref.process.pid))
        except AssertionError:
            calls = [line for line in cp.components[1].log_tail(200_000).splitlines() if "webhook" in line]
            print("\n".join(calls[-5:]), "\n", ref.log_tail(), file=sys.stderr)
            raise
        finally:
            ref.stop()

    base, _, ours, peer = phases
    rows = [[p.name, p.pods, f"{p.rate:.0f}", f"{p.rate / base.rate:.2f}", f"{p.p(50):.1f}", f"{p.p(99):.1f}",
             f"{p.p(99) - base.p(99):+.1f}", p.failures,
             "-" if p.webhook_cpu_s is None else f"{p.webhook_cpu_s / p.pods * 1e6:.0f}",
             "-" if p.webhook_calls is None else f"{p.webhook_calls / p.pods:.2f}"] for p in phases]
    body = table(["phase", "pods", "pods/s", "x no webhook", "p50 ms", "p99 ms", "added p99 ms", "failed",
                  "webhook CPU µs/pod", "webhook calls/pod"], rows)
    verdict = (
        f"\n\nKubernetes {args.version}, {args.concurrency} creates in flight. Targets: gpufence >= "
        f"{TARGET_RATIO} x the no-webhook rate (measured {ours.rate / base.rate:.2f}: "
        f"{'met' if ours.rate / base.rate >= TARGET_RATIO else 'missed'}); added p99 < {TARGET_ADDED_P99_MS} ms "
        f"(measured {ours.p(99) - base.p(99):+.1f} ms: "
        f"{'met' if ours.p(99) - base.p(99) < TARGET_ADDED_P99_MS else 'missed'}). gpufence vs the Go reference "
        f"returning the same patch: {ours.rate / peer.rate:.2f} x its rate, {ours.p(99) - peer.p(99):+.1f} ms p99.\n"
    )
    print(body + verdict)
    if not args.no_write:
        write_section("pod_creation", "Pod creation through the real API server", body + verdict)
    return 0 if all(p.failures == 0 for p in phases) else 1


def _webhook_calls(hook: WebhookProcess) -> float:
    with urllib.request.urlopen(hook.url + "/metrics", context=hook.client_context(), timeout=10) as resp:
        text = resp.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name == "gpufence_webhook_requests" for sample in family.samples
               if sample.name.endswith("_total"))


def _ready(port: int, component: Any, ctx: ssl.SSLContext) -> bool:
    component.check_alive()
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=ctx, timeout=2) as resp:
            return resp.read() == b"ok"
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
