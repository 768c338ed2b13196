"""Byte-size strings used by KV-pool settings (``global_segment_size``, ``local_buffer_size``, ...).

Runs in: any process that reads configuration. Pure: no I/O.

Unit table (case-insensitive, optional whitespace between number and unit; multipliers are **binary**,
as Mooncake's and vllm-ascend's ``convert_to_bytes`` use them, so ``"1GB"`` is 2**30 bytes):

========  ==================  ==========
unit      alias               bytes
========  ==================  ==========
``B``     (no unit)           1
``KB``    ``KiB``             1024
``MB``    ``MiB``             1024**2
``GB``    ``GiB``             1024**3
========  ==================  ==========

The ``KiB``/``MiB``/``GiB`` spellings are accepted in addition to the upstream set because they
say the same thing unambiguously and `format_bytes` writes them. The number may be fractional
(``"1.5 GB"``); the result is truncated to whole bytes, like upstream's ``int(number * multiplier)``.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Final

from ascend_dist.common.errors import ConfigError

__all__ = ["BYTE_UNITS", "format_bytes", "parse_byte_size"]

# Lower-cased unit -> multiplier.
BYTE_UNITS: Final[dict[str, int]] = {
    "b": 1,
    "kb": 1 << 10,
    "mb": 1 << 20,
    "gb": 1 << 30,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
}

# ASCII only: ``\d`` would otherwise accept e.g. Arabic-Indic digits.
_SIZE_RE: Final = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)", re.ASCII)

_FORMAT_UNITS: Final[tuple[tuple[str, int], ...]] = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


_EXPECTED: Final = (
    "a non-negative integer or a string 'number [unit]' with unit one of "
    "B, KB, MB, GB, KiB, MiB, GiB (case-insensitive, binary multiples; no unit means bytes)"
)


def parse_byte_size(value: str | int | float, *, field: str = "size") -> int:
    """Parse a byte size given as a number or a string such as ``"4KB"`` or ``"1.5 GB"``.

    Args:
        value: An ``int`` (taken as bytes), a finite non-negative ``float`` (truncated), or a
            string ``"<number> [unit]"`` using the module's unit table.
        field: Name of the configuration field, used in error messages.

    Returns:
        The size in bytes (``>= 0``).

    Raises:
        ConfigError: The value is negative, NaN/infinite, empty, of an unsupported type, or uses an
            unknown unit; the message names ``field`` and lists the allowed units.
    """
    if isinstance(value, bool):  # bool is an int subclass; True is never meant as "1 byte"
        raise ConfigError(field, value, _EXPECTED)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, value, _EXPECTED)
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(field, value, _EXPECTED)
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(field, value, _EXPECTED)
    match = _SIZE_RE.fullmatch(value.strip().lower())
    if match is None or (match["unit"] or "b") not in BYTE_UNITS:
        raise ConfigError(field, value, _EXPECTED)
    multiplier = BYTE_UNITS[match["unit"] or "b"]
    # Decimal, not float: exact for long digit strings and never overflows to inf.
    return int(Decimal(match["number"]) * multiplier)


def format_bytes(n: int) -> str:
    """Render a byte count for humans, in the largest binary unit not exceeding it.

    The output parses back with `parse_byte_size`. It is exact unless it shows two decimals:
    ``"2GiB"`` and ``"1.5MiB"`` are exact, ``"2.00KiB"`` (for 2043) is rounded.

    Args:
        n: A non-negative byte count.

    Returns:
        For example ``"512B"``, ``"4KiB"``, ``"1.5MiB"``, ``"1.33GiB"``.

    Raises:
        ConfigError: ``n`` is negative or not an integer.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError("n", n, "a non-negative integer byte count")
    for name, size in _FORMAT_UNITS:
        if n >= size:
            if n % size == 0:
                return f"{n // size}{name}"
            rounded = f"{n / size:.2f}"
            short = rounded.rstrip("0").rstrip(".")
            # "1.5MiB" only when exact; an approximation keeps both decimals ("2.00KiB" for 2043).
            return (short if Decimal(short) * size == n else rounded) + name
    return f"{n}B"
