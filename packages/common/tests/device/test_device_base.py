"""The runtime contract: copy-direction codes, descriptor splitting and batch validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.device import (
    MAX_DESCRIPTORS_PER_CALL,
    CopyDirection,
    split_descriptors,
    validate_batch,
)
from ascend_dist.common.errors import ConfigError


def test_direction_codes_are_fixed() -> None:
    assert [(d.name, int(d)) for d in CopyDirection] == [("H2D", 0), ("D2H", 1), ("D2D", 2)]
    assert MAX_DESCRIPTORS_PER_CALL == 4096


@pytest.mark.parametrize(
    ("n", "limit", "expected"),
    [
        (0, 4096, []),
        (1, 4096, [(0, 1)]),
        (4096, 4096, [(0, 4096)]),
        (4097, 4096, [(0, 4096), (4096, 4097)]),
        (10_000, 4096, [(0, 4096), (4096, 8192), (8192, 10_000)]),
        (5, 2, [(0, 2), (2, 4), (4, 5)]),
    ],
)
def test_split_descriptors_table(n: int, limit: int, expected: list[tuple[int, int]]) -> None:
    assert [(s.start, s.stop) for s in split_descriptors(n, limit)] == expected


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 50_000), limit=st.integers(1, 5000))
def test_split_descriptors_covers_in_order(n: int, limit: int) -> None:
    parts = split_descriptors(n, limit)
    covered = [i for s in parts for i in range(s.start, s.stop)]
    assert covered == list(range(n))
    assert all(0 < s.stop - s.start <= limit for s in parts)
    assert len(parts) == -(-n // limit)


@pytest.mark.parametrize(("n", "limit", "field"), [(-1, 4096, "n"), (3, 0, "limit")])
def test_split_descriptors_rejects(n: int, limit: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        split_descriptors(n, limit)


def test_validate_accepts_sequences_and_arrays_and_copies_them() -> None:
    src = np.array([100, 200], dtype=np.int64)
    batch = validate_batch(src, [300, 400], np.array([8, 0], dtype=np.uint32), 1)
    assert batch.direction is CopyDirection.D2H
    assert len(batch) == 2
    assert batch.src.dtype == batch.dst.dtype == batch.sizes.dtype == np.int64
    src[0] = 999  # the batch holds its own copy
    assert batch.src.tolist() == [100, 200]
    assert len(validate_batch([], [], [], CopyDirection.H2D)) == 0


@pytest.mark.parametrize(
    ("src", "dst", "sizes", "direction", "field"),
    [
        ([1, 2], [3], [4, 5], 0, "src_ptrs/dst_ptrs/sizes"),
        ([1], [2], [4, 5], 0, "src_ptrs/dst_ptrs/sizes"),
        ([1, 2], [3, 4], [4, -1], 0, r"sizes\[1\]"),
        ([1], [2], [3], 3, "direction"),
        ([1], [2], [3], -1, "direction"),
        ([1.5], [2], [3], 0, "src_ptrs"),
        ([1], np.array([2.0]), [3], 0, "dst_ptrs"),
        ([1], [2], [[3]], 0, "sizes"),
        ([0], [2], [3], 0, r"src_ptrs\[0\]"),
        ([1, 5], [2, -7], [3, 1], 0, r"dst_ptrs\[1\]"),
        ([1], [2], np.array([2**63], dtype=np.uint64), 0, "sizes"),
    ],
)
def test_validate_rejects_naming_the_field(src: object, dst: object, sizes: object, direction: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        validate_batch(src, dst, sizes, direction)  # type: ignore[arg-type]


def test_validate_allows_null_address_for_empty_descriptor() -> None:
    assert len(validate_batch([0], [0], [0], CopyDirection.D2D)) == 1
