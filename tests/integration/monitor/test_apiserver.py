"""``gpufence top`` without Prometheus: each sidecar's /metrics through the API server's pod proxy,
with the real ``kubernetes`` client against a stand-in API server that lists the scenario's pods and
proxies ``/api/v1/namespaces/<ns>/pods/<pod>:<port>/proxy/metrics`` to their real enforcers. Also as
the kubectl plugin (``kubectl gpufence top``) where kubectl is installed.

The same screen as through Prometheus (test_top.check_screen): what the PodMonitor's relabelling
adds there (the node, the sidecar's namespace/pod) the monitor adds here from the pod object."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.integration.monitor.conftest import ROOT, Scenario
from tests.integration.monitor.test_top import check_screen
from tests.support.prerequisites import needs
from tests.support.prometheus import MISSING, prometheus_binary

pytestmark = [needs(prometheus_binary() is not None, MISSING), pytest.mark.timeout(300)]

TOKEN = "monitor-test-token"
PROXY = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<pod>[^/:]+):(?P<port>\d+)/proxy/metrics$")


class FakeApiServer:
    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests.append(self.path)
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, b'{"kind":"Status","code":401}', "application/json")
                url = urllib.parse.urlsplit(self.path)
                path = urllib.parse.unquote(url.path)
                if path == "/api/v1/pods":
                    doc = {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": outer.pods}
                    return self._send(200, json.dumps(doc).encode(), "application/json")
                if match := PROXY.match(path):
                    pod = next(p for p in outer.pods if (p["metadata"]["namespace"], p["metadata"]["name"]) ==
                               (match["ns"], match["pod"]))
                    assert str(pod["spec"]["initContainers"][0]["ports"][0]["containerPort"]) == match["port"]
                    with urllib.request.urlopen(f"http://127.0.0.1:{match['port']}/metrics", timeout=10) as resp:
                        return self._send(200, resp.read(), resp.headers["Content-Type"])
                return self._send(404, b'{"kind":"Status","code":404}', "application/json")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": TOKEN}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        }))
        return path


@pytest.fixture
def apiserver(scenario: Scenario) -> Iterator[FakeApiServer]:
    server = FakeApiServer([p.object for p in scenario.pods.values()])
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()


def test_top_through_the_pod_proxy(apiserver: FakeApiServer, tmp_path: Path) -> None:
    kubeconfig = apiserver.kubeconfig(tmp_path / "kubeconfig")
    argv = [sys.executable, "-m", "gpufence.monitor", "top", "--once", "--kubeconfig", str(kubeconfig)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert f"from API server {apiserver.url} (pod proxy)" in result.stdout.splitlines()[0]
    check_screen(result.stdout)
    proxied = sorted(p.split("/pods/")[1] for p in apiserver.requests if "/proxy/" in p)
    assert len(proxied) == len(apiserver.pods) == 6, apiserver.requests
    assert any(p.startswith("/api/v1/pods?") and "fieldSelector=status.phase" in p for p in apiserver.requests)


@needs(shutil.which("kubectl") is not None, "kubectl not installed")
def test_kubectl_gpufence_top(apiserver: FakeApiServer, tmp_path: Path) -> None:
    """kubectl finds ``kubectl-gpufence`` on PATH (the console script) and runs it as ``kubectl gpufence``."""
    plugin = shutil.which("kubectl-gpufence", path=str(Path(sys.executable).parent))
    assert plugin, "kubectl-gpufence is not installed next to this interpreter: run make venv"
    kubeconfig = apiserver.kubeconfig(tmp_path / "kubeconfig")
    env = {**os.environ, "PATH": f"{Path(plugin).parent}:{os.environ['PATH']}", "KUBECONFIG": str(kubeconfig)}
    listed = subprocess.run(["kubectl", "plugin", "list"], capture_output=True, text=True, env=env, timeout=60,
                            check=False)
    assert plugin in listed.stdout, listed.stdout + listed.stderr
    result = subprocess.run(["kubectl", "gpufence", "top", "--once"], capture_output=True, text=True, env=env,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    check_screen(result.stdout)
    version = subprocess.run(["kubectl", "gpufence", "--version"], capture_output=True, text=True, env=env,
                             timeout=60, check=False)
    assert version.stdout.startswith("kubectl gpufence ")
