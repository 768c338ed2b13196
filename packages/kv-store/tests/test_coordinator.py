"""Hybrid coordinator: worked examples of each group rule, then full + sliding-window end to end."""

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
from ascend_dist.kv_store.keys.coordinator import GroupRule, HybridCoordinator

FULL = GroupRule("full", 128)
SWA = GroupRule("sliding_window", 128, window=256)


def flags(n: int, present: set[int]) -> list[bool]:
    return [i in present for i in range(n)]


def test_spec_example_full_plus_sliding_window() -> None:
    coord = HybridCoordinator([FULL, SWA], 512)
    everything = flags(8, set(range(8)))
    assert coord.longest_hit([everything, flags(8, {2, 3, 6, 7})], 1024) == 1024
    # SWA chunk 7 evicted: 7 x, 6 ok, 5 x, 4 x, 3 ok, 2 ok -> SWA 512 -> full attention capped -> 512
    assert coord.longest_hit([everything, flags(8, {2, 3, 6})], 1024) == 512
    assert coord.longest_hit([flags(8, {0, 1, 2}), flags(8, {2, 3, 6, 7})], 1024) == 0  # full stops at 384 -> 0


def test_spec_example_dsv4_like_compressed_groups() -> None:
    coord = HybridCoordinator([GroupRule("full", 128), GroupRule("full", 16384)], 16384)
    assert coord.longest_hit([flags(128, set(range(128))), flags(1, set())], 16384) == 0
    assert coord.longest_hit([flags(128, set(range(128))), flags(1, {0})], 40000) == 16384


def test_mamba_hits_are_discontinuous() -> None:
    mamba = GroupRule("mamba", 16)
    present = [False, False, True, False, False, True]  # ends 16..96
    assert mamba.hit(present, 96, 16) == 96
    assert mamba.hit(present, 64, 16) == 48
    assert mamba.hit(present, 96, 32) == 96 and mamba.hit(present, 80, 32) == 0  # 48 is not 32-aligned


def test_sliding_window_rules() -> None:
    assert SWA.contiguous(False) == 2 and SWA.contiguous(True) == 3
    assert SWA.hit(flags(8, {0}), 1024, 128) == 128  # a short run from the prompt start is a hit
    assert SWA.hit(flags(8, {6, 7}), 1024, 128) == 1024
    assert SWA.hit(flags(8, {7}), 1024, 128) == 0
    assert SWA.reachable(8, 512) == [False, False, True, True, False, False, True, True]
    assert GroupRule("mamba", 128).reachable(8, 512) == [False, False, False, True] * 2
    assert FULL.reachable(8, 512) is None and SWA.reachable(8, 128) == [True] * 8
    assert SWA.needed_for_hit(1024) == (6, 8) and FULL.needed_for_hit(512) == (0, 4)


def test_eagle_drops_the_last_matched_chunk() -> None:
    assert FULL.hit(flags(8, set(range(8))), 1024, 128, use_eagle=True) == 896
    assert SWA.hit(flags(8, {5, 6, 7}), 1024, 128, use_eagle=True) == 896
    coord = HybridCoordinator([FULL], 128, use_eagle=True)
    assert coord.longest_hit([flags(8, set(range(8)))], 1024) == 896


def test_bad_rules_are_refused() -> None:
    with pytest.raises(ConfigError, match="group kind"):
        GroupRule("linear", 16)
    with pytest.raises(ConfigError, match="granularity"):
        HybridCoordinator([GroupRule("full", 48)], 64)
    with pytest.raises(ConfigError, match="group_kinds"):
        PoolSpec(model="m", block_sizes=(16,), num_kv_heads=1, group_kinds=("full", "full")).coordinator()


# ---- end to end: full attention (64-token chunks) + sliding window (16-token chunks, window 32) ----

