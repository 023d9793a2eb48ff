"""The few Kubernetes CEL library functions the guard policy uses, for cel-python.

cel-python implements the CEL language but none of the libraries Kubernetes adds to it. The guard
uses these (all available from Kubernetes 1.30, the oldest version we support):

* strings extension (cel-go ``ext.Strings``): ``s.split(sep)``, ``s.trim()``, ``s.replace(a, b)``;
* regex library (``k8s.io/apiserver/pkg/cel/library/regex.go``): ``s.find(re)``, the first match
  or ``''``;
* quantity library (``.../library/quantity.go``): ``isQuantity(s)``, ``quantity(s).asInteger()``.

These stand-ins follow the documented semantics for the inputs the policy gives them (RE2 and
Python's ``re`` agree on the character classes and anchors it uses). They are a test harness, not a
second implementation of the guard: the real kube-apiserver evaluates the same policy in
``tests/e2e/test_guard.py`` and ``tests/e2e/test_forged_sidecar.py``.
"""

from __future__ import annotations

import re
from typing import Any

from celpy import celtypes

from webhook.quantity import QuantityError, parse_bytes


class _Quantity:
    def __init__(self, text: str) -> None:
        self.value = parse_bytes(text)


def _split(text: Any, separator: Any) -> celtypes.ListType:
    return celtypes.ListType([celtypes.StringType(part) for part in str(text).split(str(separator))])


def _trim(text: Any) -> celtypes.StringType:
    return celtypes.StringType(str(text).strip())


def _replace(text: Any, old: Any, new: Any) -> celtypes.StringType:
    return celtypes.StringType(str(text).replace(str(old), str(new)))


def _find(text: Any, pattern: Any) -> celtypes.StringType:
    match = re.search(str(pattern), str(text))
    return celtypes.StringType(match.group(0) if match else "")


def _is_quantity(text: Any) -> celtypes.BoolType:
    try:
        parse_bytes(str(text))
    except QuantityError:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _quantity(text: Any) -> _Quantity:
    return _Quantity(str(text))


def _as_integer(quantity: _Quantity) -> celtypes.IntType:
    return celtypes.IntType(quantity.value)


FUNCTIONS = {
    "split": _split,
    "trim": _trim,
    "replace": _replace,
    "find": _find,
    "isQuantity": _is_quantity,
    "quantity": _quantity,
    "asInteger": _as_integer,
}
