"""How a rule refuses a pod (pure): one exception type, and a user's value quoted inside its message.

Every rule of the core that refuses raises ``Denial``; ``admission.review`` turns it into the
AdmissionReview's denial (HTTP 400 to the API server, the message to the user). Messages name the
field, the value, the rule and an accepted alternative; they never carry a traceback or an internal
detail.
"""

from __future__ import annotations

import json
from collections.abc import Collection

_MAX_SHOWN = 64  # characters of a user's value quoted back in a message


class Denial(ValueError):
    """The pod (or its namespace's configuration) cannot be admitted as it is; the message is for the user."""


def quote(value: object) -> str:
    """A user's value as a JSON string literal, truncated: safe and short inside a message."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)[: _MAX_SHOWN * 2]
    if len(text) > _MAX_SHOWN:
        text = text[:_MAX_SHOWN] + "..."
    return json.dumps(text)


def from_admin(groups: object, admin_groups: Collection[str]) -> bool:
    """Whether the request's ``groups`` (the AdmissionReview's userInfo.groups, any JSON) name one of
    ``admin_groups``: the admin's exemption from the side-door rules, decided in one place."""
    return isinstance(groups, list) and any(g in admin_groups for g in groups if isinstance(g, str))
