"""How a rule refuses a pod (pure): one exception type, and a user's value quoted inside its message.

Every rule of the core that refuses raises ``Denial``; ``admission.review`` turns it into the
AdmissionReview's denial (HTTP 400 to the API server, the message to the user). Messages name the
field, the value, the rule and an accepted alternative; they never carry a traceback or an internal
detail.
"""

from __future__ import annotations

import json

_MAX_SHOWN = 64  # characters of a user's value quoted back in a message


class Denial(ValueError):
    """The pod (or its namespace's configuration) cannot be admitted as it is; the message is for the user."""


def quote(value: object) -> str:
    """A user's value as a JSON string literal, truncated: safe and short inside a message."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)[: _MAX_SHOWN * 2]
    if len(text) > _MAX_SHOWN:
        text = text[:_MAX_SHOWN] + "..."
    return json.dumps(text)
