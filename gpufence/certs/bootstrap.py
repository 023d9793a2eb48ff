"""In-cluster bootstrap of the webhook's TLS Secret and the caBundle of its webhook configurations.

The webhook serves two configurations of the same name, both with this one CA: the
MutatingWebhookConfiguration (inject/debug) and the ValidatingWebhookConfiguration (verify).

What the Secret and the caBundle should hold, and when to renew, is decided in
``certs.renewal`` (pure); ``KubeApi`` is the thin adapter over the ``kubernetes`` client and
``run_bootstrap`` the orchestration (GET Secret → POST/PUT Secret if needed → for each of the
two configurations, GET → PATCH if needed; a second run makes only the three GETs). A missing
configuration of either kind is an error (gpufence is not installed yet, or only half applied: the
Job retries). Not a warning: both fail closed, so a configuration left without its caBundle would
refuse every new pod of the opted-in namespaces until the next run.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufence.certs import pki
from gpufence.certs.files import CA_CERT, CA_KEY
from gpufence.certs.renewal import (
    SECRET_TYPE_TLS,
    Action,
    assess_secret,
    ca_bundle_patch,
    changed_webhooks,
    decode_secret_data,
    fmt_time,
    secret_data,
    secret_manifest,
)
from gpufence.logs import log_event as _log_event

log = logging.getLogger("gpufence.certs")

DEFAULT_NAMESPACE = "gpufence"
DEFAULT_SECRET = "gpufence-webhook-tls"
DEFAULT_SERVICE = "gpufence-webhook"
DEFAULT_WEBHOOK_CONFIGURATION = "gpufence"
DEFAULT_RENEW_BEFORE_DAYS = 30
DEFAULT_DAYS = 365
DEFAULT_CA_DAYS = 3650

# RBAC objects the install is expected to bind to the bootstrap Job's ServiceAccount; named in
# permission errors so the operator knows what to fix.
SECRETS_ROLE = "Role gpufence-certs"
WEBHOOK_ROLE = "ClusterRole gpufence-certs"


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    _log_event(log, event, level, **fields)


# --------------------------------------------------------------------------------------------
# Kubernetes API adapter
# --------------------------------------------------------------------------------------------


class KubeError(Exception):
    """An API call failed; the message is meant for the operator."""


class Forbidden(KubeError):
    pass


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    pass


def _server_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            message = json.loads(body).get("message")
            if message:
                return str(message)
        except (ValueError, AttributeError):
            pass
    return f"{getattr(exc, 'status', '?')} {getattr(exc, 'reason', '') or ''}".strip()


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A ``kubernetes.client.ApiClient``: ``kubeconfig`` if given, else in-cluster, else ~/.kube/config."""
    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig, context=context, persist_config=False)
    try:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except config.ConfigException:
        return config.new_client_from_config(context=context, persist_config=False)


@dataclass(frozen=True)
class WebhookConfigurationKind:
    """One of the two admissionregistration.k8s.io/v1 kinds whose caBundle bootstrap sets."""

    kind: str  # as in a manifest
    resource: str  # as in RBAC rules and URLs
    method_suffix: str  # AdmissionregistrationV1Api.read_<suffix> / patch_<suffix>


MUTATING = WebhookConfigurationKind(
    "MutatingWebhookConfiguration", "mutatingwebhookconfigurations", "mutating_webhook_configuration"
)
VALIDATING = WebhookConfigurationKind(
    "ValidatingWebhookConfiguration", "validatingwebhookconfigurations", "validating_webhook_configuration"
)
WEBHOOK_CONFIGURATION_KINDS = (MUTATING, VALIDATING)


# The generated client sends POST/PUT bodies without a Content-Type (the API server then assumes
# JSON); say it explicitly.
JSON_BODY = {"Content-Type": "application/json"}


