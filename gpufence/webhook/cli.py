"""``gpufence-webhook``: flags (Kubernetes-style names, each also an env var), JSON logs, lifecycle.

Every flag ``--some-flag`` can be given as ``GPUFENCE_WEBHOOK_SOME_FLAG``; the flag wins. A bad value,
from either place, exits 2 with a message naming it. Repeatable flags take a comma-separated env value.
In a cluster the policy flags come from a ConfigMap instead (``--policy-configmap``, read and watched
by webhook.cluster.policy with these flags' converters); given together with it, a policy flag exits 2.
The namespace cache and the policy watch share one client (webhook.cluster.namespaces.load_core_api): in a
cluster whose client configuration does not load, both refuse to start with the same error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from gpufence import version_line
from gpufence.logs import log_event
from gpufence.logs import setup_logging as _setup_logging
from gpufence.webhook.flags import FLAGS, POLICY_FLAGS, Flag, boolean, settings_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpufence-webhook",
                                     description="gpufence mutating admission webhook (HTTPS only).")
    parser.add_argument("--version", action="version", version=version_line("gpufence-webhook"))
    for flag in FLAGS:
        # A flag whose help explains its default itself (gpu-resource-name) shows only its env var.
        shown = "" if flag.default is None and "default" in flag.help else f"; default {flag.shown_default}"
        text = f"{flag.help} [env {flag.env}{shown}]"
        kwargs: dict[str, Any] = {"dest": flag.dest, "default": None, "metavar": "VALUE",
                                  "help": text.replace("%", "%%")}  # argparse %-formats help texts
        if flag.convert is boolean:
            # --mps-limits alone means true; --mps-limits=false is accepted too.
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        if flag.deprecated:
            kwargs["help"] += f" (formerly --{flag.deprecated}, deprecated)"
        action = "append" if flag.repeat else "store"
        parser.add_argument(f"--{flag.name}", action=action, **kwargs)
        if flag.deprecated:
            kwargs.update(dest=f"deprecated__{flag.dest}", help=argparse.SUPPRESS)
            parser.add_argument(f"--{flag.deprecated}", action=action, **kwargs)
    return parser


def _convert(parser: argparse.ArgumentParser, flag: Flag, text: str, source: str) -> Any:
    try:
        return flag.convert(text)
    except ValueError as exc:
        parser.error(f"{source} {text!r}: {exc}")


def parse_args(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Flags, then ``GPUFENCE_WEBHOOK_*`` env vars, then defaults; exits 2 on a bad value."""
    environ = dict(os.environ if environ is None else environ)
    parser = build_parser()
    raw = parser.parse_args(argv)
    values: dict[str, Any] = {}
    deprecated: list[tuple[str, str]] = []  # (the old name used, the name to use)
    policy_given: list[tuple[str, str]] = []  # (flag or env var, its ConfigMap key: value) of each policy flag set
    for flag in FLAGS:
        given = getattr(raw, flag.dest)
        old_given = getattr(raw, f"deprecated__{flag.dest}", None)
        if given is not None and old_given is not None:
            parser.error(f"--{flag.name} and its deprecated name --{flag.deprecated} are both given")
        env_name = flag.env
        if environ.get(env_name, "") == "" and flag.deprecated_env and environ.get(flag.deprecated_env, "") != "":
            env_name = flag.deprecated_env
        if given is None and old_given is not None:
            given = old_given
            deprecated.append((f"--{flag.deprecated}", f"--{flag.name}"))
        if given is not None:
            texts, source = (given if flag.repeat else [given]), f"--{flag.name}"
        elif environ.get(env_name, "") != "":
            env_value = environ[env_name]
            texts = [t.strip() for t in env_value.split(",")] if flag.repeat else [env_value]
            source = env_name
            if env_name != flag.env:
                deprecated.append((env_name, flag.env))
        else:
            values[flag.dest] = flag.default
            continue
        converted = [_convert(parser, flag, t, source) for t in texts]
        values[flag.dest] = tuple(converted) if flag.repeat else converted[0]
        if flag in POLICY_FLAGS:
            policy_given.append((source, f'{flag.name}: "{",".join(texts)}"'))
    if values["policy_configmap"] is not None and policy_given:
        # One source of each setting: a flag on top of the ConfigMap would be a second, which the
        # replicas, the protect policy (admin-groups) and the next reader of the ConfigMap do not see.
        where = "/".join(values["policy_configmap"])
        parser.error(f"--policy-configmap {where} takes the policy from that ConfigMap, the one source of "
                     f"the policy, so {', '.join(s for s, _ in policy_given)} would be a second one that the "
                     f"ConfigMap does not show: set each in the ConfigMap's data instead "
                     f"({'; '.join(k for _, k in policy_given)}), "
                     f"or leave out --policy-configmap to run on flags alone")
    args = argparse.Namespace(**values, deprecated=deprecated)
    for required in ("tls_cert_file", "tls_private_key_file"):
        if getattr(args, required) is None:
            flag = next(f for f in FLAGS if f.dest == required)
            parser.error(f"--{flag.name} (or {flag.env}) is required")
    return args


