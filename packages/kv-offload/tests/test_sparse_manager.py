"""Sparse KV offload manager on the CPU simulation: decode writes to host, top-k misses to the hot buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.host_pool_share import held_host_pool
from ascend_dist.kv_offload.sparse_manager import SparseGeometry, SparseOffloadManager, get_manager, reset_manager

GEO = SparseGeometry(
    num_layers=2, num_blocks=4, block_size=16, kv_lora_rank=8, rope_dim=2, rows=2, topk=4, cap=16, max_model_len=64
)

BLOCK_TOKENS = GEO.block_size


def _decode(mgr: SparseOffloadManager, layer: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(-128, 127, (tokens, mgr.tk), dtype=torch.int8, generator=gen)
    v = torch.randint(-128, 127, (tokens, mgr.tv), dtype=torch.int8, generator=gen)
    assert mgr.offload_new_kv(layer, np.arange(tokens), k, v) == 2 * tokens
    return k, v


def test_hot_buffer_rows_equal_the_host_rows_of_the_topk_tokens(rt: CpuSimRuntime) -> None:
    mgr = SparseOffloadManager(rt, GEO)
    k, v = _decode(mgr, 0, 64, seed=1)
    table = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    for step, topk in enumerate([[[1, 5, 9, -1], [40, 41, 42, 43]], [[5, 20, 1, 63], [43, 44, 0, 2]]]):
        slots = mgr.onload_topk_kv(0, np.array(topk), np.array([1, 2]), np.array([64, 64]), table)
        rt.compute_stream().synchronize(5.0)
        for row in range(2):
            for pos, token in enumerate(topk[row]):
                if token < 0:
                    assert slots[row, pos] == -1
                    continue
                s = int(slots[row, pos])
                assert torch.equal(mgr.hot_k[0][row, s], k[token]), (step, row, token)
                assert torch.equal(mgr.hot_v[0][row, s], v[token])
    assert mgr.host_v[0].data_ptr() - mgr.host_k[0].data_ptr() == mgr.host_v[1].data_ptr() - mgr.host_k[1].data_ptr()
    mgr.synchronize()


def test_invalid_slots_copy_nothing_and_singleton(rt: CpuSimRuntime) -> None:
    mgr = SparseOffloadManager(rt, GEO)
    k = torch.ones(2, mgr.tk, dtype=torch.int8)
    v = torch.ones(2, mgr.tv, dtype=torch.int8)
    mgr.host_k[1].zero_()
    mgr.offload_new_kv(1, np.array([-1, 10_000]), k, v)
    mgr.synchronize()
    assert int(mgr.host_k[1].abs().sum()) == 0
    reset_manager()
    with pytest.raises(ConfigError, match="first call"):
        get_manager()
    first = get_manager(rt, GEO)
    assert get_manager() is first
    with pytest.raises(ConfigError, match="geometry"):
        get_manager(rt, SparseGeometry(**{**GEO.__dict__, "rows": 3}))
    reset_manager()


def test_the_process_manager_shares_its_host_pool_and_a_direct_one_does_not(rt: CpuSimRuntime) -> None:
    """`get_manager` claims the device's pool (SFA's D worker writes into it); a direct manager keeps its own."""
    reset_manager()
    own = SparseOffloadManager(rt, GEO)
    assert held_host_pool(rt.device_index) is None  # control: the direct form publishes nothing
    mgr = get_manager(rt, GEO)
    pool = held_host_pool(rt.device_index)
    assert pool is not None and pool.part(1, 1).data_ptr() == mgr.host_v[1].data_ptr() != own.host_v[1].data_ptr()
    # Rows written by the other sharer are what the manager onloads.
    pool.part(0, 0)[:BLOCK_TOKENS].fill_(7)
    pool.part(0, 1)[:BLOCK_TOKENS].fill_(9)
    slots = mgr.onload_topk_kv(0, np.array([[0, 1, 2, 3]]), np.array([1]), np.array([16]), np.array([[0]]))
    rt.compute_stream().synchronize(5.0)
    assert bool((mgr.hot_k[0][0, slots[0]] == 7).all()) and bool((mgr.hot_v[0][0, slots[0]] == 9).all())
    reset_manager()
    assert held_host_pool(rt.device_index) is None  # the singleton's claim is released with it
    own.close()
