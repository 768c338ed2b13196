"""Registration regions: ranges, merging, per-storage collection and the region limit."""

from __future__ import annotations

import logging

import pytest
import torch

from ascend_dist.common.errors import RegionError
from ascend_dist.common.regions import (
    MAX_REGISTERED_REGIONS,
    MERGE_GAP_BYTES,
    RegionLimitError,
    RegisterRange,
    RegisterRegions,
    collect_storage_merged_register_regions,
    iter_kv_cache_tensors,
    merge_ranges,
    tensor_storage_key,
    validate_ranges,
    validate_register_region_count,
)

KiB = 1024
MiB = 1024 * KiB


def test_register_range_length_and_validation() -> None:
    assert RegisterRange(0x1000, 0x3000).length == 0x2000
    with pytest.raises(RegionError, match="end"):
        RegisterRange(10, 10)
    with pytest.raises(RegionError, match="start"):
        RegisterRange(-1, 10)


def test_register_regions_bytes_and_validation() -> None:
    regions = RegisterRegions((0x1000, 0x9000), (0x100, 0x200), logical_tensor_count=3)
    assert regions.registered_bytes == 0x300
    assert len(regions) == 2
    assert regions.ranges() == [RegisterRange(0x1000, 0x1100), RegisterRange(0x9000, 0x9200)]
    with pytest.raises(RegionError, match="lengths"):
        RegisterRegions((1, 2), (3,))
    with pytest.raises(RegionError, match=r"lengths\[0\]"):
        RegisterRegions((1,), (0,))
    with pytest.raises(RegionError, match=r"ptrs\[1\]"):
        RegisterRegions((1, -2), (3, 4))


def test_merge_ranges_spec_example_addresses() -> None:
    # Storage A: K and V adjacent, 1 MiB each -> one 2 MiB region.
    storage_a = [RegisterRange(0x1010_0000, 0x1010_0000 + MiB), RegisterRange(0x1000_0000, 0x1000_0000 + MiB)]
    assert merge_ranges(storage_a) == [RegisterRange(0x1000_0000, 0x1000_0000 + 2 * MiB)]
    # Storage B: gap 4 KiB merges, gap 8 KiB does not.
    storage_b = [
        RegisterRange(0x2000_0000, 0x2000_1000),
        RegisterRange(0x2000_2000, 0x2000_3000),
        RegisterRange(0x2000_5000, 0x2000_6000),
    ]
    assert merge_ranges(storage_b) == [
        RegisterRange(0x2000_0000, 0x2000_3000),
        RegisterRange(0x2000_5000, 0x2000_6000),
    ]


def test_merge_ranges_overlap_containment_and_gap_parameter() -> None:
    ranges = [RegisterRange(0, 100), RegisterRange(10, 20), RegisterRange(50, 150), RegisterRange(151, 160)]
    assert merge_ranges(ranges, gap=0) == [RegisterRange(0, 150), RegisterRange(151, 160)]
    assert merge_ranges(ranges, gap=1) == [RegisterRange(0, 160)]
    assert merge_ranges([]) == []
    with pytest.raises(RegionError, match="gap"):
        merge_ranges(ranges, gap=-1)


def test_validate_ranges_accepts_sorted_touching() -> None:
    validate_ranges([RegisterRange(0, 10), RegisterRange(10, 20), RegisterRange(30, 40)])
    validate_ranges([])


def test_validate_ranges_names_first_offending_pair() -> None:
    with pytest.raises(RegionError, match=r"buffers\[2\].*buffers\[1\].*overlapping"):
        validate_ranges(
            [RegisterRange(0, 10), RegisterRange(10, 20), RegisterRange(15, 30), RegisterRange(0, 1)],
            field="buffers",
        )
    with pytest.raises(RegionError, match=r"regions\[1\].*regions\[0\].*out of order"):
        validate_ranges([RegisterRange(100, 200), RegisterRange(0, 10)])
    with pytest.raises(RegionError, match=r"regions\[0\]"):
        validate_ranges([(0, 10)])  # type: ignore[list-item]


def test_iter_kv_cache_tensors_depth_first() -> None:
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    nest = {"layer0": (a, b), "layer1": [None, {"x": c}], "layer2": None, "layer3": d}
    assert [t is x for t, x in zip(iter_kv_cache_tensors(nest), (a, b, c, d), strict=True)] == [True] * 4
    assert list(iter_kv_cache_tensors(None)) == []
    with pytest.raises(RegionError, match="kv_caches"):
        list(iter_kv_cache_tensors({"layer0": 3}))


