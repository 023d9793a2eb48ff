"""Fixtures for the node tests: a real kubelet + containerd + runc joined to the e2e control plane.

The node runs with the oldest tested control plane only: the kubelet is v1.30.14 (cgroup v1, which
these machines mount), and the version skew policy allows a kubelet at most three minors older
than the API server, so against v1.37 the node tests skip and say so. A missing prerequisite (root,
containerd, runc, the CNI plugins, an image tool, Go) skips them too, or fails them under CI=true
(tests/support/prerequisites.py); root and the runtime are checked before any control plane starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client

from gpufence.simnvml import reset_driver_state
from tests.e2e import kube
from tests.e2e.binaries import GoMissing
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import WebhookProcess
from tests.e2e.tenant import Tenant, make_tenant
from tests.node.binaries import NODE_VERSION
from tests.node.guardian import GuardianDaemonSet, running_guardian
from tests.node.images import ImageBuildUnavailable
from tests.node.node import Node, NodeUnavailable, check_prerequisites, running_node
from tests.node.workloads import clear_namespace, write_gpu_state
from tests.support.prerequisites import missing, skip_by_design

POD_SECURITY = "pod-security.kubernetes.io/enforce"
MAX_KUBELET_SKEW = 3  # minors, https://kubernetes.io/releases/version-skew-policy/#kubelet


def _minor(version: str) -> int:
    return int(version.lstrip("v").split(".")[1])


@pytest.fixture(scope="session", autouse=True)
def node_prerequisites() -> None:
    """Autouse, so it comes before the control plane: a machine without them says so in seconds."""
    if os.environ.get("GPUFENCE_SKIP_NODE"):
        skip_by_design("opted-out", f"GPUFENCE_SKIP_NODE={os.environ['GPUFENCE_SKIP_NODE']} set")
    try:
        check_prerequisites()
    except NodeUnavailable as exc:
        missing(f"no node: {exc}")


@pytest.fixture(scope="session")
def node(cluster: ControlPlane, gpufence: WebhookProcess) -> Iterator[Node]:
    if _minor(cluster.version) - _minor(NODE_VERSION) > MAX_KUBELET_SKEW:
        skip_by_design("kubelet-skew", f"kubelet {NODE_VERSION} is more than {MAX_KUBELET_SKEW} minors older "
                       f"than the API server {cluster.version} (unsupported skew); the node runs with v1.30 only")
    try:
        with running_node(cluster) as running:
            yield running
    except (NodeUnavailable, ImageBuildUnavailable, GoMissing) as exc:
        missing(f"no node: {exc}")


@pytest.fixture(scope="session")
def sim(node: Node) -> Node:
    """The node with one idle simulated GPU (tests put processes on it with ``write_gpu_state``)."""
    write_gpu_state(node, ())
    return node


@pytest.fixture
def gpu_namespace(admin: client.ApiClient, cluster: ControlPlane, node: Node, sim: Node) -> Iterator[str]:
    """An opted-in namespace whose pods may record Events (the install's documented RoleBinding)."""
    namespace = kube.create_namespace(admin, "node", kube.OPT_IN)
    cluster.kubectl("-n", namespace, "create", "rolebinding", "gpufence-enforcer-events",
                    "--clusterrole=gpufence-enforcer-events", f"--group=system:serviceaccounts:{namespace}")
    yield namespace
    clear_namespace(cluster, node, namespace)
    # And a driver that forgot them: no limit, no allocation of this test's processes is left for the
    # next test's (whose pod may get the same PID-namespace inode and the same small pids).
    reset_driver_state(node.state_file)


@pytest.fixture
def tenant_on_node(cluster: ControlPlane, node: Node, sim: Node, tenant: Tenant) -> Iterator[Tenant]:
    """The ``edit`` tenant (tests/e2e/tenant.py), its pods on the node; they are gone before the next test."""
    yield tenant
    clear_namespace(cluster, node, tenant.namespace)


@pytest.fixture
def tenant_at_level(cluster: ControlPlane, admin: client.ApiClient, node: Node, sim: Node, gpufence: WebhookProcess,
                    tmp_path: Path) -> Iterator[Callable[[str | None], Tenant]]:
    """Makes ``edit`` tenants whose namespace enforces a Pod Security level (None: unlabelled), with
    the install's Events RoleBinding, known to the webhook before their first pod (it reads the
    level from its namespace cache); their pods and namespaces are gone before the next test."""
    made: list[Tenant] = []

    def make(level: str | None) -> Tenant:
        tenant = make_tenant(cluster, admin, tmp_path, labels={} if level is None else {POD_SECURITY: level})
        made.append(tenant)
        cluster.kubectl("-n", tenant.namespace, "create", "rolebinding", "gpufence-enforcer-events",
                        "--clusterrole=gpufence-enforcer-events",
                        f"--group=system:serviceaccounts:{tenant.namespace}")
        gpufence.wait_until_known(tenant.namespace)
        return tenant

    yield make
    for tenant in made:
        clear_namespace(cluster, node, tenant.namespace)


@pytest.fixture(scope="module")
def guardian(cluster: ControlPlane, node: Node, sim: Node) -> Iterator[GuardianDaemonSet]:
    """The node guardian, as the shipped DaemonSet (tests/node/guardian.py), for the tests of one module."""
    with running_guardian(cluster, node) as running:
        yield running
