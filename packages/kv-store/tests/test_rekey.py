"""Heterogeneous P/D layouts read each other's pool objects: TP-mismatch sub-keys and PP re-keying.

A TP2 prefill (2 heads per rank) and a TP1 decode (all 4 heads) share the real Mooncake Store: the
decode rank moves each chunk as two sub-keys of strided per-token head slices, byte-identical to the
objects of the two prefill ranks, in both directions. A PP1 decode keys its chunks as a two-stage
prefill does (one key per stage holding that stage's layers), in both directions.
"""

from __future__ import annotations

import pytest
import torch

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_store import (
    InMemoryBackend,
    NewRequest,
    PoolConfig,
    PoolSpec,
    StepInput,
    build_scheduler,
    build_worker,
)
from ascend_dist.kv_store.backends.mooncake import MooncakeBackend
from ascend_dist.kv_store.config.config import MooncakeStoreConfig
from ascend_dist.kv_store.keys.rekey import KeySplit
from ascend_dist.kv_store.keys.token_db import GroupBuffers

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
CONSUMER = {"consumer_is_to_put": True, "consumer_is_to_load": True}


def caches(heads: int, seed: int, layers: list[str] = LAYERS) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: tuple(torch.randn(8, 16, heads, 4, generator=gen).to(torch.float16) for _ in range(2))  # type: ignore[misc]
        for n in layers
    }


def step(worker, scheduler, req: str, prompt: list[int], blocks: list[int]) -> int:
    need, _ = scheduler.get_num_new_matched_tokens(req, prompt, len(prompt), 0)
    scheduler.update_state_after_alloc(req, [blocks], need)
    meta = scheduler.build_meta(StepInput(new=[NewRequest(req, prompt, [blocks], need, len(prompt) - need)]))
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    worker.drain(20)
    return need


def test_split_example_from_the_spec() -> None:
    buffers = GroupBuffers((1000,), (64,), (128,), 0, ("l0",), (0, 1))
    meta = PoolSpec(model="m", block_sizes=(4,), num_kv_heads=8, tp_size=2, tp_rank=1).key_metadata()[0]
    ((k0, _, _), (k1, addrs, sizes)) = KeySplit(tp_rank=1, num_sub_keys=2).split(
        meta, "ab", buffers, block_id=2, num_tokens=3, span=4
    )
    assert "@head_or_tp_rank:2@" in k0 and "@head_or_tp_rank:3@" in k1
    assert addrs == [1264, 1280, 1296] and sizes == [8, 8, 8]


@pytest.mark.mooncake
def test_tp2_prefill_and_tp1_decode_read_each_other(mooncake_master) -> None:
    def backend() -> MooncakeBackend:
        return MooncakeBackend(MooncakeStoreConfig.load(mooncake_master.config(), env={}))

    prefill_cfg = PoolConfig.from_extra({"decode_tp_size": 1})
    decode_cfg = PoolConfig.from_extra({**CONSUMER, "prefill_tp_size": 2}, kv_role="kv_consumer")
    p_specs = [
        PoolSpec(model="tpm", block_sizes=(16,), num_kv_heads=4, tp_size=2, tp_rank=r, peer_tp_size=1) for r in (0, 1)
    ]
    d_spec = PoolSpec(model="tpm", block_sizes=(16,), num_kv_heads=4, peer_tp_size=2)
    assert d_spec.compat_hash() == p_specs[0].compat_hash() and d_spec.key_split() == KeySplit(0, 2)
    p_workers = [build_worker(s, prefill_cfg, backend()) for s in p_specs]
    d_worker = build_worker(d_spec, decode_cfg, backend())
    p_caches, d_caches = [caches(2, 1), caches(2, 2)], caches(4, 3)
    try:
        for w, c in zip(p_workers, p_caches, strict=True):
            w.register_kv_caches(c, 8)
        d_worker.register_kv_caches(d_caches, 8)
        p_scheds = [build_scheduler(s, prefill_cfg, p_workers[0].safe_lookup) for s in p_specs]
        d_sched = build_scheduler(d_spec, decode_cfg, d_worker.safe_lookup)

        prompt = list(range(2000, 2048))  # 3 chunks, computed by the prefill ranks
        for w, s in zip(p_workers, p_scheds, strict=True):
            assert step(w, s, "p", prompt, [1, 2, 3]) == 0
        assert step(d_worker, d_sched, "d", prompt, [4, 5, 6]) == 47
        assert d_worker.get_block_ids_with_load_errors() == set()
        for name in LAYERS:
            for kv in (0, 1):
                for src, dst in zip([1, 2, 3], [4, 5, 6], strict=True):
                    for rank in (0, 1):
                        got = d_caches[name][kv][dst][:, 2 * rank : 2 * rank + 2]
                        assert torch.equal(got, p_caches[rank][name][kv][src])

        prompt = list(range(3000, 3032))  # 2 chunks, computed by the decode instance
        assert step(d_worker, d_sched, "d2", prompt, [1, 2]) == 0
        for rank, (w, s) in enumerate(zip(p_workers, p_scheds, strict=True)):
            assert step(w, s, "p2", prompt, [6, 7]) == 31
            assert w.get_block_ids_with_load_errors() == set()
            for name in LAYERS:
                assert torch.equal(p_caches[rank][name][0][6], d_caches[name][0][1][:, 2 * rank : 2 * rank + 2])
    finally:
        for w in [*p_workers, d_worker]:
            w.close()


