"""Canonical block views: the six worked examples and the allocation traps."""

from __future__ import annotations

import pytest
import torch

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.kv_offload.layouts import (
    BlockView,
    canonical_block_views,
    dedup_views,
    generic_block_view,
)
from ascend_dist.kv_offload.memory import REGISTRATION_ALIGNMENT, align_memory


def _geometry(view: BlockView) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    return tuple(view.tensor.shape), tuple(view.tensor.stride()), view.copy_bytes, view.row_stride


# --- the six worked examples -------------------------------------------------------------------


def test_example_split_kv() -> None:
    k = torch.zeros(4, 2, 3, dtype=torch.bfloat16)
    v = torch.zeros(4, 2, 3, dtype=torch.bfloat16)
    views = canonical_block_views([k, v], num_blocks=4, unpadded_page_bytes=24)
    assert [_geometry(x) for x in views] == [((4, 12), (12, 1), 12, 12)] * 2
    assert [x.base_ptr for x in views] == [k.data_ptr(), v.data_ptr()]
    assert all(x.tensor.dtype == torch.int8 for x in views)


def test_example_kernel_block_coalescing() -> None:
    k = torch.zeros(8, 2, dtype=torch.int8)
    v = torch.zeros(8, 2, dtype=torch.int8)
    views = canonical_block_views([k, v], num_blocks=4, unpadded_page_bytes=8)
    assert [_geometry(x) for x in views] == [((4, 4), (4, 1), 4, 4)] * 2
    # Logical block 1 is kernel blocks 2 and 3.
    k[2:4] = torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)
    assert views[0].tensor[1].tolist() == [1, 2, 3, 4]


def test_example_extra_physical_rows_is_not_a_full_view() -> None:
    k = torch.zeros(10, 2, dtype=torch.int8)
    v = torch.zeros(10, 2, dtype=torch.int8)
    views = canonical_block_views([k, v], num_blocks=4, unpadded_page_bytes=4)
    assert len(views) == 2
    assert [_geometry(x) for x in views] == [((4, 2), (2, 1), 2, 2)] * 2
    assert [x.base_ptr for x in views] == [k.data_ptr(), v.data_ptr()]


def test_example_overlapping_full_view() -> None:
    full = torch.zeros(4, 8, dtype=torch.int8)
    key, scale = full[:, :4], full[:, 4:]
    views = canonical_block_views([key, scale, full], num_blocks=4, unpadded_page_bytes=8)
    assert len(views) == 1
    assert _geometry(views[0]) == ((4, 8), (8, 1), 8, 8)
    assert views[0].base_ptr == full.data_ptr()


