"""A device plugin on the test node (``tests/e2e/gomod/deviceplugin``): a resource the kubelet
allocates through the device plugin API, whose Allocate sets ``NVIDIA_VISIBLE_DEVICES`` in the
container's environment as the NVIDIA device plugin does under its default ``envvar`` strategy.

The node's ``nvidia.com/gpu`` is advertised by a status PATCH (``tests.node.node``), which
allocates nothing and sets no variable; the renamed and MIG resources need the real API, because
what is tested is that the variable the plugin set survives gpufence's mutation of the pod.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from tests.e2e import kube
from tests.e2e.binaries import GOMOD, BuildRecipe, build
from tests.e2e.controlplane import start
from tests.node.node import Node

# Where the kubelet serves its Registration socket: fixed in kubelet 1.30 (its device manager uses
# the API's KubeletSocket, whatever --root-dir says), so the test node shares it with the host.
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"


def recipe() -> BuildRecipe:
    return BuildRecipe(GOMOD / "deviceplugin", ("gpufence.test/e2e/deviceplugin",), "-s -w")


def allocatable(node: Node, resource: str) -> str | None:
    status = json.loads(node.cp.kubectl("get", "node", node.name, "-o", "json").stdout)["status"]
    return (status.get("allocatable") or {}).get(resource)


@contextlib.contextmanager
def device_plugin(node: Node, resource: str, devices: int, id_prefix: str) -> Iterator[list[str]]:
    """Serves ``devices`` devices of ``resource`` (ids ``id_prefix`` + 0, 1, ...) until the block ends;
    yields the ids once the Node advertises them."""
    binary = build(recipe())["deviceplugin"]
    name = "deviceplugin-" + resource.replace("/", "-")
    component = start(name, [str(binary), f"-dir={DEVICE_PLUGIN_DIR}",
                             f"-resource={resource}", f"-devices={devices}", f"-id-prefix={id_prefix}"],
                      node.workdir)
    try:
        def advertised() -> bool:
            component.check_alive()
            return allocatable(node, resource) == str(devices)
        kube.wait_for(advertised, f"the node to advertise {devices} {resource}", timeout=60, interval=0.3)
        yield [f"{id_prefix}{i}" for i in range(devices)]
    finally:
        component.stop()
