"""``gpufence-certs``: generate, bootstrap (in-cluster) and inspect the webhook's certificates.

    gpufence-certs generate --out-dir DIR [--service S] [--namespace NS] [--dns-name X ...]
                            [--ca-days N] [--days N] [--ca-cert F --ca-key F] [--force]
    gpufence-certs bootstrap [--kubeconfig F] [--namespace NS] [--secret S] [--service S]
                             [--webhook-configuration W] [--dns-name X ...]
                             [--renew-before-days N] [--days N] [--ca-days N]
    gpufence-certs inspect (--cert-file F | --secret S [--namespace NS] [--kubeconfig F])
                           [--warn-days N]

Logs go to stderr as one JSON object per line; human-readable results go to stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufence import version_line
from gpufence.certs import bootstrap as bs
from gpufence.certs import files, inspect_cert, pki
from gpufence.certs.renewal import decode_secret_data, public_bytes
from gpufence.logs import JsonFormatter

log = logging.getLogger("gpufence.certs")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def _error(message: str, **fields: Any) -> None:
    bs.log_event("error", logging.ERROR, message=message, **fields)
    print(f"gpufence-certs: error: {message}", file=sys.stderr)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Appends an option's default to its help text, unless it has none worth showing or says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.required or action.default in (None, [], False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    # Every option has a help text with its default, so --help is the reference.
    fmt = _HelpFormatter
    parser = argparse.ArgumentParser(prog="gpufence-certs", description="Certificates for the gpufence webhook.",
                                     formatter_class=fmt)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=version_line("gpufence-certs"))
    sub = parser.add_subparsers(dest="command", required=True)

    service_help = "the webhook's Service: the certificate is valid for its in-cluster DNS names"
    namespace_help = "namespace of the webhook's Service (and of the Secret)"
    dns_help = "extra DNS name or IP address in the serving certificate (repeatable)"
    days_help = "validity of the serving certificate, days"
    ca_days_help = "validity of a new CA certificate, days"

    gen = sub.add_parser("generate", help="write a CA and a serving certificate as PEM files", formatter_class=fmt)
    gen.add_argument("--out-dir", required=True, type=Path,
                     help="directory to write ca.crt, ca.key, tls.crt, tls.key to")
    gen.add_argument("--service", default=bs.DEFAULT_SERVICE, help=service_help)
    gen.add_argument("--namespace", default=bs.DEFAULT_NAMESPACE, help=namespace_help)
    gen.add_argument("--dns-name", action="append", default=[], help=dns_help)
    gen.add_argument("--ca-days", type=_positive_int, default=bs.DEFAULT_CA_DAYS, help=ca_days_help)
    gen.add_argument("--days", type=_positive_int, default=bs.DEFAULT_DAYS, help=days_help)
    gen.add_argument("--ca-cert", type=Path, help="sign with this existing CA certificate (needs --ca-key)")
    gen.add_argument("--ca-key", type=Path, help="private key of --ca-cert (not copied to --out-dir)")
    gen.add_argument("--force", action="store_true", help="replace existing files")

    boot = sub.add_parser("bootstrap", help="create/renew the TLS Secret and set the webhooks' caBundle",
                          formatter_class=fmt)
    boot.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, else ~/.kube/config)")
    boot.add_argument("--context", help="kubeconfig context (default: the current context)")
    boot.add_argument("--namespace", default=bs.DEFAULT_NAMESPACE, help=namespace_help)
    boot.add_argument("--secret", default=bs.DEFAULT_SECRET, help="the kubernetes.io/tls Secret to create or renew")
    boot.add_argument("--service", default=bs.DEFAULT_SERVICE, help=service_help)
    boot.add_argument("--webhook-configuration", default=bs.DEFAULT_WEBHOOK_CONFIGURATION,
                      help="name of the MutatingWebhookConfiguration and of the ValidatingWebhookConfiguration "
                      "whose caBundle is set to the CA")
    boot.add_argument("--dns-name", action="append", default=[], help=dns_help)
    boot.add_argument("--renew-before-days", type=_non_negative_float, default=bs.DEFAULT_RENEW_BEFORE_DAYS,
                      help="renew the serving certificate when it expires within this many days")
    boot.add_argument("--days", type=_positive_int, default=bs.DEFAULT_DAYS, help=days_help)
    boot.add_argument("--ca-days", type=_positive_int, default=bs.DEFAULT_CA_DAYS, help=ca_days_help)

    ins = sub.add_parser("inspect", help="print certificate details; exit 1 if expiring within --warn-days",
                         formatter_class=fmt)
    src = ins.add_mutually_exclusive_group(required=True)
    src.add_argument("--cert-file", type=Path, help="a PEM certificate file")
    src.add_argument("--secret", help="a Secret holding tls.crt (and ca.crt)")
    ins.add_argument("--namespace", default=bs.DEFAULT_NAMESPACE, help="namespace of --secret")
    ins.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config, else ~/.kube/config)")
    ins.add_argument("--context", help="kubeconfig context (default: the current context)")
    ins.add_argument("--warn-days", type=_non_negative_float, default=inspect_cert.DEFAULT_WARN_DAYS,
                     help="exit 1 when a certificate expires within this many days")
    return parser


# --------------------------------------------------------------------------------------------


def _load_existing_ca(cert_path: Path, key_path: Path) -> tuple[pki.KeyPair, bytes]:
    cert_pem = files.read_file(cert_path)
    key_pem = files.read_file(key_path)
    try:
        cert = pki.load_cert(cert_pem)
    except ValueError as exc:
        raise ValueError(f"{cert_path}: not a PEM certificate ({exc})") from None
    try:
        key = pki.load_key(key_pem)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{key_path}: not an unencrypted EC private key ({exc})") from None
    if public_bytes(cert.public_key()) != public_bytes(key.public_key()):
        raise ValueError(f"{key_path} does not match {cert_path}")
    try:
        is_ca = cert.extensions.get_extension_for_class(pki.x509.BasicConstraints).value.ca
    except pki.x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise ValueError(f"{cert_path} is not a CA certificate")
    return pki.KeyPair(cert, key), cert_pem


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.ca_cert is None) != (args.ca_key is None):
        _error("--ca-cert and --ca-key must be given together")
        return EXIT_USAGE
    dns_names = pki.service_dns_names(args.service, args.namespace, tuple(args.dns_name))
    out: list[files.OutputFile] = []
    try:
        if args.ca_cert is not None:
            ca, ca_pem = _load_existing_ca(args.ca_cert, args.ca_key)
            target = args.out_dir / files.CA_CERT
            # Re-signing in place (--out-dir holding the same CA) must not trip the overwrite guard.
            if not (target.is_file() and files.read_file(target) == ca_pem):
                out.append(files.OutputFile(files.CA_CERT, ca_pem, private=False))
        else:
            ca = pki.make_ca(days=args.ca_days)
            out += [
                files.OutputFile(files.CA_CERT, ca.cert_pem, private=False),
                files.OutputFile(files.CA_KEY, ca.key_pem, private=True),
            ]
        serving = pki.make_serving_cert(ca, dns_names, days=args.days)
    except (OSError, ValueError) as exc:
        _error(str(exc))
        return EXIT_FAILURE
    out += [
        files.OutputFile(files.TLS_CERT, serving.cert_pem, private=False),
        files.OutputFile(files.TLS_KEY, serving.key_pem, private=True),
    ]
    try:
        written = files.write_files(args.out_dir, out, force=args.force)
    except files.FileExistsRefused as exc:
        _error(str(exc))
        return EXIT_FAILURE
    except OSError as exc:
        _error(f"cannot write to {args.out_dir}: {exc}")
        return EXIT_FAILURE
    bs.log_event(
        "certificates_generated", out_dir=str(args.out_dir), files=[p.name for p in written], dns_names=dns_names,
        not_after=serving.cert.not_valid_after_utc.isoformat(), ca_not_after=ca.cert.not_valid_after_utc.isoformat(),
    )
    for path in written:
        print(path)
    return EXIT_OK


def _api(args: argparse.Namespace) -> bs.KubeApi:
    return bs.KubeApi(bs.load_api_client(args.kubeconfig, args.context))


def cmd_bootstrap(args: argparse.Namespace) -> int:
    opts = bs.BootstrapOptions(
        namespace=args.namespace,
        secret=args.secret,
        service=args.service,
        webhook_configuration=args.webhook_configuration,
        extra_dns_names=tuple(args.dns_name),
        renew_before=dt.timedelta(days=args.renew_before_days),
        days=args.days,
        ca_days=args.ca_days,
    )
    try:
        opts.validate()
    except ValueError as exc:
        _error(str(exc))
        return EXIT_USAGE
    try:
        api = _api(args)
        result = bs.run_bootstrap(api, opts)
    except bs.NotFound as exc:
        _error(f"{exc}; is gpufence installed (MutatingWebhookConfiguration {opts.webhook_configuration!r})?")
        return EXIT_FAILURE
    except bs.KubeError as exc:
        _error(str(exc))
        return EXIT_FAILURE
    except Exception as exc:  # kubeconfig/in-cluster config errors and the like
        from kubernetes.config import ConfigException

        if isinstance(exc, ConfigException):
            _error(f"no Kubernetes configuration: {exc}")
            return EXIT_FAILURE
        raise
    print(
        f"secret {opts.namespace}/{opts.secret}: {result.action} ({result.reason}); "
        f"caBundle {'patched in ' + ', '.join(result.patched_webhooks) if result.patched_webhooks else 'unchanged'}"
    )
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    now = dt.datetime.now(dt.UTC)
    named: list[tuple[str, bytes]] = []
    if args.cert_file is not None:
        try:
            named.append((str(args.cert_file), files.read_file(args.cert_file)))
        except OSError as exc:
            _error(f"cannot read {args.cert_file}: {exc}")
            return inspect_cert.EXIT_UNREADABLE
    else:
        try:
            secret = _api(args).get_secret(args.namespace, args.secret)
        except bs.KubeError as exc:
            _error(str(exc))
            return inspect_cert.EXIT_UNREADABLE
        except Exception as exc:
            from kubernetes.config import ConfigException

            if isinstance(exc, ConfigException):
                _error(f"no Kubernetes configuration: {exc}")
                return inspect_cert.EXIT_UNREADABLE
            raise
        if secret is None:
            _error(f"Secret {args.secret!r} not found in namespace {args.namespace}")
            return inspect_cert.EXIT_UNREADABLE
        data = decode_secret_data(secret)
        if not data.get(files.TLS_CERT):
            _error(f"Secret {args.namespace}/{args.secret} has no {files.TLS_CERT}")
            return inspect_cert.EXIT_UNREADABLE
        prefix = f"secret/{args.namespace}/{args.secret}"
        named.append((f"{prefix}:{files.TLS_CERT}", data[files.TLS_CERT]))
        if data.get(files.CA_CERT):
            named.append((f"{prefix}:{files.CA_CERT}", data[files.CA_CERT]))
    try:
        infos = inspect_cert.describe_all(named, now)
    except ValueError as exc:
        _error(str(exc))
        return inspect_cert.EXIT_UNREADABLE
    print("\n".join(inspect_cert.format_info(i, args.warn_days) for i in infos))
    code = inspect_cert.exit_code(infos, args.warn_days)
    soonest = min(infos, key=lambda i: i.not_after)
    bs.log_event(
        "certificate_inspected", logging.WARNING if code else logging.INFO, source=soonest.source,
        not_after=soonest.not_after.isoformat(), days_left=round(soonest.days_left, 2), warn_days=args.warn_days,
        expiring=bool(code),
    )
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    handler = {"generate": cmd_generate, "bootstrap": cmd_bootstrap, "inspect": cmd_inspect}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
