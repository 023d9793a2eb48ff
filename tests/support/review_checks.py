"""What every answer of the webhook must be, and inputs that try to break it.

``check_answer``: a well-formed AdmissionReview for the request (apiVersion/kind, the request's uid,
a boolean ``allowed``, a denial with ``status.code`` and a message, a base64 JSON Patch that applies
to the request's object, warnings as strings); ``check_http``: over HTTPS, 200 with such an answer or
a 4xx JSON ``{"error": ...}``, never a 5xx. ``json_values`` and ``hypothesis_reviews`` are
hypothesis strategies of arbitrary JSON, the second in the fields the webhook reads. Shared by the
fuzz tests and ``bench.fuzz_webhook``.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
from typing import Any

OUTCOMES = {"mutated", "unchanged", "denied", "skipped"}
PATCH_OPS = {"add", "remove", "replace", "move", "copy", "test"}


class Malformed(AssertionError):
    pass


def check_answer(request_payload: Any, answer: Any, outcome: str | None = None) -> None:
    """Raise Malformed unless ``answer`` is a well-formed AdmissionReview for ``request_payload``."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise Malformed(what)

    need(isinstance(answer, dict), "answer is not an object")
    need(answer.get("apiVersion") == "admission.k8s.io/v1", "apiVersion")
    need(answer.get("kind") == "AdmissionReview", "kind")
    resp = answer.get("response")
    need(isinstance(resp, dict), "response is not an object")
    need(resp.get("uid") == request_payload["request"]["uid"], "uid differs from the request's")
    need(isinstance(resp.get("allowed"), bool), "allowed is not a boolean")
    if outcome is not None:
        need(outcome in OUTCOMES, f"unknown outcome {outcome!r}")
        need((outcome == "denied") == (resp["allowed"] is False), "outcome/allowed mismatch")
    if not resp["allowed"]:
        status = resp.get("status")
        need(isinstance(status, dict) and isinstance(status.get("code"), int), "denial without status.code")
        need(isinstance(status.get("message"), str) and status["message"] != "", "denial without a message")
        need("patch" not in resp, "denial with a patch")
    warnings = resp.get("warnings")
    need(warnings is None or (isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)),
         "warnings are not strings")
    if "patch" in resp:
        need(resp.get("patchType") == "JSONPatch", "patch without patchType JSONPatch")
        ops = json.loads(base64.b64decode(resp["patch"], validate=True))
        need(isinstance(ops, list) and ops != [], "patch is not a non-empty list")
        for op in ops:
            need(isinstance(op, dict) and op.get("op") in PATCH_OPS and isinstance(op.get("path"), str),
                 f"bad patch operation {str(op)[:200]}")
        try:
            import jsonpatch
        except ImportError:  # the test extras are not installed: shape checks only
            return
        try:
            jsonpatch.apply_patch(request_payload["request"]["object"], ops)
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise Malformed(f"patch does not apply to the object: {exc}") from None
        except RecursionError:
            pass  # jsonpatch deep-copies the object: too deep for the checker, not a finding


def json_values(max_leaves: int = 20) -> Any:
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40)
    return st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=20),
                                                                                           kids, max_size=4),
                        max_leaves=max_leaves)


def hypothesis_reviews() -> Any:
    """AdmissionReviews whose fields the webhook reads are arbitrary JSON (hypothesis strategy)."""
    from hypothesis import strategies as st

    anything = json_values()
    share = st.sampled_from(["8Gi", "25%", "50", "lots", "150%", "-1Gi", "0", "1E999999999", "audit"]) | st.text(
        max_size=30)
    annotations = st.dictionaries(
        st.sampled_from(["gpufence.io/memory", "gpufence.io/compute", "gpufence.io/mode", "gpufence.io/grace-period",
                         "gpufence.io/memory.train", "gpufence.io/compute.ü", "kubernetes.io/config.mirror"])
        | st.text(max_size=30), share | anything, max_size=5)
    resources = st.fixed_dictionaries({}, optional={
        "limits": st.dictionaries(st.sampled_from(["nvidia.com/gpu", "cpu"]) | st.text(max_size=10),
                                  st.sampled_from(["1", "0", "2"]) | anything, max_size=3),
        "requests": anything})
    gpu = st.just({"limits": {"nvidia.com/gpu": "1"}})
    container = st.fixed_dictionaries(
        {"name": st.sampled_from(["train", "eval", "gpufence-enforcer", ""]) | anything,
         "resources": gpu | gpu | resources | anything},
        optional={"env": st.lists(
            st.fixed_dictionaries({"name": st.text(max_size=10) | anything}, optional={"value": anything}),
            max_size=4) | anything, "volumeMounts": anything, "ports": anything, "image": anything})
    spec = st.fixed_dictionaries({"containers": st.lists(container, min_size=1, max_size=4)
                                                 | st.lists(container, min_size=1, max_size=4) | anything},
                                 optional={"initContainers": st.lists(container, max_size=2) | anything,
                                           "volumes": anything, "shareProcessNamespace": anything,
                                           "hostPID": anything})
    pod = st.fixed_dictionaries({"metadata": st.fixed_dictionaries({}, optional={
        "annotations": annotations | anything, "labels": anything, "namespace": anything}) | anything,
        "spec": spec | anything})
    request = st.fixed_dictionaries(
        {"uid": st.text(max_size=40), "object": pod | pod | anything,
         "kind": st.just({"group": "", "version": "v1", "kind": "Pod"}) | anything,
         "operation": st.just("CREATE") | st.just("CREATE") | st.just("UPDATE") | anything},
        optional={"resource": st.just({"group": "", "version": "v1", "resource": "pods"}) | anything,
                  "namespace": st.text(max_size=20) | anything, "subResource": anything})
    return st.fixed_dictionaries({"apiVersion": st.just("admission.k8s.io/v1"), "kind": st.just("AdmissionReview"),
                                  "request": request})


class HttpsClient:
    """A keep-alive, certificate-verifying HTTPS client (http.client) that reconnects after a close."""

    def __init__(self, port: int, ctx: ssl.SSLContext, timeout: float = 15.0) -> None:
        self.port, self.ctx, self.timeout = port, ctx, timeout
        self.conn: http.client.HTTPSConnection | None = None

    def post(self, body: bytes, path: str = "/mutate") -> tuple[int, bytes]:
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPSConnection("localhost", self.port, context=self.ctx, timeout=self.timeout)
                self.conn.connect()
                # connect() resolves localhost; make sure it is the loopback
                assert self.conn.sock.getpeername()[0] in ("127.0.0.1", "::1")
            try:
                self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self.close()
                return resp.status, data
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None


def check_http(payload: Any, status: int, data: bytes) -> str:
    """'ok', '4xx' or raise Malformed."""
    if status >= 500:
        raise Malformed(f"HTTP {status}: {data[:300]!r}")
    try:
        doc = json.loads(data)
    except ValueError:
        raise Malformed(f"HTTP {status} with a non-JSON body {data[:200]!r}") from None
    if status == 200:
        check_answer(payload, doc)
        return "200"
    if 400 <= status < 500 and isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(status)
    raise Malformed(f"HTTP {status}: {data[:300]!r}")
