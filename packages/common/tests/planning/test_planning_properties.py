"""Properties: range merging never loses bytes (nor invents any beyond the bridged gaps), and concurrent
contiguous grouping matches a reference."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.blocks import group_concurrent_contiguous
from ascend_dist.common.regions import RegisterRange, merge_ranges

SETTINGS = settings(max_examples=60, deadline=None)


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
