"""Properties: descriptors built from runs move exactly the bytes of the naive per-block ones, and
range merging never loses bytes (nor invents any beyond the bridged gaps)."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.blocks import group_concurrent_contiguous
from ascend_dist.common.chunk_descriptors import (
    ChunkRef,
    CopyDescriptors,
    build_chunk_descriptors,
    coalesce_descriptors,
)
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


def _triples(d: Descriptors | CopyDescriptors) -> Triples:
    cols = (d.local, d.remote, d.lengths) if isinstance(d, Descriptors) else (d.src, d.dst, d.sizes)
    return list(zip(*(c.tolist() for c in cols), strict=True))


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


@st.composite
def copy_batches(draw: st.DrawFn) -> CopyDescriptors:
    """Copies walking up, down or jumping, with an occasional size change."""
    n = draw(st.integers(1, 20))
    size = draw(st.sampled_from([4, 8]))
    src, dst, sizes = [draw(st.integers(0, 50)) * 8], [draw(st.integers(0, 50)) * 8], [size]
    for _ in range(n - 1):
        move = draw(st.sampled_from(["up", "up", "down", "down", "jump", "resize"]))
        if move == "resize":
            size = 12 - size
        step = {"up": sizes[-1], "down": -size}.get(move)
        if step is None:
            src.append(draw(st.integers(0, 50)) * 8)
            dst.append(draw(st.integers(0, 50)) * 8)
        else:
            src.append(max(0, src[-1] + step))
            dst.append(max(0, dst[-1] + step))
        sizes.append(size)
    return CopyDescriptors(np.array(src), np.array(dst), np.array(sizes))


@SETTINGS
@given(batch=copy_batches())
def test_coalescing_moves_the_same_bytes(batch: CopyDescriptors) -> None:
    merged = coalesce_descriptors(batch)
    assert _byte_pairs(_triples(merged)) == _byte_pairs(_triples(batch))
    assert len(merged) <= len(batch)
    assert merged.total_bytes == batch.total_bytes


@SETTINGS
@given(
    k=st.integers(1, 4),
    groups=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 9)), min_size=1, max_size=3),
    direction=st.sampled_from(["store", "load"]),
    variant=st.tuples(st.integers(0, 3), st.integers(0, 2**16)),
)
def test_chunk_descriptors_match_formula_and_coalescing(
    k: int, groups: list[tuple[int, int]], direction: str, variant: tuple[int, int]
) -> None:
    copy_cut, seed = variant
    sizes = [size for size, _ in groups]
    starts = [start for _, start in groups]
    rng = np.random.default_rng(seed)
    width = 16
    refs = [
        [ChunkRef(10_000 * (g + 1), width + 4 * (g % 2), width, width - copy_cut, 1_000_000 * (g + 1))]
        for g in range(len(sizes))
    ]
    device: list[int] = []
    host: list[int] = []
    naive: Triples = []
    for g, (size, start) in enumerate(groups):
        if size == 0:
            continue
        skip = start % k
        dev_ids = rng.integers(0, 30, size).tolist()
        chunk_ids = rng.integers(0, 30, math.ceil((size + skip) / k)).tolist()
        device += dev_ids
        host += chunk_ids
        ref = refs[g][0]
        for i, b in enumerate(dev_ids):
            c, j = divmod(skip + i, k)
            dev_addr = ref.device_base + b * ref.device_row_stride
            host_addr = ref.host_base + chunk_ids[c] * width * k + j * width
            pair = (dev_addr, host_addr) if direction == "store" else (host_addr, dev_addr)
            naive.append((*pair, ref.copy_bytes))
    kwargs = {"blocks_per_chunk": k, "group_sizes": sizes, "block_indices": starts}
    plain = build_chunk_descriptors(refs, device, host, direction=direction, **kwargs)  # type: ignore[arg-type]
    assert _triples(plain) == naive
    merged = build_chunk_descriptors(refs, device, host, direction=direction, coalesce=True, **kwargs)  # type: ignore[arg-type]
    assert _byte_pairs(_triples(merged)) == _byte_pairs(naive)


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
