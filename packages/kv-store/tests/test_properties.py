"""Property tests of the new planning modules: coordinator fix-point and key splitting."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.kv_store.keys.coordinator import GroupRule, HybridCoordinator
from ascend_dist.kv_store.keys.keys import KeyMetadata
from ascend_dist.kv_store.keys.rekey import KeySplit
from ascend_dist.kv_store.keys.token_db import GroupBuffers

ALIGN = 64


@st.composite
def hybrid(draw: st.DrawFn) -> tuple[HybridCoordinator, list[list[bool]], int]:
    n_groups = draw(st.integers(1, 3))
    rules = []
    for _ in range(n_groups):
        kind = draw(st.sampled_from(["full", "sliding_window", "mamba"]))
        span = draw(st.sampled_from([16, 32, 64]))
        rules.append(GroupRule(kind, span, draw(st.integers(1, 200)) if kind == "sliding_window" else 0))
    max_length = draw(st.integers(0, 512))
    present = [draw(st.lists(st.booleans(), min_size=512 // r.block_size, max_size=512 // r.block_size)) for r in rules]
    return HybridCoordinator(rules, ALIGN, use_eagle=draw(st.booleans())), present, max_length


@settings(max_examples=300, deadline=None)
@given(hybrid())
def test_hit_is_aligned_bounded_and_served_by_every_group(case) -> None:
    coord, present, max_length = case
    hit = coord.longest_hit(present, max_length)
    assert hit % ALIGN == 0 and 0 <= hit <= max_length
    if hit and not coord.use_eagle:
        assert all(r.hit(p, hit, ALIGN) == hit for r, p in zip(coord.rules, present, strict=True))
        for r, p in zip(coord.rules, present, strict=True):  # every chunk a load reads is present
            first, end = r.needed_for_hit(hit)
            assert all(p[first:end])


@settings(max_examples=300, deadline=None)
@given(hybrid(), st.data())
def test_more_present_chunks_never_lower_the_hit(case, data) -> None:
    coord, present, max_length = case
    g = data.draw(st.integers(0, len(present) - 1))
    i = data.draw(st.integers(0, len(present[g]) - 1))
    more = [list(p) for p in present]
    more[g][i] = True
    assert coord.longest_hit(more, max_length) >= coord.longest_hit(present, max_length)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([1, 2, 4]),
    st.lists(st.integers(1, 3), min_size=1, max_size=3),
    st.integers(1, 4),
    st.integers(0, 5),
    st.integers(1, 16),
)
def test_split_pieces_partition_the_chunk_bytes(
    subs: int, parts: list[int], entries_per_layer: int, block: int, ntok: int
) -> None:
    span = 16
    layers = sum(parts)
    n = layers * entries_per_layer
    lens = tuple(span * subs * 8 * (1 + e % 2) for e in range(n))  # per-token bytes divisible by subs
    bases = tuple(10**6 * (e + 1) for e in range(n))
    buffers = GroupBuffers(bases, lens, lens, 0, tuple(f"l{i}" for i in range(layers)),
                           tuple(i * entries_per_layer for i in range(layers + 1)))  # fmt: skip
    split = KeySplit(tp_rank=1, num_sub_keys=subs, pp_parts=tuple(parts) if len(parts) > 1 else ())
    out = split.split(
        KeyMetadata(model_name="m", head_or_tp_rank=1), "ab", buffers, block_id=block, num_tokens=ntok, span=span
    )
    assert len(out) == subs * max(1, len(parts) if len(parts) > 1 else 1)
    assert len({k for k, _, _ in out}) == len(out)
    covered = sorted((a, a + s) for _, addrs, sizes in out for a, s in zip(addrs, sizes, strict=True))
    expected = []
    for e in range(n):
        per_token = lens[e] // span
        start = bases[e] + block * lens[e]
        expected.append((start, start + per_token * ntok))
    merged: list[tuple[int, int]] = []
    for lo, hi in covered:
        assert not merged or lo >= merged[-1][1]  # no overlap
        if merged and lo == merged[-1][1]:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    assert merged == expected
