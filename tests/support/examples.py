"""How many examples a property test runs: its own count under the full hypothesis profile (CI,
`make test`), at most the fast profile's under the fast loop (`make unit` sets
HYPOTHESIS_PROFILE=fast; both profiles are registered in tests/conftest.py).

A test's ``@settings(max_examples=...)`` wins over any profile, so a test that sets its own count
writes ``max_examples=examples(300)`` for the fast profile to lighten it too."""

from __future__ import annotations

from hypothesis import settings

FULL_PROFILE = "gpufence"
FAST_PROFILE = "fast"
FAST_EXAMPLES = 15  # per property: catches a broken property while editing, not a rare corner


def examples(count: int) -> int:
    if settings.get_current_profile_name() == FAST_PROFILE:
        return min(count, FAST_EXAMPLES)
    return count
