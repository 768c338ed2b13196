"""Sparse KV offload: worked numbers, the LRU example and planner properties."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_offload.sparse_lru import (
    LruResidency,
    RequestIds,
    miss_descriptors,
    mtp_dummy_identity,
    token_to_request,
)
from ascend_dist.kv_offload.sparse_plan import (
    ALIGN_2MB,
    SparseOffloadConfig,
    host_pool_layout,
    hot_buffer_bytes,
    plan_sparse_memory,
    ratio_plan,
)

GIB = 1 << 30
H_DS = 61 * 128 * 1152
D_DS = 61 * 128 * 256


def test_unit_planner_examples() -> None:
    reserve = 2 * 3 * ALIGN_2MB
    kw = dict(
        host_page_bytes=2048, device_page_bytes=512, num_host_layers=2, max_blocks_per_request=100, max_num_seqs=2
    )
    plan = plan_sparse_memory(available_device_bytes=1000 * 512, dram_bytes=reserve + 1000 * 2048, **kw)  # type: ignore[arg-type]
    assert (plan.npu_limit, plan.dram_limit, plan.workload_limit) == (1000, 1000, 201)
    assert (plan.num_blocks, plan.limit, plan.planner_bytes) == (201, "workload", 201 * 2560)
    plan = plan_sparse_memory(available_device_bytes=1000 * 512, dram_bytes=reserve + 150 * 2048, **kw)  # type: ignore[arg-type]
    assert (plan.num_blocks, plan.limit) == (150, "dram")
    plan = plan_sparse_memory(
        available_device_bytes=125 * 2560,
        dram_bytes=reserve + 1000 * 2048,
        keep_device_kv_cache=True,
        **kw,  # type: ignore[arg-type]
    )
    assert (plan.num_blocks, plan.limit, plan.device_bytes) == (125, "npu", 125 * 2560)
    zero = plan_sparse_memory(available_device_bytes=-5, dram_bytes=reserve + 1000 * 2048, **kw)  # type: ignore[arg-type]
    assert (zero.num_blocks, zero.limit) == (0, "npu")


def test_deepseek_planner_and_ratio_examples() -> None:
    assert (H_DS, D_DS) == (8_994_816, 1_998_848)
    ratio, reported, blocks = ratio_plan(H_DS, D_DS, 20 * GIB, 128)
    assert ratio == 4.5 and blocks == 10_743 and reported == int(20 * GIB * 5.5)
    common = dict(
        host_page_bytes=H_DS,
        device_page_bytes=D_DS,
        num_host_layers=61,
        available_device_bytes=20 * GIB,
        dram_bytes=128 * GIB,
        max_blocks_per_request=131072 // 128,
    )
    plan = plan_sparse_memory(max_num_seqs=16, **common)  # type: ignore[arg-type]
    assert plan.reserve == 61 * 6 * (1 << 20)
    assert (plan.npu_limit, plan.dram_limit, plan.workload_limit, plan.num_blocks, plan.limit) == (
        10_743,
        15_237,
        16_385,
        10_743,
        "npu",
    )
    plan8 = plan_sparse_memory(max_num_seqs=8, **common)  # type: ignore[arg-type]
    assert (plan8.num_blocks, plan8.limit) == (8_193, "workload")
    with pytest.raises(ConfigError, match="dram_size_per_dp_GB"):
        ratio_plan(H_DS, D_DS, 20 * GIB, 64)


def test_ratio_unit_examples() -> None:
    assert ratio_plan(4 * 576 * 2, 4 * 128 * 2, 0, 1)[0] == 4.5
    assert ratio_plan(4 * 576 * 2, 128 * 2, 0, 1)[0] == 18
    assert ratio_plan(4 * 576 * 2, 128 + 2, 0, 1)[0] == pytest.approx(35.446, abs=1e-3)
    assert ratio_plan(0, 256, 0, 1)[0] == 0


def test_planner_for_61_layers_takes_under_10_ms() -> None:
    start = time.perf_counter()
    for _ in range(10):
        plan_sparse_memory(
            host_page_bytes=H_DS,
            device_page_bytes=D_DS,
            num_host_layers=61,
            available_device_bytes=20 * GIB,
            dram_bytes=128 * GIB,
            max_blocks_per_request=1024,
            max_num_seqs=16,
        )
    assert (time.perf_counter() - start) / 10 < 0.010


def test_hot_buffer_and_host_layout() -> None:
    rows, k, v = hot_buffer_bytes(
        max_num_batched_tokens=4096,
        max_num_seqs=16,
        num_spec_tokens=1,
        topk_buffer_size=4096,
        kv_lora_rank=512,
        rope_dim=64,
    )
    assert (rows, k, v) == (32, 128 << 20, 16 << 20)
    assert 61 * (k + v) / GIB == pytest.approx(8.58, abs=0.01)
    raw, offsets = host_pool_layout([3 << 20, 1 << 20, 3 << 20])
    assert offsets == [0, 4 << 20, 6 << 20] and raw == (1 + 2 + 1 + 2) * ALIGN_2MB


def test_config_errors_name_the_key() -> None:
    ok = SparseOffloadConfig.from_dict({"enabled": True, "topk_buffer_size": 4096}, index_topk=2048, block_size=128)
    assert ok.topk == 2048 and ok.dram_bytes == 128 * GIB
    for raw, key in [
        ({"topk_buffer_size": 1024}, "topk_buffer_size"),
        ({"topk_buffer_size": 4100}, "topk_buffer_size"),
        ({"dram_size_per_dp_GB": 0}, "dram_size_per_dp_GB"),
        ({"enabled": "yes"}, "enabled"),
    ]:
        with pytest.raises(ConfigError, match=key):
            SparseOffloadConfig.from_dict(raw, index_topk=2048, block_size=128)
    with pytest.raises(ConfigError, match="index_topk"):
        SparseOffloadConfig.from_dict({}, index_topk=None, block_size=128)
    with pytest.raises(ConfigError, match="kv_role"):
        SparseOffloadConfig.from_dict({"enabled": True}, index_topk=2048, block_size=128, is_kv_consumer=False)


def test_lru_worked_example() -> None:
    lru = LruResidency(rows=1, cap=8, topk=4, max_model_len=100_000)
    steps = [
        ([10, 20, 30, -1], 1000, [0, 1, 2, -1], [3, 4, 5, 6, 7, 0, 1, 2], 3),
        ([20, 40, 10, 50], 1000, [1, 3, 0, 4], [5, 6, 7, 2, 3, 4, 0, 1], 2),
        ([50, 10, 60, 70], 45, [5, 0, 6, 7], [2, 3, 4, 1, 5, 6, 7, 0], 3),
    ]
    for topk, stable, current, order, misses in steps:
        plan = lru.step(np.array([topk]), [7], [stable])
        assert plan.current_slots[0].tolist() == current
        assert lru.lru[0].tolist() == order and int(plan.miss_count[0]) == misses


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(-1, 40), min_size=4, max_size=4), st.integers(0, 2), st.integers(0, 45)),
        min_size=1,
        max_size=12,
    )
)
def test_lru_properties(steps: list[tuple[list[int], int, int]]) -> None:
    lru = LruResidency(rows=1, cap=6, topk=4, max_model_len=50)
    prev_req = None
    for topk, req, stable in steps:
        before = lru.slot_to_token[0].copy()
        plan = lru.step(np.array([topk]), [req], [stable])
        assert sorted(lru.lru[0].tolist()) == list(range(6))  # (a) a permutation
        valid = [s for s in plan.current_slots[0].tolist() if s >= 0]
        assert len(valid) == len(set(valid))  # (b) distinct
        misses = set(plan.miss_slots[0, : plan.miss_count[0]].tolist())
        for p, slot in enumerate(plan.current_slots[0].tolist()):
            if slot >= 0:
                assert lru.slot_to_token[0, slot] == topk[p]
                if slot not in misses:  # (c) a hit moved nothing; (d) below the stable prefix; (e) same request
                    assert before[slot] == topk[p] and topk[p] < stable and req == prev_req
        prev_req = req


def test_miss_descriptors_write_size_zero_for_unaddressable_entries() -> None:
    lru = LruResidency(rows=2, cap=4, topk=2, max_model_len=1000)
    plan = lru.step(np.array([[1, 130], [5, 300]]), [1, 2], [1000, 1000])
    table = np.array([[3, -1], [0, 1]])  # row 0: token 130's block is null; row 1: token 300 beyond the table
    src, dst, sizes = miss_descriptors(
        plan,
        table,
        host_k=1 << 20,
        host_v=1 << 24,
        dev_k=1 << 28,
        dev_v=1 << 30,
        token_k_bytes=1024,
        token_v_bytes=128,
        block_size=128,
        cap=4,
    )
    assert len(sizes) == 8 and sizes.tolist() == [1024, 0, 1024, 0, 128, 0, 128, 0]
    assert src[0] == (1 << 20) + (3 * 128 + 1) * 1024 and dst[2] == (1 << 28) + (1 * 4 + 0) * 1024


def test_request_identity_is_collision_free_and_token_owners() -> None:
    ids = RequestIds()
    rows = ids.row_ids(["a", "b"], 4)
    assert rows.tolist() == [1, 2, 0, 0]
    ids.release("a")
    assert ids.admit("a") == 3  # a re-admitted id never reuses a number
    assert token_to_request([0, 1, 3, 4], 6).tolist() == [0, 1, 1, 2, 0, 0]
    with pytest.raises(ConfigError, match="num_tokens"):
        token_to_request([0, 4], 2)
    req, owners = mtp_dummy_identity(3, [0, 2, 4, 6], 8)
    assert req.tolist() == [1, 2, 3] and owners.tolist() == [0, 0, 1, 1, 2, 2, 0, 0]
