"""align_up and align_memory."""

from __future__ import annotations

import pytest
import torch

from ascend_dist.common.errors import ConfigError, RegionError
from ascend_dist.kv_offload.memory import REGISTRATION_ALIGNMENT, align_memory, align_up, is_power_of_two


@pytest.mark.parametrize(
    ("value", "alignment", "expected"),
    [(0, 8, 0), (1, 8, 8), (8, 8, 8), (9, 8, 16), (5, 1, 5), (0x1234_5678, 2 << 20, 0x1240_0000)],
)
def test_align_up(value: int, alignment: int, expected: int) -> None:
    assert align_up(value, alignment) == expected


@pytest.mark.parametrize("alignment", [0, -8, 3, 12, True])
def test_align_up_rejects_non_power_of_two(alignment: int) -> None:
    with pytest.raises(ConfigError, match="alignment"):
        align_up(10, alignment)


def test_align_up_rejects_negative_value() -> None:
    with pytest.raises(ConfigError, match="value"):
        align_up(-1, 8)


def test_is_power_of_two() -> None:
    assert [n for n in range(-2, 70) if is_power_of_two(n)] == [1, 2, 4, 8, 16, 32, 64]


def test_align_memory_returns_aliasing_suffix_at_aligned_address() -> None:
    raw = torch.zeros(3 * REGISTRATION_ALIGNMENT, dtype=torch.int8)
    unaligned = raw[7:]  # make sure the input does not start on the boundary
    aligned = align_memory(unaligned, REGISTRATION_ALIGNMENT)
    assert aligned.data_ptr() % REGISTRATION_ALIGNMENT == 0
    skipped = aligned.data_ptr() - unaligned.data_ptr()
    assert 0 < skipped < REGISTRATION_ALIGNMENT
    assert aligned.numel() == unaligned.numel() - skipped
    aligned[0] = 42  # zero copy: the original buffer sees the write
    assert int(unaligned[skipped]) == 42


def test_align_memory_counts_offset_in_elements() -> None:
    raw = torch.zeros(4096, dtype=torch.float32)
    view = raw[1:]
    aligned = align_memory(view, 256)
    assert aligned.dtype == torch.float32
    assert aligned.data_ptr() % 256 == 0
    assert aligned.data_ptr() - view.data_ptr() == (view.numel() - aligned.numel()) * 4


def test_align_memory_already_aligned_is_identity_view() -> None:
    raw = torch.zeros(2 * REGISTRATION_ALIGNMENT, dtype=torch.int8)
    aligned = align_memory(raw, REGISTRATION_ALIGNMENT)
    again = align_memory(aligned, REGISTRATION_ALIGNMENT)
    assert again.data_ptr() == aligned.data_ptr()
    assert again.numel() == aligned.numel()


def test_align_memory_too_small() -> None:
    raw = torch.zeros(REGISTRATION_ALIGNMENT, dtype=torch.int8)
    tiny = raw[1:2] if raw.data_ptr() % REGISTRATION_ALIGNMENT != REGISTRATION_ALIGNMENT - 1 else raw[2:3]
    with pytest.raises(RegionError, match="tensor"):
        align_memory(tiny, REGISTRATION_ALIGNMENT)


def test_align_memory_rejects_strided_tensor_and_bad_alignment() -> None:
    with pytest.raises(ConfigError, match="contiguous"):
        align_memory(torch.zeros(8, 8).t(), 64)
    with pytest.raises(ConfigError, match="alignment"):
        align_memory(torch.zeros(64, dtype=torch.int16), 3)
