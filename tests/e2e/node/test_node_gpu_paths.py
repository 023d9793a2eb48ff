"""Renamed and MIG resources keep their device on the real node.

The kubelet starts a container's environment from the device plugin's Allocate answer and
appends the container's own env after it; the runtime keeps the last value. A
``NVIDIA_VISIBLE_DEVICES=void`` that gpufence added to a container holding a MIG slice or a
renamed shared GPU would therefore take the device away. A real device plugin
(tests/node/deviceplugins.py) serves ``nvidia.com/mig-1g.10gb`` and ``nvidia.com/gpu.shared`` and
sets the variable; the running workload's own environment (``/proc/<pid>/environ``) must still hold
the plugin's value after the webhook injected the pod, while its log shipper holds ``void``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client

from gpufence.contract import SIDECAR_NAME
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.node.deviceplugins import device_plugin
from tests.node.node import Node
from tests.node.workloads import gpu_pod, host_pid, wait_running, workload_container


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


@pytest.mark.parametrize(("resource", "id_prefix"), [("nvidia.com/mig-1g.10gb", "MIG-sim-"),
                                                     ("nvidia.com/gpu.shared", "GPU-shared-")])
def test_the_device_plugins_variable_survives_the_injection(admin: client.ApiClient, cluster: ControlPlane,
                                                            node: Node, sim: Node, gpu_namespace: str,
                                                            resource: str, id_prefix: str):
    with device_plugin(node, resource, 2, id_prefix) as ids:
        trainer = workload_container("trainer", resources={
            "limits": {resource: "1"}, "requests": {"cpu": "10m", "memory": "32Mi"}})
        logs = workload_container("logs", resources={"requests": {"cpu": "10m", "memory": "32Mi"}})
        logs["command"] = ["python3", "-c", "import time; time.sleep(3600)"]
        created = kube.create_pod(admin, gpu_namespace, gpu_pod([trainer, logs], {"gpufence.io/memory": "50%"}))
        assert created.admitted, created.message
        submitted = created.obj
        assert kube.is_mutated(submitted), "gpufence did not take the pod for a GPU pod"
        assert "NVIDIA_VISIBLE_DEVICES" not in kube.env_of(next(
            c for c in submitted["spec"]["containers"] if c["name"] == "trainer"))
        running = wait_running(cluster, node, gpu_namespace, submitted["metadata"]["name"])

        seen = environ(host_pid(node, running, "trainer"))
        assert seen.get("NVIDIA_VISIBLE_DEVICES") in ids, seen.get("NVIDIA_VISIBLE_DEVICES")
        assert seen.get("GPUFENCE_CONTAINER") == "trainer"  # and gpufence's share variables reached it
        assert environ(host_pid(node, running, "logs")).get("NVIDIA_VISIBLE_DEVICES") == "void"
        assert environ(host_pid(node, running, SIDECAR_NAME)).get("NVIDIA_VISIBLE_DEVICES") == "all"

        # The premise, on this kubelet: a void in the container's own env wins over the plugin's
        # value, so a void added by the webhook would have taken the device away.
        voided = workload_container("trainer", resources=trainer["resources"],
                                    env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}])
        created = kube.create_pod(admin, gpu_namespace, gpu_pod([voided], {"gpufence.io/memory": "50%"}))
        assert created.admitted, created.message
        running = wait_running(cluster, node, gpu_namespace, created.obj["metadata"]["name"])
        assert environ(host_pid(node, running, "trainer")).get("NVIDIA_VISIBLE_DEVICES") == "void"
