"""What a user feels: how much gpufence slows pod creation, through the real API server.

    python -m bench.pod_creation [--version v1.37.2] [--pods 1000] [--rounds 3] [--concurrency 100]
                                 [--sequential-pods 300] [--no-write]

One control plane (tests/e2e's: etcd, kube-apiserver, kube-controller-manager from pinned Go
modules) with gpufence installed as shipped (the webhook as a local process: ``inject.gpufence.io``
on /mutate and ``verify.gpufence.io`` on /validate, both ``failurePolicy: Fail``) and a reference
peer. Each round runs six phases, each creating ``--pods`` GPU pods (``generateName``) with
``--concurrency`` creates in flight from an aiohttp client, then ``--sequential-pods`` one at a time:

1. **no webhook**: a namespace that is not opted in (the API server calls no webhook): the pod as
   its user wrote it;
2. **no webhook, pre-injected pod**: the pod as gpufence would store it (gpufence's own patch for
   it), sent as is to a namespace that is not opted in: what storing and validating the larger pod
   costs by itself, the floor of any webhook that injects it;
3. **gpufence**: an opted-in namespace, as shipped: the API server calls /mutate, then /validate
   (the final pod re-reviewed);
4. **gpufence, no verify**: the same in a namespace that only the validating webhook skips: what
   ``verify.gpufence.io`` costs is the difference between 3 and 4;
5. **reference**: as 3, with both configurations pointed at a minimal Go webhook
   (tests/e2e/gomod/refwebhook) that returns the JSON Patch gpufence computed for this pod on
   /mutate and answers allowed on /validate: registered the way gpufence is, so the difference
   between 3 and 5 is gpufence's own cost, and between 2 and 5 the cost of calling two webhooks;
6. **reference, no verify**: as 5 in the namespace that the validating webhook skips;
7. **gpufence, distinct pods**: as 3, each pod with a label value of its own. Phases 3 and 4 create
   pods of one template, as a Deployment or a Job does: after the first, gpufence answers them from
   its memo of verdicts (webhook.verdicts); here every pod is reviewed on both calls;
8. **reference, HTTP/1.1**: as 5, the Go peer with HTTP/2 off (``GODEBUG=http2server=0``). The API
   server calls a webhook registered by a loopback URL, as all are here, over HTTP/2 where the
   webhook offers it (Go's server does, aiohttp cannot), one connection for every call in flight;
   it calls a webhook registered as a Service, as in a cluster, over HTTP/1.1 only
   (k8s.io/apiserver/pkg/util/webhook/client.go), a connection per call in flight, keeping 25 of
   them idle (client-go's transport) and handshaking anew beyond that. This phase is the reference
   as a cluster calls it.

Besides the rates, a second table per level gives each webhook's CPU as a share of one core, the
connections the API server held open to it at the end of the window and, for gpufence (its
/metrics), the connections it accepted per create and the share of each path's reviews answered
from the memo.

Phases 4 and 6 need one change to the installed objects, made once before the first phase: the
ValidatingWebhookConfiguration's namespaceSelector gains a term excluding namespaces labelled
``bench.gpufence.io/verify=off``. Only those phases' namespaces carry the label; the mutating
webhooks' selectors are unchanged. The API server's own metric
``apiserver_admission_webhook_admission_duration_seconds`` gives, per phase, the calls per create
and the API server's time in its mutating and validating webhooks (TLS, the call, the answer
applied); the phases check it: no webhook called where none applies, no validating webhook in the
"no verify" phases, one of each otherwise.

Phases alternate round by round and each figure is the median over the rounds, because the
machine is shared. Every process (API server, etcd, webhook, this client) shares its cores: on 2
cores the webhook's CPU is taken from the API server's, so the ratio is the end-to-end one.
Targets (issue 31): with ``--concurrency`` creates in flight, gpufence >= 0.9 x the Go reference
registered the same way; one create at a time, added p50 <= 3 ms over no webhook.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import re
import ssl
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.common import table, write_section
from gpufence.webhook.core.desired import SERVICE_ACCOUNT_MOUNT_PATH as SA_PATH
from tests.e2e import kube
from tests.e2e.binaries import KUBERNETES_VERSIONS, build, control_plane, refwebhook_recipe
from tests.e2e.controlplane import ControlPlane, free_port, running_control_plane, start
from tests.e2e.gpufence_install import WEBHOOK_CONFIGURATION, WebhookProcess, point_webhook_at, start_gpufence
from tests.support.stats import median, percentile

# Issue 31: gpufence registered as shipped against the Go reference registered the same way, with
# creates in flight; and one create at a time, what gpufence adds to the median.
TARGET_VS_REFERENCE = 0.9
TARGET_ADDED_P50_MS = 3.0

VERIFY_OFF = "bench.gpufence.io/verify"
DISTINCT_LABEL = "bench.gpufence.io/pod"
WEBHOOK_METRIC = "apiserver_admission_webhook_admission_duration_seconds"
MUTATING, VALIDATING = "admit", "validating"  # the metric's "type" label


@dataclass(frozen=True)
class Phase:
    name: str
    pods: int
    seconds: float
    latencies_ms: list[float]
    failures: int
    webhook_cpu_s: float | None
    namespace: str
    concurrency: int = 0
    # The API server's webhook calls in the measured window, by type: (calls, seconds).
    webhooks: dict[str, tuple[float, float]] = field(default_factory=dict)
    gpufence_calls: float | None = None  # gpufence's own count of the reviews it answered
    # gpufence's own counters over the window (its /metrics): connections accepted, memo lookups.
    gpufence_stats: dict[str, float] = field(default_factory=dict)
    # Connections to the webhook's port open at the end of the window (the API server's pool).
    open_connections: int | None = None

    @property
    def rate(self) -> float:
        return self.pods / self.seconds

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

    def calls(self, kind: str) -> float:
        return self.webhooks.get(kind, (0.0, 0.0))[0]

    def webhook_us_per_create(self, kind: str) -> float:
        return self.webhooks.get(kind, (0.0, 0.0))[1] / self.pods * 1e6

    def hit_rate(self, judge: str) -> float | None:
        hits, misses = self.gpufence_stats.get(f"{judge} hit", 0.0), self.gpufence_stats.get(f"{judge} miss", 0.0)
        return hits / (hits + misses) if hits + misses else None


def bench_pod(generate_name: str = "bench-") -> dict[str, Any]:
    return kube.gpu_pod(generate_name=generate_name, annotations={"gpufence.io/memory": "8Gi"})


async def create_many(cp: ControlPlane, namespace: str, pods: int, concurrency: int,
                      pod: dict[str, Any], mark: Callable[[], None],
                      distinct: bool = False) -> tuple[float, list[float], int]:
    """Create ``pods`` pods, ``concurrency`` at a time; ``mark`` runs when the measurement starts and ends;
    ``distinct``: each pod with a label value of its own."""
    ctx: ssl.SSLContext = cp.ssl_context()
    body = json.dumps(pod).encode()
    labels = dict(pod["metadata"].get("labels") or {})
    bodies = ([json.dumps({**pod, "metadata": {**pod["metadata"], "labels": {**labels, DISTINCT_LABEL: str(i)}}})
               .encode() for i in range(pods)] if distinct else [body] * pods)
    url = f"{cp.server}/api/v1/namespaces/{namespace}/pods"
    latencies: list[float] = []
    failures = 0
    remaining = pods

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, failures
        while remaining > 0:
            remaining -= 1
            data = bodies[remaining]
            t0 = time.perf_counter()
            async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                ok = resp.status == 201
            latencies.append((time.perf_counter() - t0) * 1000)
            failures += not ok

    connector = aiohttp.TCPConnector(ssl=ctx, limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        # Warm up connections and the API server's caches (its webhook clients' too) outside the measurement.
        for answer in await asyncio.gather(*(session.post(url, data=body, headers={"Content-Type": "application/json"})
                                             for _ in range(concurrency))):
            answer.release()
        mark()
        start_t = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start_t
        mark()
    return elapsed, latencies, failures


def run_phase(cp: ControlPlane, name: str, pods: int, concurrency: int, *, expect_mutated: bool,
              webhook_pid: int | tuple[int, ...] | None, pod: dict[str, Any] | None = None, opted_in: bool = True,
              verify_off: bool = False, gpufence_calls: Callable[[], float] | None = None,
              distinct: bool = False, gpufence_stats: Callable[[], dict[str, float]] | None = None,
              webhook_port: int | None = None) -> Phase:
    """One phase; ``verify_off`` labels the namespace so that only the validating webhook skips it."""
    pod = pod or bench_pod()
    admin = kube.api_client(cp.admin_kubeconfig)
    labels = dict(kube.OPT_IN) if opted_in else {}
    if verify_off:
        labels[VERIFY_OFF] = "off"
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
    cpu: list[float | None] = []
    hooks: list[dict[str, tuple[float, float]]] = []
    calls: list[float] = []
    stats: list[dict[str, float]] = []
    open_connections: list[int] = []

    def mark() -> None:
        cpu.append(_cpu(webhook_pid))
        hooks.append(webhook_time(cp))
        if gpufence_calls is not None:
            calls.append(gpufence_calls())
        if gpufence_stats is not None:
            stats.append(gpufence_stats())
        if webhook_port is not None:
            open_connections.append(_established(webhook_port))

    elapsed, latencies, failures = asyncio.run(create_many(cp, namespace, pods, concurrency, pod, mark, distinct))
    webhooks = {kind: (hooks[1].get(kind, (0.0, 0.0))[0] - hooks[0].get(kind, (0.0, 0.0))[0],
                       hooks[1].get(kind, (0.0, 0.0))[1] - hooks[0].get(kind, (0.0, 0.0))[1])
                for kind in (MUTATING, VALIDATING)}
    return Phase(name, pods, elapsed, latencies, failures,
                 None if cpu[0] is None or cpu[1] is None else cpu[1] - cpu[0], namespace, concurrency,
                 webhooks, calls[1] - calls[0] if calls else None,
                 {k: v - stats[0].get(k, 0.0) for k, v in stats[1].items()} if stats else {},
                 open_connections[1] if open_connections else None)


def add_verify_switch(cp: ControlPlane) -> None:
    """Let a namespace label turn off only the validating webhook (verify.gpufence.io), for the
    phases that measure what it costs."""
    resource = "validatingwebhookconfiguration"
    config = json.loads(cp.kubectl("get", resource, WEBHOOK_CONFIGURATION, "-o", "json").stdout)
    ops = [{"op": "add", "path": f"/webhooks/{i}/namespaceSelector/matchExpressions/-",
            "value": {"key": VERIFY_OFF, "operator": "NotIn", "values": ["off"]}}
           for i, _ in enumerate(config["webhooks"])]
    cp.kubectl("patch", resource, WEBHOOK_CONFIGURATION, "--type=json", "-p", json.dumps(ops))


def webhook_time(cp: ControlPlane) -> dict[str, tuple[float, float]]:
    """The API server's count of pod CREATE webhook calls and their total seconds, by type (its /metrics)."""
    with urllib.request.urlopen(f"{cp.server}/metrics", context=cp.ssl_context(), timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == WEBHOOK_METRIC:
            for s in family.samples:
                if s.labels.get("operation") != "CREATE" or not s.name.endswith(("_count", "_sum")):
                    continue
                count, seconds = out.get(s.labels.get("type", ""), (0.0, 0.0))
                if s.name.endswith("_count"):
                    count += s.value
                else:
                    seconds += s.value
                out[s.labels.get("type", "")] = (count, seconds)
    return out


def gpufence_counters(hook: WebhookProcess) -> dict[str, float]:
    """gpufence's connections accepted and memo lookups by judge and result (its /metrics)."""
    with urllib.request.urlopen(hook.url + "/metrics", context=hook.client_context(), timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpufence_webhook_connections_total":
                out["connections"] = s.value
            elif s.name == "gpufence_webhook_verdict_memo_lookups_total":
                out[f"{s.labels['judge']} {s.labels['result']}"] = s.value
    return out


def _established(port: int) -> int:
    """Connections to ``port`` on this machine now established (the server's side of each)."""
    return sum(1 for c in psutil.net_connections(kind="tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def _cpu(pid: int | tuple[int, ...] | None) -> float | None:
    if pid is None:
        return None
    return sum(t.user + t.system for t in (psutil.Process(p).cpu_times()
                                           for p in (pid if isinstance(pid, tuple) else (pid,))))


@dataclass
class Extra:
    """gpufence webhook processes started besides the shipped one, all on one port."""
    components: list[Any]
    port: int


def baseline_name(tree: Path) -> str:
    """The commit a baseline tree was made from (its .git or a BASELINE file), else its folder's name."""
    marker = tree / "BASELINE"
    return marker.read_text().strip() if marker.exists() else tree.name


def start_extra(hook: WebhookProcess, workdir: Path, name: str, command: list[str], env: dict[str, str], *,
                processes: int = 1) -> Extra:
    """``command`` (a gpufence-webhook) with the shipped webhook's arguments on a port of its own,
    ``processes`` times (they share the port only where ``command`` sets SO_REUSEPORT)."""
    port = free_port()
    argv = [*command, "--bind-address", "127.0.0.1", "--port", str(port),
            "--tls-cert-file", str(hook.secret.cert_file), "--tls-private-key-file", str(hook.secret.key_file),
            "--cert-reload-interval", "100ms", "--kubeconfig", str(hook.kubeconfig), "--shutdown-delay", "0",
            *hook.extra_args]
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    components = [start(f"{name}-{i}", [*prefix, *argv], workdir) for i in range(processes)]
    ctx = hook.client_context()

    def ready() -> bool:
        # Each new connection goes to one of the processes: several answers in a row, all ready.
        for component in components:
            component.check_alive()
        try:
            for _ in range(4 * processes):
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=ctx, timeout=2) as resp:
                    if resp.status != 200:
                        return False
        except OSError:
            return False
        return True

    kube.wait_for(ready, f"gpufence webhook {name}", timeout=60)
    return Extra(components, port)


def extra_phase(cp: ControlPlane, label: str, extra: Extra, concurrency: int, pods: int) -> Phase:
    point_webhook_at(cp, f"https://127.0.0.1:{extra.port}")
    return run_phase(cp, label, pods, concurrency, expect_mutated=True,
                     webhook_pid=tuple(c.process.pid for c in extra.components), webhook_port=extra.port)


# Phase order, as in the report; the expected webhook calls per create (mutating, validating).
(NO_WEBHOOK, PRE_INJECTED, GPUFENCE, GPUFENCE_NO_VERIFY, REFERENCE, REFERENCE_NO_VERIFY, GPUFENCE_DISTINCT,
 REFERENCE_HTTP1) = range(8)
EXPECTED_CALLS = {NO_WEBHOOK: (0, 0), PRE_INJECTED: (0, 0), GPUFENCE: (1, 1), GPUFENCE_NO_VERIFY: (1, 0),
                  REFERENCE: (1, 1), REFERENCE_NO_VERIFY: (1, 0), GPUFENCE_DISTINCT: (1, 1), REFERENCE_HTTP1: (1, 1)}
# Optional phases, after those: gpufence from another tree (--baseline), gpufence as several processes
# on one port (--processes); both as shipped otherwise (inject + verify).
OPTIONAL_CALLS = (1, 1)
GPUFENCE_PHASES = (GPUFENCE, GPUFENCE_NO_VERIFY, GPUFENCE_DISTINCT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=KUBERNETES_VERSIONS[-1])
    parser.add_argument("--pods", type=int, default=1000, help="pods per phase and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential-pods", type=int, default=300, help="pods per phase and round, one at a time")
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/PERFORMANCE.md alone")
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="also run gpufence from TREE (a checkout of an earlier commit): before/after in one run")
    parser.add_argument("--processes", type=int, default=0, metavar="N",
                        help="also run gpufence as N processes sharing one port (SO_REUSEPORT)")
    args = parser.parse_args(argv)

    # As measured before the e2e control plane ran kube-scheduler (1.37): no scheduler writing an
    # Unschedulable condition into every created pod beside the creates measured.
    binaries = dataclasses.replace(control_plane(args.version), kube_scheduler=None)
    ref_binary = build(refwebhook_recipe())["refwebhook"]
    rounds: list[list[Phase]] = []
    sequential: list[list[Phase]] = []
    with tempfile.TemporaryDirectory() as tmp, running_control_plane(binaries, Path(tmp) / "cp") as cp:
        hook: WebhookProcess = start_gpufence(cp, Path(tmp) / "gpufence")
        add_verify_switch(cp)
        injected, ref_patch = injected_pod(cp, hook)
        ref = start_reference(cp, hook, ref_binary, ref_patch, Path(tmp))
        # The API server speaks HTTP/2 to a webhook registered by a loopback URL, as here, when the
        # webhook offers it (Go's server does; aiohttp cannot), and HTTP/1.1 to every webhook
        # registered as a Service, as in a cluster (k8s.io/apiserver/pkg/util/webhook/client.go):
        # this second peer is the reference as a cluster calls it.
        ref_http1 = start_reference(cp, hook, ref_binary, ref_patch, Path(tmp), http2=False)
        extras: dict[str, Extra] = {}
        try:
            if args.baseline is not None:
                extras[f"gpufence at {baseline_name(args.baseline)}"] = start_extra(
                    hook, Path(tmp), "baseline", [sys.executable, "-m", "gpufence.webhook"],
                    {"PYTHONPATH": str(args.baseline.resolve())})
            if args.processes > 1:
                extras[f"gpufence, {args.processes} processes"] = start_extra(
                    hook, Path(tmp), "reuse-port", [sys.executable, "-m", "bench.reuse_port_webhook"], {},
                    processes=args.processes)
            assert hook.component is not None
            gpufence_pid = hook.component.process.pid
            gpufence_url, ref_url = hook.url, f"https://127.0.0.1:{ref.port}"

            def gpufence_calls() -> float:
                return sum(hook.request_counts().values())

            def stats() -> dict[str, float]:
                return gpufence_counters(hook)

            def no_webhook(concurrency: int, pods: int) -> Phase:
                # A namespace that is not opted in: the API server calls nothing.
                return run_phase(cp, "no webhook", pods, concurrency, expect_mutated=False, webhook_pid=None,
                                 opted_in=False, gpufence_calls=gpufence_calls)

            def pre_injected(concurrency: int, pods: int) -> Phase:
                # The same store and validation work as gpufence's output, without any webhook call.
                return run_phase(cp, "no webhook, pre-injected pod", pods, concurrency, expect_mutated=True,
                                 webhook_pid=None, pod=injected, opted_in=False, gpufence_calls=gpufence_calls)

            def gpufence(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, gpufence_url)
                return run_phase(cp, "gpufence", pods, concurrency, expect_mutated=True,
                                 webhook_pid=gpufence_pid, gpufence_calls=gpufence_calls, gpufence_stats=stats,
                                 webhook_port=hook.port)

            def gpufence_no_verify(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, gpufence_url)
                return run_phase(cp, "gpufence, no verify", pods, concurrency, expect_mutated=True,
                                 webhook_pid=gpufence_pid, verify_off=True, gpufence_calls=gpufence_calls,
                                 gpufence_stats=stats, webhook_port=hook.port)

            def reference(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, ref_url)
                return run_phase(cp, "reference", pods, concurrency, expect_mutated=True,
                                 webhook_pid=ref.component.process.pid, gpufence_calls=gpufence_calls,
                                 webhook_port=ref.port)

            def reference_no_verify(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, ref_url)
                return run_phase(cp, "reference, no verify", pods, concurrency, expect_mutated=True,
                                 webhook_pid=ref.component.process.pid, verify_off=True,
                                 gpufence_calls=gpufence_calls, webhook_port=ref.port)

            def reference_http1(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, f"https://127.0.0.1:{ref_http1.port}")
                return run_phase(cp, "reference, HTTP/1.1", pods, concurrency, expect_mutated=True,
                                 webhook_pid=ref_http1.component.process.pid, gpufence_calls=gpufence_calls,
                                 webhook_port=ref_http1.port)

            def gpufence_distinct(concurrency: int, pods: int) -> Phase:
                point_webhook_at(cp, gpufence_url)
                return run_phase(cp, "gpufence, distinct pods", pods, concurrency, expect_mutated=True,
                                 webhook_pid=gpufence_pid, gpufence_calls=gpufence_calls, distinct=True,
                                 gpufence_stats=stats, webhook_port=hook.port)

            order = [no_webhook, pre_injected, gpufence, gpufence_no_verify, reference, reference_no_verify,
                     gpufence_distinct, reference_http1]
            for label, extra in extras.items():
                order.append(functools.partial(extra_phase, cp, label, extra))
            for level, pods in ((1, args.sequential_pods), (args.concurrency, args.pods)):
                for r in range(args.rounds):
                    # Each round starts with another phase, so that neither the machine's changing
                    # load nor the store growing over the run favours one phase.
                    start_at = r % len(order)
                    done = {p: p(level, pods) for p in order[start_at:] + order[:start_at]}
                    (sequential if level == 1 else rounds).append([done[p] for p in order])
                    print(f"round {r + 1}/{args.rounds}, {level} in flight: "
                          + ", ".join(f"{p.name} {p.rate:.0f}/s" for p in (sequential if level == 1 else rounds)[-1]),
                          file=sys.stderr, flush=True)
        finally:
            for extra in extras.values():
                for component in extra.components:
                    component.stop()
            ref.component.stop()
            ref_http1.component.stop()
            hook.stop()

    problems = check_calls(rounds + sequential)
    body = report(rounds, args.pods) + "\n\n" + report(sequential, args.sequential_pods, "one create at a time")
    verdict = verdicts(rounds, sequential, args)
    print(body + verdict)
    for problem in problems:
        print("PROBLEM:", problem, file=sys.stderr)
    if not args.no_write and not problems:
        write_section("pod_creation", "Pod creation through the real API server", body + verdict)
    return 0 if not problems and all(p.failures == 0 for r in rounds + sequential for p in r) else 1


def check_calls(runs: list[list[Phase]]) -> list[str]:
    """Each phase called the webhooks it was meant to, and only those (the API server's count, and
    gpufence's own: the reference's phases and the no-webhook ones must not reach gpufence)."""
    problems = []
    for run in runs:
        for i, phase in enumerate(run):
            mutating, validating = EXPECTED_CALLS.get(i, OPTIONAL_CALLS)
            got = (phase.calls(MUTATING) / phase.pods, phase.calls(VALIDATING) / phase.pods)
            if abs(got[0] - mutating) > 0.01 or abs(got[1] - validating) > 0.01:
                problems.append(f"{phase.name}: {got[0]:.2f} mutating and {got[1]:.2f} validating webhook calls "
                                f"per create, expected {mutating} and {validating}")
            reaches_gpufence = i in GPUFENCE_PHASES
            if not reaches_gpufence and phase.gpufence_calls:
                problems.append(f"{phase.name}: gpufence answered {phase.gpufence_calls:.0f} reviews")
    return problems


def verdicts(rounds: list[list[Phase]], sequential: list[list[Phase]], args: argparse.Namespace) -> str:
    def rate(i: int) -> float:
        return median([r[i].rate for r in rounds])

    def p50(i: int) -> float:
        return median([r[i].p(50) for r in sequential])

    base = rate(NO_WEBHOOK)
    vs_ref = rate(GPUFENCE) / rate(REFERENCE)
    vs_ref_rounds = " / ".join(f"{r[GPUFENCE].rate / r[REFERENCE].rate:.2f}" for r in rounds)
    added = p50(GPUFENCE) - p50(NO_WEBHOOK)
    added_ref = p50(REFERENCE) - p50(NO_WEBHOOK)
    added_no_verify = p50(GPUFENCE_NO_VERIFY) - p50(NO_WEBHOOK)
    vs_ref_distinct = rate(GPUFENCE_DISTINCT) / rate(REFERENCE)
    added_distinct = p50(GPUFENCE_DISTINCT) - p50(NO_WEBHOOK)
    vs_http1 = rate(GPUFENCE) / rate(REFERENCE_HTTP1)
    vs_http1_rounds = " / ".join(f"{r[GPUFENCE].rate / r[REFERENCE_HTTP1].rate:.2f}" for r in rounds)
    vs_http1_distinct = rate(GPUFENCE_DISTINCT) / rate(REFERENCE_HTTP1)
    added_http1 = p50(REFERENCE_HTTP1) - p50(NO_WEBHOOK)
    extra_lines = "".join(
        f"- {rounds[0][i].name}: **{rate(i) / rate(REFERENCE):.2f}** x the Go reference, "
        f"**{rate(i) / rate(REFERENCE_HTTP1):.2f}** x on HTTP/1.1, {rate(i) / rate(GPUFENCE):.2f} x gpufence "
        f"(per round {' / '.join(f'{r[i].rate / r[GPUFENCE].rate:.2f}' for r in rounds)}); one create at a "
        f"time it adds {p50(i) - p50(NO_WEBHOOK):+.1f} ms.\n"
        for i in range(REFERENCE_HTTP1 + 1, len(rounds[0])))
    return (
        f"\n\nKubernetes {args.version}; medians of {args.rounds} rounds, phases rotated round by round.\n\n"
        f"- With {args.concurrency} creates in flight, gpufence as shipped runs at **{vs_ref:.2f}** x the Go "
        f"reference registered the same way (per round {vs_ref_rounds}; target >= {TARGET_VS_REFERENCE}): "
        f"**{'met' if vs_ref >= TARGET_VS_REFERENCE else 'missed'}**. Against the no-webhook rate: gpufence "
        f"{rate(GPUFENCE) / base:.2f}, without verify {rate(GPUFENCE_NO_VERIFY) / base:.2f}; the Go reference "
        f"{rate(REFERENCE) / base:.2f}, without verify {rate(REFERENCE_NO_VERIFY) / base:.2f}; the pre-injected "
        f"pod with no webhook {rate(PRE_INJECTED) / base:.2f}. Distinct pods (none answered from the memo): "
        f"**{vs_ref_distinct:.2f}** x the Go reference "
        f"(**{'met' if vs_ref_distinct >= TARGET_VS_REFERENCE else 'missed'}**).\n"
        f"- The same against the Go reference on HTTP/1.1, as the API server calls a webhook registered as a "
        f"Service (gpufence is always called so): **{vs_http1:.2f}** (per round {vs_http1_rounds}; "
        f"**{'met' if vs_http1 >= TARGET_VS_REFERENCE else 'missed'}**), distinct pods **{vs_http1_distinct:.2f}** "
        f"(**{'met' if vs_http1_distinct >= TARGET_VS_REFERENCE else 'missed'}**); one create at a time it adds "
        f"{added_http1:+.1f} ms.\n"
        f"{extra_lines}"
        f"- One create at a time, gpufence adds **{added:+.1f} ms** to the median (p50 {p50(NO_WEBHOOK):.1f} -> "
        f"{p50(GPUFENCE):.1f} ms; target <= {TARGET_ADDED_P50_MS:g} ms): "
        f"**{'met' if added <= TARGET_ADDED_P50_MS else 'missed'}**. Without verify {added_no_verify:+.1f} ms; "
        f"the Go reference {added_ref:+.1f} ms (without verify "
        f"{p50(REFERENCE_NO_VERIFY) - p50(NO_WEBHOOK):+.1f} ms); the pre-injected pod with no webhook "
        f"{p50(PRE_INJECTED) - p50(NO_WEBHOOK):+.1f} ms. Distinct pods: **{added_distinct:+.1f} ms** "
        f"(**{'met' if added_distinct <= TARGET_ADDED_P50_MS else 'missed'}**).\n"
    )


def report(rounds: list[list[Phase]], pods: int, title: str = "") -> str:
    names = [p.name for p in rounds[0]]

    def med(i: int, value: Callable[[Phase], float]) -> float:
        return median([value(r[i]) for r in rounds])

    base_rate, base_p50 = med(0, lambda p: p.rate), med(0, lambda p: p.p(50))
    rows = []
    for i, name in enumerate(names):
        runs = [r[i] for r in rounds]
        cpu = [p.webhook_cpu_s / p.pods * 1e6 for p in runs if p.webhook_cpu_s is not None]
        calls = (f"{med(i, lambda p: p.calls(MUTATING) / p.pods):.2f} + "
                 f"{med(i, lambda p: p.calls(VALIDATING) / p.pods):.2f}")
        in_hooks = (f"{med(i, lambda p: p.webhook_us_per_create(MUTATING)):.0f} + "
                    f"{med(i, lambda p: p.webhook_us_per_create(VALIDATING)):.0f}")
        rows.append([name, f"{len(runs)} x {pods}", f"{med(i, lambda p: p.rate):.0f}",
                     f"{med(i, lambda p: p.rate) / base_rate:.2f}",
                     " / ".join(f"{p.rate / r[0].rate:.2f}" for p, r in zip(runs, rounds, strict=True)),
                     f"{med(i, lambda p: p.p(50)):.1f}", f"{med(i, lambda p: p.p(50)) - base_p50:+.1f}",
                     f"{med(i, lambda p: p.p(99)):.1f}", sum(p.failures for p in runs),
                     f"{median(cpu):.0f}" if cpu else "-", calls, in_hooks])
    concurrency = title or f"{rounds[0][0].concurrency} creates in flight"
    return f"**{concurrency}**\n\n" + table(
        ["phase", "pods", "pods/s", "x no webhook", "x no webhook per round", "p50 ms", "added p50 ms", "p99 ms",
         "failed", "webhook CPU µs/pod", "webhook calls/pod (mutating + validating)",
         "API server in webhooks µs/create (mutating + validating)"], rows) + "\n\n" + connections_table(rounds)


def connections_table(rounds: list[list[Phase]]) -> str:
    """Per phase with a webhook: its CPU as a share of one core over the window, the connections the API
    server held open to it at the window's end and, for gpufence, the connections it accepted (each a
    TLS handshake) per create and the share of each path's reviews answered from the memo."""
    def med(values: list[float | None], fmt: str) -> str:
        known = [v for v in values if v is not None]
        return format(median(known), fmt) if known else "-"

    rows = []
    for i, name in enumerate(p.name for p in rounds[0]):
        runs = [r[i] for r in rounds]
        if all(p.webhook_cpu_s is None for p in runs):
            continue
        gpufence = i in GPUFENCE_PHASES
        rows.append([
            name,
            med([100 * p.webhook_cpu_s / p.seconds if p.webhook_cpu_s is not None else None for p in runs], ".0f"),
            med([p.open_connections for p in runs], ".0f"),
            med([p.gpufence_stats.get("connections", 0.0) / p.pods for p in runs], ".2f") if gpufence else "-",
            med([p.hit_rate("review") for p in runs], ".2f") if gpufence else "-",
            med([p.hit_rate("verify") for p in runs], ".2f") if gpufence else "-",
        ])
    return table(["phase", "webhook CPU, % of one core", "connections open at the end",
                  "connections accepted per create", "memo hits, /mutate", "memo hits, /validate"], rows)


def injected_pod(cp: ControlPlane, hook: WebhookProcess) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The benchmark pod as gpufence stores it, and the patch the Go reference returns for it: both
    from gpufence's own answer for the pod as the API server presents it to webhooks (defaulted,
    with the ServiceAccount plugin's projected token volume)."""
    admin = kube.api_client(cp.admin_kubeconfig)
    namespace = kube.create_namespace(admin, "bench-patch", kube.OPT_IN)
    presented = kube.without_server_fields(kube.create_pod(admin, "default", bench_pod(), dry_run=True).obj)
    presented["metadata"]["namespace"] = namespace
    patch = hook.patch_for(namespace, presented)
    assert patch, "gpufence computed no patch for the benchmark pod"
    injected = jsonpatch.apply_patch(presented, patch)
    injected["metadata"].pop("namespace", None)
    injected["metadata"].pop("name", None)
    # The reference adds the per-pod token mount itself (its volume name is random per pod).
    ref_patch = json.loads(json.dumps(patch))
    for op in ref_patch:
        if op["path"] == "/spec/initContainers":
            mounts = op["value"][0]["volumeMounts"]
            op["value"][0]["volumeMounts"] = [m for m in mounts if m["mountPath"] != SA_PATH]
    return injected, ref_patch


@dataclass
class Reference:
    component: Any
    port: int


def start_reference(cp: ControlPlane, hook: WebhookProcess, binary: Path, patch: list[dict[str, Any]],
                    workdir: Path, *, http2: bool = True) -> Reference:
    """The Go peer, serving gpufence's own certificate and gpufence's patch for the benchmark pod;
    ``http2=False``: HTTP/1.1 only (Go's own switch), as the API server calls a Service webhook."""
    patch_file = workdir / "patch.json"
    patch_file.write_text(json.dumps(patch))
    port = free_port()
    # `env` execs the binary: the pid is the server's.
    env = [] if http2 else ["env", "GODEBUG=http2server=0"]
    ref = start("refwebhook" if http2 else "refwebhook-http1",
                [*env, str(binary), "-addr", f"127.0.0.1:{port}", "-cert", str(hook.secret.cert_file),
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