def test_pp1_decode_keys_chunks_for_a_two_stage_prefill() -> None:
    backend = InMemoryBackend()
    prefill_cfg = PoolConfig.from_extra({})
    decode_cfg = PoolConfig.from_extra(
        {**CONSUMER, "prefill_pp_size": 2, "prefill_pp_layer_partition": "1,1"}, kv_role="kv_consumer"
    )
    stages = [
        PoolSpec(model="ppm", block_sizes=(16,), num_kv_heads=2, pp_size=2, pp_rank=j, stage_layers=(1, 1))
        for j in (0, 1)
    ]
    d_spec = PoolSpec(model="ppm", block_sizes=(16,), num_kv_heads=2, rekey_pp_parts=(1, 1))
    assert d_spec.compat_hash() == stages[0].compat_hash()
    s_workers = [build_worker(s, prefill_cfg, backend) for s in stages]
    d_worker = build_worker(d_spec, decode_cfg, backend)
    s_caches = [caches(2, 4, [LAYERS[0]]), caches(2, 5, [LAYERS[1]])]
    d_caches = caches(2, 6)
    try:
        for w, c in zip(s_workers, s_caches, strict=True):
            w.register_kv_caches(c, 8)
        d_worker.register_kv_caches(d_caches, 8)
        s_scheds = [build_scheduler(s, prefill_cfg, s_workers[0].safe_lookup) for s in stages]
        d_sched = build_scheduler(d_spec, decode_cfg, d_worker.safe_lookup)

        prompt = list(range(32))
        assert step(d_worker, d_sched, "d", prompt, [1, 2]) == 0
        assert sorted({k.split("@")[4] for k in backend.stored_keys()}) == ["pp_rank:0", "pp_rank:1"]
        for j, (w, s) in enumerate(zip(s_workers, s_scheds, strict=True)):
            assert step(w, s, "p", prompt, [5, 6]) == 31  # stage 0's lookup checks both stages' keys
            name = LAYERS[j]
            assert torch.equal(s_caches[j][name][1][6], d_caches[name][1][2])

        prompt = list(range(100, 132))  # computed by the prefill stages, loaded by the decode
        for w, s in zip(s_workers, s_scheds, strict=True):
            step(w, s, "p2", prompt, [3, 4])
        assert step(d_worker, d_sched, "d2", prompt, [6, 7]) == 31
        for j, name in enumerate(LAYERS):
            assert torch.equal(d_caches[name][0][6], s_caches[j][name][0][3])
    finally:
        for w in [*s_workers, d_worker]:
            w.close()


def test_bad_split_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="prefill_pp_layer_partition"):
        PoolConfig.from_extra({"prefill_pp_layer_partition": "a,b"})
    d_spec = PoolSpec(model="ppm", block_sizes=(16,), num_kv_heads=2, rekey_pp_parts=(1, 2))
    worker = build_worker(d_spec, PoolConfig.from_extra({}), InMemoryBackend())
    try:
        with pytest.raises(ConfigError, match="prefill_pp_layer_partition"):
            worker.register_kv_caches(caches(2, 1), 8)  # 2 layers, partition sums to 3
    finally:
        worker.close()
    with pytest.raises(ConfigError, match="prefill_tp_size"):
        build_worker(
            PoolSpec(model="m", block_sizes=(16,), num_kv_heads=4, peer_tp_size=2),
            PoolConfig.from_extra({"use_layerwise": True}),
            InMemoryBackend(),
        )
