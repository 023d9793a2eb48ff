"""The few Kubernetes CEL library functions the protect policy may use, for cel-python.

cel-python implements the CEL language but none of the libraries Kubernetes adds to it. These are
the ones gpufence's CEL has used (all available from Kubernetes 1.30, the oldest version we support):

* strings extension (cel-go ``ext.Strings``): ``s.split(sep)``, ``s.trim()``, ``s.replace(a, b)``,
  ``s.lowerAscii()``, ``s.substring(start, end)``;
* regex library (``k8s.io/apiserver/pkg/cel/library/regex.go``): ``s.find(re)``, the first match
  or ``''``;
* quantity library (``.../library/quantity.go``): ``isQuantity(s)``, ``quantity(s).asInteger()``,
  ``quantity(a).compareTo(quantity(b))`` (-1, 0 or 1);
* lists library (``.../library/lists.go``): ``list.sum()``, ``list.indexOf(x)`` (-1 when absent).

These stand-ins follow the documented semantics for the inputs the policy gives them (RE2 and
Python's ``re`` agree on the character classes and anchors it uses). They are a test harness, not a
second implementation of the policy: the real kube-apiserver evaluates it in
``tests/e2e/test_running_pod_attacks.py``.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from celpy import celtypes

_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_SUFFIX = {None: Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal("1e3"),
           "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18"),
           **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"])}}


class _Quantity:
    """resource.Quantity's value, from its serialised form (Kubernetes' regular grammar)."""

    def __init__(self, text: str) -> None:
        match = _QUANTITY.match(text)
        if match is None:
            raise ValueError(f"not a quantity: {text!r}")
        number, suffix = match.groups()
        scale = Decimal(10) ** int(suffix[1:]) if suffix and suffix[0] in "eE" else _SUFFIX[suffix]
        self.value = Decimal(number) * scale


def _split(text: Any, separator: Any) -> celtypes.ListType:
    return celtypes.ListType([celtypes.StringType(part) for part in str(text).split(str(separator))])


def _trim(text: Any) -> celtypes.StringType:
    return celtypes.StringType(str(text).strip())


def _replace(text: Any, old: Any, new: Any) -> celtypes.StringType:
    return celtypes.StringType(str(text).replace(str(old), str(new)))


def _substring(text: Any, start: Any, end: Any) -> celtypes.StringType:
    """cel-go errors on indexes outside the string (Python would clip them)."""
    value, first, last = str(text), int(start), int(end)
    if not 0 <= first <= last <= len(value):
        raise ValueError(f"substring({first}, {last}) out of range for {value!r}")
    return celtypes.StringType(value[first:last])


def _lower_ascii(text: Any) -> celtypes.StringType:
    """Only A-Z change, as in cel-go (Python's lower() would also fold other letters)."""
    return celtypes.StringType(str(text).translate(_ASCII_LOWER))


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _find(text: Any, pattern: Any) -> celtypes.StringType:
    match = re.search(str(pattern), str(text))
    return celtypes.StringType(match.group(0) if match else "")


def _is_quantity(text: Any) -> celtypes.BoolType:
    return celtypes.BoolType(_QUANTITY.match(str(text)) is not None)


def _quantity(text: Any) -> _Quantity:
    return _Quantity(str(text))


def _as_integer(quantity: _Quantity) -> celtypes.IntType:
    """Kubernetes raises an error when the value is not a whole number (or does not fit 64 bits)."""
    if quantity.value != quantity.value.to_integral_value():
        raise ValueError(f"{quantity.value} is not an integer")
    return celtypes.IntType(int(quantity.value))


def _compare_to(left: _Quantity, right: _Quantity) -> celtypes.IntType:
    return celtypes.IntType((left.value > right.value) - (left.value < right.value))


def _index_of(values: Any, item: Any) -> celtypes.IntType:
    return celtypes.IntType(next((i for i, v in enumerate(values) if v == item), -1))


def _sum(values: Any) -> celtypes.IntType:
    return celtypes.IntType(sum(int(v) for v in values))


FUNCTIONS = {
    "sum": _sum,
    "split": _split,
    "trim": _trim,
    "replace": _replace,
    "lowerAscii": _lower_ascii,
    "substring": _substring,
    "find": _find,
    "isQuantity": _is_quantity,
    "quantity": _quantity,
    "asInteger": _as_integer,
    "compareTo": _compare_to,
    "indexOf": _index_of,
}