def test_example_non_contiguous_payload() -> None:
    k = torch.zeros(4, 2, 3, dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(LayoutError, match="non-contiguous") as info:
        canonical_block_views([k], num_blocks=4, unpadded_page_bytes=12)
    assert isinstance(info.value, ValueError)


def test_example_mamba_with_offset() -> None:
    raw = torch.zeros(21, dtype=torch.int8)
    state0 = raw[1:9].view(4, 2)
    state1 = raw[9:21].view(4, 3)
    views = canonical_block_views([state0, state1], num_blocks=4, unpadded_page_bytes=5)
    assert [_geometry(x) for x in views] == [((4, 2), (2, 1), 2, 2), ((4, 3), (3, 1), 3, 3)]
    assert [x.base_ptr for x in views] == [state0.data_ptr(), state1.data_ptr()]


# --- allocation traps ------------------------------------------------------------------------------


def _padded_allocation(rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """As the runner allocates: over-allocate by 2 MiB, align, slice (storage_offset != 0)."""
    elt = torch.empty(0, dtype=dtype).element_size()
    nbytes = rows * elt * int(torch.Size(row_shape).numel())
    raw = torch.zeros(nbytes + 2 * REGISTRATION_ALIGNMENT, dtype=torch.int8)
    aligned = align_memory(raw[123:], REGISTRATION_ALIGNMENT)
    return aligned[:nbytes].view(dtype).view(rows, *row_shape)


def test_padded_offset_allocation_with_extra_rows_is_zero_copy() -> None:
    num_blocks, extra = 6, 3
    k = _padded_allocation(num_blocks + extra, (4, 2, 8), torch.bfloat16)
    v = _padded_allocation(num_blocks + extra, (4, 2, 8), torch.bfloat16)
    assert k.storage_offset() != 0
    assert k.untyped_storage().nbytes() % (num_blocks + extra) != 0
    page = 4 * 2 * 8 * 2
    views = canonical_block_views([k, v], num_blocks=num_blocks, unpadded_page_bytes=2 * page)
    assert [x.base_ptr for x in views] == [k.data_ptr(), v.data_ptr()]
    assert [_geometry(x) for x in views] == [((num_blocks, page), (page, 1), page, page)] * 2
    # Writing through the view changes the cache itself, and the bytes line up block by block.
    views[1].tensor[5].fill_(1)
    assert bool((v[5].view(torch.int16) == 0x0101).all())
    assert int(v[4].abs().sum()) == 0
    k[2] = 3.0
    assert torch.equal(views[0].tensor[2], k[2].reshape(-1).view(torch.int8))


def test_packed_rows_keep_their_stride() -> None:
    backing = torch.zeros(5, 16, dtype=torch.int8)
    packed = backing[:, :12]  # 12 payload bytes in 16-byte rows
    (view,) = canonical_block_views([packed], num_blocks=4, unpadded_page_bytes=12)
    assert _geometry(view) == ((4, 12), (16, 1), 12, 16)


def test_too_few_physical_blocks() -> None:
    k = torch.zeros(3, 4, dtype=torch.int8)
    with pytest.raises(LayoutError, match="too few physical blocks"):
        canonical_block_views([k, torch.zeros(3, 4, dtype=torch.int8)], num_blocks=4, unpadded_page_bytes=8)


def test_blocks_overlap() -> None:
    base = torch.zeros(64, dtype=torch.int8)
    overlapping = base.as_strided((4, 8), (4, 1))
    with pytest.raises(LayoutError, match="blocks overlap"):
        canonical_block_views([overlapping], num_blocks=4, unpadded_page_bytes=8)


def test_cannot_coalesce_padded_kernel_blocks() -> None:
    backing = torch.zeros(8, 4, dtype=torch.int8)
    padded = backing[:, :2]  # stride 4 > 2 bytes per kernel block
    with pytest.raises(LayoutError, match="cannot coalesce non-contiguous layout"):
        canonical_block_views([padded], num_blocks=4, unpadded_page_bytes=4)


def test_page_size_mismatch_and_bad_arguments() -> None:
    k = torch.zeros(4, 3, dtype=torch.int8)
    with pytest.raises(LayoutError, match="unpadded_page_bytes"):
        canonical_block_views([k, k.clone()], num_blocks=4, unpadded_page_bytes=5)
    with pytest.raises(LayoutError, match="parts"):
        canonical_block_views([], num_blocks=4, unpadded_page_bytes=4)
    with pytest.raises(LayoutError, match=r"parts\[0\]"):
        canonical_block_views([torch.zeros(4, 0)], num_blocks=4, unpadded_page_bytes=4)
    with pytest.raises(ConfigError, match="num_blocks"):
        canonical_block_views([k], num_blocks=0, unpadded_page_bytes=3)


def test_full_view_needs_same_storage_not_just_shape() -> None:
    # A long K with extra rows and U = 2 * L would qualify by shape; V elsewhere keeps it out.
    k = torch.zeros(8, 4, dtype=torch.int8)
    v = torch.zeros(8, 4, dtype=torch.int8)
    views = canonical_block_views([k, v], num_blocks=4, unpadded_page_bytes=8)
    assert len(views) == 2


def test_generic_single_tensor_packed_copies_unpadded_page() -> None:
    backing = torch.zeros(6, 32, dtype=torch.int8)
    view = generic_block_view(backing, num_blocks=5, unpadded_page_bytes=20)
    assert _geometry(view) == ((5, 32), (32, 1), 20, 32)
    with pytest.raises(LayoutError, match="row width"):
        generic_block_view(backing, num_blocks=5, unpadded_page_bytes=33)


def test_dedup_by_pointer_stride_and_width_not_storage() -> None:
    shared = torch.zeros(8, 16, dtype=torch.int8)
    k, v = shared[:, :8], shared[:, 8:]  # siblings of ONE storage: both must survive
    views = canonical_block_views([k], 8, 8) + canonical_block_views([v], 8, 8)
    aliased = canonical_block_views([k], 8, 8)  # another layer sharing K's bytes
    unique = dedup_views([*views, *aliased])
    assert [x.base_ptr for x in unique] == [k.data_ptr(), v.data_ptr()]
    narrower = canonical_block_views([shared[:, :4]], 8, 4)  # same pointer, other width: kept
    assert len(dedup_views([*views, *narrower])) == 3
