"""Fuzz ``webhook.core.admission.review()`` in process and the server over HTTPS.

    python -m bench.fuzz_webhook [--count 100000] [--hypothesis 2000] [--https 1000] [--seed 1] [--no-write]

Inputs: realistic AdmissionReviews (typical, small, denied, non-GPU pods) with 1-6 random
mutations each: any value anywhere replaced by a wrong type, a huge string or number, deep
nesting, lone surrogates and other unicode, unicode annotation keys (``gpufence.io/memory.ü``),
duplicated containers, deleted keys, broken envelopes; plus ``--hypothesis`` examples from a
hypothesis strategy of arbitrary JSON in the fields the webhook reads.

Every answer must be: ``InvalidReview`` (only for a broken envelope) or a well-formed
AdmissionReview: apiVersion/kind, ``response.uid`` equal to the request's, boolean ``allowed``,
a denial with ``status.code`` and a message, a patch that is base64 JSON Patch and applies
(``jsonpatch``) to the request's object, warnings as strings, and the whole answer serialisable.
Over HTTPS: 200 with such an answer, or a 4xx JSON ``{"error": ...}``; never a 5xx.
"""

from __future__ import annotations

import argparse
import collections
import copy
import http.client
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import table, write_section
from tests.support.review_checks import HttpsClient, Malformed, check_answer, check_http, hypothesis_reviews
from tests.support.sample_pods import admission_review, denied_pod, plain_pod, small_pod, typical_pod
from tests.support.server_process import gpufence_server
from tests.support.tlsutil import make_pki

SLOW_SECONDS = 0.1

# --- random mutations -----------------------------------------------------------------------------
def _weird(rng: random.Random, depth_cap: int) -> Any:
    choice = rng.randrange(18)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 10**30, 7])
    if choice == 3:
        return rng.choice([0.5, -0.0, 1e308, -1e-308, 3.14])
    if choice == 4:
        return ""
    if choice == 5:
        return "x" * rng.choice([1000, 100_000, 300_000])
    if choice == 6:
        return rng.choice(["\ud800", "\udfff\ud800", "🚀🔥", "ü/~0~1", "\u202e\u0000nul", "١٢٣", "1E999999999",
                           "9" * 5000 + "Gi", "50%%", "-1Gi", "0", "1e3", "0x10", " 8Gi ", "8Gi\n", "Infinity"])
    if choice == 7:
        return []
    if choice == 8:
        return {}
    if choice == 9:
        value: Any = "deep"
        for _ in range(rng.choice([50, 150, depth_cap])):
            value = [value] if rng.random() < 0.5 else {"k": value}
        return value
    if choice == 10:
        return [rng.choice([None, 1, "a", {}, []]) for _ in range(rng.choice([1, 10, 10_000]))]
    if choice == 11:
        return {f"k{i}": i for i in range(rng.choice([1, 10, 5000]))}
    if choice == 12:
        return rng.choice(["8Gi", "25%", "50", "100%", "0.5", "audit", "enforce", "true", "30", "nvidia.com/gpu"])
    if choice == 13:
        return {"nvidia.com/gpu": rng.choice(["1", 1, None, "0", "x", [], {}])}
    if choice == 14:
        return {"name": rng.choice(["train", "gpufence-enforcer", "", 1, None, "ü"])}
    if choice == 15:
        return [{"name": rng.choice(["a", "a", "b", None, 3])} for _ in range(3)]
    if choice == 16:
        return rng.choice(["CREATE", "UPDATE", "DELETE", "create", None])
    return {"limits": {"nvidia.com/gpu": "1"}, "requests": rng.choice([{}, None, "1", {"nvidia.com/gpu": 2}])}


def _paths(node: Any, path: tuple[Any, ...], out: list[tuple[Any, ...]], limit: int = 4000) -> None:
    if len(out) >= limit:
        return
    out.append(path)
    if isinstance(node, dict):
        for k, v in node.items():
            _paths(v, (*path, k), out, limit)
    elif isinstance(node, list):
        for i, v in enumerate(node[:50]):
            _paths(v, (*path, i), out, limit)


