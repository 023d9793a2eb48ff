"""Test-only second mutating webhook: the simulated NVIDIA driver inside gpufence's pods.

On a GPU node the NVIDIA container toolkit puts ``libnvidia-ml.so.1`` into containers and the
device plugin hands them ``/dev/nvidia*``. Here a small TLS webhook does the equivalent for the
simulator, never touching the gpufence webhook or its install:

* the ``gpufence-enforcer`` sidecar gets the node's simulator directory (hostPath, read-only) at
  ``/opt/simnvml`` and ``LD_LIBRARY_PATH`` / ``GPUFENCE_SIM_STATE`` pointing into it, so the
  real pynvml in the real sidecar loads the simulator and reads the state the test writes;
* every container asking for ``nvidia.com/gpu`` gets the stand-in device file at ``/dev/nvidia0``
  (a process holding it open counts as a GPU process, as with the real device).

Its configuration name sorts after ``gpufence`` and it has ``reinvocationPolicy: IfNeeded``: the
API server calls it once the sidecar exists, and again if gpufence's reinvocation rebuilds the
sidecar, so the final pod carries both. hostPath volumes keep such pods out of Pod Security
``baseline``/``restricted`` namespaces (see the Pod Security test for how those levels are run).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

from certs import pki
from tests.e2e.controlplane import ControlPlane, free_port
from webhook.settings import SIDECAR_NAME

CONFIGURATION = "zz-gpufence-test-simnvml"  # after "gpufence" in the API server's (name) order
SIM_VOLUME = "gpufence-test-simnvml"
DEVICE_VOLUME = "gpufence-test-nvidia0"
SIM_MOUNT = "/opt/simnvml"
DEVICE_PATH = "/dev/nvidia0"
GPU_RESOURCE = "nvidia.com/gpu"


def _asks_for_gpu(container: dict[str, Any]) -> bool:
    resources = container.get("resources") or {}
    return any(GPU_RESOURCE in (resources.get(kind) or {}) for kind in ("limits", "requests"))


def _mounts(container: dict[str, Any]) -> list[dict[str, Any]]:
    return container.get("volumeMounts") or []


def sim_patch(pod: dict[str, Any], sim_dir: Path) -> list[dict[str, Any]]:
    """JSON Patch operations (idempotent: none when the pod already has them)."""
    spec = pod["spec"]
    ops: list[dict[str, Any]] = []
    volumes = spec.get("volumes") or []
    names = {v.get("name") for v in volumes}
    wanted_volumes = [
        {"name": SIM_VOLUME, "hostPath": {"path": str(sim_dir), "type": "Directory"}},
        {"name": DEVICE_VOLUME, "hostPath": {"path": str(sim_dir / "nvidia0"), "type": "File"}},
    ]
    if not volumes:
        ops.append({"op": "add", "path": "/spec/volumes", "value": []})
    ops += [{"op": "add", "path": "/spec/volumes/-", "value": v} for v in wanted_volumes if v["name"] not in names]
    for key in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(key) or []):
            base = f"/spec/{key}/{index}"
            mounts = _mounts(container)
            if container.get("name") == SIDECAR_NAME:
                if any(m.get("name") == SIM_VOLUME for m in mounts):
                    continue
                env = container.get("env") or []
                extra_env = [{"name": "LD_LIBRARY_PATH", "value": SIM_MOUNT},
                             {"name": "GPUFENCE_SIM_STATE", "value": f"{SIM_MOUNT}/state"}]
                ops += ([{"op": "add", "path": f"{base}/env/-", "value": e} for e in extra_env] if env
                        else [{"op": "add", "path": f"{base}/env", "value": extra_env}])
                mount = {"name": SIM_VOLUME, "mountPath": SIM_MOUNT, "readOnly": True}
            elif _asks_for_gpu(container):
                if any(m.get("name") == DEVICE_VOLUME for m in mounts):
                    continue
                mount = {"name": DEVICE_VOLUME, "mountPath": DEVICE_PATH}
            else:
                continue
            ops.append({"op": "add", "path": f"{base}/volumeMounts/-", "value": mount} if mounts
                       else {"op": "add", "path": f"{base}/volumeMounts", "value": [mount]})
    return ops


class SimInjector:
    """The webhook server (aiohttp over TLS on loopback, in a thread) and its registration."""

    def __init__(self, cp: ControlPlane, sim_dir: Path, workdir: Path) -> None:
        self.cp = cp
        self.sim_dir = sim_dir
        self.port = free_port()
        self.calls = 0
        ca = pki.make_ca("gpufence-test-simnvml-ca")
        serving = pki.make_serving_cert(ca, ["127.0.0.1"])
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "sim.crt").write_bytes(serving.cert_pem)
        (workdir / "sim.key").write_bytes(serving.key_pem)
        self._ca_pem = ca.cert_pem
        self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._ctx.load_cert_chain(str(workdir / "sim.crt"), str(workdir / "sim.key"))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _mutate(self, request: web.Request) -> web.Response:
        review = await request.json()
        self.calls += 1
        response: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": True}
        ops = sim_patch(review["request"]["object"], self.sim_dir)
        if ops:
            response |= {"patchType": "JSONPatch", "patch": base64.b64encode(json.dumps(ops).encode()).decode()}
        return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                  "response": response})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/inject", self._mutate)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port, ssl_context=self._ctx).start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> SimInjector:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the simulator injector did not start")
        config = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": CONFIGURATION},
            "webhooks": [{
                "name": "simnvml.test.gpufence.io", "admissionReviewVersions": ["v1"],
                "sideEffects": "None", "reinvocationPolicy": "IfNeeded", "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "clientConfig": {"url": f"https://127.0.0.1:{self.port}/inject",
                                 "caBundle": base64.b64encode(self._ca_pem).decode()},
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                           "resources": ["pods"]}],
                "namespaceSelector": {"matchLabels": {"gpufence.io/injection": "enabled"}},
            }],
        }
        self.cp.kubectl("apply", "-f", "-", input=json.dumps(config))
        return self

    def __exit__(self, *exc: object) -> None:
        self.cp.kubectl("delete", "mutatingwebhookconfiguration", CONFIGURATION, check=False)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