HYBRID = PoolSpec(
    model="hybrid-swa",
    block_sizes=(64, 16),
    num_kv_heads=2,
    group_kinds=("full", "sliding_window"),
    sliding_windows=(0, 32),
)
FULL_LAYER, SWA_LAYER = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


def caches(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)

    def kv(block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(16, block, 2, 4, generator=gen).to(torch.float16) for _ in range(2))  # type: ignore[return-value]

    return {FULL_LAYER: kv(64), SWA_LAYER: kv(16)}


def block(c: dict[str, tuple[torch.Tensor, torch.Tensor]], layer: str, b: int) -> bytes:
    return b"".join(t[b].numpy().tobytes() for t in c[layer])


def test_hybrid_stores_reachable_chunks_and_loads_the_window() -> None:
    backend = InMemoryBackend()
    cfg = PoolConfig.from_extra({})
    wa, wb = build_worker(HYBRID, cfg, backend), build_worker(HYBRID, cfg, backend)
    ca, cb = caches(1), caches(2)
    try:
        for w, c in ((wa, ca), (wb, cb)):
            w.register_kv_caches(c, 16, [[FULL_LAYER], [SWA_LAYER]])
        sa, sb = build_scheduler(HYBRID, cfg, wa.safe_lookup), build_scheduler(HYBRID, cfg, wb.safe_lookup)
        prompt = list(range(500, 628))  # 128 tokens: 2 full-attention chunks, 8 sliding-window chunks
        assert sa.get_num_new_matched_tokens("a", prompt, 128, 0) == (0, False)
        ids_a = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10]]
        wa.wait_for_save(sa.build_meta(StepInput(new=[NewRequest("a", prompt, ids_a, 0, 128)])))
        stored = backend.stored_keys()  # no drain: a sliding-window model's saves finish inside the step
        assert sum("@group:0@" in k for k in stored) == 2
        assert sum("@group:1@" in k for k in stored) == 4  # only the window tails before 64 and 128

        need, _ = sb.get_num_new_matched_tokens("b", prompt, 128, 0)
        assert need == 127
        ids_b = [[11, 12], [0, 0, 0, 0, 0, 0, 13, 14]]  # vLLM leaves out-of-window SWA blocks null
        sb.update_state_after_alloc("b", ids_b, need)
        wb.start_load_kv(sb.build_meta(StepInput(new=[NewRequest("b", prompt, ids_b, 127, 1)])))
        assert wb.get_block_ids_with_load_errors() == set()
        assert [block(cb, FULL_LAYER, b) for b in (11, 12)] == [block(ca, FULL_LAYER, b) for b in (1, 2)]
        assert [block(cb, SWA_LAYER, b) for b in (13, 14)] == [block(ca, SWA_LAYER, b) for b in (9, 10)]

        # evict the SWA tail of the second boundary: the hit falls back to the first boundary
        hashes = sb.hashes_for(prompt)[1]
        backend.remove([HYBRID.key_metadata()[1].pool_key(hashes[7])])
        assert sb.get_num_new_matched_tokens("c", prompt, 128, 0)[0] == 64
    finally:
        wa.close()
        wb.close()


