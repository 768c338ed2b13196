"""Offload host-chunk descriptors: worked example, groups, skip, coalescing, limits."""

from __future__ import annotations

import numpy as np
import pytest

from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.kv_offload.chunk_descriptors import (
    BATCH_COPY_MAX_DESCRIPTORS,
    ChunkRef,
    CopyDescriptors,
    build_chunk_descriptors,
    coalesce_descriptors,
    device_block_addresses,
    host_chunks_needed,
    host_subblock_addresses,
    split_copy_descriptors,
)

KiB = 1024
MiB = 1024 * KiB
PAGE = 256 * KiB


def _ref(device_base: int, host_base: int, *, stride: int = PAGE, copy: int = PAGE) -> ChunkRef:
    return ChunkRef(
        device_base=device_base,
        device_row_stride=stride,
        row_width=PAGE,
        copy_bytes=copy,
        host_base=host_base,
    )


K = _ref(0x1_0000_0000, 0x8_0000_0000)
V = _ref(0x2_0000_0000, 0x9_0000_0000)


def _rows(d: CopyDescriptors) -> list[tuple[int, int, int]]:
    return list(zip(d.src.tolist(), d.dst.tolist(), d.sizes.tolist(), strict=True))


def test_worked_example_store() -> None:
    blocks = [11, 12, 13, 14, 15, 16]
    assert host_chunks_needed(len(blocks), 5 % 4, 4) == 2
    d = build_chunk_descriptors([[K, V]], blocks, [7, 9], blocks_per_chunk=4, direction="store", block_indices=[5])
    expected = []
    for ref in (K, V):
        host = [ref.host_base + 7 * MiB + j * PAGE for j in (1, 2, 3)]
        host += [ref.host_base + 9 * MiB + j * PAGE for j in (0, 1, 2)]
        expected += [(ref.device_base + b * PAGE, h, PAGE) for b, h in zip(blocks, host, strict=True)]
    assert _rows(d) == expected
    assert len(d) == 12
    assert d.total_bytes == 3 * MiB


def test_load_direction_swaps_source_and_destination() -> None:
    store = build_chunk_descriptors([[K]], [3, 4], [2], blocks_per_chunk=4, direction="store")
    load = build_chunk_descriptors([[K]], [3, 4], [2], blocks_per_chunk=4, direction="load")
    assert load.src.tolist() == store.dst.tolist()
    assert load.dst.tolist() == store.src.tolist()


def test_copy_bytes_is_the_unpadded_page_not_the_row_stride() -> None:
    packed = _ref(0x1000_0000, 0x2000_0000, stride=PAGE + 4 * KiB, copy=PAGE - 512)
    d = build_chunk_descriptors([[packed]], [0, 1], [0], blocks_per_chunk=2, direction="store")
    assert _rows(d) == [
        (0x1000_0000, 0x2000_0000, PAGE - 512),
        (0x1000_0000 + PAGE + 4 * KiB, 0x2000_0000 + PAGE, PAGE - 512),
    ]


def test_groups_consume_ids_from_both_sides_and_skip_empty_groups() -> None:
    g0 = [_ref(0x1000_0000, 0x5000_0000)]
    g1 = [_ref(0x2000_0000, 0x6000_0000), _ref(0x3000_0000, 0x7000_0000)]
    g2 = [_ref(0x4000_0000, 0x8000_0000)]
    d = build_chunk_descriptors(
        [g0, g1, g2],
        [1, 2, 3, 20, 21],  # group 0: 3 blocks, group 1: none, group 2: 2 blocks
        [10, 11, 30],  # group 0: skip 2 -> ceil(5/4) = 2 chunks; group 2: skip 0 -> 1 chunk
        blocks_per_chunk=4,
        direction="store",
        group_sizes=[3, 0, 2],
        block_indices=[6, 0, 8],
    )
    assert _rows(d) == [
        (0x1000_0000 + 1 * PAGE, 0x5000_0000 + 10 * MiB + 2 * PAGE, PAGE),
        (0x1000_0000 + 2 * PAGE, 0x5000_0000 + 10 * MiB + 3 * PAGE, PAGE),
        (0x1000_0000 + 3 * PAGE, 0x5000_0000 + 11 * MiB, PAGE),
        (0x4000_0000 + 20 * PAGE, 0x8000_0000 + 30 * MiB, PAGE),
        (0x4000_0000 + 21 * PAGE, 0x8000_0000 + 30 * MiB + PAGE, PAGE),
    ]