# --- logging -----------------------------------------------------------------------------------------
# The format all three programs share (gpufence/logs.py), on stderr. Libraries stay at warning
# unless --log-level=debug: aiohttp and the kubernetes client are chatty at info.
def setup_logging(level: str) -> None:
    _setup_logging(level, libraries_level="warning")


# --- main --------------------------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> None:
    # The I/O stack (aiohttp, the kubernetes client) loads only to serve: --help or a bad flag answers
    # without it (about 1 s sooner on 2 cores). No cycle: none of these imports webhook.cli.
    from gpufence.webhook.cluster.dra_cache import DraCache
    from gpufence.webhook.cluster.namespaces import NamespaceCache, load_core_api
    from gpufence.webhook.cluster.nodes import NodeCache
    from gpufence.webhook.cluster.policy import ClusterPolicy, PolicyWatch
    from gpufence.webhook.core.settings import AllNamespacesOptedIn
    from gpufence.webhook.server import ServerLimits, serve
    from gpufence.webhook.tls import CertReloader

    reloader = CertReloader(args.tls_cert_file, args.tls_private_key_file, interval=args.cert_reload_interval)
    api = load_core_api(args.kubeconfig)
    namespaces = AllNamespacesOptedIn() if api is None else NamespaceCache(api)
    # DRA claims resolved through their DeviceClasses (webhook.core.dra); none outside a cluster.
    claims = None if api is None else DraCache(_custom_objects(api))
    # The nodes' labels, for the driver limits under auto (webhook.core.driver_limits); none outside a cluster.
    nodes = None if api is None else NodeCache(api)
    policy, policy_watch = ClusterPolicy(settings_from_args(args)), None
    if args.policy_configmap is not None:
        namespace, name = args.policy_configmap
        if api is None:
            raise ValueError(f"--policy-configmap {namespace}/{name} needs the Kubernetes API: run in a cluster "
                             "or give --kubeconfig (or leave out --policy-configmap to run on flags alone)")
        policy = ClusterPolicy(source=f"{namespace}/{name}")
        policy_watch = PolicyWatch(api, namespace, name, policy)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # graceful: stop accepting, finish in-flight requests
    limits = ServerLimits(shutdown_delay=args.shutdown_delay)
    await serve(policy, namespaces, reloader, stop, host=args.bind_address, port=args.port, limits=limits,
                policy_watch=policy_watch, claims=claims, nodes=nodes)


def _custom_objects(core_api: Any) -> Any:
    """A CustomObjectsApi on the same client as ``core_api`` (the DRA caches list through it)."""
    from kubernetes import client

    return client.CustomObjectsApi(core_api.api_client)


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop ``--event-loop`` names (None: asyncio's own). ``auto`` takes uvloop where it imports
    (a platform without its wheel runs on asyncio's loop, which serves the same); ``uvloop`` without
    it is a ValueError, a start-up failure naming it."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise ValueError(f"--event-loop uvloop: uvloop cannot be imported ({exc})") from None
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    log = logging.getLogger("webhook")
    for old, new in args.deprecated:
        log_event(log, "deprecated_flag", logging.WARNING, flag=old, use=new,
                  message=f"{old} is deprecated and will be removed in the next release; use {new}")
    from gpufence.webhook.cluster.namespaces import ClusterConfigurationError

    try:
        with asyncio.Runner(loop_factory=event_loop_factory(args.event_loop)) as runner:
            runner.run(run(args))
    except ClusterConfigurationError as exc:  # in a pod without its service account: never "all opted in"
        log_event(log, "startup_failed", logging.ERROR, error=str(exc), missing=exc.missing)
        return 1
    except (OSError, ssl.SSLError, ValueError) as exc:  # unreadable cert, bad key, port in use: no traceback
        log_event(log, "startup_failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
        return 1
    except Exception as exc:
        log_event(log, "startup_failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        return 1
    return 0
