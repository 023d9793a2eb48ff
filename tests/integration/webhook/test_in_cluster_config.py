"""The real ``gpufence-webhook`` in a pod whose client configuration cannot be loaded refuses to start.

In a cluster (``KUBERNETES_SERVICE_HOST`` set) "no configuration" must not mean "every namespace
opted in": the process exits 1 with one ``startup_failed`` line naming what is missing and how to
fix it. The service-account files are the kubernetes client's own paths; a test that needs some of
them present runs the process in a private mount namespace with a tmpfs over /run, so nothing of
ours is mocked and the host is not touched.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from kubernetes.config.incluster_config import SERVICE_CERT_FILENAME, SERVICE_TOKEN_FILENAME

from tests.integration.webhook.test_cli import POLICY, REPO, outside_cluster_env
from tests.support.prerequisites import needs, skip_by_design
from tests.support.tlsutil import LocalPKI

SERVICE_ACCOUNT_DIR = str(Path(SERVICE_TOKEN_FILENAME).parent)


def in_pod_env(tmp_path: Path) -> dict[str, str]:
    """A pod's environment (the API server's Service address), no kubeconfig anywhere."""
    env = outside_cluster_env(tmp_path)
    # Port 1 on loopback: nothing answers, so a process that got past its configuration would not
    # find an API server either; the configuration itself must stop it.
    env.update(KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT="1")
    return env


def webhook_argv(pki: LocalPKI, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gpufence.webhook", "--port=0", "--bind-address=127.0.0.1",
            f"--tls-cert-file={pki.volume.cert_file}", f"--tls-private-key-file={pki.volume.key_file}", *extra]


async def run_until_exit_or_serving(argv: list[str], env: dict[str, str]) -> tuple[int | None, list[dict]]:
    """The exit status and the JSON log lines; None if the process started serving instead (then killed)."""
    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=REPO, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    lines: list[dict] = []
    try:
        async with asyncio.timeout(20):
            while raw := await proc.stderr.readline():
                lines.append(json.loads(raw))  # every line is one JSON object
                if lines[-1]["event"] == "serving":
                    return None, lines
            return await proc.wait(), lines
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def assert_refused_to_start(code: int | None, lines: list[dict], missing: str) -> dict:
    assert code is not None, f"the webhook served in a cluster without a client configuration: {lines}"
    assert code == 1
    (failed,) = [entry for entry in lines if entry["event"] == "startup_failed"]
    assert failed["level"] == "error" and "exception" not in failed  # a message, not a traceback
    error = failed["error"]
    assert "KUBERNETES_SERVICE_HOST" in error and missing in error
    assert "automountServiceAccountToken" in error and "--kubeconfig" in error  # how to fix it
    assert "opted in" in error  # why it does not fall back
    assert failed["missing"] == missing
    assert not [entry for entry in lines if "namespace defaults are off" in entry.get("message", "")]
    return failed


@pytest.mark.parametrize("extra", [(), tuple(POLICY)], ids=["namespaces", "policy-configmap"])
async def test_in_a_pod_without_a_service_account_token_the_webhook_refuses_to_start(
        pki: LocalPKI, tmp_path: Path, extra: tuple[str, ...]) -> None:
    if os.path.exists(SERVICE_ACCOUNT_DIR):
        skip_by_design("in-a-pod", f"{SERVICE_ACCOUNT_DIR} exists on this machine")
    # With --policy-configmap too: both watches need the same client, so the same refusal.
    code, lines = await run_until_exit_or_serving(webhook_argv(pki, *extra), in_pod_env(tmp_path))
    assert_refused_to_start(code, lines, SERVICE_TOKEN_FILENAME)


PRIVATE_RUN = shutil.which("unshare") is not None and os.geteuid() == 0 and os.path.realpath("/var/run") == "/run"


@needs(PRIVATE_RUN, "needs root, unshare and /var/run -> /run for a private /run")
@pytest.mark.parametrize(("files", "missing"), [
    ({"token": "a-token"}, SERVICE_CERT_FILENAME),  # the CA is not mounted
    ({"token": "a-token", "ca.crt": ""}, SERVICE_CERT_FILENAME),  # the CA is empty
    ({"token": "", "ca.crt": "not a certificate"}, SERVICE_TOKEN_FILENAME),  # the token is empty
])
async def test_in_a_pod_with_a_broken_service_account_mount_the_webhook_refuses_to_start(
        pki: LocalPKI, tmp_path: Path, files: dict[str, str], missing: str) -> None:
    writes = " && ".join(f"printf %s {json.dumps(text)} > {SERVICE_ACCOUNT_DIR}/{name}" for name, text in files.items())
    script = f'mount -t tmpfs tmpfs /run && mkdir -p {SERVICE_ACCOUNT_DIR} && {writes} && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *webhook_argv(pki)]
    code, lines = await run_until_exit_or_serving(argv, in_pod_env(tmp_path))
    assert_refused_to_start(code, lines, missing)
