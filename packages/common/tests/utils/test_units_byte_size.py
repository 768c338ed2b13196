"""Byte-size parsing and formatting."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.units import BYTE_UNITS, format_bytes, parse_byte_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1GB", 1073741824),  # the documented size syntax
        ("1.5 mb", 1572864),
        ("1024", 1024),
        ("512", 512),
        ("4KB", 4096),
        ("1.5 GB", 1610612736),
        ("  2 gb  ", 2 * 1024**3),
        ("64MiB", 64 * 1024**2),
        ("3kib", 3072),
        ("7B", 7),
        ("0", 0),
        ("0GB", 0),
        (".5KB", 512),
        ("1.KB", 1024),
        ("0.1 GB", 107374182),  # truncated to whole bytes
        (4096, 4096),
        (0, 0),
        (3.9, 3),
    ],
)
def test_parse_accepts(value: str | int | float, expected: int) -> None:
    assert parse_byte_size(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "abc",
        "12XB",
        "1 TB",
        "-1GB",
        "",
        "   ",
        "1e3",
        "GB",
        "1 2GB",
        "+5",
        "١٢",
        -1,
        math.nan,
        math.inf,
        -0.5,
        True,
    ],
)
def test_parse_rejects_with_field_and_allowed_units(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_byte_size(value, field="global_segment_size")  # type: ignore[arg-type]
    assert info.value.field == "global_segment_size"
    message = str(info.value)
    assert "global_segment_size" in message
    assert all(unit in message for unit in ("B", "KB", "MB", "GB"))


def test_parse_rejects_unsupported_type() -> None:
    with pytest.raises(ConfigError) as info:
        parse_byte_size([1], field="local_buffer_size")  # type: ignore[arg-type]
    assert info.value.field == "local_buffer_size"


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="size="):
        parse_byte_size("nope")


def test_unit_table_is_binary() -> None:
    assert BYTE_UNITS["kb"] == BYTE_UNITS["kib"] == 1024
    assert BYTE_UNITS["gb"] == BYTE_UNITS["gib"] == 1 << 30


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0B"),
        (512, "512B"),
        (1023, "1023B"),
        (1024, "1KiB"),
        (1572864, "1.5MiB"),
        (3 << 30, "3GiB"),
        (1536, "1.5KiB"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_format_bytes_rejects_non_counts(n: object) -> None:
    with pytest.raises(ConfigError):
        format_bytes(n)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 1 << 40))
def test_format_is_exact_unless_it_shows_two_decimals(n: int) -> None:
    text = format_bytes(n)
    parsed = parse_byte_size(text)
    number = text.rstrip("BKMGi")
    if "." not in number or len(number.split(".")[1]) < 2:
        assert parsed == n
    else:
        unit = 1 << 30 if text.endswith("GiB") else 1 << 20 if text.endswith("MiB") else 1 << 10
        assert abs(parsed - n) <= unit // 200 + 1  # rounded to 1/100 of the unit


def test_format_marks_approximations() -> None:
    assert format_bytes(2043) == "2.00KiB"
    assert parse_byte_size(format_bytes(1572864)) == 1572864
