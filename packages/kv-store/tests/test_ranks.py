"""Multi-rank behaviour over the in-memory backend: every rank's keys must exist; replica sets shard saves."""

from __future__ import annotations

from dataclasses import replace

from ascend_dist.kv_store import (
    InMemoryBackend,
    NewRequest,
    PoolConfig,
    PoolSpec,
    StepInput,
    build_scheduler,
    build_worker,
)
from ascend_dist.kv_store.step_metadata import PoolStepMeta

CFG = PoolConfig.from_extra({})


def _ranks(spec: PoolSpec, backend: InMemoryBackend, kvtools, n: int):
    workers = []
    for rank in range(n):
        w = build_worker(replace(spec, tp_rank=rank), CFG, backend)
        w.register_kv_caches(kvtools.make(num_blocks=8, seed=rank), 8)
        workers.append(w)
    return workers


def _meta(spec: PoolSpec, prompt: list[int]) -> PoolStepMeta:
    scheduler = build_scheduler(spec, CFG, lambda *_: 0)
    scheduler.get_num_new_matched_tokens("r", prompt, len(prompt), 0)
    return scheduler.build_meta(StepInput(new=[NewRequest("r", prompt, [[1, 2, 3, 4]], 0, len(prompt))]))


def test_hit_needs_every_tp_rank(kvtools) -> None:
    backend = InMemoryBackend()
    spec = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2, tp_size=2)
    r0, r1 = _ranks(spec, backend, kvtools, 2)
    try:
        prompt = list(range(64))
        meta = _meta(spec, prompt)
        lookup = build_scheduler(spec, CFG, r0.safe_lookup)
        r0.wait_for_save(meta)
        r0.drain(10)
        assert lookup.get_num_new_matched_tokens("a", prompt, 64, 0) == (0, False)  # rank 1's half is missing
        r1.wait_for_save(meta)
        r1.drain(10)
        assert lookup.get_num_new_matched_tokens("b", prompt, 64, 0)[0] == 63
        assert {k.split("@")[3] for k in backend.stored_keys()} == {"head_or_tp_rank:0", "head_or_tp_rank:1"}
    finally:
        r0.close()
        r1.close()


def test_mla_replicas_shard_the_writes(kvtools) -> None:
    backend = InMemoryBackend()
    spec = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=8, use_mla=True, tp_size=2)
    r0, r1 = _ranks(spec, backend, kvtools, 2)
    try:
        prompt = list(range(64))
        meta = _meta(spec, prompt)
        r0.wait_for_save(meta)
        r0.drain(10)
        assert r0.stats.saved_keys == 2  # survivors 0 and 2
        r1.wait_for_save(meta)
        r1.drain(10)
        assert r1.stats.saved_keys == 2 and len(backend.stored_keys()) == 4
        assert {k.split("@")[3] for k in backend.stored_keys()} == {"head_or_tp_rank:0"}
        lookup = build_scheduler(spec, CFG, r1.safe_lookup)
        assert lookup.get_num_new_matched_tokens("b", prompt, 64, 0)[0] == 63
    finally:
        r0.close()
        r1.close()


def test_hbm_hit_chunks_are_not_queried(kvtools) -> None:
    backend = InMemoryBackend()
    spec = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2)
    (w,) = _ranks(spec, backend, kvtools, 1)
    try:
        prompt = list(range(64))
        w.wait_for_save(_meta(spec, prompt))
        w.drain(10)
        hashes = build_scheduler(spec, CFG, w.safe_lookup).hashes_for(prompt)[1]
        first = spec.key_metadata()[0].pool_key(hashes[0])
        backend.remove([first])
        assert w.lookup(64, hashes) == 0
        assert w.lookup(64, hashes, hbm_hit_tokens=16) == 64  # chunk 0 is in HBM: not asked for
    finally:
        w.close()


class _Gate:
    """A fake `ComputeEvent` (our own Protocol): completes when the test says so."""

    def __init__(self) -> None:
        import threading

        self.done = threading.Event()

    def synchronize(self, timeout: float | None = None) -> None:
        from ascend_dist.common.errors import DeadlineExceeded

        if not self.done.wait(timeout):
            raise DeadlineExceeded("forward still running")


def test_save_waits_for_the_compute_event(kvtools) -> None:
    backend = InMemoryBackend()
    spec = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2)
    gates: list[_Gate] = []

    def record() -> _Gate:
        gates.append(_Gate())
        return gates[-1]

    from ascend_dist.kv_store.assembly import WorkerWaits

    w = build_worker(spec, CFG, backend, record_compute_event=record, waits=WorkerWaits(compute_s=5))
    try:
        w.register_kv_caches(kvtools.make(num_blocks=8), 8)
        w.wait_for_save(_meta(spec, list(range(32))))  # returns at once: the save waits on the event
        assert len(gates) == 1 and backend.stored_keys() == []
        gates[0].done.set()
        w.drain(10)
        assert len(backend.stored_keys()) == 2
    finally:
        w.close()


def test_save_decode_cache_saves_chunks_completed_while_decoding(kvtools) -> None:
    from ascend_dist.kv_store import RunningRequest

    backend = InMemoryBackend()
    spec = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2)
    cfg = PoolConfig.from_extra({"save_decode_cache": True})
    w = build_worker(spec, cfg, backend)
    try:
        w.register_kv_caches(kvtools.make(num_blocks=8), 8)
        s = build_scheduler(spec, cfg, w.safe_lookup)
        prompt = list(range(20))
        s.get_num_new_matched_tokens("r", prompt, 20, 0)
        w.wait_for_save(s.build_meta(StepInput(new=[NewRequest("r", prompt, [[1, 2]], 0, 20)])))
        for t in range(12):  # decode tokens 20..31: the second chunk completes at 32
            meta = s.build_meta(StepInput(running=[RunningRequest("r", [100 + t], [[3]] if t == 0 else None, 20 + t)]))
            w.wait_for_save(meta)
        w.drain(10)
        assert len(backend.stored_keys()) == 2
    finally:
        w.close()


def test_kv_events_for_every_chunk_put(kvtools) -> None:
    backend = InMemoryBackend()
    spec = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2)
    cfg = PoolConfig.from_extra({}, kv_events=True)
    w = build_worker(spec, cfg, backend)
    try:
        w.register_kv_caches(kvtools.make(num_blocks=8), 8)
        s = build_scheduler(spec, cfg, w.safe_lookup)
        prompt = list(range(40))
        s.get_num_new_matched_tokens("r", prompt, 40, 0)
        w.wait_for_save(s.build_meta(StepInput(new=[NewRequest("r", prompt, [[1, 2, 3]], 0, 40)])))
        w.drain(10)
        events = w.events.drain()
        hashes = s.hashes_for(prompt)[1]
        assert [(e.block_hash, e.parent_block_hash, e.token_ids) for e in events] == [
            (hashes[0], None, tuple(range(16))),
            (hashes[1], hashes[0], tuple(range(16, 32))),
        ]
        assert w.events.drain() == []
    finally:
        w.close()
