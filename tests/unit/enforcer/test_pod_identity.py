"""The enforcer names its pod from the kubelet's service-account token (gpufence/enforcer/observe/pod_identity.py)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpufence.enforcer.observe.pod_identity import from_token, identify


def jwt(claims: dict[str, Any]) -> str:
    """A token shaped as the API server issues it (header.payload.signature, base64url, no padding)."""
    def part(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    return ".".join([part(b'{"alg":"RS256","kid":"k"}'), part(json.dumps(claims).encode()), part(b"sig")])


# What a projected token of a pod carries (kube-apiserver's claims for a pod-bound token).
BOUND = {"aud": ["https://kubernetes.default.svc"], "sub": "system:serviceaccount:ml-team:default",
         "kubernetes.io": {"namespace": "ml-team", "pod": {"name": "trainer-x7k2p", "uid": "5f8e-1c1a"},
                           "serviceaccount": {"name": "default", "uid": "0a1b"}}}


def account_dir(tmp_path: Path, token: str | None = None, namespace: str | None = None) -> Path:
    if token is not None:
        (tmp_path / "token").write_text(token)
    if namespace is not None:
        (tmp_path / "namespace").write_text(namespace)
    return tmp_path


def test_a_pod_bound_token_names_the_namespace_the_pod_and_its_uid(tmp_path: Path) -> None:
    identity = identify(account_dir(tmp_path, jwt(BOUND) + "\n"), env={})
    assert (identity.namespace, identity.name, identity.uid) == ("ml-team", "trainer-x7k2p", "5f8e-1c1a")
    assert identity.source == "service-account token"


def test_the_variables_win_outside_a_pod(tmp_path: Path) -> None:
    env = {"GPUFENCE_POD_NAMESPACE": "demo", "GPUFENCE_POD_NAME": "local-run"}
    identity = identify(account_dir(tmp_path, jwt(BOUND)), env=env)
    assert (identity.namespace, identity.name, identity.uid, identity.source) == ("demo", "local-run", None,
                                                                                  "environment")


def test_a_legacy_token_names_no_pod_so_the_hostname_does(tmp_path: Path) -> None:
    legacy = {"iss": "kubernetes/serviceaccount", "kubernetes.io/serviceaccount/namespace": "ml-team"}
    identity = identify(account_dir(tmp_path, jwt(legacy), namespace="ml-team"), env={})
    assert (identity.namespace, identity.name, identity.source) == ("ml-team", os.uname().nodename, "hostname")


@pytest.mark.parametrize("token", ["", "not-a-jwt", "a.!!!.c", "a." + base64.urlsafe_b64encode(b"[1]").decode() + ".c",
                                   jwt({"kubernetes.io": "ml-team"}), jwt({"kubernetes.io": {"pod": "x"}})])
def test_a_token_that_is_not_a_pods_jwt_is_no_identity_and_no_error(tmp_path: Path, token: str) -> None:
    assert from_token(token)[1:] == (None, None)
    identity = identify(account_dir(tmp_path, token, namespace="ml-team\n"), env={})
    assert (identity.namespace, identity.name, identity.uid) == ("ml-team", os.uname().nodename, None)


def test_without_a_token_the_namespace_is_unknown_and_events_stay_off(tmp_path: Path) -> None:
    identity = identify(tmp_path / "absent", env={})
    assert identity.namespace is None and identity.name == os.uname().nodename