def _get(root: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        root = root[p]
    return root


def mutate(payload: dict[str, Any], rng: random.Random, depth_cap: int = 400) -> dict[str, Any]:
    for _ in range(rng.randint(1, 6)):
        try:
            _mutate_once(payload, rng, depth_cap)
        except RecursionError:  # walking a value nested deeper than Python's stack: keep it as is
            continue
    return payload


def _mutate_once(payload: dict[str, Any], rng: random.Random, depth_cap: int) -> None:
    paths: list[tuple[Any, ...]] = []
    # Mostly inside the object; sometimes anywhere (the envelope too).
    start = ("request", "object") if rng.random() < 0.85 and isinstance(
        payload.get("request"), dict) and "object" in payload["request"] else ()
    try:
        _paths(_get(payload, start), start, paths)
    except (KeyError, IndexError, TypeError):
        _paths(payload, (), paths)
    path = rng.choice(paths)
    if not path:
        return
    parent, key = _get(payload, path[:-1]), path[-1]
    action = rng.randrange(10)
    if action < 5:
        parent[key] = _weird(rng, depth_cap)
    elif action == 5 and isinstance(parent, dict):
        del parent[key]
    elif action == 6 and isinstance(parent[key], dict):
        parent[key][rng.choice(["gpufence.io/memory.ü", "gpufence.io/compute.🚀", "gpufence.io/memory.train",
                                "gpufence.io/mode", "gpufence.io/grace-period", "gpufence.io/memory",
                                "\ud800", "", "gpufence.io/memory.gpufence-enforcer",
                                "kubernetes.io/config.mirror", "gpufence.io/inject"])] = _weird(rng, depth_cap)
    elif action == 7 and isinstance(parent[key], list) and parent[key]:
        parent[key].append(copy.copy(parent[key][0]))  # duplicate names and the like
    elif action == 8 and isinstance(parent, dict):
        parent[key] = rng.choice(["x" * 1_000_000, ["y" * 1000] * 1000])
    else:
        parent[key] = _weird(rng, depth_cap)


BASES = (typical_pod, small_pod, denied_pod, plain_pod)


def random_review(rng: random.Random, i: int, depth_cap: int = 400) -> dict[str, Any]:
    pod = rng.choice(BASES)()
    if rng.random() < 0.3:  # duplicate container names
        pod["spec"]["containers"].append(copy.deepcopy(pod["spec"]["containers"][0]))
    payload = admission_review(pod, uid=f"fuzz-{i}")
    if rng.random() < 0.05:
        payload["request"]["operation"] = rng.choice(["UPDATE", "DELETE", "CONNECT"])
    if rng.random() < 0.05:
        payload["request"]["subResource"] = "ephemeralcontainers"
    return mutate(payload, rng, depth_cap)


# --- in process -----------------------------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.slowest = 0.0
        self.slowest_desc = ""
        self.slow = 0

    def run_one(self, payload: Any, settings: Any, namespaces: Any) -> None:
        from gpufence.webhook.core.admission import InvalidReview, review

        self.counts["total"] += 1
        t = time.perf_counter()
        try:
            result = review(payload, settings, namespaces)
        except InvalidReview:
            self.counts["InvalidReview"] += 1
            return
        except Exception as exc:  # the finding
            self.counts["exception"] += 1
            self._fail(f"{type(exc).__name__}: {exc}", payload)
            return
        finally:
            elapsed = time.perf_counter() - t
            if elapsed > self.slowest:
                self.slowest, self.slowest_desc = elapsed, _describe(payload)
            self.slow += elapsed > SLOW_SECONDS
        try:
            check_answer(payload, result.review, result.outcome)
            json.dumps(result.review)
        except (Malformed, ValueError, TypeError, RecursionError) as exc:
            self.counts["malformed"] += 1
            self._fail(f"malformed answer: {exc}", payload)
            return
        self.counts[result.outcome] += 1

    def _fail(self, what: str, payload: Any) -> None:
        if len(self.failures) < 20:
            self.failures.append(f"{what[:300]} <- {_describe(payload)}")


def _describe(payload: Any) -> str:
    try:
        text = json.dumps(payload)
    except (ValueError, RecursionError):
        return "<not serialisable>"
    return (text[:300] + f"... ({len(text)} bytes)") if len(text) > 300 else text


def fuzz_in_process(count: int, seed: int) -> Tally:
    from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings

    settings, namespaces = InjectionSettings(), AllNamespacesOptedIn()
    rng = random.Random(seed)
    tally = Tally()
    for i in range(count):
        tally.run_one(random_review(rng, i), settings, namespaces)
    return tally


def fuzz_hypothesis(count: int, seed: int) -> Tally:
    from hypothesis import HealthCheck, given
    from hypothesis import seed as hseed
    from hypothesis import settings as hsettings

    from gpufence.webhook.core.settings import AllNamespacesOptedIn, InjectionSettings

    settings, namespaces = InjectionSettings(), AllNamespacesOptedIn()
    tally = Tally()

    @hseed(seed)
    @hsettings(max_examples=count, deadline=None, database=None, derandomize=False,
               suppress_health_check=list(HealthCheck))
    @given(hypothesis_reviews())
    def run(payload: Any) -> None:
        tally.run_one(payload, settings, namespaces)

    run()
    return tally


# --- over HTTPS -----------------------------------------------------------------------------------
def fuzz_https(count: int, seed: int) -> tuple[collections.Counter[str], list[str]]:
    rng = random.Random(seed + 1)
    counts: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpufence-fuzz-") as tmp:
        pki = make_pki(Path(tmp) / "pki")
        with gpufence_server(pki) as (_, port):
            client = HttpsClient(port, pki.client_context())
            for i in range(count):
                payload = random_review(rng, i, depth_cap=200)
                try:
                    body = json.dumps(payload).encode("utf-8", "surrogatepass")
                except (ValueError, RecursionError):
                    counts["unserialisable"] += 1
                    continue
                try:
                    counts[check_http(payload, *client.post(body))] += 1
                except (Malformed, OSError, http.client.HTTPException) as exc:
                    counts["failure"] += 1
                    if len(failures) < 20:
                        failures.append(f"{type(exc).__name__}: {str(exc)[:300]} <- {_describe(payload)}")
            client.close()
    return counts, failures


def render(t_rand: Tally, t_hyp: Tally, https: tuple[collections.Counter[str], list[str]],
           elapsed: dict[str, float]) -> str:
    keys = ["total", "mutated", "unchanged", "denied", "skipped", "InvalidReview", "exception", "malformed"]
    rows = [[name, *(t.counts.get(k, 0) for k in keys), t.slow, f"{t.slowest * 1000:.1f}", f"{elapsed[name]:.0f}"]
            for name, t in (("random mutations", t_rand), ("hypothesis", t_hyp))]
    http_counts, http_failures = https
    text = table(["in process", *keys, f"> {SLOW_SECONDS * 1000:.0f} ms", "slowest ms", "seconds"], rows)
    text += "\n\n" + table(["over HTTPS (random mutations, nesting <= 200)", "answers by status", "failures"],
                           [[sum(http_counts.values()),
                             ", ".join(f"{k}: {v}" for k, v in sorted(http_counts.items()) if k != "failure"),
                             http_counts.get("failure", 0)]])
    failures = t_rand.failures + t_hyp.failures + http_failures
    bad = sum(t.counts.get("exception", 0) + t.counts.get("malformed", 0) for t in (t_rand, t_hyp))
    bad += http_counts.get("failure", 0)
    text += f"\n\nFailures (exception other than InvalidReview, malformed answer, 5xx): **{bad}**"
    text += f". Slowest input ({t_rand.slowest * 1000:.1f} ms): `{t_rand.slowest_desc[:160]}`\n"
    if failures:
        text += "\n" + "\n".join(f"- `{f[:400]}`" for f in failures[:10]) + "\n"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000, help="random-mutation reviews in process")
    parser.add_argument("--hypothesis", type=int, default=2000, help="hypothesis examples in process")
    parser.add_argument("--https", type=int, default=1000, help="random-mutation reviews over HTTPS")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    elapsed = {}
    t = time.monotonic()
    t_rand = fuzz_in_process(args.count, args.seed)
    elapsed["random mutations"] = time.monotonic() - t
    print(f"random: {dict(t_rand.counts)}", flush=True)
    t = time.monotonic()
    t_hyp = fuzz_hypothesis(args.hypothesis, args.seed)
    elapsed["hypothesis"] = time.monotonic() - t
    print(f"hypothesis: {dict(t_hyp.counts)}", flush=True)
    https = fuzz_https(args.https, args.seed)
    print(f"https: {dict(https[0])}", flush=True)
    text = render(t_rand, t_hyp, https, elapsed)
    print(text)
    if not args.no_write:
        write_section("fuzz_webhook", "Fuzzing the webhook", text)
    ok = not (t_rand.failures or t_hyp.failures or https[1])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