def test_mamba_group_loads_only_the_state_at_the_hit() -> None:
    spec = PoolSpec(model="hybrid-mamba", block_sizes=(16, 16), num_kv_heads=2, group_kinds=("full", "mamba"))
    backend = InMemoryBackend()
    cfg = PoolConfig.from_extra({})
    wa, wb = build_worker(spec, cfg, backend), build_worker(spec, cfg, backend)
    gen = torch.Generator().manual_seed(3)

    def caches() -> dict[str, object]:
        return {
            FULL_LAYER: tuple(torch.randn(16, 16, 2, 4, generator=gen).to(torch.float16) for _ in range(2)),
            "model.layers.1.mixer": torch.randn(16, 64, generator=gen).to(torch.float16),  # one state per block
        }

    ca, cb = caches(), caches()
    try:
        for w, c in ((wa, ca), (wb, cb)):
            w.register_kv_caches(c, 16, [[FULL_LAYER], ["model.layers.1.mixer"]])
        sa, sb = build_scheduler(spec, cfg, wa.safe_lookup), build_scheduler(spec, cfg, wb.safe_lookup)
        prompt = list(range(900, 964))  # 4 chunks per group
        sa.get_num_new_matched_tokens("a", prompt, 64, 0)
        wa.wait_for_save(sa.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3, 4], [5, 6, 7, 8]], 0, 64)])))
        wa.drain(10)
        hashes = sb.hashes_for(prompt)[1]
        backend.remove([spec.key_metadata()[1].pool_key(hashes[3])])  # the state after 64 tokens is gone
        need, _ = sb.get_num_new_matched_tokens("b", prompt, 64, 0)
        assert need == 48  # the state after 48 tokens still serves a hit (missing chunks do not stop Mamba)
        ids = [[9, 10, 11, 12], [0, 0, 13, 14]]  # vLLM keeps only the needed state blocks
        sb.update_state_after_alloc("b", ids, need)
        before = cb["model.layers.1.mixer"].clone()
        wb.start_load_kv(sb.build_meta(StepInput(new=[NewRequest("b", prompt, ids, 48, 16)])))
        assert wb.get_block_ids_with_load_errors() == set()
        mixer_a, mixer_b = ca["model.layers.1.mixer"], cb["model.layers.1.mixer"]
        assert torch.equal(mixer_b[13], mixer_a[7])  # state chunk 2 only
        assert torch.equal(mixer_b[14], before[14]) and torch.equal(mixer_b[0], before[0])
        assert all(torch.equal(cb[FULL_LAYER][0][d], ca[FULL_LAYER][0][s]) for s, d in ((1, 9), (2, 10), (3, 11)))
    finally:
        wa.close()
        wb.close()


def test_a_mamba_hit_stops_before_the_last_prompt_token() -> None:
    """The state after the whole prompt cannot serve it: vLLM recomputes the last token on top of the
    loaded state, which would apply that token twice. The hit is the last aligned state before it."""
    spec = PoolSpec(model="hybrid-mamba-end", block_sizes=(16, 16), num_kv_heads=2, group_kinds=("full", "mamba"))
    backend = InMemoryBackend()
    cfg = PoolConfig.from_extra({})
    wa = build_worker(spec, cfg, backend)
    gen = torch.Generator().manual_seed(4)
    caches = {
        FULL_LAYER: tuple(torch.randn(16, 16, 2, 4, generator=gen).to(torch.float16) for _ in range(2)),
        "model.layers.1.mixer": torch.randn(16, 64, generator=gen).to(torch.float16),
    }
    try:
        wa.register_kv_caches(caches, 16, [[FULL_LAYER], ["model.layers.1.mixer"]])
        sa = build_scheduler(spec, cfg, wa.safe_lookup)
        prompt = list(range(300, 364))  # 64 tokens: every chunk and every state is saved
        sa.get_num_new_matched_tokens("a", prompt, 64, 0)
        wa.wait_for_save(sa.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3, 4], [5, 6, 7, 8]], 0, 64)])))
        wa.drain(10)
        assert len(backend.stored_keys()) == 8
        assert sa.get_num_new_matched_tokens("b", prompt, 64, 0)[0] == 48  # not 63 on top of the state after 64
    finally:
        wa.close()


# ---- sparse retention (vLLM prefix_cache_retention_interval) ----


def _chunks(mask: list[bool] | None) -> set[int] | None:
    return None if mask is None else {i for i, keep in enumerate(mask) if keep}


