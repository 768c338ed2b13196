"""Layer-wise pool transfers end to end against a real ``mooncake_master`` on loopback.

Instance A computes a prompt layer by layer and saves each layer as soon as it is "computed";
instance B finds the prefix and loads it layer by layer while the earlier layers "compute". A
recording wrapper around the real Mooncake backend (our own `PoolBackend` Protocol) shows the
overlap: layer L+1's get runs before ``wait_for_layer_load(L+1)`` is called, and ``save_kv_layer``
returns while its put is still blocked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

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
from ascend_dist.kv_store.assembly import WorkerWaits
from ascend_dist.kv_store.backends.mooncake import MooncakeBackend
from ascend_dist.kv_store.config.config import MooncakeStoreConfig

pytestmark = pytest.mark.mooncake
SPEC = PoolSpec(model="tiny-lw", block_sizes=(16,), num_kv_heads=2)
LAYERWISE = {"use_layerwise": True}
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


class Recording:
    """A `PoolBackend` wrapper: records calls, can hold puts until released."""

    def __init__(self, inner: MooncakeBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.cond = threading.Condition()
        self.put_gate = threading.Event()
        self.put_gate.set()

    def _log(self, op: str, keys: Sequence[str]) -> None:
        with self.cond:
            self.calls.append((op, tuple(keys)))
            self.cond.notify_all()

    def wait_calls(self, op: str, count: int, timeout_s: float = 10.0) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: sum(c[0] == op for c in self.calls) >= count, timeout_s)

    def count(self, op: str) -> int:
        with self.cond:
            return sum(c[0] == op for c in self.calls)

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        self.inner.register_buffer(ptrs, lengths)

    def exists(self, keys: Sequence[str]) -> list[int]:
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        assert self.put_gate.wait(20)
        self._log("put", keys)
        return self.inner.put(keys, addrs, sizes)

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        out = self.inner.get(keys, addrs, sizes)
        self._log("get", keys)
        return out

    def close(self) -> None:
        self.inner.close()


class Instance:
    def __init__(self, master, kvtools, seed: int, extra: dict[str, object] | None = None) -> None:
        self.cfg = PoolConfig.from_extra({**LAYERWISE, **(extra or {})})
        store = MooncakeStoreConfig.load(master.config(), env={})
        self.backend = Recording(MooncakeBackend(store))
        self.worker = build_worker(SPEC, self.cfg, self.backend)
        self.caches = kvtools.make(num_layers=len(LAYERS), num_blocks=16, seed=seed)
        self.worker.register_kv_caches(self.caches, 16)
        self.scheduler = build_scheduler(SPEC, self.cfg, self.worker.safe_lookup)

    def layer_block(self, layer: int, block: int) -> bytes:
        k, v = self.caches[LAYERS[layer]]
        return k[block].numpy().tobytes() + v[block].numpy().tobytes()

    def close(self) -> None:
        self.worker.close()


def prefill(inst: Instance, req_id: str, prompt: list[int], blocks: list[int]) -> int:
    need, is_async = inst.scheduler.get_num_new_matched_tokens(req_id, prompt, len(prompt), 0)
    assert not is_async
    inst.scheduler.update_state_after_alloc(req_id, [blocks], need)
    meta = inst.scheduler.build_meta(StepInput(new=[NewRequest(req_id, prompt, [blocks], need, len(prompt) - need)]))
    inst.worker.start_load_kv(meta)
    for name in LAYERS:
        inst.worker.wait_for_layer_load(name)
        inst.worker.save_kv_layer(name)
    inst.worker.wait_for_save(meta)
    inst.worker.drain(20)
    return need


def test_layer_objects_round_trip_between_instances(long_lease_master, kvtools) -> None:
    a, b = Instance(long_lease_master, kvtools, 1), Instance(long_lease_master, kvtools, 2)
    try:
        prompt = list(range(9000, 9070))  # 4 whole chunks
        assert prefill(a, "a", prompt, [1, 2, 3, 4, 5]) == 0
        assert a.worker.stats.saved_keys == 4 * len(LAYERS)
        assert all("@layer_id:" in k and "@pp_rank:0@" in k for _, keys in a.backend.calls for k in keys)
        blocks = [9, 10, 11, 12, 13]
        assert prefill(b, "b", prompt, blocks) == 64
        assert b.worker.get_block_ids_with_load_errors() == set()
        for layer in range(len(LAYERS)):
            for src, dst in zip([1, 2, 3, 4], blocks[:4], strict=True):
                assert b.layer_block(layer, dst) == a.layer_block(layer, src)
        assert b.worker.stats.saved_keys == 0  # everything it holds was already pooled
    finally:
        a.close()
        b.close()


def test_loads_prefetch_and_saves_do_not_block(long_lease_master, kvtools) -> None:
    a, b = Instance(long_lease_master, kvtools, 3), Instance(long_lease_master, kvtools, 4)
    try:
        prompt = list(range(7000, 7064))
        need, _ = a.scheduler.get_num_new_matched_tokens("a", prompt, 64, 0)
        meta = a.scheduler.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3, 4]], 0, 64)]))
        a.backend.put_gate.clear()  # the store is slow: no put completes until released
        a.worker.start_load_kv(meta)
        for name in LAYERS:
            a.worker.wait_for_layer_load(name)
            a.worker.save_kv_layer(name)  # returns although the put is held
        a.worker.wait_for_save(meta)
        assert a.backend.count("put") == 0
        assert a.worker.get_finished(set())[0] == set()
        a.backend.put_gate.set()
        a.worker.drain(20)
        assert a.backend.count("put") == len(LAYERS)

        need, _ = b.scheduler.get_num_new_matched_tokens("b", prompt, 64, 0)
        assert need == 63
        b.scheduler.update_state_after_alloc("b", [[5, 6, 7, 8]], need)
        meta = b.scheduler.build_meta(StepInput(new=[NewRequest("b", prompt, [[5, 6, 7, 8]], 63, 1)]))
        b.worker.start_load_kv(meta)  # submits layer 0
        for layer, name in enumerate(LAYERS):
            b.worker.wait_for_layer_load(name)  # submits layer+1 first, then waits for layer
            assert b.layer_block(layer, 8) == a.layer_block(layer, 4)  # this layer is complete now
            if layer + 1 < len(LAYERS):
                # layer+1 is loaded while layer "computes", before anybody waits for it
                assert b.backend.wait_calls("get", layer + 2)
            b.worker.save_kv_layer(name)
        b.worker.wait_for_save(meta)
        assert b.worker.get_block_ids_with_load_errors() == set()
    finally:
        a.backend.put_gate.set()
        a.close()
        b.close()


def test_missing_layer_object_is_a_miss_and_a_load_error(long_lease_master, kvtools) -> None:
    from mooncake.store import MooncakeDistributedStore

    a, b = Instance(long_lease_master, kvtools, 5), Instance(long_lease_master, kvtools, 6)
    admin = MooncakeDistributedStore()
    assert admin.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", long_lease_master.address) == 0
    try:
        prompt = list(range(3000, 3064))
        prefill(a, "a", prompt, [1, 2, 3, 4])
        hashes = a.scheduler.hashes_for(prompt)[1]
        meta0 = SPEC.key_metadata()[0]
        need, _ = b.scheduler.get_num_new_matched_tokens("b", prompt, 64, 0)
        assert need == 63
        # evicted between lookup and load: layer 2 of chunk 1 -> exactly that chunk's block fails
        assert admin.remove(meta0.layer_key(hashes[1], 2), True) == 0
        b.scheduler.update_state_after_alloc("b", [[5, 6, 7, 8]], need)
        meta = b.scheduler.build_meta(StepInput(new=[NewRequest("b", prompt, [[5, 6, 7, 8]], 63, 1)]))
        b.worker.start_load_kv(meta)
        for name in LAYERS:
            b.worker.wait_for_layer_load(name)
        b.worker.wait_for_save(meta)
        assert b.worker.get_block_ids_with_load_errors() == {6}
        # a later lookup stops before the chunk with a missing layer
        assert b.scheduler.get_num_new_matched_tokens("c", prompt, 64, 0)[0] == 16
    finally:
        admin.close()
        a.close()
        b.close()


def test_layerwise_config_rules(kvtools) -> None:
    assert PoolConfig.from_extra(LAYERWISE).async_loads is False
    assert PoolConfig.from_extra({**LAYERWISE, "load_async": True}).async_loads is False
    gva = PoolConfig.from_extra({**LAYERWISE, "backend": "memcache"})  # the GVA path: prefetch 8 by default
    assert gva.layerwise_prefetch_layers == 8 and gva.layerwise_options(4).tp_size == 4
    with pytest.raises(ConfigError, match="layerwise_num_shared_buffers"):
        PoolConfig.from_extra({**LAYERWISE, "layerwise_num_shared_buffers": 2})  # reuse is a memcache feature
    with pytest.raises(ConfigError, match="layerwise_independent_layers"):
        PoolConfig.from_extra({**LAYERWISE, "layerwise_independent_layers": "first"})
    with pytest.raises(ConfigError, match="layerwise_prefetch_layers"):
        PoolConfig.from_extra({**LAYERWISE, "layerwise_prefetch_layers": 0})
    two_groups = PoolSpec(model="m", block_sizes=(16, 16), num_kv_heads=2)
    with pytest.raises(ConfigError, match="use_layerwise"):
        build_worker(two_groups, PoolConfig.from_extra(LAYERWISE), InMemoryBackend())


def test_load_only_consumer_advances_layers(kvtools) -> None:
    """Upstream advanced the layer index only in save_kv_layer; here the name decides."""
    backend = InMemoryBackend()
    producer = build_worker(SPEC, PoolConfig.from_extra(LAYERWISE), backend)
    consumer_cfg = PoolConfig.from_extra({**LAYERWISE, "consumer_is_to_load": True}, kv_role="kv_consumer")
    consumer = build_worker(SPEC, consumer_cfg, backend)
    try:
        src, dst = kvtools.make(num_layers=3, num_blocks=8, seed=7), kvtools.make(num_layers=3, num_blocks=8, seed=8)
        producer.register_kv_caches(src, 8)
        consumer.register_kv_caches(dst, 8)
        prompt = list(range(48))
        sp = build_scheduler(SPEC, producer_cfg := PoolConfig.from_extra(LAYERWISE), producer.safe_lookup)
        assert producer_cfg.use_layerwise
        sp.get_num_new_matched_tokens("p", prompt, 48, 0)
        meta = sp.build_meta(StepInput(new=[NewRequest("p", prompt, [[1, 2, 3]], 0, 48)]))
        producer.start_load_kv(meta)
        for name in src:
            producer.wait_for_layer_load(name)
            producer.save_kv_layer(name)
        producer.wait_for_save(meta)
        producer.drain(10)
        assert len(backend.stored_keys()) == 9
        sc = build_scheduler(SPEC, consumer_cfg, consumer.safe_lookup)
        need, _ = sc.get_num_new_matched_tokens("c", prompt, 48, 0)
        sc.update_state_after_alloc("c", [[4, 5, 6]], need)
        meta = sc.build_meta(StepInput(new=[NewRequest("c", prompt, [[4, 5, 6]], need, 48 - need)]))
        consumer.start_load_kv(meta)
        for name in dst:  # a load-only consumer never calls save_kv_layer
            consumer.wait_for_layer_load(name)
        consumer.wait_for_save(meta)
        for name in src:
            for s, d in zip([1, 2, 3], [4, 5, 6], strict=True):
                assert dst[name][0][d].equal(src[name][0][s]) and dst[name][1][d].equal(src[name][1][s])
    finally:
        producer.close()
        consumer.close()


def test_a_late_layer_is_reported_not_waited_for(kvtools) -> None:
    class SlowGets(InMemoryBackend):
        def __init__(self) -> None:
            super().__init__()
            self.gate = threading.Event()

        def get(self, keys, addrs, sizes):  # type: ignore[no-untyped-def]
            assert self.gate.wait(20)
            return super().get(keys, addrs, sizes)

    backend = SlowGets()
    cfg = PoolConfig.from_extra(LAYERWISE)
    w = build_worker(SPEC, cfg, backend, waits=WorkerWaits(step_load_s=0.3))
    try:
        w.register_kv_caches(kvtools.make(num_layers=2, num_blocks=8), 8)
        sched = build_scheduler(SPEC, cfg, w.safe_lookup)
        prompt = list(range(32))
        sched.get_num_new_matched_tokens("a", prompt, 32, 0)
        meta = sched.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2]], 0, 32)]))
        backend.gate.set()
        w.start_load_kv(meta)
        for name in ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"):
            w.wait_for_layer_load(name)
            w.save_kv_layer(name)
        w.wait_for_save(meta)
        w.drain(10)
        backend.gate.clear()  # the store stalls from now on
        need, _ = sched.get_num_new_matched_tokens("b", prompt, 32, 0)
        sched.update_state_after_alloc("b", [[3, 4]], need)
        meta = sched.build_meta(StepInput(new=[NewRequest("b", prompt, [[3, 4]], need, 32 - need)]))
        w.start_load_kv(meta)
        t0 = time.monotonic()
        w.wait_for_layer_load("model.layers.0.self_attn.attn")
        assert time.monotonic() - t0 < 5
        assert w.get_block_ids_with_load_errors() == {3, 4}
    finally:
        backend.gate.set()
        w.close()


def test_kv_events_once_per_chunk_when_its_last_layer_is_stored(kvtools) -> None:
    cfg = PoolConfig.from_extra(LAYERWISE, kv_events=True)
    w = build_worker(SPEC, cfg, InMemoryBackend())
    try:
        w.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8), 8)
        sched = build_scheduler(SPEC, cfg, w.safe_lookup)
        prompt = list(range(40, 88))
        sched.get_num_new_matched_tokens("e", prompt, 48, 0)
        meta = sched.build_meta(StepInput(new=[NewRequest("e", prompt, [[1, 2, 3]], 0, 48)]))
        w.start_load_kv(meta)
        for i in range(3):
            w.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
            w.save_kv_layer(f"model.layers.{i}.self_attn.attn")
        w.wait_for_save(meta)
        w.drain(10)
        events = w.events.drain()
        hashes = sched.hashes_for(prompt)[1]
        assert [e.block_hash for e in events] == hashes[:3]
        assert [e.token_ids for e in events] == [tuple(prompt[i : i + 16]) for i in (0, 16, 32)]
        assert events[1].parent_block_hash == hashes[0]
    finally:
        w.close()
