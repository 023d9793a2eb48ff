"""Fixtures for the end-to-end tests: one real control plane per tested Kubernetes version.

Every test here runs once against each version in ``KUBERNETES_VERSIONS``; pytest groups them so
that one control plane runs at a time. Where Go (or the module proxy) is missing the binaries
cannot be built and the tests skip with that reason (``-ra`` prints it), or fail with it under
CI=true (tests/support/prerequisites.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.e2e import kube
from tests.e2e.binaries import KUBERNETES_VERSIONS
from tests.e2e.controlplane import ControlPlane, control_plane_for
from tests.e2e.gpufence_install import NAMESPACE, POLICY_CONFIGMAP, WebhookProcess, apply_objects, start_gpufence
from tests.e2e.tenant import Tenant, make_tenant
from tests.e2e.test_policy_reload import policy_valid, shipped_configmap


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            # Starting a control plane is part of the first test's setup.
            item.add_marker(pytest.mark.timeout(600))


@pytest.fixture(scope="session", params=KUBERNETES_VERSIONS, ids=lambda v: f"k8s-{v}")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with control_plane_for(request.param, tmp_path_factory.mktemp(f"k8s-{request.param}")) as cp:
        yield cp


@pytest.fixture(scope="session")
def gpufence(cluster: ControlPlane) -> Iterator[WebhookProcess]:
    hook = start_gpufence(cluster, cluster.workdir / "gpufence")
    try:
        yield hook
    finally:
        hook.stop()


@pytest.fixture
def webhook(gpufence: WebhookProcess) -> Iterator[WebhookProcess]:
    """The installed webhook, running (restarted if an earlier test stopped it)."""
    if gpufence.component is None or gpufence.component.process.poll() is not None:
        gpufence.start()
    yield gpufence
    if gpufence.component is None or gpufence.component.process.poll() is not None:
        gpufence.start()


@pytest.fixture(scope="session")
def admin(cluster: ControlPlane) -> client.ApiClient:
    return kube.api_client(cluster.admin_kubeconfig)


@pytest.fixture
def opted_in(admin: client.ApiClient, gpufence: WebhookProcess) -> str:
    return kube.create_namespace(admin, "team", kube.OPT_IN)


@pytest.fixture
def not_opted_in(admin: client.ApiClient, gpufence: WebhookProcess) -> str:
    return kube.create_namespace(admin, "plain")


@pytest.fixture
def tenant(cluster: ControlPlane, admin: client.ApiClient, gpufence: WebhookProcess,
           tmp_path: Path) -> Tenant:
    """An ``edit`` ServiceAccount in an opted-in namespace with ceilings (tests/e2e/tenant.py)."""
    return make_tenant(cluster, admin, tmp_path)


@pytest.fixture
def set_policy(cluster: ControlPlane, admin: client.ApiClient,
               webhook: WebhookProcess) -> Iterator[Callable[[dict[str, str]], None]]:
    """Patches keys of the policy ConfigMap as an admin would; afterwards the shipped ConfigMap is
    back, seen by the webhook."""
    def set_keys(data: dict[str, str]) -> None:
        client.CoreV1Api(admin).patch_namespaced_config_map(POLICY_CONFIGMAP, NAMESPACE, {"data": data})

    yield set_keys
    # As an admin re-applying the install would: the shipped data wins over the patches (and a
    # deleted ConfigMap is created again).
    apply_objects(cluster, [shipped_configmap(cluster, webhook)], "--force-conflicts")
    if webhook.component is not None and webhook.component.process.poll() is None:
        kube.wait_for(lambda: policy_valid(webhook), "the webhook to read the shipped policy again", timeout=30)
