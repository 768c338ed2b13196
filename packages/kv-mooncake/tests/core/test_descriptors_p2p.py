"""P2P descriptors: the numeric examples, many layers, splitting, bad input."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ascend_dist.common.blocks import group_concurrent_contiguous
from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.kv_mooncake.core.descriptors import (
    MOONCAKE_TCP_MAX_PIECES,
    Descriptors,
    build_block_descriptors,
    build_layer_descriptors,
    descriptors_from_runs,
    split_descriptors_by_limit,
)


def _rows(d: Descriptors) -> list[tuple[int, int, int]]:
    return list(zip(d.local.tolist(), d.remote.tolist(), d.lengths.tolist(), strict=True))


def test_example_contiguous_run_is_one_descriptor() -> None:
    d = build_block_descriptors(
        0x1000, 0x3000, [2, 3, 4], [7, 8, 9], local_stride=1024, remote_stride=1024, length=1024
    )
    assert _rows(d) == [(0x1000 + 2048, 0x3000 + 7168, 3072)]
    assert len(d) == 1
    assert d.total_bytes == 3072


def test_example_strides_differ_from_length_one_per_block() -> None:
    d = build_block_descriptors(0x1000, 0x3000, [1, 2], [3, 4], local_stride=2048, remote_stride=4096, length=1024)
    assert _rows(d) == [(0x1800, 0x3000 + 12288, 1024), (0x2000, 0x3000 + 16384, 1024)]


def test_example_gqa_pull_offset() -> None:
    # TP 8 -> 2, 8 heads, block 128, head_dim 128, bf16: local block 131 072 B, 4 pulls of 32 768 B.
    block_len = 128 * 4 * 128 * 2
    pulls = 4
    inner = block_len // pulls
    assert (block_len, inner) == (131_072, 32_768)
    base, rbase = 0x10_0000_0000, 0x20_0000_0000
    d = build_block_descriptors(
        base,
        rbase,
        [5],
        [9],
        local_stride=block_len,
        remote_stride=inner,
        length=inner,
        local_offset=2 * inner,
    )
    assert _rows(d) == [(base + 720_896, rbase + 294_912, 32_768)]
    # Pulls > 1: contiguous ids still give one descriptor per block (the local stride is not the length).
    d = build_block_descriptors(base, rbase, [5, 6], [9, 10], local_stride=block_len, remote_stride=inner, length=inner)
    assert len(d) == 2


def test_example_replicated_indexer_runs() -> None:
    remote_runs, local_runs = group_concurrent_contiguous([7, 8], [4, 5])
    assert (remote_runs, local_runs) == ([[7, 8]], [[4, 5]])
    d = descriptors_from_runs(
        0x2000,
        0x4000,
        [run[0] for run in local_runs],
        [run[0] for run in remote_runs],
        [len(run) for run in local_runs],
        local_stride=2048,
        remote_stride=8192,
        length=2048,
    )
    assert _rows(d) == [(0x2000 + 8192, 0x4000 + 57_344, 4096)]


def test_layer_descriptors_split_kv_tensor_major() -> None:
    local_bases = np.array([[0x10000, 0x20000], [0x30000, 0x40000]])  # 2 layers x (K, V)
    remote_bases = local_bases + 0x100000
    d = build_layer_descriptors(local_bases, remote_bases, [0, 1, 5], [3, 4, 7], block_len=256)
    expected = []
    for lb, rb in zip(local_bases.reshape(-1).tolist(), remote_bases.reshape(-1).tolist(), strict=True):
        expected += [(lb + 0, rb + 3 * 256, 512), (lb + 5 * 256, rb + 7 * 256, 256)]
    assert _rows(d) == expected


def test_layer_descriptors_mla_parts_with_different_block_len() -> None:
    nope, rope = 1024, 128
    local_bases = [[0x1_0000, 0x2_0000], [0x3_0000, 0x4_0000]]
    remote_bases = [[0x5_0000, 0x6_0000], [0x7_0000, 0x8_0000]]
    d = build_layer_descriptors(local_bases, remote_bases, [1, 2], [4, 5], block_len=[nope, rope])
    assert _rows(d) == [
        (0x1_0000 + nope, 0x5_0000 + 4 * nope, 2 * nope),
        (0x2_0000 + rope, 0x6_0000 + 4 * rope, 2 * rope),
        (0x3_0000 + nope, 0x7_0000 + 4 * nope, 2 * nope),
        (0x4_0000 + rope, 0x8_0000 + 4 * rope, 2 * rope),
    ]


def test_layer_descriptors_mixed_packed_and_dense_keep_tensor_order() -> None:
    # Tensor 0 dense (merges), tensor 1 packed on the remote side (one per block), tensor 2 dense.
    d = build_layer_descriptors(
        [0, 10_000, 20_000],
        [50_000, 60_000, 70_000],
        [0, 1],
        [0, 1],
        block_len=100,
        remote_stride=[100, 128, 100],
    )
    assert _rows(d) == [
        (0, 50_000, 200),
        (10_000, 60_000, 100),
        (10_100, 60_128, 100),
        (20_000, 70_000, 200),
    ]


def test_layer_descriptors_empty_inputs() -> None:
    assert len(build_layer_descriptors([1, 2], [3, 4], [], [], block_len=8)) == 0
    assert (
        len(build_layer_descriptors(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), [1], [1], block_len=8))
        == 0
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"local_ids": [1, 2], "remote_ids": [1]}, "remote_ids"),
        ({"local_ids": [-1], "remote_ids": [1]}, r"local_ids\[0\]"),
        ({"block_len": 0}, "block_len"),
        ({"block_len": 64, "local_stride": 32}, "local_stride"),
        ({"block_len": 64, "remote_offset": -1}, "remote_offset"),
        ({"block_len": 64, "local_stride": 128, "local_offset": 96}, "local_stride"),
        ({"remote_bases": [1, 2, 3]}, "remote_bases"),
        ({"local_bases": [-1, 2], "remote_bases": [1, 2]}, r"local_bases\[0\]"),
        ({"block_len": [8, 8, 8]}, "block_len"),
    ],
)
def test_layer_descriptors_bad_input_names_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {
        "local_bases": [0, 4096],
        "remote_bases": [0, 4096],
        "local_ids": [1],
        "remote_ids": [1],
        "block_len": 64,
    }
    args.update(kwargs)
    with pytest.raises((BlockIdError, ConfigError), match=field):
        build_layer_descriptors(**args)  # type: ignore[arg-type]


def test_descriptors_type_checks_and_helpers() -> None:
    a = Descriptors(np.array([1, 2]), np.array([3, 4]), np.array([5, 6]))
    b = Descriptors([7], [8], [9])  # type: ignore[arg-type]
    joined = Descriptors.concat(a, b)
    assert _rows(joined) == [(1, 3, 5), (2, 4, 6), (7, 8, 9)]
    assert _rows(Descriptors.concat([a, b])) == _rows(joined)
    assert len(Descriptors.concat()) == 0
    assert joined.total_bytes == 20
    assert not joined.local.flags.writeable
    with pytest.raises(ConfigError, match="remote"):
        Descriptors(np.array([1, 2]), np.array([3]), np.array([5, 6]))
    with pytest.raises(ConfigError, match=r"lengths\[1\]"):
        Descriptors(np.array([1, 2]), np.array([3, 4]), np.array([5, 0]))
    with pytest.raises(ConfigError, match="local"):
        Descriptors(np.array([1.5]), np.array([3]), np.array([5]))


def test_split_by_limit() -> None:
    n = 2 * MOONCAKE_TCP_MAX_PIECES + 5
    d = build_block_descriptors(
        0, 0, np.arange(0, 2 * n, 2), np.arange(n), local_stride=64, remote_stride=64, length=64
    )
    assert len(d) == n
    parts = split_descriptors_by_limit(d)
    assert [len(p) for p in parts] == [2048, 2048, 5]
    assert _rows(Descriptors.concat(parts)) == _rows(d)
    assert split_descriptors_by_limit(Descriptors.empty()) == []
    with pytest.raises(ConfigError, match="limit"):
        split_descriptors_by_limit(d, limit=0)


def _naive(
    lbases: list[int], rbases: list[int], lids: list[int], rids: list[int], blen: int
) -> list[tuple[int, int, int]]:
    out = []
    for lb, rb in zip(lbases, rbases, strict=True):
        for lid, rid in zip(lids, rids, strict=True):
            out.append((lb + lid * blen, rb + rid * blen, blen))
    return out


def test_layer_descriptors_much_faster_than_python_loop() -> None:
    # The benchmark (bench_planning) enforces 20x; here a loose bound keeps CI timing noise harmless.
    rng = np.random.default_rng(0)
    local_ids = rng.permutation(4000)[:1000]
    local_ids[:500].sort()
    remote_ids = np.arange(1000) + 7
    lbases = [0x1000_0000 + i * 0x100_0000 for i in range(122)]
    rbases = [0x9000_0000 + i * 0x100_0000 for i in range(122)]
    blen = 65_536
    start = time.perf_counter()
    expected = _naive(lbases, rbases, local_ids.tolist(), remote_ids.tolist(), blen)
    naive_s = time.perf_counter() - start
    best = float("inf")
    d = Descriptors.empty()
    for _ in range(3):
        start = time.perf_counter()
        d = build_layer_descriptors(np.array(lbases), np.array(rbases), local_ids, remote_ids, block_len=blen)
        best = min(best, time.perf_counter() - start)
    assert d.total_bytes == len(expected) * blen
    assert naive_s / best > 5
