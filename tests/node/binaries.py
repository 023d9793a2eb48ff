"""Build (once) the node's kubelet from its own pinned module (``tests/e2e/gomod/kubelet-<version>``).

Same recipe and cache as the control plane (``tests.e2e.binaries``): the module's go.mod and
go.sum fix every dependency, the binary lands in ``~/.cache/gpufence/e2e/kubelet-<version>-<hash>/``
and a pin change rebuilds. ``python -m tests.node.binaries`` builds it and prints the cost.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.e2e.binaries import GOMOD, BuildRecipe, GoMissing, build, kubernetes_recipe

# The oldest supported Kubernetes: the last minor whose kubelet still runs on cgroup v1 by
# default (1.31 puts cgroup v1 in maintenance mode, 1.35 refuses it unless told otherwise), and
# these machines mount cgroup v1.
NODE_VERSION = "v1.30.14"


def kubelet_recipe(version: str = NODE_VERSION) -> BuildRecipe:
    # The same version stamp as the control plane's binaries (the node reports it in
    # status.nodeInfo.kubeletVersion), from the kubelet's own module.
    stamped = kubernetes_recipe(version)
    return BuildRecipe(GOMOD / f"kubelet-{version}", ("k8s.io/kubernetes/cmd/kubelet",), stamped.ldflags)


def kubelet(version: str = NODE_VERSION) -> Path:
    return build(kubelet_recipe(version))["kubelet"]


def main() -> int:
    try:
        path = kubelet()
    except GoMissing as exc:
        print(f"node: not building the kubelet, the node tests will skip: {exc}", file=sys.stderr)
        return 0
    cost = path.parent / "BUILD-COST"
    print(path, cost.read_text().strip() if cost.exists() else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
