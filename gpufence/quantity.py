"""Kubernetes resource quantities and percentages, parsed exactly and safely (no I/O).

Grammar (k8s.io/apimachinery/pkg/api/resource)::

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= <number> | <sign><number>
    <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
    <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= "e" <signedInteger> | "E" <signedInteger>

Everything is integer arithmetic (no floats near byte counts). The input length and the decimal
exponent are bounded *before* any power is computed, so ``1E999999999`` is rejected in
microseconds instead of building a billion-digit integer.

Why not ``kubernetes.utils.parse_quantity`` (already a dependency): it hands the number to
``Decimal``, so it accepts what the API server refuses (``" 8Gi"``, ``"1_000"``, ``"NaN"``,
``"Infinity"``, an exponent with a suffix such as ``"1e3Ki"``), and it computes in the ambient
28-digit context (``"1.0000000000000000000000000000001Gi"`` comes out as exactly 1 GiB, where the
share rounds up to one byte more). Behind our grammar and bounds all that would be left for it is
one multiplication; tests/unit/test_quantity.py pins these cases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

MAX_QUANTITY_LENGTH = 64
# Largest accepted byte count (int64, as Kubernetes stores quantities).
MAX_BYTES = 2**63 - 1
# With at most 64 characters the mantissa is below 10**64, so an exponent above this bound
# always overflows MAX_BYTES (unless the mantissa is zero) and one below -_EXPONENT_BOUND always
# gives a value below one.
_EXPONENT_BOUND = 128

_BINARY = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5, "Ei": 1024**6}
_DECIMAL = {"": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18, "m": -3, "u": -6, "n": -9}

_QUANTITY_RE = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|[eE](?P<exp>[+-]?[0-9]+)|(?P<dec>[kMGTPEmun]?))",
    re.ASCII,
)
_PERCENT_RE = re.compile(r"(?P<num>[0-9]{1,3}(?:\.[0-9]{1,4})?)(?P<pct>%?)", re.ASCII)


class QuantityError(ValueError):
    """The text is not an acceptable quantity or percentage (the message says why)."""


@dataclass(frozen=True)
class _Parsed:
    negative: bool
    mantissa: int  # all digits, decimal point removed
    exponent10: int  # value = mantissa * 10**exponent10 * multiplier
    multiplier: int  # 1 or a power of 1024
    exponent_form: bool = False  # written as 1e3 (the API server keeps that notation)


def _parse(text: str) -> _Parsed:
    if not isinstance(text, str):
        raise QuantityError("not a string")
    if len(text) > MAX_QUANTITY_LENGTH:
        raise QuantityError(f"longer than {MAX_QUANTITY_LENGTH} characters")
    match = _QUANTITY_RE.fullmatch(text)
    if match is None:
        raise QuantityError("not a Kubernetes quantity")
    int_digits = match["int"]
    frac_digits = match["frac"] or ""
    if not int_digits and not frac_digits:
        raise QuantityError("no digits")
    exponent10 = -len(frac_digits)
    multiplier = 1
    if match["bin"]:
        multiplier = _BINARY[match["bin"]]
    elif match["exp"] is not None:
        exp_text = match["exp"]
        # Bounded by MAX_QUANTITY_LENGTH, so int() is cheap; clamp before any power is taken.
        exp = int(exp_text)
        exponent10 += max(-2 * _EXPONENT_BOUND, min(2 * _EXPONENT_BOUND, exp))
    else:
        exponent10 += _DECIMAL[match["dec"] or ""]
    return _Parsed(match["sign"] == "-", int(int_digits + frac_digits or "0"), exponent10, multiplier,
                   match["exp"] is not None)


def parse_bytes(text: str) -> int:
    """A positive Kubernetes quantity as whole bytes (fractions round up), at most ``MAX_BYTES``."""
    parsed = _parse(text)
    if parsed.mantissa == 0:
        raise QuantityError("must be greater than zero")
    if parsed.negative:
        raise QuantityError("must not be negative")
    if parsed.exponent10 > _EXPONENT_BOUND:
        raise QuantityError("too large")
    if parsed.exponent10 < -_EXPONENT_BOUND:
        return 1  # a positive value far below one byte rounds up to one
    value: int = parsed.mantissa * parsed.multiplier
    if parsed.exponent10 >= 0:
        value *= 10**parsed.exponent10
    else:
        value = -(-value // 10**-parsed.exponent10)  # ceiling division
    if value > MAX_BYTES:
        raise QuantityError("too large")
    return value


def is_positive_quantity(value: object) -> bool:
    """Whether a resource-list value (normally a string, tolerated as a number) is a quantity > 0."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value > 0
    if isinstance(value, float):
        return value > 0 and value == value  # NaN is not positive
    if not isinstance(value, str):
        return False
    if value.isdigit() and value.isascii() and len(value) <= MAX_QUANTITY_LENGTH:
        return value.strip("0") != ""  # plain digits (a GPU count, "1"): positive unless all zeros
    try:
        parsed = _parse(value)
    except QuantityError:
        return False
    return parsed.mantissa > 0 and not parsed.negative


