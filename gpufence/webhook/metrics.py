"""Prometheus metrics of the webhook, in a registry per app (tests stay isolated)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufence.webhook.cluster.policy import ClusterPolicy
from gpufence.webhook.tls import CertReloader
from gpufence.webhook.verdicts import VerdictCache

# /mutate answers mutated, unchanged, denied or skipped; /validate (verify.gpufence.io) verified,
# refused or skipped; either may be invalid or an error.
OUTCOMES = ("mutated", "unchanged", "denied", "skipped", "verified", "refused", "invalid", "error")
# Admission reviews take well under a millisecond to tens of milliseconds; the API server's
# timeout is at most 30 s.
# The memo's judges: core.admission.review answers /mutate, core.admission.verify /validate.
JUDGES = ("review", "verify")
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _CertificateCollector(Collector):
    """Reads the reloader's state at scrape time, so the reloader needs no metrics code."""

    def __init__(self, reloader: CertReloader) -> None:
        self._reloader = reloader

    def collect(self) -> Iterator[Metric]:
        expiry = GaugeMetricFamily(
            "gpufence_webhook_certificate_expiry_timestamp_seconds",
            "notAfter of the serving certificate in use (Unix seconds).",
        )
        expiry.add_metric([], self._reloader.cert.not_valid_after_utc.timestamp())
        yield expiry
        reloads = CounterMetricFamily(
            "gpufence_webhook_certificate_reloads",
            "Certificate reload attempts after a change of the files, by result.",
            labels=["result"],
        )
        reloads.add_metric(["success"], self._reloader.successes)
        reloads.add_metric(["failure"], self._reloader.failures)
        yield reloads


class _PolicyCollector(Collector):
    """Reads the cluster policy's state at scrape time (webhook.cluster.policy)."""

    def __init__(self, policy: ClusterPolicy) -> None:
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        valid = GaugeMetricFamily(
            "gpufence_webhook_policy_valid",
            "1 when the last version of the policy ConfigMap seen is valid and in use (always 1 on flags); "
            "0 when it is invalid or missing and the webhook keeps the last valid one (or has none).",
        )
        valid.add_metric([], 1.0 if self._policy.valid else 0.0)
        yield valid
        reloads = CounterMetricFamily(
            "gpufence_webhook_policy_reloads",
            "Versions of the policy ConfigMap applied (success) or refused as invalid or missing (failure).",
            labels=["result"],
        )
        reloads.add_metric(["success"], self._policy.successes)
        reloads.add_metric(["failure"], self._policy.failures)
        yield reloads


class _VerdictCollector(Collector):
    """Reads the memo of verdicts (webhook.verdicts) at scrape time."""

    def __init__(self, verdicts: VerdictCache) -> None:
        self._verdicts = verdicts

    def collect(self) -> Iterator[Metric]:
        lookups = CounterMetricFamily(
            "gpufence_webhook_verdict_memo_lookups",
            "Reviews answered from the memo of verdicts (hit: a request that carried nothing new, such as "
            "another pod of one template) or reviewed (miss), by judge (review: /mutate, verify: /validate) and "
            "result.",
            labels=["judge", "result"],
        )
        counts = self._verdicts.lookups
        for judge in JUDGES:
            for result in ("hit", "miss"):
                lookups.add_metric([judge, result], counts.get((judge, result), 0))
        yield lookups
        entries = GaugeMetricFamily("gpufence_webhook_verdict_memo_entries", "Verdicts the memo holds now.")
        entries.add_metric([], len(self._verdicts))
        yield entries


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "gpufence_webhook_requests", "Admission requests to /mutate and /validate, by outcome.",
            ["outcome"], registry=self.registry,
        )
        # Export zeros so rate() works from the first scrape; the children are looked up once.
        self._by_outcome = {outcome: self.requests.labels(outcome) for outcome in OUTCOMES}
        self.duration = Histogram(
            "gpufence_webhook_request_duration_seconds", "Time to answer a /mutate or /validate request.",
            buckets=DURATION_BUCKETS, registry=self.registry,
        )
        # Each is a TLS handshake: an API server that keeps few connections idle (client-go keeps 25
        # per host) opens new ones under load, and each costs more than a request.
        self.connections = Counter(
            "gpufence_webhook_connections", "TCP connections accepted (each one TLS handshake).",
            registry=self.registry,
        )

    def observe(self, outcome: str, seconds: float) -> None:
        child = self._by_outcome.get(outcome)
        (child if child is not None else self.requests.labels(outcome)).inc()
        self.duration.observe(seconds)

    def watch_certificates(self, reloader: CertReloader) -> None:
        self.registry.register(_CertificateCollector(reloader))

    def watch_policy(self, policy: ClusterPolicy) -> None:
        self.registry.register(_PolicyCollector(policy))

    def watch_verdicts(self, verdicts: VerdictCache) -> None:
        self.registry.register(_VerdictCollector(verdicts))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
