"""Process-independent hashes and the canonical stable_hash."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.hashing import stable_hash, string_to_int64_hash

SRC = Path(__file__).resolve().parents[2] / "src"


def test_string_to_int64_hash_is_sha256_prefix_little_endian() -> None:
    digest = hashlib.sha256(b"req-1").digest()
    assert string_to_int64_hash("req-1") == int.from_bytes(digest[:8], "little")
    assert string_to_int64_hash("") == int.from_bytes(hashlib.sha256(b"").digest()[:8], "little")
    assert string_to_int64_hash("é") == int.from_bytes(hashlib.sha256("é".encode()).digest()[:8], "little")


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_string_to_int64_hash_is_unsigned_64_bit(s: str) -> None:
    assert 0 <= string_to_int64_hash(s) < 2**64


def test_stable_hash_shape_and_determinism() -> None:
    value = stable_hash("model", 16, 1.5, True, None, (1, ("a", b"\x00")))
    assert len(value) == 64
    assert int(value, 16) >= 0
    assert value == stable_hash("model", 16, 1.5, True, None, (1, ("a", b"\x00")))


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ((1,), (1.0,)),
        ((1,), (True,)),
        ((1,), ("1",)),
        ((0,), (False,)),
        ((0,), (None,)),
        (("ab",), ("a", "b")),
        ((("a", "b"),), ("a", "b")),
        (("a",), (b"a",)),
        ((0.0,), (-0.0,)),
        ((), ((),)),
    ],
)
def test_stable_hash_distinguishes_types_and_structure(left: tuple[object, ...], right: tuple[object, ...]) -> None:
    assert stable_hash(*left) != stable_hash(*right)  # type: ignore[arg-type]


def test_stable_hash_handles_big_ints_and_all_nans() -> None:
    assert stable_hash(10**5000) != stable_hash(10**5000 + 1)
    assert stable_hash(float("nan")) == stable_hash(-float("nan"))


@pytest.mark.parametrize(
    ("parts", "where"), [(([1],), "parts[0]"), ((1, ({"a": 1},)), "parts[1][0]"), (({1},), "parts[0]")]
)
def test_stable_hash_rejects_other_types_naming_the_position(parts: tuple[object, ...], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        stable_hash(*parts)  # type: ignore[arg-type]
    assert info.value.field == where


_CHILD = (
    "from ascend_dist.common.hashing import stable_hash, string_to_int64_hash;"
    "print(stable_hash('engine', 8, 2.5, (True, None, b'x')), string_to_int64_hash('req-42'), hash('salted'))"
)


def _run_with_seed(seed: str) -> list[str]:
    env = dict(
        os.environ,
        PYTHONHASHSEED=seed,
        PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.split()


def test_hashes_do_not_depend_on_pythonhashseed() -> None:
    first, second = _run_with_seed("1"), _run_with_seed("2")
    assert first[2] != second[2], "the builtin hash really is salted differently in the two children"
    assert first[:2] == second[:2]
    assert first[0] == stable_hash("engine", 8, 2.5, (True, None, b"x"))
    assert int(first[1]) == string_to_int64_hash("req-42")