def parse_percent(text: str, *, require_sign: bool) -> float:
    """A percentage in (0, 100]: ``"25%"``, or also ``"25"`` unless ``require_sign``.

    At most three integer digits and four decimals, so the value is exact enough to print back.
    """
    if not isinstance(text, str):
        raise QuantityError("not a string")
    if len(text) > MAX_QUANTITY_LENGTH:
        raise QuantityError(f"longer than {MAX_QUANTITY_LENGTH} characters")
    match = _PERCENT_RE.fullmatch(text)
    if match is None or (require_sign and not match["pct"]):
        raise QuantityError("not a percentage")
    try:
        value = Decimal(match["num"])
    except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
        raise QuantityError("not a percentage") from None
    if not (0 < value <= 100):
        raise QuantityError("must be greater than 0% and at most 100%")
    return float(value)


def mebibytes_floor(num_bytes: int) -> int:
    return num_bytes // (1024 * 1024)


# --- canonical form (what the API server stores) -----------------------------------------------

_CANONICAL_DECIMAL = ((18, "E"), (15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "k"), (0, ""), (-3, "m"),
                      (-6, "u"), (-9, "n"))
_CANONICAL_BINARY = (("Ei", 1024**6), ("Pi", 1024**5), ("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2),
                     ("Ki", 1024))


def canonical_quantity(text: str) -> str:
    """``text`` as the API server writes it back (``1024Mi`` -> ``1Gi``, ``0.5`` -> ``500m``).

    A value the webhook writes into a pod must already be canonical: the API server canonicalises
    the stored pod, and a reinvocation would otherwise see a "different" value and patch it again.
    Raises ``QuantityError`` for anything but a non-negative quantity. Binary suffixes stay binary
    while the value is a whole number of KiB; otherwise the largest decimal suffix (or, for input
    written as ``1e3``, exponent) that keeps a whole mantissa, rounded up to nano units.
    """
    parsed = _parse(text)
    if parsed.negative and parsed.mantissa:
        raise QuantityError("must not be negative")
    if parsed.exponent10 > _EXPONENT_BOUND:
        raise QuantityError("too large")
    value = Fraction(parsed.mantissa * parsed.multiplier) * Fraction(10) ** parsed.exponent10
    if value == 0:
        return "0"
    if parsed.multiplier != 1 and value.denominator == 1:
        for suffix, size in _CANONICAL_BINARY:
            if value >= size and value.numerator % size == 0:
                return f"{value.numerator // size}{suffix}"
    nanos = -(-value.numerator * 10**9 // value.denominator)  # ceiling, in nano units
    for exponent, suffix in _CANONICAL_DECIMAL:
        unit = 10 ** (exponent + 9)
        if nanos % unit == 0:
            if parsed.exponent_form:
                suffix = f"e{exponent}" if exponent else ""
            return f"{nanos // unit}{suffix}"
    raise AssertionError("unreachable: every value is a whole number of nano units")  # pragma: no cover
