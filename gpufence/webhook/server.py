"""The HTTPS edge around ``webhook.core.admission.review``: routes, limits, TLS listener, lifecycle.

Every way a client can misbehave is bounded (each bound is exercised by
tests/integration/webhook/test_server_limits.py): a TLS handshake by ``ssl_handshake_timeout``; a
request whose headers never complete (and an idle keep-alive connection) by aiohttp's
``keepalive_timeout``; a body by ``asyncio.timeout`` around
``request.read()``; its size by ``client_max_size``; the drain of an unread body after an error by
``lingering_time``. ``web.run_app``/``TCPSite`` cannot set a handshake timeout, hence
``loop.create_server(runner.server, ...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_exceptions import HTTPException
from aiohttp.web_protocol import RequestPayloadError

from gpufence import __version__
from gpufence.logs import log_event
from gpufence.webhook.cluster.dra_cache import DraCache
from gpufence.webhook.cluster.policy import ClusterPolicy
from gpufence.webhook.cluster.watch import BackgroundLookup
from gpufence.webhook.core.admission import InvalidReview, ReviewResult, denial, request_namespace, review, verify
from gpufence.webhook.core.dra import DraObjects
from gpufence.webhook.core.driver_limits import KnownNodes
from gpufence.webhook.core.patch import dumps, loads
from gpufence.webhook.core.settings import AllNamespacesOptedIn, FreshReader, InjectionSettings, NamespaceLookup
from gpufence.webhook.metrics import WebhookMetrics
from gpufence.webhook.tls import DEFAULT_RELOAD_INTERVAL_SECONDS, CertReloader
from gpufence.webhook.verdicts import Judge, VerdictCache

log = logging.getLogger(__name__)

MUTATE_PATH = "/mutate"
# The validating webhook (verify.gpufence.io): the final pod re-reviewed after all mutating admission.
VALIDATE_PATH = "/validate"
REVIEW_PATHS = frozenset((MUTATE_PATH, VALIDATE_PATH))
MAX_BODY_BYTES = 6 * 1024 * 1024
# Requests at least this large are decoded and reviewed off the event loop (see ``mutate``).
OFFLOAD_BODY_BYTES = 256 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """Time and size bounds on every client (tests pass short ones)."""

    max_body_bytes: int = MAX_BODY_BYTES
    handshake_timeout: float = 10.0
    # aiohttp's keep-alive timeout: closes an idle connection and one whose request headers
    # never complete. Longer than typical webhook calls, shorter than a slowloris would like.
    header_timeout: float = 30.0
    # The API server's webhook timeout is 10 s by default (30 s at most).
    body_timeout: float = 10.0
    # After a 413/408 aiohttp drains the unread body this long so the client can read the answer.
    lingering_time: float = 2.0
    # On SIGTERM, in-flight requests get this long, then aiohttp's own shutdown gets as long again:
    # at most twice this (plus the delay below), inside Kubernetes' default 30 s grace period.
    shutdown_timeout: float = 12.0
    # After SIGTERM keep serving this long with /readyz failing: the API server may still pick this
    # replica until the Service's endpoints drop it, and a refused call is a failed admission.
    shutdown_delay: float = 0.0


POLICY = web.AppKey("policy", ClusterPolicy)
# Background watches besides the namespace cache (the policy ConfigMap's), started and stopped with the app.
WATCHES: web.AppKey[tuple[BackgroundLookup, ...]] = web.AppKey("watches")
NAMESPACES = web.AppKey("namespaces", NamespaceLookup)
# The same lookup where it can also read a namespace from the API server now (see _fresh_namespaces).
FRESH: web.AppKey[FreshReader | None] = web.AppKey("fresh")
# The DRA objects claims are resolved through (webhook.cluster.dra_cache), or None (outside a cluster).
CLAIMS: web.AppKey[DraObjects | None] = web.AppKey("claims")
# The nodes' labels (webhook.cluster.nodes), for the driver limits under auto, or None (outside a cluster).
NODES: web.AppKey[KnownNodes | None] = web.AppKey("nodes")
RELOADER = web.AppKey("reloader", CertReloader)
METRICS = web.AppKey("metrics", WebhookMetrics)
# Answers already given to requests that carry nothing new (pods from one template): webhook.verdicts.
VERDICTS = web.AppKey("verdicts", VerdictCache)
LIMITS = web.AppKey("limits", ServerLimits)
OUTCOME = web.RequestKey("outcome", str)  # the review's outcome, for the metrics



def _dumps(value: object) -> str:
    return dumps(value).decode()


class Rejected(Exception):
    """A request we refuse; ``message`` is safe to show the client."""

    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close  # the connection is in an unknown state: do not reuse it


def error_response(status: int, message: str, *, close: bool = False,
                   headers: dict[str, str] | None = None) -> web.Response:
    response = web.json_response({"error": message}, status=status, headers=headers, dumps=_dumps)
    if close:
        response.force_close()
    return response


class InFlight:
    """Counts requests inside handlers, so shutdown can wait for them before closing connections.

    aiohttp's own graceful shutdown stops reading from every connection at once, which fails a
    request whose body is still arriving; waiting here first lets such a request complete.
    """

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


IN_FLIGHT = web.AppKey("in_flight", InFlight)
# Set on SIGTERM while the shutdown delay runs: /readyz fails, /mutate keeps answering.
DRAINING = web.AppKey("draining", asyncio.Event)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """The one place errors become JSON answers (never a traceback) and /mutate is measured."""
    started = time.perf_counter()
    outcome = "error"
    try:
        in_flight = request.app[IN_FLIGHT]
        in_flight.enter()  # not ``with in_flight.track()``: a generator per request costs more
        try:
            response = await handler(request)
        finally:
            in_flight.leave()
        outcome = request.get(OUTCOME, "error")
        return response
    except Rejected as exc:
        outcome = "invalid"
        return error_response(exc.status, exc.message, close=exc.close)
    except HTTPException as exc:  # aiohttp's own: 404, 405, 413 from client_max_size
        outcome = "invalid" if exc.status < 500 else "error"
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, exc.text or exc.reason, headers=allow, close=exc.status == 413)
    except ConnectionError:
        outcome = "invalid"  # the client went away mid-request; nobody to answer
        raise
    except Exception:
        log_event(log, "request_failed", logging.ERROR, path=request.path, method=request.method, exc_info=True)
        return error_response(500, "internal server error")
    finally:
        if request.path in REVIEW_PATHS:
            request.app[METRICS].observe(outcome, time.perf_counter() - started)


def _check_content_type(request: web.Request) -> None:
    # JSON on the wire is UTF-8 (RFC 8259); any other declared charset is a client bug.
    if request.content_type != "application/json" or (request.charset or "utf-8").lower() not in ("utf-8", "utf8"):
        raise Rejected(415, "Content-Type must be application/json (charset utf-8)")


async def _read_body(request: web.Request, limits: ServerLimits) -> bytes:
    length = request.content_length
    if length is not None and length > limits.max_body_bytes:
        raise Rejected(413, f"request body of {length} bytes exceeds the limit of {limits.max_body_bytes}", close=True)
    try:
        if request.content.is_eof():
            # The whole body has arrived already (the usual case): read() cannot wait, so it
            # needs no timer.
            body = await request.read()
        else:
            # aiohttp's read() has no timeout of its own: a client that stops mid-body would hang it.
            async with asyncio.timeout(limits.body_timeout):
                body = await request.read()  # client_max_size also bounds chunked bodies
    except TimeoutError:
        raise Rejected(408, "timed out reading the request body", close=True) from None
    except RequestPayloadError as exc:
        raise Rejected(400, f"malformed request body: {exc}", close=True) from None
    if not body:
        raise Rejected(400, "empty request body")
    return body


def _decode(body: bytes) -> Any:
    try:
        return loads(body)
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, NaN, nesting deeper than 1024
        raise Rejected(400, f"malformed JSON: {exc}") from None


# --- the decision log --------------------------------------------------------------------------------
# The webhook's decision log: what it did to which pod, and why, one JSON line per review.
#
# ``pod_mutated`` and ``pod_denied`` are logged at info, so an operator can answer "why was my pod
# denied" or "did it get the sidecar" from ``kubectl logs``; ``pod_unchanged`` (a reinvocation that
# found the sidecar already there) and ``pod_skipped`` (not a GPU pod, opted out, not a CREATE) at
# debug, because they are most of the traffic. ``review_failed`` (error) names the pod whose review
# raised. Each line carries ``namespace``, ``pod`` (empty at admission for pods a controller creates,
# hence ``generate_name``), the request ``uid`` (the API server's audit log has the same uid),
# ``decision``, ``reason`` for a denial, the admission ``warnings`` and the requesting ``user``.
#
# Kept out of ``webhook.core.admission`` so the review stays a pure function: ``_answer`` calls these
# after a review, and a line is built only when its level is enabled.
decision_log = logging.getLogger("webhook.decisions")

_EVENTS = {
    "mutated": ("pod_mutated", logging.INFO),
    "denied": ("pod_denied", logging.INFO),
    "unchanged": ("pod_unchanged", logging.DEBUG),
    "skipped": ("pod_skipped", logging.DEBUG),
    "verified": ("pod_verified", logging.DEBUG),
    # The final pod differs from what gpufence admits: another mutating step interfered.
    "refused": ("pod_refused", logging.WARNING),
}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _identity(payload: Any) -> dict[str, Any]:
    """namespace, pod, generate_name, uid, user of a review request, from whatever is present."""
    request = _dict(_dict(payload).get("request"))
    metadata = _dict(_dict(request.get("object")).get("metadata"))
    name = request.get("name") or metadata.get("name") or None
    return {
        "namespace": request.get("namespace") or metadata.get("namespace") or None,
        "pod": name,
        "generate_name": None if name else metadata.get("generateName") or None,
        "uid": request.get("uid"),
        "user": _dict(request.get("userInfo")).get("username"),
        "dry_run": True if request.get("dryRun") else None,
    }


def log_decision(payload: Any, result: ReviewResult) -> None:
    event, level = _EVENTS.get(result.outcome, ("pod_reviewed", logging.INFO))
    if not decision_log.isEnabledFor(level):
        return  # the common case for skipped pods: no line is built
    response = result.review["response"]
    log_event(
        decision_log, event, level, **_identity(payload), decision=result.outcome,
        reason=_dict(response.get("status")).get("message"), warnings=response.get("warnings"),
    )


def log_review_failed(payload: Any, exc: BaseException) -> None:
    # The traceback is logged once, by the server's error middleware; this line names the pod.
    log_event(decision_log, "review_failed", logging.ERROR, **_identity(payload), decision="error",
              error=f"{type(exc).__name__}: {exc}")


def _answer(payload: Any, judge: Judge, settings: InjectionSettings, namespaces: NamespaceLookup,
            claims: DraObjects | None = None, nodes: KnownNodes | None = None) -> tuple[str, bytes]:
    """Reviews (``judge``: admission.review or admission.verify) and encodes one decoded request."""
    try:
        result = judge(payload, settings, namespaces, claims, nodes)
    except InvalidReview as exc:
        raise Rejected(400, str(exc)) from None
    except Exception as exc:
        log_review_failed(payload, exc)
        raise
    log_decision(payload, result)
    return result.outcome, dumps(result.review)


async def _fresh_namespaces(payload: Any, namespaces: NamespaceLookup,
                            fresh: FreshReader | None) -> NamespaceLookup | ReviewResult:
    """The namespaces to review ``payload`` with: the watch cache, or, where the cache does not show the
    request's namespace as opted in, the namespace read now from the API server.

    The API server sends a pod here only for a namespace its own informer shows as opted in (the
    webhook configurations' namespaceSelector); a cache that lags behind it (a namespace created, or
    labelled, a moment ago) must not decide that the pod needs nothing, nor review it without the
    namespace's ceilings. A read that fails is a denial naming why, never a pod admitted unjudged.
    """
    if fresh is None:
        return namespaces
    name = request_namespace(payload)
    if name is None:
        return namespaces
    cached = namespaces.get(name)
    if cached is not None and cached.opted_in:
        return namespaces
    try:
        await asyncio.to_thread(fresh.read_fresh, name)
    except Exception as exc:  # the API server's error, or none in time: say which and refuse
        log_event(log, "namespace_read_failed", logging.WARNING, namespace=name, error=str(exc))
        return denial(payload, f"gpufence could not read namespace {name!r} from the API server to judge "
                               f"this pod ({_short(exc)}); nothing was admitted unjudged: create the pod again")
    return namespaces


async def _fresh_claims(payload: Any, claims: DraObjects | None) -> DraObjects | None:
    """The DRA objects to review ``payload`` with: the watch cache, or, where it misses an object the
    pod names, the cache with those objects read now from the API server (cluster.dra_cache).

    /mutate and /validate of one create must see the same objects: a claim created a moment before
    its pod, missing from a lagging cache at /mutate and present at /validate, would make the two
    compute different pods and verify.gpufence.io refuse the pod gpufence made.
    """
    if not isinstance(claims, DraCache):
        return claims
    request = payload.get("request") if isinstance(payload, dict) else None
    pod = request.get("object") if isinstance(request, dict) else None
    spec = pod.get("spec") if isinstance(pod, dict) else None
    namespace = request_namespace(payload)
    if namespace is None or not claims.needs_fresh(namespace, spec):
        return claims
    return await asyncio.to_thread(claims.for_review, namespace, spec)


def _short(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    return f"{type(exc).__name__}: {exc}"[:200]


async def _judge(request: web.Request, judge: Judge) -> web.Response:
    app = request.app
    _check_content_type(request)
    body = await _read_body(request, app[LIMITS])
    # Read once: the policy watch may swap in a new policy meanwhile; this review keeps the one it began with.
    settings = app[POLICY].current
    if settings is None:  # /readyz fails meanwhile; the API server refuses the pod (failurePolicy Fail)
        raise web.HTTPServiceUnavailable(text=app[POLICY].not_ready_reason() or "no cluster policy")
    large = len(body) >= OFFLOAD_BODY_BYTES
    payload = await asyncio.to_thread(_decode, body) if large else _decode(body)
    try:
        namespaces = await _fresh_namespaces(payload, app[NAMESPACES], app[FRESH])
    except InvalidReview as exc:
        raise Rejected(400, str(exc)) from None
    if isinstance(namespaces, ReviewResult):
        log_decision(payload, namespaces)
        request[OUTCOME] = namespaces.outcome
        return web.Response(body=dumps(namespaces.review), content_type="application/json")
    claims = await _fresh_claims(payload, app[CLAIMS])
    if large:
        # A body this large takes milliseconds to decode and review (tens at the 6 MiB limit); on the event
        # loop that would stall every other request of this replica. In a worker thread the GIL
        # still serialises the Python work, but its switch interval lets the loop keep answering
        # small reviews meanwhile.
        outcome, answer = await asyncio.to_thread(_answer, payload, judge, settings, namespaces, claims,
                                                  app[NODES])
    else:
        outcome, answer = _answer(payload, functools.partial(app[VERDICTS].judge, judge), settings, namespaces,
                                  claims, app[NODES])
    request[OUTCOME] = outcome
    return web.Response(body=answer, content_type="application/json")


async def mutate(request: web.Request) -> web.Response:
    return await _judge(request, review)


async def validate(request: web.Request) -> web.Response:
    return await _judge(request, verify)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def not_ready_reasons(app: web.Application) -> list[str]:
    # The certificate is loaded before the app exists (CertReloader refuses to start without one);
    # only the namespace cache and the policy ConfigMap can lag.
    reasons = []
    namespaces = app[NAMESPACES]
    if isinstance(namespaces, BackgroundLookup) and not namespaces.has_synced():
        reasons.append("namespace cache has not synced")
    policy = app[POLICY].not_ready_reason()
    if policy is not None:
        reasons.append(policy)
    return reasons


async def readyz(request: web.Request) -> web.Response:
    reasons = not_ready_reasons(request.app)
    if request.app[DRAINING].is_set():
        reasons.append("shutting down")
    if reasons:
        return web.json_response({"status": "not ready", "reasons": reasons}, status=503)
    return web.json_response({"status": "ready"})


async def metrics_endpoint(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _reload_certificates(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[RELOADER].run(), name="cert-reloader")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _run_watches(app: web.Application) -> AsyncIterator[None]:
    namespaces = app[NAMESPACES]
    watches = [w for w in (namespaces, *app[WATCHES]) if isinstance(w, BackgroundLookup)]
    for watch in watches:
        watch.start()
    yield
    for watch in watches:
        await asyncio.to_thread(watch.stop, 5.0)


def create_app(settings: InjectionSettings | ClusterPolicy, namespaces: NamespaceLookup, reloader: CertReloader, *,
               limits: ServerLimits = ServerLimits(), metrics: WebhookMetrics | None = None,
               policy_watch: BackgroundLookup | None = None, claims: DraObjects | None = None,
               nodes: KnownNodes | None = None) -> web.Application:
    """The webhook application. ``reloader`` holds the serving certificate (see ``start_server``).

    ``settings``: fixed InjectionSettings (the flags), or a ClusterPolicy that ``policy_watch`` feeds.
    ``claims``: the DRA cache (started and stopped with the app; never part of /readyz: a claim it
    cannot resolve is taken for a GPU, see webhook.core.dra).
    ``nodes``: the node cache (started and stopped with the app; never part of /readyz either: a
    pod whose nodes it does not know gets no driver limits, see webhook.core.driver_limits).
    """
    app = web.Application(middlewares=[error_middleware], client_max_size=limits.max_body_bytes)
    policy = settings if isinstance(settings, ClusterPolicy) else ClusterPolicy(settings)
    app[POLICY] = policy
    app[WATCHES] = tuple(w for w in (policy_watch, claims, nodes) if isinstance(w, BackgroundLookup))
    app[CLAIMS] = claims
    app[NODES] = nodes
    app[NAMESPACES] = namespaces
    # Asked once here: isinstance against a runtime-checkable Protocol walks its attributes, a
    # measurable share of a request answered from the memo.
    app[FRESH] = namespaces if isinstance(namespaces, FreshReader) else None
    app[RELOADER] = reloader
    app[LIMITS] = limits
    app[IN_FLIGHT] = InFlight()
    app[DRAINING] = asyncio.Event()
    app[METRICS] = metrics or WebhookMetrics()
    app[VERDICTS] = VerdictCache()
    app[METRICS].watch_certificates(reloader)
    app[METRICS].watch_policy(policy)
    app[METRICS].watch_verdicts(app[VERDICTS])
    app.cleanup_ctx.append(_reload_certificates)
    app.cleanup_ctx.append(_run_watches)
    app.router.add_post(MUTATE_PATH, mutate)
    app.router.add_post(VALIDATE_PATH, validate)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    return app


@dataclass
class RunningServer:
    runner: web.AppRunner
    server: asyncio.Server
    closed: bool = False

    @property
    def app(self) -> web.Application:
        return self.runner.app

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting, let in-flight requests finish (up to shutdown_timeout), stop background tasks."""
        if self.closed:
            return
        self.closed = True
        self.server.close()
        app = self.runner.app
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(app[LIMITS].shutdown_timeout):
                await app[IN_FLIGHT].wait_idle()
        await self.runner.cleanup()  # closes idle keep-alive connections, runs cleanup_ctx
        await self.server.wait_closed()


