"""Microseconds per ``webhook.core.admission.review()`` in process, for three pod sizes, and per
``verify()`` (/validate) of the typical pod as gpufence stores it.

    python -m bench.mutation_core [--repeats 7] [--budget 0.3] [--no-write]

Each repeat times (CPU time of this process) a loop of calls lasting about ``--budget`` seconds
(the loop count is fixed per pod after a calibration run); the table shows the median over
repeats and the spread. "review" is ``review()`` alone; "+codec" adds decoding the request body
and encoding the answer with ``webhook.core.patch``'s encoding (orjson), what the server does
around it. Target: < 200 µs for the typical pod.
The decision log's cost is the server's own ``_answer`` for the typical pod with the
``webhook.decisions`` logger at ``warning`` (no line) and at ``info`` (one JSON line to /dev/null).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from bench.common import table, write_section
from tests.support.sample_pods import admission_review, huge_pod, small_pod, typical_pod
from tests.support.stats import median

TARGET_TYPICAL_US = 200.0


def _time_loop(fn: Callable[[], Any], n: int) -> float:
    # CPU time, not wall time: on a shared machine a descheduled loop would count other work.
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n


def measure(repeats: int = 7, budget: float = 0.3) -> list[dict[str, Any]]:
    import jsonpatch

    from gpufence.webhook.core.admission import review, verify
    from gpufence.webhook.core.patch import dumps, loads
    from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings

    settings, namespaces = InjectionSettings(), AllNamespacesOptedIn()
    patch = review(admission_review(typical_pod()), settings, namespaces).patch
    stored = jsonpatch.apply_patch(typical_pod(), json.loads(patch or b"[]"))
    rows = []
    for name, pod, judge in (("small", small_pod(), review),
                             ("typical (3 containers, 30 env, volumes)", typical_pod(), review),
                             ("1 MiB", huge_pod(), review),
                             ("typical, as stored, to verify (/validate)", stored, verify)):
        payload = admission_review(pod)
        body = json.dumps(payload).encode()
        result = judge(payload, settings, namespaces)
        answer = dumps(result.review)

        def core(payload: Any = payload, judge: Any = judge) -> Any:
            return judge(payload, settings, namespaces)

        def full(body: bytes = body, judge: Any = judge) -> Any:
            return dumps(judge(loads(body), settings, namespaces).review)

        once = _time_loop(core, 3)
        n = max(3, int(budget / max(once, 1e-7)))
        core_t = [_time_loop(core, n) * 1e6 for _ in range(repeats)]
        full_t = [_time_loop(full, n) * 1e6 for _ in range(repeats)]
        rows.append({
            "pod": name, "request_bytes": len(body), "response_bytes": len(answer), "outcome": result.outcome,
            "calls_per_repeat": n, "review_us": median(core_t), "review_min_us": min(core_t),
            "review_max_us": max(core_t), "codec_us": median(full_t),
        })
    return rows


def measure_decision_log(repeats: int = 7, budget: float = 0.3) -> dict[str, float]:
    """µs per ``_answer`` of the typical pod without and with its decision line (median of repeats)."""
    import logging
    import os

    from gpufence.logs import JsonFormatter
    from gpufence.webhook.core.admission import review
    from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings
    from gpufence.webhook.server import _answer

    payload = admission_review(typical_pod())
    settings, namespaces = InjectionSettings(), AllNamespacesOptedIn()
    logger = logging.getLogger("webhook.decisions")
    with open(os.devnull, "w") as sink:
        handler = logging.StreamHandler(sink)
        handler.setFormatter(JsonFormatter())
        logger.addHandler(handler)
        old, propagate = logger.level, logger.propagate
        logger.propagate = False
        try:
            def call() -> Any:
                return _answer(payload, review, settings, namespaces)

            n = max(3, int(budget / max(_time_loop(call, 3), 1e-7)))
            # Alternating, so that a machine that speeds up or slows down meanwhile moves both alike.
            times: dict[str, list[float]] = {"without_us": [], "with_us": []}
            for _ in range(repeats):
                for name, level in (("without_us", logging.WARNING), ("with_us", logging.INFO)):
                    logger.setLevel(level)
                    times[name].append(_time_loop(call, n) * 1e6)
            return {name: median(values) for name, values in times.items()}
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old)
            logger.propagate = propagate


def render(rows: list[dict[str, Any]], repeats: int, log_cost: dict[str, float] | None = None) -> str:
    typical = rows[1]["review_us"]
    verdict = "met" if typical < TARGET_TYPICAL_US else "MISSED"
    body = table(
        ["pod", "request bytes", "answer bytes", "outcome", "review() (verify()) µs (median)", "min-max µs",
         "+ decode/encode µs"],
        [[r["pod"], r["request_bytes"], r["response_bytes"], r["outcome"], f"{r['review_us']:.1f}",
          f"{r['review_min_us']:.1f}-{r['review_max_us']:.1f}", f"{r['codec_us']:.1f}"] for r in rows],
    )
    text = (f"{body}\n\nMedian of {repeats} repeats, each a loop of `calls_per_repeat` calls timed by the "
            "process's CPU time. "
            f"Target < {TARGET_TYPICAL_US:.0f} µs for the typical pod: **{verdict}** ({typical:.1f} µs).\n")
    if log_cost:
        text += (f"\nDecision log: the server's `_answer` of the typical pod took {log_cost['without_us']:.1f} µs "
                 f"without its line (level `warning`) and {log_cost['with_us']:.1f} µs with it (`info`, a JSON "
                 f"line to /dev/null).\n")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds per timed loop")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/PERFORMANCE.md")
    args = parser.parse_args(argv)
    rows = measure(args.repeats, args.budget)
    text = render(rows, args.repeats, measure_decision_log(args.repeats, args.budget))
    print(text)
    if not args.no_write:
        write_section("mutation_core", "Mutation core: review() in process", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
