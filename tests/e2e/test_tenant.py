"""The tenant fixture is what the attack tests claim it is: ``edit`` rights, checked by the API server."""

from __future__ import annotations

import pytest

from tests.e2e.controlplane import ControlPlane
from tests.e2e.tenant import Tenant


@pytest.mark.parametrize(("verb", "resource", "allowed"), [
    ("create", "pods", True),
    ("patch", "pods", True),
    ("create", "pods/exec", True),
    ("create", "pods/attach", True),
    ("create", "configmaps", True),
    ("patch", "namespaces", False),
    ("patch", "pods/ephemeralcontainers", False),
    ("patch", "pods/resize", False),
    ("create", "rolebindings", False),
])
def test_tenant_has_edit_rights_and_no_more(cluster: ControlPlane, tenant: Tenant, verb: str, resource: str,
                                            allowed: bool):
    assert tenant.can(cluster, verb, resource) is allowed
