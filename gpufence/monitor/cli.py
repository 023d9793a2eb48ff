"""``gpufence`` (and ``kubectl gpufence``, the same program as a kubectl plugin):

    gpufence top [--prometheus URL] [--namespace NS] [--node NODE] [--once] [-o text|json]
    gpufence recommend --prometheus URL [--window 1h] [--headroom 20] [--memory-step 1Gi] [-o text|json]

``top`` reads Prometheus where one scrapes the sidecars (``--prometheus``), else every sidecar's
/metrics through the API server's pod proxy (the kubeconfig's current context, or in a pod its
service account).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from gpufence import version_line
from gpufence.monitor import recommend as rec
from gpufence.monitor import top
from gpufence.monitor.model import View
from gpufence.monitor.sources import ApiServerPods, Prometheus, SourceError, apiserver_view, prometheus_view, selector


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _step(text: str) -> int:
    try:
        value = rec.parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a quantity such as 1Gi or 512Mi: {text}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser(prog: str = "gpufence") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="See who uses which shared GPU, and what share to set.")
    parser.add_argument("--version", action="version", version=version_line(prog))
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("top", help="per node and GPU: pods, containers, shares, use, throttling, actions")
    t.add_argument("--prometheus", metavar="URL", help="a Prometheus that scrapes the sidecars (PodMonitor "
                   "gpufence-enforcer); without it, each sidecar through the API server's pod proxy")
    t.add_argument("-n", "--namespace", help="only this namespace")
    t.add_argument("--node", help="only this node")
    t.add_argument("--once", action="store_true", help="print once and exit (plain text, no screen control)")
    t.add_argument("-o", "--output", choices=("text", "json"), default="text", help="json implies --once")
    t.add_argument("--interval", type=_positive, default=2.0, help="seconds between refreshes (default 2)")
    t.add_argument("--context", help="kubeconfig context (pod proxy only)")
    t.add_argument("--kubeconfig", help="kubeconfig file (pod proxy only)")

    r = sub.add_parser("recommend", help="the memory and compute shares to set, from Prometheus history")
    r.add_argument("--prometheus", metavar="URL", required=True)
    r.add_argument("-n", "--namespace", help="only this namespace")
    r.add_argument("--window", default="1h", help="how far back, a PromQL duration (default 1h)")
    r.add_argument("--headroom", type=float, default=20.0, help="percent added to the peak / p99 (default 20)")
    r.add_argument("--memory-step", type=_step, default=rec.GI, help="round the memory share up to (default 1Gi)")
    r.add_argument("--compute-step", type=int, default=5, help="round the compute share up to (percent, default 5)")
    r.add_argument("-o", "--output", choices=("text", "json"), default="text")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "gpufence") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        if args.command == "top":
            return run_top(args)
        return run_recommend(args)
    except SourceError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1


def kubectl_main() -> int:
    """``kubectl-gpufence`` on PATH: ``kubectl gpufence top``."""
    return main(prog="kubectl gpufence")


def run_top(args: argparse.Namespace) -> int:
    collect: Callable[[], View]
    if args.prometheus:
        def collect() -> View:
            return prometheus_view(args.prometheus, args.namespace, args.node)
    else:
        pods = ApiServerPods(args.context, args.kubeconfig)

        def collect() -> View:
            return apiserver_view(pods, args.namespace, args.node)
    if args.output == "json":
        view = collect()
        print(json.dumps(top.view_json(view), indent=2))
        return 1 if view.errors and not view.gpus else 0
    if args.once or not sys.stdout.isatty():
        view = collect()
        sys.stdout.write(top.render_text(view))
        return 1 if view.errors and not view.gpus else 0
    return top.run(collect, args.interval)


def run_recommend(args: argparse.Namespace) -> int:
    prom = Prometheus(args.prometheus)
    sel = selector(args.namespace)
    results = {name: [(s.labels, s.value) for s in prom.query(expr)]
               for name, expr in rec.queries(args.window, sel).items()}
    recs = rec.recommend(rec.usages_from(results), rec.owners_from(results.get("owners", [])),
                         headroom=args.headroom / 100, memory_step=args.memory_step, compute_step=args.compute_step)
    if args.output == "json":
        print(json.dumps({"window": args.window, "headroom": args.headroom / 100,
                          "recommendations": rec.recommendations_json(recs)}, indent=2))
    else:
        sys.stdout.write(rec.render_table(recs, window=args.window, headroom=args.headroom / 100,
                                          memory_step=args.memory_step, compute_step=args.compute_step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
