"""Kubernetes quantities and percentages: exact integers, bounded work."""

from __future__ import annotations

import threading
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufence.quantity import (
    MAX_BYTES,
    QuantityError,
    canonical_quantity,
    is_positive_quantity,
    mebibytes_floor,
    parse_bytes,
    parse_percent,
)

BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", 1),
        ("1073741824", 2**30),
        ("8Gi", 8 * 2**30),
        ("500M", 500_000_000),
        ("1.5Gi", 3 * 2**29),
        ("1Ki", 1024),
        ("1k", 1000),
        ("2Ei", 2 * 2**60),
        ("7E", 7 * 10**18),
        ("1e9", 10**9),
        ("1E9", 10**9),
        ("1e+3", 1000),
        ("12e-1", 2),  # 1.2 bytes rounds up
        ("1500m", 2),  # 1.5 bytes rounds up
        ("1000m", 1),
        ("1m", 1),
        (".5Ki", 512),
        ("5.", 5),
        ("+3Mi", 3 * 2**20),
        ("0.1", 1),
        ("1e-300", 1),  # positive, far below a byte: rounds up, computed without a huge power
        ("3.3333333333333333333333Gi", 3579139414),  # exact (ceil of 3579139413.33), no float error
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "lots",
        "Gi",
        "1 Gi",
        " 1Gi",
        "1gi",
        "1GB",
        "1e",
        "1.2.3",
        "-1Gi",
        "0",
        "0.0",
        "0Gi",
        "-0",
        "1e1.5",
        "\u0661",
        "1\n",
        "10Ei",
        "9223372036854775808",
        "1e19",
        "1E999999999",
        "1" * 65,
        "0x10",
        "1_000",
        "--1",
        "e3",
        # kubernetes.utils.parse_quantity accepts these (Decimal syntax); the API server does not.
        "NaN",
        "Infinity",
        "1e3Ki",
    ],
)
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_bytes(text)


def test_precision_beyond_28_digits_rounds_up() -> None:
    # A 28-digit Decimal context (kubernetes.utils.parse_quantity's) would give exactly 1 GiB.
    assert parse_bytes("1.0000000000000000000000000000001Gi") == 2**30 + 1


def test_largest_value_is_accepted() -> None:
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES
    assert parse_bytes("7Ei") == 7 * 2**60


@pytest.mark.parametrize("text", ["1E999999999", "1e-999999999", "9" * 60 + "E9999", "1E" + "9" * 62])
def test_huge_exponents_are_rejected_without_computing_them(text: str) -> None:
    """Evaluating 10**999999999 exactly takes minutes; a bounded parser answers at once. The parse runs
    on a daemon thread joined with a generous bound, so a loaded machine cannot fail this, but a
    parser that computes the power would never return in time."""
    outcome: list[int | None] = []

    def parse() -> None:
        try:
            outcome.append(parse_bytes(text))
        except QuantityError:
            outcome.append(None)

    worker = threading.Thread(target=parse, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), f"parse_bytes({text[:20]!r}...) did not return: it is computing the power"
    assert outcome in ([None], [1])


def _reference(number: str, suffix: str) -> Fraction:
    if suffix in BINARY:
        return Fraction(Decimal(number)) * BINARY[suffix]
    if suffix in DECIMAL:
        return Fraction(Decimal(number)) * DECIMAL[suffix]
    if suffix == "m":
        return Fraction(Decimal(number)) / 1000
    return Fraction(Decimal(number + suffix))  # an exponent such as e9


numbers = st.builds(
    lambda whole, frac: f"{whole}.{frac}" if frac else str(whole),
    st.integers(min_value=0, max_value=10**12),
    st.one_of(st.just(""), st.from_regex(r"[0-9]{1,6}", fullmatch=True)),
)
suffixes = st.one_of(
    st.sampled_from([*BINARY, *DECIMAL, "m"]),
    st.integers(min_value=-20, max_value=20).map(lambda e: f"e{e}"),
    st.integers(min_value=-20, max_value=20).map(lambda e: f"E{e}"),
)


@given(numbers, suffixes)
def test_round_trip_against_exact_reference(number: str, suffix: str) -> None:
    exact = _reference(number, suffix)
    text = number + suffix
    if exact <= 0 or exact > MAX_BYTES:
        with pytest.raises(QuantityError):
            parse_bytes(text)
        return
    expected = -(-exact.numerator // exact.denominator)
    if expected > MAX_BYTES:
        with pytest.raises(QuantityError):
            parse_bytes(text)
        return
    assert parse_bytes(text) == expected


@given(st.integers(min_value=1, max_value=MAX_BYTES))
def test_plain_integers_round_trip(n: int) -> None:
    assert parse_bytes(str(n)) == n


@given(st.text(max_size=80))
def test_arbitrary_text_never_raises_anything_else(text: str) -> None:
    try:
        value = parse_bytes(text)
    except QuantityError:
        return
    assert isinstance(value, int) and 1 <= value <= MAX_BYTES


@pytest.mark.parametrize(
    ("text", "require_sign", "expected"),
    [
        ("25%", True, 25.0),
        ("100%", True, 100.0),
        ("12.5%", True, 12.5),
        ("0.0001%", True, 0.0001),
        ("50", False, 50.0),
        ("50%", False, 50.0),
        ("33.5", False, 33.5),
    ],
)
def test_parse_percent(text: str, require_sign: bool, expected: float) -> None:
    assert parse_percent(text, require_sign=require_sign) == expected


@pytest.mark.parametrize(
    "text", ["0%", "0", "150%", "100.0001%", "-5%", "%", "50 %", "1000%", "5e1%", "1.23456%", "nan%", "inf", ""]
)
def test_parse_percent_rejects(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_percent(text, require_sign=False)


def test_memory_percent_needs_the_sign() -> None:
    with pytest.raises(QuantityError):
        parse_percent("25", require_sign=True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("0", False),
        ("-1", False),
        ("500m", True),
        (2, True),
        (0, False),
        (True, False),
        (None, False),
        ("x", False),
        (1.5, True),
        (float("nan"), False),
        ({}, False),
    ],
)
def test_is_positive_quantity(value: object, expected: bool) -> None:
    assert is_positive_quantity(value) is expected


def test_mebibytes_floor() -> None:
    assert mebibytes_floor(5 * 10**9) == 4768
    assert mebibytes_floor(2**20 - 1) == 0


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("1024Mi", "1Gi"), ("1536Mi", "1536Mi"), ("1.5Gi", "1536Mi"), ("48Mi", "48Mi"), ("1Ki", "1Ki"),
        ("0.5", "500m"), ("500m", "500m"), ("2000m", "2"), ("1000", "1k"), ("1500", "1500"), ("0.0001", "100u"),
        ("1e3", "1e3"), ("1.5e3", "1500"), ("0", "0"), ("1025", "1025"),
    ],
)
def test_canonical_quantity(text: str, canonical: str) -> None:
    assert canonical_quantity(text) == canonical
    assert canonical_quantity(canonical) == canonical  # a fixed point, like the API server's


@pytest.mark.parametrize("text", ["-1", "lots", "1E999999999", "1 Gi"])
def test_canonical_quantity_rejects(text: str) -> None:
    with pytest.raises(QuantityError):
        canonical_quantity(text)
