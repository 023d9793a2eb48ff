"""What a test needs from the machine, and what happens when it is missing.

Locally, a test whose tool (kubectl, promtool, setpriv, unshare, Go for helm and the Kubernetes
binaries, the node's runtime), root, or built binary (the simulated NVML library, the framework
interpreter) is missing skips and says why: a developer's machine need not have them all. With
``CI=true`` the same test fails with the same reason, because a CI run that skipped it would pass
without having run it. Every such skip goes through :func:`missing` (or :func:`require`, or the
``needs`` mark that tests/conftest.py checks at setup).

The skips that stay skips in CI are in ``BY_DESIGN``, each with why; they go through
:func:`skip_by_design`, which refuses a key that is not listed there.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

CI_VARIABLE = "CI"

BY_DESIGN: dict[str, str] = {
    "gpu": "tests/gpu needs a real NVIDIA GPU and driver; pytest does not collect it, it is run by hand "
    "(tests/gpu/README.md)",
    "torch": "the real-torch check needs PyPI's Linux torch, the CUDA build (about 1 GB plus the NVIDIA "
    "libraries); no make target installs it, so it runs only where GPUFENCE_FRAMEWORK_PYTHON has it",
    "jaxlib-version": "a check of what one range of jaxlib releases reads; the pinned framework interpreter "
    "(make framework-python) is in that range, another one need not be",
    "system-nvml": "the check that a missing libnvidia-ml.so.1 is reported cannot run on a host that has "
    "the real one",
    "kubelet-skew": "the node's kubelet (v1.30) is more than three minors older than the newer control "
    "plane, a skew Kubernetes does not support; the node tests run with the older one",
    "in-a-pod": "the check of a webhook started in a pod without a service-account token cannot run where "
    "the suite itself runs in a pod that has one mounted",
    "dra-not-served": "the DRA objects (DeviceClass, ResourceClaimTemplate) can only be created where the "
    "API server serves resource.k8s.io/v1 (Kubernetes >= 1.34; 1.30's DRA is a beta API off by default); "
    "tests/e2e/test_gpu_paths.py checks on every version that claims break nothing",
    "cgroup-v2-node": "the check that NVIDIA's memory-limit hook fails a container's start where it cannot "
    "apply the limit needs a node whose /sys/fs/cgroup is not cgroup2 (on a v2 node the hook succeeds)",
    "opted-out": "the person running the suite set GPUFENCE_SKIP_E2E or GPUFENCE_SKIP_NODE to leave "
    "those tests out",
}


def in_ci() -> bool:
    """Whether missing prerequisites fail the run (CI=true, as CI services set it)."""
    return os.environ.get(CI_VARIABLE, "").strip().lower() in ("true", "1")


def missing(reason: str) -> NoReturn:
    """This test cannot run here, for ``reason``: skip it, or under CI=true fail it."""
    __tracebackhide__ = True  # the report names the test's line, not this one
    if in_ci():
        pytest.fail(f"{reason} ({CI_VARIABLE}=true: a missing prerequisite fails the run, it does not skip)",
                    pytrace=False)
    pytest.skip(reason)


def require(condition: bool, reason: str) -> None:
    """:func:`missing` unless ``condition`` holds."""
    __tracebackhide__ = True
    if not condition:
        missing(reason)


def needs(condition: bool, reason: str) -> pytest.MarkDecorator:
    """:func:`require` as a mark, for a test or a module's ``pytestmark`` (checked at setup)."""
    return pytest.mark.needs(condition, reason=reason)


def unmet_needs(item: pytest.Item) -> list[str]:
    return [mark.kwargs["reason"] for mark in item.iter_markers("needs") if not mark.args[0]]


def skip_unmet_needs(items: list[pytest.Item]) -> None:
    """Outside CI, an unmet ``needs`` mark becomes a skip mark, so the report names the test's own
    line (tests/conftest.py calls this after collection)."""
    if in_ci():
        return
    for item in items:
        for reason in unmet_needs(item):
            item.add_marker(pytest.mark.skip(reason=reason))


def check_needs(item: pytest.Item) -> None:
    """Applies the ``needs`` marks of a test at its setup (tests/conftest.py calls this): under
    CI=true an unmet one fails it."""
    __tracebackhide__ = True
    for reason in unmet_needs(item):
        missing(reason)


def skip_by_design(key: str, detail: str) -> NoReturn:
    """A skip that stays one in CI; ``key`` names its entry in BY_DESIGN."""
    __tracebackhide__ = True
    if key not in BY_DESIGN:
        raise KeyError(f"skip_by_design({key!r}): not in BY_DESIGN (tests/support/prerequisites.py); "
                       f"add it there with why it may skip in CI, e.g. {next(iter(BY_DESIGN))!r}")
    pytest.skip(f"{detail} [by design in CI: {key}]")