@pytest.mark.parametrize(
    ("device", "host", "sizes", "field"),
    [
        ([1, 2, 3, 4, 5], [7], [5], "group_sizes"),  # 5 blocks need 2 chunks, only 1 given
        ([1, 2], [7, 8], [2], "host_chunk_ids"),  # a host id left over
        ([1, 2, 3, 4, 5], [7], [4], "device_block_ids"),  # a device id left over
    ],
)
def test_ids_must_be_fully_consumed(device: list[int], host: list[int], sizes: list[int], field: str) -> None:
    with pytest.raises(BlockIdError, match=field):
        build_chunk_descriptors([[K]], device, host, blocks_per_chunk=4, direction="store", group_sizes=sizes)


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ConfigError, match="direction"):
        build_chunk_descriptors([[K]], [1], [1], blocks_per_chunk=4, direction="sideways")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_indices"):
        build_chunk_descriptors([[K]], [1], [1], blocks_per_chunk=4, direction="load", block_indices=[0, 1])
    with pytest.raises(ConfigError, match="refs_per_group"):
        build_chunk_descriptors([[K], [V]], [1], [1], blocks_per_chunk=4, direction="load")
    with pytest.raises(ConfigError, match="blocks_per_chunk"):
        build_chunk_descriptors([[K]], [1], [1], blocks_per_chunk=0, direction="load")
    with pytest.raises(BlockIdError, match=r"host_chunk_ids\[0\]"):
        build_chunk_descriptors([[K]], [1], [-1], blocks_per_chunk=4, direction="load")
    with pytest.raises(ConfigError, match="copy_bytes"):
        _ref(0, 0, copy=PAGE + 1)
    with pytest.raises(ConfigError, match="device_row_stride"):
        _ref(0, 0, stride=PAGE - 1)
    with pytest.raises(ConfigError, match="skip"):
        host_chunks_needed(3, 4, 4)


def test_single_ref_address_helpers() -> None:
    assert device_block_addresses(1000, 10, [0, 3]).tolist() == [1000, 1030]
    addrs = host_subblock_addresses(0, 400, 400, 4, [2, 5], skip=3, count=2)
    assert addrs.tolist() == [2 * 400 + 300, 5 * 400]
    with pytest.raises(BlockIdError, match="host_chunk_ids"):
        host_subblock_addresses(0, 400, 400, 4, [2, 5], skip=0, count=2)
    with pytest.raises(ConfigError, match="row_width"):
        host_subblock_addresses(0, 400, 402, 4, [2])


def test_coalescing_ascending_and_descending_runs() -> None:
    d = build_chunk_descriptors([[K]], [4, 5, 6, 7], [1], blocks_per_chunk=4, direction="store", coalesce=True)
    assert _rows(d) == [(K.device_base + 4 * PAGE, K.host_base + MiB, 4 * PAGE)]
    descending = CopyDescriptors(np.array([300, 200, 100, 900]), np.array([3000, 2900, 2800, 50]), np.full(4, 100))
    assert _rows(coalesce_descriptors(descending)) == [(100, 2800, 300), (900, 50, 100)]
    # A direction change shares no element between runs.
    walk = np.array([0, 10, 0, 10])
    zigzag = CopyDescriptors(walk, walk, np.full(4, 10))
    assert _rows(coalesce_descriptors(zigzag)) == [(0, 0, 20), (0, 0, 20)]
    # Padded rows (copy < stride) never coalesce.
    packed = _ref(0, 1 << 40, stride=PAGE, copy=PAGE // 2)
    d = build_chunk_descriptors([[packed]], [0, 1], [0], blocks_per_chunk=2, direction="store", coalesce=True)
    assert len(d) == 2


def test_split_to_batch_copy_cap() -> None:
    n = BATCH_COPY_MAX_DESCRIPTORS + 1
    d = CopyDescriptors(np.arange(n) * 8, np.arange(n) * 16, np.full(n, 8))
    parts = split_copy_descriptors(d)
    assert [len(p) for p in parts] == [4096, 1]
    assert _rows(CopyDescriptors.concat(parts)) == _rows(d)
