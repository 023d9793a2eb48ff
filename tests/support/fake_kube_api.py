"""A fake Kubernetes API server for the ``gpufence-certs`` tests.

Only the surface ``bootstrap`` and ``inspect --secret`` use:

* ``GET/POST  /api/v1/namespaces/{ns}/secrets``, ``GET/PUT/PATCH .../secrets/{name}``
* ``GET/PATCH /apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}``
* ``GET/PATCH /apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}``

Objects live in memory; every request is recorded (method, path, query, content type, parsed
body). ``fail(method, path_regex, status)`` makes matching requests answer a ``Status`` error
(403, 404, 409, ...). Requests must carry ``Authorization: Bearer <token>``. The server runs in a
thread on 127.0.0.1 and ``write_kubeconfig`` points the real ``kubernetes`` client at it.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jsonpatch

SECRET_ITEM = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/secrets/(?P<name>[^/]+)$")
SECRET_LIST = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/secrets$")
WEBHOOK_CONFIGURATION_ITEM = re.compile(
    r"^/apis/admissionregistration\.k8s\.io/v1/(?P<resource>mutating|validating)webhookconfigurations/(?P<name>[^/]+)$"
)
# Plural resource of each kind, as in URLs and error messages.
WEBHOOK_CONFIGURATION_RESOURCES = {
    "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
}

REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
           409: "Conflict", 415: "UnsupportedMediaType", 422: "Invalid", 500: "InternalError"}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str | None
    body: Any  # parsed JSON or None

    @property
    def is_write(self) -> bool:
        return self.method in ("POST", "PUT", "PATCH", "DELETE")


@dataclass
class _Failure:
    method: str | None
    path: re.Pattern[str]
    status: int
    message: str | None
    times: int | None  # None: forever


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


@dataclass
class FakeKubeApi:
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    secrets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    webhook_configurations: dict[str, dict[str, Any]] = field(default_factory=dict)  # mutating, by name
    validating_webhook_configurations: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    _failures: list[_Failure] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rv: int = 100
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    # ---- control ------------------------------------------------------------------------

    def fail(self, method: str | None, path_regex: str, status: int, message: str | None = None,
             times: int | None = None) -> None:
        """Answer ``status`` to requests whose method (None: any) and path match."""
        self._failures.append(_Failure(method, re.compile(path_regex), status, message, times))

    def clear_requests(self) -> None:
        with self._lock:
            self.requests.clear()

    def writes(self) -> list[Request]:
        return [r for r in self.requests if r.is_write]

    def calls(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def put_secret(self, namespace: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", namespace)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = self._next_rv()
        obj.setdefault("apiVersion", "v1")
        obj.setdefault("kind", "Secret")
        self.secrets[(namespace, meta["name"])] = obj

    def configurations_of(self, kind: str) -> dict[str, dict[str, Any]]:
        """The stored webhook configurations of ``kind`` (Mutating- or ValidatingWebhookConfiguration)."""
        if kind == "MutatingWebhookConfiguration":
            return self.webhook_configurations
        if kind == "ValidatingWebhookConfiguration":
            return self.validating_webhook_configurations
        raise ValueError(f"not a webhook configuration kind: {kind!r}")

    def put_webhook_configuration(self, obj: dict[str, Any], kind: str | None = None) -> None:
        """Store ``obj`` as a ``kind`` (default: its own ``kind``, else MutatingWebhookConfiguration)."""
        obj = copy.deepcopy(obj)
        kind = kind or obj.get("kind") or "MutatingWebhookConfiguration"
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = self._next_rv()
        obj.setdefault("apiVersion", "admissionregistration.k8s.io/v1")
        obj["kind"] = kind
        self.configurations_of(kind)[meta["name"]] = obj

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeKubeApi:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _handle(self) -> None:
                fake._dispatch(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-kube-api", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    # ---- HTTP ---------------------------------------------------------------------------

    def _dispatch(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        content_type = h.headers.get("Content-Type")
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("latin-1")
        req = Request(h.command, parts.path, parse_qs(parts.query), content_type, body)
        with self._lock:
            self.requests.append(req)
            if h.headers.get("Authorization") != f"Bearer {self.token}":
                status, payload = self._status(401, "Unauthorized")
            else:
                status, payload = self._injected_failure(req) or self._route(req)
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _status(code: int, message: str, name: str | None = None, kind: str | None = None) -> tuple[int, dict]:
        return code, {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": REASONS.get(code, "Unknown"),
            "details": {"name": name, "kind": kind}, "code": code,
        }

    def _injected_failure(self, req: Request) -> tuple[int, dict] | None:
        for f in self._failures:
            if (f.method is None or f.method == req.method) and f.path.search(req.path):
                if f.times is not None:
                    if f.times <= 0:
                        continue
                    f.times -= 1
                m = WEBHOOK_CONFIGURATION_ITEM.match(req.path)
                resource = f"{m['resource']}webhookconfigurations" if m else "secrets"
                name = req.path.rstrip("/").rsplit("/", 1)[-1]
                verb = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
                message = f.message or (
                    f'{resource} "{name}" is forbidden: User "system:serviceaccount:gpufence:gpufence-certs" '
                    f'cannot {verb[req.method]} resource "{resource}"'
                    if f.status == 403 else f"injected {f.status}"
                )
                return self._status(f.status, message, name, resource)
        return None

    def _route(self, req: Request) -> tuple[int, dict]:
        if m := SECRET_ITEM.match(req.path):
            return self._secret_item(req, m["ns"], m["name"])
        if m := SECRET_LIST.match(req.path):
            return self._secret_list(req, m["ns"])
        if m := WEBHOOK_CONFIGURATION_ITEM.match(req.path):
            kind = "MutatingWebhookConfiguration" if m["resource"] == "mutating" else "ValidatingWebhookConfiguration"
            return self._webhook_configuration_item(req, kind, m["name"])
        return self._status(404, f"the server could not find the requested resource ({req.path})")

    def _apply_patch(self, obj: dict, req: Request) -> dict | tuple[int, dict]:
        ctype = (req.content_type or "").split(";")[0].strip()
        if ctype == "application/json-patch+json":
            try:
                return jsonpatch.apply_patch(obj, req.body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                return self._status(422, f"the server rejected our request due to an error in our request: {exc}")
        if ctype == "application/merge-patch+json":
            return merge_patch(obj, req.body)
        return self._status(415, f"unsupported patch type in fake: {ctype!r}")

    def _secret_item(self, req: Request, ns: str, name: str) -> tuple[int, dict]:
        key = (ns, name)
        current = self.secrets.get(key)
        if current is None:
            return self._status(404, f'secrets "{name}" not found', name, "secrets")
        if req.method == "GET":
            return 200, copy.deepcopy(current)
        if req.method == "PUT":
            body = req.body or {}
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if rv is not None and rv != current["metadata"]["resourceVersion"]:
                return self._status(409, f'Operation cannot be fulfilled on secrets "{name}": the object has been '
                                    "modified; please apply your changes to the latest version and try again",
                                    name, "secrets")
            if body.get("type", "Opaque") != current.get("type", "Opaque"):
                return self._status(422, f'Secret "{name}" is invalid: type: Invalid value: field is immutable')
            updated = copy.deepcopy(body)
            updated["metadata"]["uid"] = current["metadata"]["uid"]
            self.put_secret(ns, updated)
            return 200, copy.deepcopy(self.secrets[key])
        if req.method == "PATCH":
            result = self._apply_patch(copy.deepcopy(current), req)
            if isinstance(result, tuple):
                return result
            self.put_secret(ns, result)
            return 200, copy.deepcopy(self.secrets[key])
        return self._status(405, f"method {req.method} not allowed")

    def _secret_list(self, req: Request, ns: str) -> tuple[int, dict]:
        if req.method == "POST":
            body = req.body or {}
            name = (body.get("metadata") or {}).get("name")
            if not name:
                return self._status(422, "metadata.name: Required value")
            if (ns, name) in self.secrets:
                return self._status(409, f'secrets "{name}" already exists', name, "secrets")
            if "resourceVersion" in (body.get("metadata") or {}):
                return self._status(400, "resourceVersion should not be set on objects to be created")
            self.put_secret(ns, body)
            return 201, copy.deepcopy(self.secrets[(ns, name)])
        if req.method == "GET":
            items = [copy.deepcopy(v) for (n, _), v in self.secrets.items() if n == ns]
            return 200, {"kind": "SecretList", "apiVersion": "v1", "metadata": {}, "items": items}
        return self._status(405, f"method {req.method} not allowed")

    def _webhook_configuration_item(self, req: Request, kind: str, name: str) -> tuple[int, dict]:
        store = self.configurations_of(kind)
        resource = WEBHOOK_CONFIGURATION_RESOURCES[kind]
        current = store.get(name)
        if current is None:
            return self._status(404, f'{resource}.admissionregistration.k8s.io "{name}" not found', name, resource)
        if req.method == "GET":
            return 200, copy.deepcopy(current)
        if req.method == "PATCH":
            result = self._apply_patch(copy.deepcopy(current), req)
            if isinstance(result, tuple):
                return result
            self.put_webhook_configuration(result, kind)
            return 200, copy.deepcopy(store[name])
        return self._status(405, f"method {req.method} not allowed")
