"""Fixtures and hooks for the whole suite: the hypothesis profile, the ``needs`` mark
(tests/support/prerequisites.py), the enforcer sandbox (tests/support/enforcer_harness.py, used by
tests/integration/enforcer and tests/deploy's alert checks) and the helm binary (the chart tests and
the Helm install on the real API server)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.support.enforcer_harness import GpuSandbox, enforcer_config
from tests.support.examples import FAST_EXAMPLES, FAST_PROFILE, FULL_PROFILE
from tests.support.prerequisites import check_needs, missing, skip_unmet_needs

# Property tests assert what the code does, never how fast: on a loaded CI machine one slow example
# must not fail a run (hypothesis' default 200 ms deadline and its too_slow health check would).
# print_blob puts a failing example's reproduction line (@reproduce_failure) into the CI log.
settings.register_profile(
    FULL_PROFILE, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
# The fast loop (`make unit`: HYPOTHESIS_PROFILE=fast) runs a few examples per property
# (tests/support/examples.py); CI and `make test` run the full profile.
settings.register_profile(FAST_PROFILE, settings.get_profile(FULL_PROFILE), max_examples=FAST_EXAMPLES)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or FULL_PROFILE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip_unmet_needs(items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    check_needs(item)


# --- the enforcer sandbox (tests/support/enforcer_harness.py) ---------------------------------------


@pytest.fixture(scope="session")
def sim_lib() -> pathlib.Path:
    """The simulated libnvidia-ml.so.1 (compiled once per source hash, cached)."""
    from gpufence import simnvml

    try:
        return simnvml.build_library()
    except simnvml.SimNvmlBuildError as exc:
        missing(f"cannot build the simulated NVML library: {exc}")


@pytest.fixture
def gpu(tmp_path: pathlib.Path, sim_lib: pathlib.Path) -> Iterator[GpuSandbox]:
    sandbox = GpuSandbox(tmp_path, sim_lib)
    try:
        yield sandbox
    finally:
        sandbox.cleanup()


@pytest.fixture
def make_config() -> Callable[..., dict[str, Any]]:
    return enforcer_config


@pytest.fixture(scope="module")
def helm() -> pathlib.Path:
    """The helm binary built from its pinned Go module (tests/support/helm_binary.py); skips (fails
    under CI=true), saying why, where it cannot be built. Shared by the chart tests and the Helm
    install on the real API server."""
    from tests.support import helm_binary

    reason = helm_binary.missing_reason()
    if reason:
        missing(reason)
    return helm_binary.ensure_helm()
