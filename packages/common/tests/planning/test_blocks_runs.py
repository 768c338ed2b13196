"""Block-id validation and run grouping."""

from __future__ import annotations

import numpy as np
import pytest

from ascend_dist.common.blocks import (
    contiguous_runs,
    group_concurrent_contiguous,
    paired_runs,
    validate_block_ids,
)
from ascend_dist.common.errors import BlockIdError, ConfigError


def test_validate_returns_int64_array_for_lists_ranges_and_arrays() -> None:
    for ids in ([3, 1, 2], range(3), np.array([5, 6], dtype=np.int32), (7,), np.array([1.0, 2.0])):
        out = validate_block_ids(ids)
        assert out.dtype == np.int64
        assert out.ndim == 1
        assert out.tolist() == [int(x) for x in ids]
    assert validate_block_ids([]).tolist() == []


@pytest.mark.parametrize(
    ("ids", "position", "value"),
    [
        ([0, 1, -3, -4], 2, "-3"),
        ([0, 1.5, 2], 1, "1.5"),
        ([1, "x"], 1, "'x'"),
        ([True, False], 0, "True"),
        (np.array([4, np.nan]), 1, "nan"),
    ],
)
def test_validate_names_field_first_bad_position_and_value(ids: object, position: int, value: str) -> None:
    with pytest.raises(BlockIdError) as info:
        validate_block_ids(ids, field="remote_block_ids")  # type: ignore[arg-type]
    message = str(info.value)
    assert f"remote_block_ids[{position}]={value}" in message
    assert info.value.field == f"remote_block_ids[{position}]"


def test_validate_upper_bound() -> None:
    assert validate_block_ids([0, 9], num_blocks=10).tolist() == [0, 9]
    with pytest.raises(BlockIdError, match=r"block_ids\[1\]=10 .*num_blocks=10"):
        validate_block_ids([9, 10, 11], num_blocks=10)
    with pytest.raises(ConfigError, match="num_blocks"):
        validate_block_ids([1], num_blocks=-1)


def test_validate_rejects_nested_and_non_sequences() -> None:
    with pytest.raises(BlockIdError, match="1-D"):
        validate_block_ids(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(BlockIdError, match="sequence"):
        validate_block_ids(5)  # type: ignore[arg-type]
    with pytest.raises(BlockIdError, match="block_ids"):
        validate_block_ids([[1, 2], [3]])  # type: ignore[list-item]
    with pytest.raises(BlockIdError):
        validate_block_ids(np.array([2**63], dtype=np.uint64))


def test_contiguous_runs() -> None:
    starts, lengths = contiguous_runs([3, 4, 5, 9, 10, 2])
    assert starts.tolist() == [3, 9, 2]
    assert lengths.tolist() == [3, 2, 1]
    starts, lengths = contiguous_runs([])
    assert starts.size == lengths.size == 0
    # A repeated id breaks the run (it does not advance by one).
    assert contiguous_runs([4, 4, 5])[1].tolist() == [1, 2]


def test_paired_runs_break_unless_both_sides_advance() -> None:
    remote, local, lengths = paired_runs([7, 8, 9, 12], [2, 3, 5, 6])
    assert remote.tolist() == [7, 9, 12]
    assert local.tolist() == [2, 5, 6]
    assert lengths.tolist() == [2, 1, 1]


def test_paired_runs_requires_equal_lengths() -> None:
    with pytest.raises(BlockIdError, match="local_ids"):
        paired_runs([1, 2, 3], [1, 2])


def test_group_concurrent_contiguous_spec_examples() -> None:
    assert group_concurrent_contiguous([1, 2, 3, 5, 6], [10, 11, 12, 14, 15]) == (
        [[1, 2, 3], [5, 6]],
        [[10, 11, 12], [14, 15]],
    )
    assert group_concurrent_contiguous([1, 2], [10, 11], stride_a=4096, stride_b=2048, length=1024) == (
        [[1], [2]],
        [[10], [11]],
    )
    assert group_concurrent_contiguous([], []) == ([], [])


def test_group_concurrent_contiguous_with_matching_strides_merges() -> None:
    groups = group_concurrent_contiguous([4, 5, 6], [0, 1, 3], stride_a=1024, stride_b=1024, length=1024)
    assert groups == ([[4, 5], [6]], [[0, 1], [3]])


def test_group_concurrent_contiguous_bad_input() -> None:
    with pytest.raises(BlockIdError, match="b"):
        group_concurrent_contiguous([1, 2], [1])
    with pytest.raises(ConfigError, match="stride_a"):
        group_concurrent_contiguous([1], [1], stride_a=0)
    with pytest.raises(BlockIdError, match=r"a\[0\]=-1"):
        group_concurrent_contiguous([-1], [1])