@dataclass
class KubeApi:
    """The few calls ``bootstrap`` and ``inspect`` need, on plain JSON dicts."""

    api_client: Any
    timeout: float = 30.0
    _core: Any = field(init=False, repr=False)
    _admission: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from kubernetes import client

        self._core = client.CoreV1Api(self.api_client)
        self._admission = client.AdmissionregistrationV1Api(self.api_client)

    def _call(
        self, verb: str, resource: str, name: str, namespace: str | None, role: str, fn: Any, *args: Any, **kw: Any
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        where = f" in namespace {namespace}" if namespace else ""
        try:
            response = fn(*args, _preload_content=False, _request_timeout=self.timeout, **kw)
        except ApiException as exc:
            detail = _server_message(exc)
            if exc.status == 401:
                raise Forbidden(
                    f"the API server rejected our credentials when trying to {verb} {resource} {name!r}{where} "
                    f"({detail}); check the ServiceAccount token or the kubeconfig user"
                ) from None
            if exc.status == 403:
                raise Forbidden(
                    f"not allowed to {verb} {resource} {name!r}{where} ({detail}); grant verb {verb!r} on "
                    f"{resource!r} to this ServiceAccount in {role}"
                    + (f" (namespace {namespace})" if namespace and role.startswith("Role ") else "")
                ) from None
            if exc.status == 404:
                raise NotFound(f"{resource} {name!r} not found{where} ({detail})") from None
            if exc.status == 409:
                raise Conflict(f"conflict on {verb} {resource} {name!r}{where} ({detail})") from None
            raise KubeError(f"cannot {verb} {resource} {name!r}{where}: {detail}") from None
        except OSError as exc:  # urllib3 errors are OSErrors or wrap them
            raise KubeError(f"cannot {verb} {resource} {name!r}{where}: {exc}") from None
        except Exception as exc:
            if type(exc).__module__.startswith("urllib3"):
                raise KubeError(f"cannot {verb} {resource} {name!r}{where}: {exc}") from None
            raise
        return json.loads(response.data or b"{}")

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call(
                "get", "secrets", name, namespace, SECRETS_ROLE, self._core.read_namespaced_secret, name, namespace
            )
        except NotFound:
            return None

    def create_secret(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            "create", "secrets", name, namespace, SECRETS_ROLE,
            self._core.create_namespaced_secret, namespace, dict(body), _headers=JSON_BODY,
        )

    def replace_secret(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return self._call(
            "update", "secrets", name, namespace, SECRETS_ROLE,
            self._core.replace_namespaced_secret, name, namespace, dict(body), _headers=JSON_BODY,
        )

    def get_webhook_configuration(self, kind: WebhookConfigurationKind, name: str) -> dict[str, Any]:
        read = getattr(self._admission, f"read_{kind.method_suffix}")
        return self._call("get", kind.resource, name, None, WEBHOOK_ROLE, read, name)

    def patch_webhook_configuration(
        self, kind: WebhookConfigurationKind, name: str, ops: list[dict[str, Any]]
    ) -> dict[str, Any]:
        patch = getattr(self._admission, f"patch_{kind.method_suffix}")
        return self._call(
            "patch", kind.resource, name, None, WEBHOOK_ROLE, patch, name, ops,
            _content_type="application/json-patch+json",
        )


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BootstrapOptions:
    namespace: str = DEFAULT_NAMESPACE
    secret: str = DEFAULT_SECRET
    service: str = DEFAULT_SERVICE
    webhook_configuration: str = DEFAULT_WEBHOOK_CONFIGURATION
    extra_dns_names: tuple[str, ...] = ()
    renew_before: dt.timedelta = dt.timedelta(days=DEFAULT_RENEW_BEFORE_DAYS)
    days: int = DEFAULT_DAYS
    ca_days: int = DEFAULT_CA_DAYS

    @property
    def dns_names(self) -> list[str]:
        return pki.service_dns_names(self.service, self.namespace, self.extra_dns_names)

    def validate(self) -> None:
        """A fresh certificate must lie outside the renewal window, or every run would renew."""
        if self.renew_before < dt.timedelta(0):
            raise ValueError("--renew-before-days must not be negative")
        for flag, days in (("--days", self.days), ("--ca-days", self.ca_days)):
            if dt.timedelta(days=days) <= self.renew_before:
                raise ValueError(f"{flag} ({days}) must be larger than --renew-before-days ({self.renew_before.days})")


@dataclass(frozen=True)
class BootstrapResult:
    action: Action
    reason: str
    patched_webhooks: tuple[str, ...]  # names of the webhook entries patched, in both configurations
    # Optional configurations not found (kind and name), e.g. "ValidatingWebhookConfiguration gpufence".


MAX_ATTEMPTS = 3


def run_bootstrap(api: KubeApi, opts: BootstrapOptions, now: dt.datetime | None = None) -> BootstrapResult:
    """Make the Secret valid and the caBundle of both webhook configurations match it.

    Raises ``KubeError`` subclasses (``NotFound`` for a webhook configuration that does not exist).
    """
    opts.validate()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return _reconcile(api, opts, now or dt.datetime.now(dt.UTC))
        except Conflict as exc:
            if attempt == MAX_ATTEMPTS:
                raise
            log_event("conflict_retry", logging.WARNING, attempt=attempt, error=str(exc))
    raise AssertionError("unreachable")


def _reconcile(api: KubeApi, opts: BootstrapOptions, now: dt.datetime) -> BootstrapResult:
    ns, name = opts.namespace, opts.secret
    dns_names = opts.dns_names
    secret = api.get_secret(ns, name)
    if secret is not None and secret.get("type", SECRET_TYPE_TLS) != SECRET_TYPE_TLS:
        raise KubeError(
            f"Secret {name!r} in namespace {ns} has type {secret.get('type')!r}, not {SECRET_TYPE_TLS!r}; "
            "the type cannot be changed in place: delete the Secret and run bootstrap again"
        )
    data = decode_secret_data(secret) if secret is not None else None
    verdict = assess_secret(data, dns_names, now, opts.renew_before)
    log_event(
        "secret_assessed", namespace=ns, secret=name, action=str(verdict.action), reason=verdict.reason,
        not_after=fmt_time(verdict.not_after) if verdict.not_after else None,
    )

    if verdict.action is Action.KEEP:
        assert data is not None
        ca_pem = data[CA_CERT]
    else:
        if verdict.action is Action.REISSUE:
            assert data is not None and verdict.ca is not None
            ca_pem, ca_key_pem, ca = data[CA_CERT], data[CA_KEY], verdict.ca
        else:
            ca = pki.make_ca(days=opts.ca_days, now=now)
            ca_pem, ca_key_pem = ca.cert_pem, ca.key_pem
        serving = pki.make_serving_cert(ca, dns_names, days=opts.days, now=now)
        body = secret_manifest(
            name, ns, secret_data(ca_pem, ca_key_pem, serving), reason=verdict.reason, now=now,
            resource_version=(secret or {}).get("metadata", {}).get("resourceVersion"),
            base_metadata=(secret or {}).get("metadata"),
        )
        fields: dict[str, Any] = {
            "namespace": ns, "secret": name, "action": str(verdict.action), "reason": verdict.reason,
            "not_after": fmt_time(serving.cert.not_valid_after_utc), "dns_names": dns_names,
            "ca_not_after": fmt_time(ca.cert.not_valid_after_utc),
        }
        if secret is None:
            api.create_secret(ns, body)
            log_event("secret_created", **fields)
        else:
            api.replace_secret(ns, body)
            log_event("secret_replaced", **fields)

    patched: list[str] = []
    for kind in WEBHOOK_CONFIGURATION_KINDS:
        patched += _set_ca_bundle(api, kind, opts.webhook_configuration, ca_pem)
    return BootstrapResult(verdict.action, verdict.reason, tuple(patched))


def _set_ca_bundle(api: KubeApi, kind: WebhookConfigurationKind, name: str, ca_pem: bytes) -> list[str]:
    """Patch the caBundle of every webhook of ``kind`` ``name`` that differs from ``ca_pem``; returns
    the names of the patched webhooks. Raises ``NotFound`` where the configuration does not exist."""
    config = api.get_webhook_configuration(kind, name)
    ops = ca_bundle_patch(config, ca_pem)
    if not config.get("webhooks"):
        log_event("webhook_configuration_empty", logging.WARNING, kind=kind.kind, name=name)
    if not ops:
        log_event("ca_bundle_unchanged", kind=kind.kind, name=name)
        return []
    patched = changed_webhooks(ops, config)
    api.patch_webhook_configuration(kind, name, ops)
    log_event("ca_bundle_patched", kind=kind.kind, name=name, webhooks=patched)
    return patched
