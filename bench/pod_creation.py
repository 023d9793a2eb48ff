"""What a user feels: how much gpufence slows pod creation, through the real API server.

    python -m bench.pod_creation [--version v1.37.2] [--pods 1000] [--rounds 3] [--concurrency 100]

One control plane (tests/e2e's: etcd, kube-apiserver, kube-controller-manager from pinned Go
modules) with gpufence installed as shipped (webhook as a local process, guard policy active) and a
reference peer. Each round runs seven phases, each creating ``--pods`` GPU pods (``generateName``)
with ``--concurrency`` creates in flight from an aiohttp client:

1. **no webhook**: a namespace that is not opted in (the API server calls no webhook and the guard
   does not apply): the pod as its user wrote it;
2. **no webhook, pre-injected pod**: the pod as gpufence would store it, sent as is to a namespace
   that is not opted in: what storing and validating the larger pod costs by itself;
3. **guard only, pre-injected pod**: the same pod sent to an opted-in namespace that the webhook
   configuration skips: only the ``gpufence-guard`` policy's CEL runs (and admits it), so the
   difference between 2 and 3 is the guard's cost;
4. **gpufence**: an opted-in namespace, the API server calling the gpufence webhook (and the guard);
5. **gpufence, no guard**: the same in a namespace that the guard's binding skips: the webhook alone;
6. **reference**: as 4, with the webhook configuration pointed at a minimal Go webhook
   (tests/e2e/gomod/refwebhook) that returns the JSON Patch gpufence computed for this pod, so the
   difference between 4 and 6 is gpufence's own cost, and between 3 and 6 the cost of any webhook;
7. **reference, no guard**: as 6 in a namespace that the guard's binding skips: the most any
   webhook returning this patch gets on this machine, whatever the guard costs.

Phases 3, 5 and 7 need one change to the installed objects, made once before the first phase: the
webhook configuration's namespaceSelector and the guard binding's matchResources each gain a term
excluding namespaces labelled ``bench.gpufence.io/webhook=off`` (resp. ``.../guard=off``). Only
those phases' namespaces carry the labels; what the guard enforces is unchanged. Before phase
3 measures, a pod as its user wrote it must be refused there (the guard applies, the webhook does
not). The API server's own metric ``apiserver_admission_controller_admission_duration_seconds`` for
its ValidatingAdmissionPolicy plugin gives, per phase, the plugin's time per create (it serves no
per-policy metric): the guard's CEL where it applies, matching alone where it does not.

Phases alternate round by round and each figure is the median over the rounds, because the
machine is shared. Every process (API server, etcd, webhook, this client) shares its cores: on 2
cores the webhook's CPU is taken from the API server's, so the ratio is the end-to-end one.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.common import table, write_section
from gpufence.webhook.admission import review
from gpufence.webhook.client import decode_patch, pod_admission_review
from gpufence.webhook.desired import SERVICE_ACCOUNT_MOUNT_PATH as SA_PATH
from gpufence.webhook.settings import AllNamespacesOptedIn, InjectionSettings
from tests.e2e import kube
from tests.e2e.binaries import KUBERNETES_VERSIONS, build, control_plane, refwebhook_recipe
from tests.e2e.controlplane import ControlPlane, free_port, running_control_plane, start
from tests.e2e.gpufence_install import WEBHOOK_CONFIGURATION, WebhookProcess, point_webhook_at, start_gpufence
from tests.support.stats import median, percentile

# What a user may be asked to pay for the injection: 0.7 of the no-webhook rate with 100 creates in flight.
TARGET_RATIO = 0.7
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
    concurrency: int = 0
    vap_creates: float = 0.0
    vap_seconds: float = 0.0

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
                      pod: dict[str, Any], mark: Callable[[], None]) -> tuple[float, list[float], int]:
    """Create ``pods`` pods, ``concurrency`` at a time; ``mark`` runs when the measurement starts and ends."""
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
        mark()
        start_t = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start_t
        mark()
    return elapsed, latencies, failures


def run_phase(cp: ControlPlane, name: str, pods: int, concurrency: int, *, expect_mutated: bool,
              webhook_pid: int | None, pod: dict[str, Any] | None = None, opted_in: bool = True,
              webhook_calls: Callable[[], float] | None = None, switch_off: str | None = None,
              check: Callable[[str], None] | None = None) -> Phase:
    """One phase; ``switch_off`` ("webhook" or "guard") labels the namespace so that part skips it."""
    pod = pod or bench_pod()
    admin = kube.api_client(cp.admin_kubeconfig)
    labels = dict(kube.OPT_IN) if opted_in else {}
    if switch_off:
        labels[SWITCH_PREFIX + switch_off] = "off"
    namespace = kube.create_namespace(admin, "bench-" + re.sub(r"[^a-z0-9]+", "-", name), labels)
    # The API server picks up configuration changes from its own watch: wait until it acts on them.
    last: list[kube.Created] = []

    def in_effect() -> bool:
        last[:] = [kube.create_pod(admin, namespace, pod, dry_run=True)]
        return last[0].admitted and kube.is_mutated(last[0].obj) == expect_mutated

    try:
        kube.wait_for(in_effect, f"phase {name!r} to take effect", timeout=30)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last[0].status} {last[0].message}") from None
    if check is not None:
        check(namespace)
    cpu: list[float | None] = []
    calls: list[float] = []
    vap: list[tuple[float, float]] = []

    def mark() -> None:
        cpu.append(_cpu(webhook_pid))
        vap.append(policy_plugin_time(cp))
        if webhook_calls is not None:
            calls.append(webhook_calls())

    elapsed, latencies, failures = asyncio.run(create_many(cp, namespace, pods, concurrency, pod, mark))
    return Phase(name, pods, elapsed, latencies, failures,
                 None if cpu[0] is None or cpu[1] is None else cpu[1] - cpu[0], namespace,
                 calls[1] - calls[0] if calls else None, concurrency,
                 vap[1][0] - vap[0][0], vap[1][1] - vap[0][1])


SWITCH_PREFIX = "bench.gpufence.io/"
GUARD = "gpufence-guard"
PLUGIN_METRIC = "apiserver_admission_controller_admission_duration_seconds"


def add_switches(cp: ControlPlane) -> None:
    """Let a namespace label turn the webhook or the guard off for the phases that measure one alone."""
    config = json.loads(cp.kubectl("get", "mutatingwebhookconfiguration", WEBHOOK_CONFIGURATION, "-o", "json").stdout)
    off = {"operator": "NotIn", "values": ["off"]}
    ops = [{"op": "add", "path": f"/webhooks/{i}/namespaceSelector/matchExpressions/-",
            "value": {"key": SWITCH_PREFIX + "webhook", **off}} for i, _ in enumerate(config["webhooks"])]
    cp.kubectl("patch", "mutatingwebhookconfiguration", WEBHOOK_CONFIGURATION, "--type=json", "-p", json.dumps(ops))
    binding = json.loads(cp.kubectl("get", "validatingadmissionpolicybinding", GUARD, "-o", "json").stdout)
    assert "matchResources" not in binding["spec"], "the shipped binding now has matchResources: merge, not add"
    cp.kubectl("patch", "validatingadmissionpolicybinding", GUARD, "--type=json", "-p", json.dumps([
        {"op": "add", "path": "/spec/matchResources",
         "value": {"namespaceSelector": {"matchExpressions": [{"key": SWITCH_PREFIX + "guard", **off}]}}}]))


def policy_plugin_time(cp: ControlPlane) -> tuple[float, float]:
    """The API server's count of CREATEs through its ValidatingAdmissionPolicy plugin and their total
    seconds (its /metrics)."""
    with urllib.request.urlopen(f"{cp.server}/metrics", context=cp.ssl_context(), timeout=10) as resp:
        text = resp.read().decode()
    count = seconds = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == PLUGIN_METRIC:
            for s in family.samples:
                if s.labels.get("name") == "ValidatingAdmissionPolicy" and s.labels.get("operation") == "CREATE":
                    count += s.value if s.name.endswith("_count") else 0.0
                    seconds += s.value if s.name.endswith("_sum") else 0.0
    return count, seconds


def _cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=KUBERNETES_VERSIONS[-1])
    parser.add_argument("--pods", type=int, default=1000, help="pods per phase and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential-pods", type=int, default=300, help="pods per phase and round, one at a time")
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/PERFORMANCE.md alone")
    args = parser.parse_args(argv)

    # As measured before the e2e control plane ran kube-scheduler (1.37): no scheduler writing an
    # Unschedulable condition into every created pod beside the creates measured.
    binaries = dataclasses.replace(control_plane(args.version), kube_scheduler=None)
    ref_binary = build(refwebhook_recipe())["refwebhook"]
    rounds: list[list[Phase]] = []
    sequential: list[list[Phase]] = []
    with tempfile.TemporaryDirectory() as tmp, running_control_plane(binaries, Path(tmp) / "cp") as cp:
        injected = pre_injected_pod(cp)
        hook: WebhookProcess = start_gpufence(cp, Path(tmp) / "gpufence")
        add_switches(cp)
        ref = start_reference(cp, hook, ref_binary, Path(tmp))
        try:
            assert hook.component is not None
            gpufence_url, ref_url = hook.url, f"https://127.0.0.1:{ref.port}"
            # Phases alternate round by round, so that a change in the machine's load (it is shared)
            # spreads over all of them; each figure is the median over the rounds.
            def no_webhook(concurrency: int, pods: int) -> Phase:
                # A namespace that is not opted in: the API server calls nothing and the guard does
                # not apply: what the same pod costs without gpufence.
                return run_phase(cp, "no webhook", pods, concurrency, expect_mutated=False, webhook_pid=None,
                                 opted_in=False)

            def pre_injected(concurrency: int, pods: int) -> Phase:
                # The same store and validation work as gpufence's output, without any webhook call.
                return run_phase(cp, "no webhook, pre-injected pod", pods, concurrency, expect_mutated=True,
                                 webhook_pid=None, pod=injected, opted_in=False)

            def guard_only(concurrency: int, pods: int) -> Phase:
                # The same pod in an opted-in namespace that the webhook configuration skips: only
                # the guard's CEL runs, and admits the webhook's output.
                return run_phase(cp, "guard only, pre-injected pod", pods, concurrency, expect_mutated=True,
                                 webhook_pid=None, pod=injected, switch_off="webhook",
                                 webhook_calls=lambda: sum(hook.request_counts().values()), check=guarded)

            def guarded(namespace: str) -> None:
                plain = kube.create_pod(kube.api_client(cp.admin_kubeconfig), namespace, bench_pod(), dry_run=True)
                assert not plain.admitted and GUARD in plain.message, f"the guard did not refuse: {plain.message}"

            def gpufence(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, gpufence_url)
                return run_phase(cp, "gpufence", pods, concurrency, expect_mutated=True,
                                 webhook_pid=hook.component.process.pid,
                                 webhook_calls=lambda: sum(hook.request_counts().values()))

            def gpufence_no_guard(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, gpufence_url)
                return run_phase(cp, "gpufence, no guard", pods, concurrency, expect_mutated=True,
                                 webhook_pid=hook.component.process.pid, switch_off="guard",
                                 webhook_calls=lambda: sum(hook.request_counts().values()))

            def reference(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, ref_url)
                return run_phase(cp, "reference", pods, concurrency, expect_mutated=True,
                                 webhook_pid=ref.component.process.pid)

            def reference_no_guard(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, ref_url)
                return run_phase(cp, "reference, no guard", pods, concurrency, expect_mutated=True,
                                 webhook_pid=ref.component.process.pid, switch_off="guard")

            order = [no_webhook, pre_injected, guard_only, gpufence, gpufence_no_guard, reference, reference_no_guard]
            for level, pods in ((1, args.sequential_pods), (args.concurrency, args.pods)):
                for r in range(args.rounds):
                    # Each round starts with another phase, so that neither the machine's changing
                    # load nor the store growing over the run favours one phase.
                    start_at = r % len(order)
                    done = {p: p(level, pods) for p in order[start_at:] + order[:start_at]}
                    (sequential if level == 1 else rounds).append([done[p] for p in order])
        finally:
            ref.component.stop()
            hook.stop()

    body = report(rounds, args.pods) + "\n\n" + report(sequential, args.sequential_pods, "one create at a time")
    base, ours, peer, peer_alone = (median([r[i].rate for r in rounds]) for i in (0, 3, 5, 6))
    added = median([r[3].p(99) for r in sequential]) - median([r[0].p(99) for r in sequential])
    added_peer = median([r[5].p(99) for r in sequential]) - median([r[0].p(99) for r in sequential])
    verdict = (
        f"\n\nKubernetes {args.version}; medians of {args.rounds} rounds, phases rotated round by round. "
        f"Targets: with {args.concurrency} creates in flight gpufence >= {TARGET_RATIO} x the no-webhook rate "
        f"(measured {ours / base:.2f}: {'met' if ours / base >= TARGET_RATIO else 'missed'}; the Go reference "
        f"returning the same patch: {peer / base:.2f}, and {peer_alone / base:.2f} where the guard does not apply); "
        f"added p99 < {TARGET_ADDED_P99_MS} ms, measured one create "
        f"at a time so that queueing on the saturated machine does not swamp it ({added:+.1f} ms: "
        f"{'met' if added < TARGET_ADDED_P99_MS else 'missed'}; the Go reference {added_peer:+.1f} ms).\n"
    )
    print(body + verdict)
    if not args.no_write:
        write_section("pod_creation", "Pod creation through the real API server", body + verdict)
    # The guard-only phase must not have reached the webhook.
    assert not any(p.name.startswith("guard") and p.webhook_calls for r in rounds + sequential for p in r)
    return 0 if all(p.failures == 0 for r in rounds + sequential for p in r) else 1


def report(rounds: list[list[Phase]], pods: int, title: str = "") -> str:
    names = [p.name for p in rounds[0]]

    def med(i: int, value: Callable[[Phase], float]) -> float:
        return median([value(r[i]) for r in rounds])

    base_rate, base_p99 = med(0, lambda p: p.rate), med(0, lambda p: p.p(99))
    rows = []
    for i, name in enumerate(names):
        runs = [r[i] for r in rounds]
        cpu = [p.webhook_cpu_s / p.pods * 1e6 for p in runs if p.webhook_cpu_s is not None]
        calls = [p.webhook_calls / p.pods for p in runs if p.webhook_calls is not None]
        vap = [p.vap_seconds / p.vap_creates * 1e6 for p in runs if p.vap_creates]
        rows.append([name, f"{len(runs)} x {pods}", f"{med(i, lambda p: p.rate):.0f}",
                     f"{med(i, lambda p: p.rate) / base_rate:.2f}",
                     " / ".join(f"{p.rate / r[0].rate:.2f}" for p, r in zip(runs, rounds, strict=True)),
                     f"{med(i, lambda p: p.p(50)):.1f}", f"{med(i, lambda p: p.p(99)):.1f}",
                     f"{med(i, lambda p: p.p(99)) - base_p99:+.1f}", sum(p.failures for p in runs),
                     f"{median(cpu):.0f}" if cpu else "-", f"{median(calls):.2f}" if calls else "-",
                     f"{median(vap):.0f}" if vap else "-"])
    concurrency = title or f"{rounds[0][0].concurrency} creates in flight"
    return f"**{concurrency}**\n\n" + table(
        ["phase", "pods", "pods/s", "x no webhook", "x no webhook per round", "p50 ms", "p99 ms",
         "added p99 ms", "failed", "webhook CPU µs/pod", "webhook calls/pod",
         "VAP plugin µs/create"], rows)


@dataclass
class Reference:
    component: Any
    port: int


def start_reference(cp: ControlPlane, hook: WebhookProcess, binary: Path, workdir: Path) -> Reference:
    """The Go peer, serving gpufence's own certificate and gpufence's patch for the benchmark pod."""
    admin = kube.api_client(cp.admin_kubeconfig)
    namespace = kube.create_namespace(admin, "bench-patch", kube.OPT_IN)
    # The pod as the API server presents it to webhooks: defaulted, with the ServiceAccount
    # plugin's projected token volume.
    presented = kube.without_server_fields(kube.create_pod(admin, "default", bench_pod(), dry_run=True).obj)
    presented["metadata"]["namespace"] = namespace
    patch = hook.patch_for(namespace, presented)
    assert patch, "gpufence computed no patch for the benchmark pod"
    # The reference adds the per-pod token mount itself (its volume name is random per pod).
    for op in patch:
        if op["path"] == "/spec/initContainers":
            mounts = op["value"][0]["volumeMounts"]
            op["value"][0]["volumeMounts"] = [m for m in mounts if m["mountPath"] != SA_PATH]
    patch_file = workdir / "patch.json"
    patch_file.write_text(json.dumps(patch))
    port = free_port()
    ref = start("refwebhook", [str(binary), "-addr", f"127.0.0.1:{port}", "-cert", str(hook.secret.cert_file),
                               "-key", str(hook.secret.key_file), "-patch", str(patch_file)], workdir)
    kube.wait_for(lambda: _ready(port, ref, hook.client_context()), "the reference webhook", timeout=30)
    return Reference(ref, port)


def _ready(port: int, component: Any, ctx: ssl.SSLContext) -> bool:
    component.check_alive()
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=ctx, timeout=2) as resp:
            return resp.read() == b"ok"
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