def test_retention_keeps_one_tail_per_interval_plus_the_prompt_boundaries() -> None:
    swa = GroupRule("sliding_window", 16, window=33)  # a hit needs the 2 chunks before its end
    assert _chunks(swa.reachable(12, 16, retention=64)) == {2, 3, 6, 7, 10, 11}
    # the prompt (150 tokens) keeps its final segment's tail and the tail before its replay boundary (144)
    assert _chunks(swa.reachable(12, 16, retention=64, prompt_end=150)) == {2, 3, 6, 7, 8, 10, 11}
    assert _chunks(swa.reachable(12, 16, retention=0, prompt_end=150)) == {7, 8}
    assert swa.reachable(12, 16, retention=32) is None  # every chunk is some interval's tail
    mamba = GroupRule("mamba", 16)
    assert _chunks(mamba.reachable(12, 16, retention=64, prompt_end=150)) == {3, 7, 8, 11}
    assert _chunks(mamba.reachable(12, 32, retention=16)) == _chunks(mamba.reachable(12, 32))
    assert FULL.reachable(8, 512, retention=1024) is None
    coord = HybridCoordinator([FULL, SWA], 512, retention=1024)
    assert coord.lookup_mask(1, 16) == SWA.reachable(16, 512)  # lookups ask for every reachable chunk
    with pytest.raises(ConfigError, match="prefix_cache_retention_interval"):
        HybridCoordinator([FULL, SWA], 512, retention=640)


def test_retention_stores_sparse_tails_and_skips_short_prompts() -> None:
    spec = PoolSpec(**{**HYBRID.__dict__, "model": "hybrid-retention", "retention_interval": 128})
    backend = InMemoryBackend()
    cfg = PoolConfig.from_extra({})
    wa, wb = build_worker(spec, cfg, backend), build_worker(spec, cfg, backend)
    ca, cb = caches(1), caches(2)
    lookups: list[int] = []
    try:
        for w, c in ((wa, ca), (wb, cb)):
            w.register_kv_caches(c, 16, [[FULL_LAYER], [SWA_LAYER]])
        sa = build_scheduler(spec, cfg, wa.safe_lookup)
        sb = build_scheduler(spec, cfg, lambda *args: lookups.append(1) or wb.safe_lookup(*args))
        prompt = list(range(1000, 1256))  # 256 tokens: 4 full-attention chunks, 16 sliding-window chunks
        sa.get_num_new_matched_tokens("a", prompt, 256, 0)
        ids = [[1, 2, 3, 4], [0] * 6 + [5, 6, 0, 0, 7, 8, 0, 0, 9, 10]]  # only blocks vLLM keeps
        wa.wait_for_save(sa.build_meta(StepInput(new=[NewRequest("a", prompt, ids, 0, 256)])))
        hashes = sa.hashes_for(prompt)[1]
        meta = spec.key_metadata()[1]
        stored = {i for i in range(16) if meta.pool_key(hashes[i]) in backend.stored_keys()}
        assert stored == {6, 7, 10, 11, 14, 15}  # interval tails (128, 256) and the replay boundary (192)
        assert sb.get_num_new_matched_tokens("b", prompt, 256, 0)[0] == 255  # the full prompt still hits
        other = prompt[:64] + list(range(5000, 5192))  # shares one aligned chunk: no tail kept there
        assert sb.get_num_new_matched_tokens("c", other, 256, 0)[0] == 0
        calls = len(lookups)
        assert sb.get_num_new_matched_tokens("d", prompt[:255], 255, 0) == (0, False)  # < 2 intervals
        assert len(lookups) == calls  # not even asked
    finally:
        wa.close()
        wb.close()


def test_retention_interval_comes_from_the_environment_variable() -> None:
    from ascend_dist.kv_store.vllm_spec import retention_interval

    assert retention_interval({}) is None  # unset: dense, whatever vLLM's local cache retains
    assert retention_interval({"VLLM_PREFIX_CACHE_RETENTION_INTERVAL": " 4096 "}) == 4096
    with pytest.raises(ConfigError, match="VLLM_PREFIX_CACHE_RETENTION_INTERVAL"):
        retention_interval({"VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "-1"})
