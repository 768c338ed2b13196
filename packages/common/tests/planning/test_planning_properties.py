"""Properties: descriptors built from runs move exactly the bytes of the naive per-block ones, and
range merging never loses bytes (nor invents any beyond the bridged gaps)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.blocks import group_concurrent_contiguous
from ascend_dist.common.descriptors import Descriptors, build_block_descriptors, build_layer_descriptors
from ascend_dist.common.regions import RegisterRange, merge_ranges

SETTINGS = settings(max_examples=60, deadline=None)

Triples = list[tuple[int, int, int]]


def _byte_pairs(triples: Triples) -> Counter[tuple[int, int]]:
    """Every (source byte, destination byte) a batch moves, with multiplicity."""
    pairs: Counter[tuple[int, int]] = Counter()
    for a, b, n in triples:
        pairs.update((a + i, b + i) for i in range(n))
    return pairs


def _triples(d: Descriptors) -> Triples:
    return list(zip(*(c.tolist() for c in (d.local, d.remote, d.lengths)), strict=True))


@st.composite
def id_pairs(draw: st.DrawFn, max_id: int = 40) -> tuple[list[int], list[int]]:
    """Parallel id lists with long runs mixed with jumps (so both merging and breaking happen)."""
    n = draw(st.integers(0, 16))
    steps = st.sampled_from([1, 1, 1, 2, -1, 0, 5])
    local, remote = [draw(st.integers(0, max_id))], [draw(st.integers(0, max_id))]
    for _ in range(n - 1):
        local.append(max(0, local[-1] + draw(steps)))
        remote.append(max(0, remote[-1] + draw(steps)))
    return local[:n], remote[:n]


@SETTINGS
@given(ids=id_pairs(), length=st.integers(1, 8), extra=st.integers(0, 3), offset=st.integers(0, 3))
def test_block_descriptors_match_naive(ids: tuple[list[int], list[int]], length: int, extra: int, offset: int) -> None:
    local_ids, remote_ids = ids
    local_stride = length + extra
    local_offset = min(offset, extra)
    d = build_block_descriptors(
        1000, 50_000, local_ids, remote_ids,
        local_stride=local_stride, remote_stride=length, length=length, local_offset=local_offset,
    )  # fmt: skip
    naive = [
        (1000 + lid * local_stride + local_offset, 50_000 + rid * length, length)
        for lid, rid in zip(local_ids, remote_ids, strict=True)
    ]
    assert _byte_pairs(_triples(d)) == _byte_pairs(naive)
    assert len(d) <= len(naive)
    if extra == 0:
        assert len(d) == _paired_run_count(ids)


def _paired_run_count(ids: tuple[list[int], list[int]]) -> int:
    local, remote = ids
    return sum(
        1 for i in range(len(local)) if i == 0 or not (local[i] == local[i - 1] + 1 and remote[i] == remote[i - 1] + 1)
    )


@SETTINGS
@given(
    ids=id_pairs(),
    layers=st.integers(1, 3),
    block_lens=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    pad=st.lists(st.integers(0, 2), min_size=1, max_size=3),
)
def test_layer_descriptors_match_naive_loop(
    ids: tuple[list[int], list[int]], layers: int, block_lens: list[int], pad: list[int]
) -> None:
    local_ids, remote_ids = ids
    parts = len(block_lens)
    pads = (pad * parts)[:parts]
    lbases = [[10_000 * (1 + layer * parts + p) for p in range(parts)] for layer in range(layers)]
    rbases = [[b + 5_000_000 for b in row] for row in lbases]
    strides = [b + x for b, x in zip(block_lens, pads, strict=True)]
    d = build_layer_descriptors(lbases, rbases, local_ids, remote_ids, block_len=block_lens, remote_stride=strides)
    naive = []
    for layer in range(layers):
        for p in range(parts):
            for lid, rid in zip(local_ids, remote_ids, strict=True):
                naive.append(
                    (
                        lbases[layer][p] + lid * block_lens[p],
                        rbases[layer][p] + rid * strides[p],
                        block_lens[p],
                    )
                )
    assert _byte_pairs(_triples(d)) == _byte_pairs(naive)


def _covered(ranges: list[RegisterRange]) -> set[int]:
    return {b for r in ranges for b in range(r.start, r.end)}


@SETTINGS
@given(
    spans=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 30)), max_size=12),
    gap=st.integers(0, 8),
)
def test_merge_ranges_never_loses_or_invents_bytes(spans: list[tuple[int, int]], gap: int) -> None:
    ranges = [RegisterRange(s, s + n) for s, n in spans]
    merged = merge_ranges(ranges, gap=gap)
    before, after = _covered(ranges), _covered(merged)
    assert before <= after
    # Bridged bytes only fill holes of at most `gap` bytes between input ranges.
    invented = sorted(after - before)
    holes = (
        [list(g) for g in np.split(np.array(invented), np.flatnonzero(np.diff(invented) != 1) + 1)] if invented else []
    )
    assert all(len(h) <= gap for h in holes)
    if gap == 0:
        assert after == before
    # Sorted, disjoint, separated by more than the gap; endpoints come from the input.
    for a, b in itertools.pairwise(merged):
        assert b.start > a.end + gap
    assert {r.start for r in merged} <= {r.start for r in ranges}
    assert {r.end for r in merged} <= {r.end for r in ranges}
    assert sum(r.length for r in merged) == len(after)


@SETTINGS
@given(
    ids=id_pairs(),
    stride_a=st.sampled_from([1, 2, 4]),
    stride_b=st.sampled_from([1, 2, 4]),
    length=st.sampled_from([1, 2, 4]),
)
def test_group_concurrent_contiguous_matches_reference(
    ids: tuple[list[int], list[int]], stride_a: int, stride_b: int, length: int
) -> None:
    a, b = ids
    ga: list[list[int]] = []
    gb: list[list[int]] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if i and (x - a[i - 1]) * stride_a == length and (y - b[i - 1]) * stride_b == length:
            ga[-1].append(x)
            gb[-1].append(y)
        else:
            ga.append([x])
            gb.append([y])
    assert group_concurrent_contiguous(a, b, stride_a=stride_a, stride_b=stride_b, length=length) == (ga, gb)
