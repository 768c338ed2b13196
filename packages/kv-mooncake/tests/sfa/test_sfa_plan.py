"""Pure planning of the SFA connector: ranks, ports, block ranges, descriptor ownership, coalescing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dist.common.errors import BlockIdError, ConfigError, LayoutError
from ascend_dist.kv_mooncake.sfa.plan import (
    DestLayer,
    GroupIds,
    chunk_block_range,
    coalesce,
    contributor_of,
    d_endpoint_port,
    infer_groups,
    layer_index,
    plan_request_reads,
    tp_block_range,
)


def test_tp_block_range_spec_example() -> None:
    assert tp_block_range(5, 0, 2, 3) == (3, 2)
    assert tp_block_range(5, 1, 2, 3) == (0, 3)


@given(n=st.integers(0, 200), size=st.integers(1, 16), start=st.integers(0, 1000))
def test_tp_block_ranges_are_disjoint_and_cover(n: int, size: int, start: int) -> None:
    covered: list[int] = []
    for rank in range(size):
        first, count = tp_block_range(n, rank, size, start)
        covered.extend(range(first, first + count))
    assert sorted(covered) == list(range(n))


def test_small_chunks_rotate_owners() -> None:
    """One-block chunks at consecutive starts land on different ranks."""
    owners = [next(r for r in range(4) if tp_block_range(1, r, 4, start)[1]) for start in range(8)]
    assert owners == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize(
    ("p_rank", "p_tp", "d_tp", "expected"),
    [(0, 4, 2, (0, 0, 2)), (1, 4, 2, (0, 1, 2)), (3, 4, 2, (1, 1, 2)), (1, 2, 2, (1, 0, 1)), (5, 8, 1, (0, 5, 8))],
)
def test_contributor_of(p_rank: int, p_tp: int, d_tp: int, expected: tuple[int, int, int]) -> None:
    assert contributor_of(p_rank, p_tp, d_tp) == expected


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (3, 2), (4, 0)])
def test_contributor_of_rejects_bad_ratios(p_tp: int, d_tp: int) -> None:
    with pytest.raises(ConfigError, match=r"prefill.tp_size"):
        contributor_of(0, p_tp, d_tp)


def test_port_math_validates_the_range() -> None:
    assert d_endpoint_port(40000, 3) == 40003
    with pytest.raises(ConfigError, match="remote_port"):
        d_endpoint_port(65535, 1)


def test_chunk_block_range() -> None:
    kw = {"cached_tokens": 0, "transferred_tokens": 0, "block_size": 16, "allocated": 10}
    assert chunk_block_range(computed_tokens=40, finished=False, **kw) == (0, 2)  # partial block waits
    assert chunk_block_range(computed_tokens=40, finished=True, **kw) == (0, 3)
    kw2 = {**kw, "cached_tokens": 32, "transferred_tokens": 16}
    assert chunk_block_range(computed_tokens=70, finished=True, **kw2) == (2, 5)
    with pytest.raises(BlockIdError, match="computed_tokens"):
        chunk_block_range(computed_tokens=200, finished=True, **kw)


def test_layer_index_and_groups() -> None:
    assert layer_index("model.layers.12.self_attn.indexer.k_cache") == 12
    with pytest.raises(ConfigError, match="layer name"):
        layer_index("lm_head")
    assert infer_groups([["model.layers.0.attn"], ["model.layers.0.indexer.k"]]) == GroupIds(0, 1)
    assert infer_groups([["model.layers.0.attn"]]) == GroupIds(0, 0)


def test_coalesce_merges_only_when_both_sides_continue() -> None:
    local = np.array([100, 110, 120, 200], dtype=np.int64)
    peer = np.array([0, 10, 30, 40], dtype=np.int64)
    lengths = np.array([10, 10, 10, 10], dtype=np.int64)
    d = coalesce(local, peer, lengths)
    assert d.local.tolist() == [100, 120, 200]
    assert d.remote.tolist() == [0, 30, 40]
    assert d.lengths.tolist() == [20, 10, 10]


_DEST = DestLayer((10_000, 20_000), (64, 8), (30_000,), (16,))
_P_MAIN = [(1_000, 64), (2_000, 8)]
_P_IDX = [(3_000, 16)]


def _plan(**kw: object) -> object:
    args: dict[str, object] = {
        "p_main": _P_MAIN,
        "p_indexer": _P_IDX,
        "dest": _DEST,
        "p_main_ids": [5, 6, 7, 8, 9],
        "p_indexer_ids": [5, 6, 7, 8, 9],
        "main_start": 3,
        "indexer_start": 3,
        "d_main_ids": list(range(20, 30)),
        "d_indexer_ids": list(range(40, 50)),
        "d_tp_rank": 0,
        "d_tp": 2,
        "member": 0,
        "ratio": 1,
        **kw,
    }
    return plan_request_reads(**args)  # type: ignore[arg-type]


def test_main_split_over_d_ranks_and_indexer_whole_per_rank() -> None:
    r0, r1 = _plan(d_tp_rank=0), _plan(d_tp_rank=1)
    assert (r0.main_blocks, r1.main_blocks) == (2, 3)  # type: ignore[attr-defined]
    assert r0.indexer_blocks == r1.indexer_blocks == 5  # type: ignore[attr-defined]
    # rank 0 owns chunk blocks [3, 5): P ids 8, 9 -> D ids d_main[3+3], d_main[3+4] = 26, 27, one run each tensor
    d = r0.descriptors  # type: ignore[attr-defined]
    assert (10_000 + 26 * 64, 1_000 + 8 * 64, 128) in list(zip(d.local, d.remote, d.lengths, strict=True))


def test_only_member_zero_reads_main_and_indexer_slices_are_disjoint() -> None:
    a, b = _plan(member=0, ratio=2), _plan(member=1, ratio=2)
    assert a.main_blocks > 0 and b.main_blocks == 0  # type: ignore[attr-defined]
    assert a.indexer_blocks + b.indexer_blocks == 5  # type: ignore[attr-defined]
    idx_a = {int(x) for x, n in zip(a.descriptors.local, a.descriptors.lengths, strict=True) if x >= 30_000}  # type: ignore[attr-defined]
    idx_b = {int(x) for x, n in zip(b.descriptors.local, b.descriptors.lengths, strict=True) if x >= 30_000}  # type: ignore[attr-defined]
    assert idx_a.isdisjoint(idx_b)


def test_layout_and_destination_mismatches_are_typed() -> None:
    with pytest.raises(LayoutError, match="main block bytes"):
        _plan(p_main=[(1_000, 32), (2_000, 8)])
    with pytest.raises(LayoutError, match="indexer"):
        _plan(p_indexer=[])
    with pytest.raises(BlockIdError, match="main destination"):
        _plan(d_main_ids=[1, 2, 3])
