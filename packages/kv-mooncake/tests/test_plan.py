"""Pure planning: rank selection, coverage, trimming, block pairing, PP ranges, descriptors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.kv_mooncake.core.blocks import (
    TensorGeom,
    layer_index,
    plan_block_pairs,
    pp_layer_ranges,
    trim_block_ids,
)
from ascend_dist.kv_mooncake.core.ranks import (
    HeadSlice,
    PullMode,
    check_coverage,
    head_range,
    p_rank_fan_in,
    pull_mode,
    select_sources,
)
from ascend_dist.kv_mooncake.pull.slice_bytes import build_pull_descriptors


def test_head_range_with_and_without_replication() -> None:
    assert [head_range(r, 2, 8) for r in range(2)] == [(0, 4), (4, 4)]
    assert [head_range(r, 8, 4) for r in range(8)] == [(r // 2, 1) for r in range(8)]
    with pytest.raises(ConfigError, match="num_kv_heads"):
        head_range(0, 3, 8)
    with pytest.raises(ConfigError, match="tp_rank"):
        head_range(2, 2, 8)


def test_equal_tp_is_identity() -> None:
    assert select_sources(3, 4, 4, 8, "r") == [HeadSlice(3, 0, 0, 2)]


def test_p_tp_greater_stacks_whole_p_blocks() -> None:
    slices = select_sources(1, 8, 2, 8, "r")  # D rank 1 holds heads 4..7, one per P rank 4..7
    assert [s.p_rank for s in slices] == [4, 5, 6, 7]
    assert pull_mode(slices, 1, 4) is PullMode.STACKED


def test_p_tp_smaller_pulls_a_row_sub_slice() -> None:
    # P tp 1 holds 4 heads; D tp 4 rank 2 holds head 2 only: the new direction upstream rejects.
    assert select_sources(2, 1, 4, 4, "r") == [HeadSlice(0, 2, 0, 1)]
    assert pull_mode(select_sources(2, 1, 4, 4, "r"), 4, 1) is PullMode.ROWS


def test_replica_choice_is_deterministic_and_seeded() -> None:
    a = [select_sources(0, 16, 2, 4, f"req-{i}") for i in range(20)]
    assert a == [select_sources(0, 16, 2, 4, f"req-{i}") for i in range(20)]
    assert len({tuple(s.p_rank for s in x) for x in a}) > 1  # different requests spread over replicas


@settings(max_examples=200, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    p_exp=st.integers(0, 4),
    d_exp=st.integers(0, 4),
    rid=st.text(min_size=1, max_size=8),
)
def test_every_topology_covers_every_destination_head_once(heads: int, p_exp: int, d_exp: int, rid: str) -> None:
    p_tp, d_tp = 2**p_exp, 2**d_exp
    pulled = set()
    for d in range(d_tp):
        slices = select_sources(d, p_tp, d_tp, heads, rid)
        d_heads = head_range(d, d_tp, heads)[1]
        p_heads = head_range(0, p_tp, heads)[1]
        check_coverage(slices, d_heads)
        pull_mode(slices, p_heads, d_heads)
        first = head_range(d, d_tp, heads)[0]
        for s in slices:  # the P rank really holds the heads it is asked for
            p_first, p_count = head_range(s.p_rank, p_tp, heads)
            assert p_first <= first + s.dst_head and s.src_head + s.n_heads <= p_count
            assert p_first + s.src_head == first + s.dst_head
        pulled |= {s.p_rank for s in slices}
    fan = [p_rank_fan_in(p, p_tp, d_tp, heads, rid) for p in range(p_tp)]
    assert {p for p in range(p_tp) if fan[p]} == pulled


def test_coverage_refuses_gaps_and_overlaps() -> None:
    with pytest.raises(LayoutError, match="exactly once"):
        check_coverage([HeadSlice(0, 0, 0, 1)], 2)
    with pytest.raises(LayoutError, match="exactly once"):
        check_coverage([HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 1, 1)], 2)


@pytest.mark.parametrize(
    ("ids", "prompt", "block", "window", "expected"),
    [
        ([10, 11, 12, 13, 14], 33, 16, 0, [10, 11, 12]),
        ([30, 31, 32, 33], 64, 32, 0, [30, 31]),
        ([40, 41, 42, 43, 44], 80, 16, 3, [42, 43, 44]),
        ([0, 10], 32, 16, 2, [10]),
        ([0, 10, 11, 12, 13], 32, 16, 3, [10]),
    ],
)
def test_trim_block_ids_tables(ids: list[int], prompt: int, block: int, window: int, expected: list[int]) -> None:
    assert trim_block_ids(ids, prompt, block, window) == expected


def test_plan_block_pairs_skips_the_prefix_and_truncates() -> None:
    assert plan_block_pairs([1, 2], [3, 4, 5], 16, 16) == ([1, 2], [4, 5])
    assert plan_block_pairs([1, 2, 3], [3, 4], 0, 16) == ([1, 2], [3, 4])
    with pytest.raises(ConfigError, match="num_computed_tokens"):
        plan_block_pairs([1], [1], -1, 16)


def test_pp_layer_ranges() -> None:
    assert [b - a for a, b in pp_layer_ranges(61, 4)] == [15, 15, 16, 15]
    assert pp_layer_ranges(4, 2, (1, 3)) == [(0, 1), (1, 4)]
    with pytest.raises(ConfigError, match="pp_layer_partition"):
        pp_layer_ranges(4, 2, (1, 2))


def test_layer_index() -> None:
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(ConfigError, match="layer_name"):
        layer_index("lm_head")


def _geom(base: int, heads: int, tokens: int = 2, head_bytes: int = 512, stride: int | None = None) -> TensorGeom:
    block = tokens * heads * head_bytes
    return TensorGeom(base, block, stride or block, tokens, heads, head_bytes)


def test_contiguous_ids_yield_one_descriptor_per_tensor_and_run() -> None:
    local, remote = [_geom(0x1000, 1), _geom(0x9000, 1)], [_geom(0x3000, 1), _geom(0xB000, 1)]
    d = build_pull_descriptors(local, remote, [2, 3, 4], [7, 8, 9], slices=[HeadSlice(0, 0, 0, 1)], p_rank=0)
    assert d.local.tolist() == [0x1000 + 2048, 0x9000 + 2048]
    assert d.remote.tolist() == [0x3000 + 7168, 0xB000 + 7168]
    assert d.lengths.tolist() == [3072, 3072]


def test_stacked_pull_lands_at_the_pull_offset() -> None:
    # Worked example: local block_len 131072, pulls 4, inner 32768; pull 2 into block 5 from block 9.
    local = [TensorGeom(0, 131072, 131072, 128, 4, 256)]
    remote = [TensorGeom(0x100000, 32768, 32768, 128, 1, 256)]
    slices = [HeadSlice(p, 0, p, 1) for p in range(4)]
    d = build_pull_descriptors(local, remote, [5], [9], slices=slices, p_rank=2)
    assert (d.local.tolist(), d.remote.tolist(), d.lengths.tolist()) == ([720896], [0x100000 + 294912], [32768])


def test_row_pull_covers_every_destination_byte_once() -> None:
    local = [_geom(0, 1, tokens=4, head_bytes=8)]
    remote = [_geom(0x10000, 4, tokens=4, head_bytes=8)]
    d = build_pull_descriptors(local, remote, [1, 2], [5, 6], slices=[HeadSlice(0, 3, 0, 1)], p_rank=0)
    hits = sorted(zip(d.local.tolist(), d.lengths.tolist(), strict=True))
    assert hits == [(b * 32 + t * 8, 8) for b in (1, 2) for t in range(4)]
    assert sorted(d.remote.tolist()) == sorted(0x10000 + b * 128 + t * 32 + 24 for b in (5, 6) for t in range(4))


def test_mismatched_geometry_is_refused() -> None:
    with pytest.raises(LayoutError, match="tensor 0 geometry"):
        build_pull_descriptors(
            [_geom(0, 1)], [_geom(0, 1, tokens=4)], [1], [1], slices=[HeadSlice(0, 0, 0, 1)], p_rank=0
        )
