"""Deterministic hashes that agree across processes, hosts and Python hash seeds.

Runs in: any process. Pure: no I/O.

Python's builtin ``hash`` of ``str``/``bytes`` is salted per process (``PYTHONHASHSEED``), so it must
never decide anything two processes have to agree on (which P rank to pull from, a compatibility
hash, a store key). These helpers hash a canonical byte encoding with SHA-256 instead.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Final, TypeAlias

from ascend_dist.common.errors import ConfigError

__all__ = ["HashPart", "stable_hash", "string_to_int64_hash"]

HashPart: TypeAlias = "str | bytes | int | float | bool | tuple[HashPart, ...] | None"

# Bumping this changes every stable_hash value; do it only with a protocol version bump.
_DOMAIN: Final = b"ascend_dist.stable_hash.v1\x00"
# Every NaN hashes alike whatever its payload bits are.
_CANONICAL_NAN: Final = struct.pack(">d", math.nan)


def string_to_int64_hash(s: str) -> int:
    """Hash a string to an unsigned 64-bit integer.

    SHA-256 of the UTF-8 bytes; the first 8 digest bytes read as little-endian unsigned
    (vllm-ascend ``string_to_int64_hash``), so both roles of a P/D pair derive the same value.

    Args:
        s: Any string, e.g. a request id.

    Returns:
        An integer in ``[0, 2**64)``.
    """
    return int.from_bytes(hashlib.sha256(s.encode("utf-8")).digest()[:8], "little")


def _sized(tag: bytes, payload: bytes) -> bytes:
    # Length prefixes make the encoding prefix-free, so distinct part lists never collide.
    return tag + len(payload).to_bytes(8, "big") + payload


def _encode(part: object, where: str, out: list[bytes]) -> None:
    """Append the canonical encoding of one part; the type tag keeps ``1``, ``1.0`` and ``True`` apart."""
    if part is None:
        out.append(b"N")
    elif isinstance(part, bool):  # before int: bool is an int subclass
        out.append(b"T" if part else b"F")
    elif isinstance(part, int):
        # Hex text: any size (decimal str() is capped at 4300 digits); int() drops subclass reprs.
        out.append(_sized(b"I", format(int(part), "x").encode("ascii")))
    elif isinstance(part, float):
        out.append(b"D" + (_CANONICAL_NAN if math.isnan(part) else struct.pack(">d", part)))
    elif isinstance(part, str):
        out.append(_sized(b"S", part.encode("utf-8")))
    elif isinstance(part, bytes):
        out.append(_sized(b"B", part))
    elif isinstance(part, tuple):
        out.append(b"L" + len(part).to_bytes(8, "big"))
        for i, item in enumerate(part):
            _encode(item, f"{where}[{i}]", out)
    else:
        raise ConfigError(where, part, "str, bytes, int, float, bool, None or a tuple of those")


def stable_hash(*parts: HashPart) -> str:
    """Hash a sequence of plain values to a hex SHA-256 digest, identically in every process.

    The encoding is typed and length-prefixed: ``stable_hash(1)``, ``stable_hash(1.0)``,
    ``stable_hash(True)`` and ``stable_hash("1")`` all differ, as do ``("a", "b")`` and ``("ab",)``.
    Lists, dicts and sets are rejected rather than guessed at (use a sorted tuple).

    Args:
        *parts: Values of type ``str``, ``bytes``, ``int``, ``float``, ``bool``, ``None`` or
            (nested) tuples of those.

    Returns:
        64 lower-case hex characters.

    Raises:
        ConfigError: A part has another type; the message names its position (``parts[2][0]``).
    """
    out: list[bytes] = [_DOMAIN]
    _encode(tuple(parts), "parts", out)
    return hashlib.sha256(b"".join(out)).hexdigest()
