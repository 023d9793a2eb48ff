"""``certs.bootstrap.run_bootstrap`` on an in-memory API: the caBundle of both webhook configurations.

The HTTP side (the real ``kubernetes`` client against a fake API server) is in
tests/integration/certs/test_bootstrap.py; here only the orchestration over the two kinds.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
import pytest

from gpufence.certs import bootstrap as bs
from gpufence.certs import renewal as rn

NOW = dt.datetime(2030, 6, 1, 12, 0, tzinfo=dt.UTC)
NAME = bs.DEFAULT_WEBHOOK_CONFIGURATION


def configuration(*webhooks: str) -> dict[str, Any]:
    return {"metadata": {"name": NAME}, "webhooks": [
        {"name": w, "clientConfig": {"service": {"namespace": "gpufence", "name": "gpufence-webhook", "port": 443}}}
        for w in webhooks
    ]}


@dataclass
class MemoryApi:
    """What ``run_bootstrap`` calls of ``KubeApi``, on dicts; ``forbidden`` holds (verb, resource) to refuse."""

    secrets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    configurations: dict[str, dict[str, dict[str, Any]]] = field(default_factory=lambda: {
        bs.MUTATING.resource: {NAME: configuration("inject.gpufence.io", "debug.gpufence.io")},
        bs.VALIDATING.resource: {NAME: configuration("verify.gpufence.io")},
    })
    forbidden: set[tuple[str, str]] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)

    def _check(self, verb: str, resource: str) -> None:
        self.calls.append((verb, resource))
        if (verb, resource) in self.forbidden:
            raise bs.Forbidden(f"not allowed to {verb} {resource} {NAME!r}; grant verb {verb!r} on {resource!r} "
                               f"to this ServiceAccount in {bs.WEBHOOK_ROLE}")

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._check("get", "secrets")
        return copy.deepcopy(self.secrets.get((namespace, name)))

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check("create", "secrets")
        self.secrets[(namespace, body["metadata"]["name"])] = {**body, "metadata": {**body["metadata"],
                                                                                    "resourceVersion": "1"}}
        return body

    def replace_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self._check("update", "secrets")
        self.secrets[(namespace, body["metadata"]["name"])] = body
        return body

    def get_webhook_configuration(self, kind: bs.WebhookConfigurationKind, name: str) -> dict[str, Any]:
        self._check("get", kind.resource)
        if name not in self.configurations[kind.resource]:
            raise bs.NotFound(f"{kind.resource} {name!r} not found")
        return copy.deepcopy(self.configurations[kind.resource][name])

    def patch_webhook_configuration(self, kind: bs.WebhookConfigurationKind, name: str,
                                    ops: list[dict[str, Any]]) -> dict[str, Any]:
        self._check("patch", kind.resource)
        store = self.configurations[kind.resource]
        store[name] = jsonpatch.apply_patch(store[name], ops)
        return store[name]

    def bundles(self, resource: str) -> list[bytes | None]:
        return [base64.b64decode(w["clientConfig"]["caBundle"]) if "caBundle" in w["clientConfig"] else None
                for w in self.configurations[resource][NAME]["webhooks"]]

    def ca(self) -> bytes:
        return rn.decode_secret_data(self.secrets[("gpufence", bs.DEFAULT_SECRET)])["ca.crt"]


def run(api: MemoryApi) -> bs.BootstrapResult:
    return bs.run_bootstrap(api, bs.BootstrapOptions(), now=NOW)  # type: ignore[arg-type]


M, V = bs.MUTATING.resource, bs.VALIDATING.resource


def test_the_two_kinds_are_the_admission_apis() -> None:
    from kubernetes import client

    assert [k.kind for k in bs.WEBHOOK_CONFIGURATION_KINDS] == ["MutatingWebhookConfiguration",
                                                                "ValidatingWebhookConfiguration"]
    for kind in bs.WEBHOOK_CONFIGURATION_KINDS:
        assert kind.resource == kind.kind.lower() + "s"
        for verb in ("read", "patch"):
            assert callable(getattr(client.AdmissionregistrationV1Api, f"{verb}_{kind.method_suffix}"))


def test_both_configurations_get_the_ca() -> None:
    api = MemoryApi()
    result = run(api)
    assert result.patched_webhooks == ("inject.gpufence.io", "debug.gpufence.io", "verify.gpufence.io")
    assert api.bundles(M) == [api.ca()] * 2 and api.bundles(V) == [api.ca()]
    assert api.calls[-4:] == [("get", M), ("patch", M), ("get", V), ("patch", V)]
    api.calls.clear()
    again = run(api)
    assert again.patched_webhooks == () and api.calls == [("get", "secrets"), ("get", M), ("get", V)]


def test_a_new_ca_reaches_both_configurations() -> None:
    api = MemoryApi()
    run(api)
    first = api.ca()
    secret = api.secrets[("gpufence", bs.DEFAULT_SECRET)]
    secret["data"]["ca.crt"] = base64.b64encode(b"not a certificate").decode()
    result = run(api)
    assert result.action is rn.Action.REPLACE_CA
    assert api.ca() != first
    assert api.bundles(M) == [api.ca()] * 2 and api.bundles(V) == [api.ca()]
    assert len(result.patched_webhooks) == 3


def test_missing_validating_configuration_is_an_error() -> None:
    api = MemoryApi()
    del api.configurations[V][NAME]
    with pytest.raises(bs.NotFound, match="validatingwebhookconfigurations"):
        run(api)
    assert api.bundles(M) == [api.ca()] * 2  # set before: a retry has only the validating one to do


def test_missing_mutating_configuration_is_an_error() -> None:
    api = MemoryApi()
    del api.configurations[M][NAME]
    with pytest.raises(bs.NotFound, match="mutatingwebhookconfigurations"):
        run(api)
    assert ("get", V) not in api.calls
    assert api.bundles(V) == [None]


@pytest.mark.parametrize("verb", ["get", "patch"])
def test_forbidden_on_the_validating_configuration_is_an_error(verb: str) -> None:
    api = MemoryApi(forbidden={(verb, V)})
    with pytest.raises(bs.Forbidden, match=f"{verb} validatingwebhookconfigurations 'gpufence'.*ClusterRole"):
        run(api)
    assert api.bundles(M) == [api.ca()] * 2  # patched before the refused call
    assert api.bundles(V) == [None]
