"""The one exception the pure injection core raises for a pod it must deny."""

from __future__ import annotations


class MutationError(ValueError):
    """The pod cannot be injected as it is; the message is for the user (sent back as the denial).

    Messages name the field, the value, the rule and an accepted alternative; they never carry a
    traceback or an internal detail.
    """