async def start_server(app: web.Application, *, host: str = "0.0.0.0", port: int = 8443) -> RunningServer:
    """Serve ``app`` over TLS only (the reloader's context) on host:port (0 picks a free port)."""
    limits = app[LIMITS]
    runner = web.AppRunner(
        app,
        access_log=None,  # /metrics counts requests; per-request lines would drown the log
        keepalive_timeout=limits.header_timeout,
        lingering_time=limits.lingering_time,
        shutdown_timeout=limits.shutdown_timeout,
    )
    await runner.setup()
    try:
        handler = runner.server
        assert handler is not None  # made by setup()
        connections = app[METRICS].connections

        def accepted() -> asyncio.BaseProtocol:
            connections.inc()
            return handler()

        server = await asyncio.get_running_loop().create_server(
            accepted, host, port,
            ssl=app[RELOADER].server_context,
            ssl_handshake_timeout=limits.handshake_timeout,
            # A peer that never answers close_notify would otherwise hold wait_closed() for 30 s.
            ssl_shutdown_timeout=limits.handshake_timeout,
            reuse_address=True,
        )
    except BaseException:
        await runner.cleanup()
        raise
    return RunningServer(runner, server)


async def start_webhook(cert_file: str | Path, key_file: str | Path, *,
                        settings: InjectionSettings | None = None, namespaces: NamespaceLookup | None = None,
                        host: str = "127.0.0.1", port: int = 0, limits: ServerLimits = ServerLimits(),
                        reload_interval: float = DEFAULT_RELOAD_INTERVAL_SECONDS) -> RunningServer:
    """Everything in one call (demo, bench): load the pair, build the app, listen. ``await .close()`` to stop."""
    reloader = CertReloader(cert_file, key_file, interval=reload_interval)
    app = create_app(settings or InjectionSettings(), namespaces or AllNamespacesOptedIn(), reloader, limits=limits)
    return await start_server(app, host=host, port=port)


async def serve(settings: InjectionSettings | ClusterPolicy, namespaces: NamespaceLookup, reloader: CertReloader,
                stop: asyncio.Event, *, host: str = "0.0.0.0", port: int = 8443,
                limits: ServerLimits = ServerLimits(), policy_watch: BackgroundLookup | None = None,
                claims: DraObjects | None = None, nodes: KnownNodes | None = None) -> None:
    """Run until ``stop`` is set, then shut down gracefully."""
    app = create_app(settings, namespaces, reloader, limits=limits, policy_watch=policy_watch, claims=claims,
                     nodes=nodes)
    running = await start_server(app, host=host, port=port)
    log_event(log, "serving", address=host, port=running.port, serial=format(reloader.cert.serial_number, "x"),
              version=__version__, event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])
    try:
        await stop.wait()
        if limits.shutdown_delay > 0:
            app[DRAINING].set()
            log_event(log, "draining", seconds=limits.shutdown_delay)
            await asyncio.sleep(limits.shutdown_delay)  # the delay itself is the point: endpoints catch up
        log_event(log, "shutting_down")
    finally:
        await running.close()
    log_event(log, "stopped")
