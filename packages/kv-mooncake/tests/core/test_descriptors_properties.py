"""Properties: descriptors built from runs move exactly the bytes of the naive per-block ones."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.kv_mooncake.core.descriptors import Descriptors, build_block_descriptors, build_layer_descriptors

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
