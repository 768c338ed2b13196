"""ChunkedTokenDatabase, prefix hashing, load specs, ReqMeta and hit helpers (tables of worked cases)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.kv_store.keys.keys import KeyMetadata
from ascend_dist.kv_store.keys.token_db import Chunk, ChunkedTokenDatabase, GroupBuffers, hash_root, prefix_hashes
from ascend_dist.kv_store.scheduler.plan import (
    RequestTracker,
    build_req_meta,
    common_hit,
    continuous_hits,
    discontinuous_hits,
    matched_tokens,
)
from ascend_dist.kv_store.step_metadata import LoadSpec


def db(block: int = 16, hash_block: int = 16, groups: int = 1) -> ChunkedTokenDatabase:
    metas = [KeyMetadata(model_name="m", kv_cache_group_id=g) for g in range(groups)]
    return ChunkedTokenDatabase(metas, [block] * groups, hash_block)


def spans(chunks) -> list[tuple[int, int, object]]:
    return [(c.start, c.end, c.chunk_hash) for c in chunks]


def test_grouped_hashes_last_fine_hash() -> None:
    assert list(db(32, 16).grouped_hashes(["a", "b", "c", "d"], 0)) == ["b", "d"]
    assert db(16, 16).grouped_hashes(["a"], 0) == ["a"]


def test_chunk_iteration_examples() -> None:
    d = db()
    assert spans(d.iter_chunks(32, ["aaa", "bbb"])) == [(0, 16, "aaa"), (16, 32, "bbb")]
    assert spans(d.iter_chunks(48, ["a", "b", "c"], mask_num=16)) == [(16, 32, "b"), (32, 48, "c")]
    assert [(c.start, c.end) for c in d.iter_chunks(40, ["a", "b", "c"])] == [(0, 16), (16, 32), (32, 40)]
    assert list(d.iter_chunks(0, ["a"])) == [] and list(d.iter_chunks(32, [])) == []


def test_tail_clipped_block_ids() -> None:
    d = db(128, 128)
    hashes = [f"h{i}" for i in range(128)]
    got = [(c.start // 128, c.block_id) for c in d.iter_chunks(16384, hashes, block_ids=[1000, 1001, 1002, 1003])]
    assert got == [(124, 1000), (125, 1001), (126, 1002), (127, 1003)]


def test_filter_then_shard() -> None:
    mask = [True, False, True, True]
    got = list(
        db().iter_chunks(
            64,
            ["a", "b", "c", "d"],
            block_ids=[10, 11, 12, 13],
            chunk_filter=lambda s: mask[s // 16],
            shard_rank=1,
            shard_size=2,
        )
    )
    assert [(c.start, c.end, c.block_id) for c in got] == [(32, 48, 12)]


def test_skip_null_blocks() -> None:
    got = list(db().iter_chunks(48, ["a", "b", "c"], block_ids=[0, 5, 6], skip_null_blocks=True))
    assert [c.block_id for c in got] == [5, 6]


def test_prepare_value_examples() -> None:
    d = db()
    d.set_buffers(0, GroupBuffers((1000, 2000), (160, 320), (160, 320)))
    assert d.prepare_value(0, 16, [5, 6, 7]) == ([1800, 3600], [160, 320], 5)
    assert d.prepare_value(0, 8, [5, 6, 7]) == ([1800, 3600], [80, 160], 5)
    assert d.prepare_value(64, 80, [5]) == ([], [], -1)
    c4 = db(512, 512)
    c4.set_buffers(0, GroupBuffers((1000,), (1024,), (1024,)))
    assert c4.prepare_value(0, 512, [5, 6]) == ([1000 + 5 * 1024], [1024], 5)
    assert c4.prepare_value(512, 1024, [5, 6]) == ([1000 + 6 * 1024], [1024], 6)


def test_chunk_values_equal_the_per_chunk_calls() -> None:
    d = db()
    layers = GroupBuffers((1000, 2000, 3000, 4000), (160,) * 4, (160,) * 4, 9, ("l0", "l1"), (0, 2, 4))
    d.set_buffers(0, layers)
    chunks = list(d.iter_chunks(40, [b"a" * 32, b"b" * 32], block_ids=[5, 6, 8], tail=b"t" * 32))
    assert [c.end - c.start for c in chunks] == [16, 16, 8]
    keys, addrs, sizes = d.chunk_values(chunks)
    assert keys == [d.key(c) for c in chunks]  # the partial chunk keeps its own key
    assert [(a, s) for a, s in zip(addrs, sizes, strict=True)] == [
        d.prepare_value(c.start, c.end, [], block_id=c.block_id)[:2] for c in chunks
    ]
    for layer in (0, 1):
        keys, addrs, sizes = d.chunk_values(chunks[:2], layer=layer)
        assert keys == [d.layer_key(c, layer) for c in chunks[:2]]
        assert addrs == [d.prepare_value_layer(c.start, c.end, [], layer, block_id=c.block_id)[0] for c in chunks[:2]]
        assert sizes == [[160, 160]] * 2
    with pytest.raises(BlockIdError, match="block_id"):
        d.chunk_values([chunks[0], Chunk(16, 32, "x", 9)])
    with pytest.raises(ConfigError, match="layer"):
        d.chunk_values(chunks, layer=2)
    assert d.chunk_values([]) == ([], [], [])


def test_partial_chunk_has_its_own_key() -> None:
    d = db()
    full, partial = list(d.iter_chunks(24, ["a", "b"]))
    assert d.key(full) == KeyMetadata(model_name="m").pool_key("a")
    assert d.key(partial) == KeyMetadata(model_name="m").partial_key("b", 8)


def test_prefix_hashes_chain_and_namespace() -> None:
    root = hash_root("m", 16)
    tokens = list(range(40))
    h = prefix_hashes(tokens, 16, root)
    assert len(h) == 2 and all(len(x) == 32 for x in h)
    assert prefix_hashes(tokens[:32] + [999] * 8, 16, root) == h  # only full blocks hash
    assert prefix_hashes([1, *tokens[1:]], 16, root)[1] != h[1]  # chained: a change early changes later
    assert prefix_hashes(tokens, 16, hash_root("other-model", 16)) != h
    assert prefix_hashes(tokens, 16, hash_root("m", 32)) != h


def test_prefix_hashes_do_not_depend_on_pythonhashseed() -> None:
    code = (
        "from ascend_dist.kv_store.keys.token_db import hash_root, prefix_hashes;"
        "print(prefix_hashes(list(range(64)), 16, hash_root('m', 16))[-1].hex())"
    )
    outs = set()
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        outs.add(res.stdout.strip())
    assert len(outs) == 1
    assert outs.pop() == prefix_hashes(list(range(64)), 16, hash_root("m", 16))[-1].hex()


@pytest.mark.parametrize(
    ("hit", "computed", "is_async", "expected", "spec"),
    [
        (48, 16, False, (32, False), LoadSpec(16, 48, 48)),
        (48, 0, True, (48, True), LoadSpec(0, 48, 48)),
        (64, 0, False, (63, False), LoadSpec(0, 63, 64)),
        (16, 32, False, (0, False), None),
        (0, 0, False, (0, False), None),
    ],
)
def test_matched_tokens_table(
    hit: int, computed: int, is_async: bool, expected: tuple[int, bool], spec: LoadSpec | None
) -> None:
    need, asyn, got = matched_tokens(hit, computed, 64, load_async=is_async)
    assert (need, asyn) == expected
    assert got == spec


def test_load_token_len_rounds_back_the_minus_one() -> None:
    assert LoadSpec(0, 63, 64, True).load_token_len(16, 64) == 64
    assert LoadSpec(0, 48, 48, True).load_token_len(16, 64) == 48


def tracker(total: int, saved: int = 0, hashes: int = 8) -> RequestTracker:
    t = RequestTracker(
        "r", list(range(total)), total, [[1, 2, 3, 4, 5, 6, 7, 8]], [bytes([i]) * 32 for i in range(hashes)]
    )
    t.num_saved_tokens = saved
    return t


def test_req_meta_table() -> None:
    m = build_req_meta(tracker(32), 16, hash_block_size=16)
    assert m is not None and (m.save_start_token, m.save_end_token, m.can_save) == (0, 32, True)
    assert build_req_meta(tracker(32), 16, hash_block_size=16, skip_save=True) is None
    load = LoadSpec(0, 32, 32, True)
    m = build_req_meta(tracker(32), 16, hash_block_size=16, skip_save=True, load_spec=load)
    assert m is not None and m.load_spec == load and not m.can_save
    m = build_req_meta(tracker(32, 32), 16, hash_block_size=16, skip_save=True, load_spec=LoadSpec(0, 32, 32, False))
    assert m is not None and m.load_spec is None and not m.can_save
    m = build_req_meta(tracker(20), 16, hash_block_size=16)
    assert m is not None and m.save_end_token == 16
    assert build_req_meta(tracker(20), 16, hash_block_size=16, discard_partial=False).save_end_token == 16  # type: ignore[union-attr]
    with_tail = tracker(20)
    with_tail.tail = b"t" * 32  # the prompt's partial tail has its own hash
    m = build_req_meta(with_tail, 16, hash_block_size=16, discard_partial=False)
    assert m is not None and m.save_end_token == 20 and m.tail_hash == b"t" * 32
    assert build_req_meta(tracker(32, 32), 16, hash_block_size=16) is None


def test_req_meta_waits_for_the_boundary_hash() -> None:
    t = tracker(128, hashes=7)
    assert build_req_meta(t, 128, hash_block_size=16) is None and t.num_saved_tokens == 0
    t = tracker(128, hashes=8)
    m = build_req_meta(t, 128, hash_block_size=16)
    assert m is not None and m.save_end_token == 128 and t.num_saved_tokens == 128


def test_hit_helpers() -> None:
    ends = [16, 32, 48]
    assert continuous_hits(ends, [[1, 1, 0], [1, 0, 1]], 16, 10**9) == [16]
    assert continuous_hits(ends, [[1, 1, 1], [1, 1, 1]], 16, 10**9) == ends
    assert continuous_hits([16, 32], [[0, 1], [1, 0]], 16, 10**9) == []
    e6 = [16, 32, 48, 64, 80, 96]
    rows = [[0, 0, 1, 0, 0, 1]] * 2
    assert discontinuous_hits(e6, rows, 16, 10**9) == [48, 96]
    assert discontinuous_hits(e6, rows, 16, 64) == [48]
    assert common_hit([[16, 32, 48], [32, 48], [16, 32], [32, 48, 64]]) == 32
    assert common_hit([[16], []]) == 0


def test_mamba_tracker_update_nulls_stale_state_blocks() -> None:
    from ascend_dist.kv_store.scheduler.plan import MambaGroups, mamba_update

    assert mamba_update([0, 3, 4, 5, 6], [4, 17], num_computed=32, spec_blocks=3, block_size=16) == [
        0,
        3,
        0,
        5,
        6,
        4,
        17,
    ]
    got = mamba_update(
        [0] * 7 + [9, 10, 11, 12], [0, 0, 0, 0, 10, 11, 12, 29], num_computed=128, spec_blocks=3, block_size=16
    )
    assert got == [0] * 7 + [9] + [0] * 7 + [10, 11, 12, 29]
    assert mamba_update([5, 6], [7], num_computed=64, spec_blocks=0, block_size=16) == [0, 0, 7]
    t = RequestTracker("r", [], 0, [[1, 2], [0, 3, 4, 5, 6]])
    t.update([], [[7], [4, 17]], mamba=MambaGroups(frozenset({1}), (16, 16), 3), num_computed=32)
    assert t.block_ids == [[1, 2, 7], [0, 3, 0, 5, 6, 4, 17]]
