"""A tenant as docs/install.md sets one up: a ServiceAccount bound to the aggregated ``edit``
ClusterRole in an opted-in namespace whose admin set ceilings. Attacks in the end-to-end tests go
through the API server with this account's real bound token, never as the cluster admin.

``edit`` may create and patch pods, exec and attach into any container of its pods, write
ConfigMaps and (from 1.34) ResourceClaimTemplates; it may not annotate its Namespace, resize pods
or add ephemeral containers. What it may do is read from the API server itself
(``Tenant.can``), not assumed.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from gpufence.contract import NAMESPACE_MAX_COMPUTE, NAMESPACE_MAX_MEMORY
from tests.e2e import kube
from tests.e2e.controlplane import ControlPlane
from tests.e2e.gpufence_install import service_account_kubeconfig

TENANT_ACCOUNT = "tenant"
# The ceilings the attacks are measured against (as the attack report that motivated them used).
TENANT_CEILINGS = {NAMESPACE_MAX_MEMORY: "8Gi", NAMESPACE_MAX_COMPUTE: "25"}


@dataclass(frozen=True)
class Tenant:
    namespace: str
    user: str  # system:serviceaccount:<namespace>:tenant
    kubeconfig: Path
    api: client.ApiClient  # authenticated with the tenant's token

    def can(self, cp: ControlPlane, verb: str, resource: str) -> bool:
        """What the API server's authorizer says this tenant may do in its namespace (``resource`` may
        name a subresource: ``pods/exec``)."""
        # "pods/exec" is the subresource exec of pods (kubectl would read "pods/exec" as a pod named exec).
        kind, _, subresource = resource.partition("/")
        args = ["auth", "can-i", verb, kind, "-n", self.namespace, "--as", self.user]
        result = cp.kubectl(*args, *([f"--subresource={subresource}"] if subresource else []), check=False)
        answer = result.stdout.strip()
        assert answer in ("yes", "no"), result.stderr
        return answer == "yes"

    def kubectl(self, cp: ControlPlane, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """kubectl as the tenant (its own kubeconfig), in its namespace."""
        return cp.kubectl("-n", self.namespace, *args, kubeconfig=self.kubeconfig, check=check)


def make_tenant(cp: ControlPlane, admin: client.ApiClient, workdir: Path,
                annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> Tenant:
    """An opted-in namespace with ``TENANT_CEILINGS`` (or ``annotations``), and ``labels`` besides
    (e.g. a Pod Security level), and its ``edit`` account."""
    namespace = kube.create_namespace(admin, "tenant", {**kube.OPT_IN, **(labels or {})},
                                      TENANT_CEILINGS if annotations is None else annotations)
    core = client.CoreV1Api(admin)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": TENANT_ACCOUNT}})
    client.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(namespace, {
        "metadata": {"name": "tenant-edit"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": TENANT_ACCOUNT, "namespace": namespace}],
    })
    kubeconfig = service_account_kubeconfig(cp, namespace, TENANT_ACCOUNT, workdir / f"{namespace}.kubeconfig")
    return Tenant(namespace, f"system:serviceaccount:{namespace}:{TENANT_ACCOUNT}", kubeconfig,
                  kube.api_client(kubeconfig))
