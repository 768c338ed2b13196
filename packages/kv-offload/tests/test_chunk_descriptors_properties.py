"""Properties: offload copy descriptors move exactly the bytes the per-block formula gives, and
coalescing them never changes which bytes move."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.kv_offload.chunk_descriptors import (
    ChunkRef,
    CopyDescriptors,
    build_chunk_descriptors,
    coalesce_descriptors,
)

SETTINGS = settings(max_examples=60, deadline=None)

Triples = list[tuple[int, int, int]]


def _byte_pairs(triples: Triples) -> Counter[tuple[int, int]]:
    """Every (source byte, destination byte) a batch moves, with multiplicity."""
    pairs: Counter[tuple[int, int]] = Counter()
    for a, b, n in triples:
        pairs.update((a + i, b + i) for i in range(n))
    return pairs


def _triples(d: CopyDescriptors) -> Triples:
    return list(zip(*(c.tolist() for c in (d.src, d.dst, d.sizes)), strict=True))


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
