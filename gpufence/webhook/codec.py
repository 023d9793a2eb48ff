"""JSON on the wire: orjson for the AdmissionReview in and out, the stdlib where orjson refuses.

orjson decodes and encodes the review several times faster than the stdlib (see
docs/PERFORMANCE.md), which is most of what a review costs besides the review itself. Its few
refusals are all on input the API server never sends and that we answer with a 400 anyway: NaN
and Infinity, invalid UTF-8 or lone surrogates, nesting deeper than 1024. It reads integers beyond
64 bits as floats, which the shape check then refuses where the injection reads them. On encoding
it refuses what the stdlib still writes (integers beyond 64 bits, nesting beyond 254 levels, keys
that are not strings): those values can only come from a caller that built the pod in Python, and
the stdlib writes them, with the same compact separators.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

DecodeError = orjson.JSONDecodeError  # a ValueError (and a json.JSONDecodeError)

_stdlib_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def loads(data: bytes | str) -> Any:
    """The JSON value of ``data``; raises ``DecodeError`` (a ValueError) with a position."""
    return orjson.loads(data)


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of ``value``."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return _stdlib_compact(value).encode()
