"""The gate on what the injection adds to a pod: the median over the goldens.

Every GPU pod carries the sidecar, and the API server stores, validates and sends every byte of it
to every watcher; the bench (bench/injected_bytes.py) prints the figure per golden.
"""

from __future__ import annotations

import pytest

from tests.support.injected_bytes import bytes_added
from tests.support.stats import median

# The target: a median of at most 1.2 kB added per injected pod.
TARGET_MEDIAN_BYTES = 1200
# What the injection adds now (1560 bytes median over 86 mutated goldens when this was last measured):
# no change may grow it.
CEILING_MEDIAN_BYTES = 1570


def _median() -> float:
    added = bytes_added()
    assert len(added) >= 50, f"only {len(added)} mutated goldens"
    return median(list(added.values()))


def test_the_injection_does_not_grow() -> None:
    assert _median() <= CEILING_MEDIAN_BYTES


@pytest.mark.xfail(strict=True, reason="measured 1560 bytes median over 86 goldens; what remains is the "
                   "sidecar's own spec (probe and postStart hook, securityContext, GPU visibility, resources, "
                   "port) and the GPU containers' variables, each an enforcement point (docs/PERFORMANCE.md)")
def test_the_median_injection_is_within_the_target() -> None:
    assert _median() <= TARGET_MEDIAN_BYTES


def test_every_piece_the_injection_adds_says_what_it_is_for() -> None:
    """The bench's per-piece table explains each byte; a new field must bring its reason."""
    from bench.injected_bytes import PURPOSE, fields

    found = fields()
    assert "sidecar securityContext" in found and "status annotation" in found
    assert sorted(set(found) - set(PURPOSE)) == []