def test_tensor_storage_key_groups_views_of_one_allocation() -> None:
    raw = torch.zeros(1024, dtype=torch.int8)
    assert tensor_storage_key(raw[100:200]) == tensor_storage_key(raw[500:]) == raw.data_ptr()
    assert tensor_storage_key(torch.zeros(4)) != tensor_storage_key(raw)


def test_collect_spec_example_with_real_storages() -> None:
    storage_a = torch.zeros(2 * MiB, dtype=torch.int8)
    k, v = storage_a[:MiB], storage_a[MiB:]
    storage_b = torch.zeros(0x6000, dtype=torch.int8)
    b0, b1, b2 = storage_b[:0x1000], storage_b[0x2000:0x3000], storage_b[0x5000:0x6000]
    regions = collect_storage_merged_register_regions({"attn": (v, k), "other": [b2, b0, b1]})
    base_b = storage_b.data_ptr()
    assert regions.ptrs == (storage_a.data_ptr(), base_b, base_b + 0x5000)
    assert regions.lengths == (2 * MiB, 0x3000, 0x1000)
    assert regions.logical_tensor_count == 5
    assert regions.logical_total_bytes == 2 * MiB + 3 * 0x1000
    assert regions.registered_bytes == 2 * MiB + 0x4000


def test_collect_never_merges_across_storages_and_skips_empty() -> None:
    # Small separate allocations typically sit within 4 KiB of each other: they must stay apart.
    tensors = [torch.zeros(16, dtype=torch.int8) for _ in range(20)]
    regions = collect_storage_merged_register_regions([*tensors, torch.zeros(0)])
    assert len(regions) == 20
    assert list(regions.ptrs) == [t.data_ptr() for t in tensors]  # first-seen storage order
    assert regions.logical_tensor_count == 20


def test_collect_duplicates_alias_once() -> None:
    k = torch.zeros(4096, dtype=torch.int8)
    regions = collect_storage_merged_register_regions({"a": k, "b": k})
    assert regions.lengths == (4096,)
    assert regions.logical_tensor_count == 2


def test_collect_warns_on_non_contiguous(caplog: pytest.LogCaptureFixture) -> None:
    base = torch.zeros(8, 8)
    with caplog.at_level(logging.WARNING, logger="ascend_dist.common.regions"):
        regions = collect_storage_merged_register_regions([base.t()])
    assert "not contiguous" in caplog.text
    assert regions.lengths == (base.numel() * 4,)


def test_collect_registers_the_span_of_a_strided_view() -> None:
    """One layer of a block-outermost cache: its blocks lie a packed block (all layers' pages) apart."""
    buf = torch.zeros(4 * 3 * 64, dtype=torch.int8)  # 4 blocks x 3 layers x 64-byte pages
    layer1 = buf.as_strided((4, 64), (3 * 64, 1), storage_offset=64)
    regions = collect_storage_merged_register_regions([layer1])
    assert regions.ptrs == (layer1.data_ptr(),)
    assert regions.lengths == (3 * 3 * 64 + 64,)  # to the end of its last block, not 4 * 64
    assert regions.logical_total_bytes == 4 * 64


def test_region_count_limit() -> None:
    ok = RegisterRegions(tuple(range(0, 256 * 8192, 8192)), (4096,) * 256)
    validate_register_region_count(ok)
    too_many = RegisterRegions(
        tuple(range(0, 257 * 8192, 8192)), (4096,) * 257, logical_tensor_count=514, logical_total_bytes=999
    )
    with pytest.raises(RegionLimitError) as info:
        validate_register_region_count(too_many)
    err = info.value
    assert isinstance(err, RuntimeError)
    assert isinstance(err, ValueError)
    assert isinstance(err, RegionError)
    message = str(err)
    assert err.field == "regions"
    for fragment in (
        "257",
        f"{MAX_REGISTERED_REGIONS}",
        f"{257 * 4096} registered bytes",
        "514 tensors",
        "999",
    ):
        assert fragment in message
    assert "fragmentation" in message
    with pytest.raises(RegionLimitError):
        validate_register_region_count(ok, limit=10)
    with pytest.raises(RegionError, match="limit"):
        validate_register_region_count(ok, limit=0)


def test_merge_gap_constant() -> None:
    assert MERGE_GAP_BYTES == 4096
