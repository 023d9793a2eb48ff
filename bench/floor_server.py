"""The floor: a bare aiohttp TLS endpoint answering every POST with a canned AdmissionReview.

    python -m bench.floor_server --port P --tls-cert-file F --tls-private-key-file F --response-file F
                                 [--validate-response-file F] [--event-loop auto|uvloop|asyncio]

It reads the request body (as any server must, to keep the connection usable) and returns the
bytes of ``--response-file`` (on /validate those of ``--validate-response-file`` where given) as
``application/json``: no JSON decoding, no review, no metrics, no
middleware. Same TLS policy (TLS >= 1.2, ALPN http/1.1), same listener construction
(``loop.create_server(runner.server, ssl=...)``) and keep-alive as gpufence's server, so the
difference between the two is what gpufence does per request; the same event loop as the webhook's
``--event-loop`` (auto: uvloop where it imports). Benchmark use only.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web

from gpufence.webhook.cli import event_loop_factory


def make_app(canned: bytes, validate_canned: bytes | None = None) -> web.Application:
    def answering(body: bytes) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=body, content_type="application/json")
        return handler

    handler = answering(canned)
    app = web.Application(client_max_size=6 * 1024 * 1024)
    app.router.add_post("/mutate", handler)
    app.router.add_post("/validate", answering(canned if validate_canned is None else validate_canned))
    app.router.add_post("/", handler)
    return app


async def serve(port: int, cert: str, key: str, canned: bytes, host: str = "127.0.0.1",
                validate_canned: bytes | None = None) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.load_cert_chain(cert, key)
    runner = web.AppRunner(make_app(canned, validate_canned), access_log=None, keepalive_timeout=30.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(runner.server, host, port, ssl=ctx, ssl_handshake_timeout=10.0,
                                      reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--tls-cert-file", required=True)
    parser.add_argument("--tls-private-key-file", required=True)
    parser.add_argument("--response-file", required=True)
    parser.add_argument("--validate-response-file", help="the answer on /validate (default: --response-file's)")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                        help="as the webhook's --event-loop")
    args = parser.parse_args(argv)
    with open(args.response_file, "rb") as f:
        canned = f.read()
    validate_canned = None
    if args.validate_response_file:
        with open(args.validate_response_file, "rb") as f:
            validate_canned = f.read()
    with asyncio.Runner(loop_factory=event_loop_factory(args.event_loop)) as runner:
        runner.run(serve(args.port, args.tls_cert_file, args.tls_private_key_file, canned, args.host,
                         validate_canned))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
