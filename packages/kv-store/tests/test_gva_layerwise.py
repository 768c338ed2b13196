"""The memcache GVA layer-wise path on CPU: `MemcacheBackend` over `HostGvaStore` (memcache's native API).

Instance A saves a prompt layer by layer into one global object per block; instance B finds it
through the GVA keys and copies each layer back, byte-exact. Objects stay invisible until their
last layer was copied; leases, copy windows, packets, the attention gate and failed copies are
checked through what users see: bytes, load errors and what the store holds.
"""

from __future__ import annotations

import ctypes
import time

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.transfer_stats import TransferStats
from ascend_dist.kv_store import NewRequest, PoolConfig, PoolSpec, StepInput, build_scheduler, build_worker
from ascend_dist.kv_store.backends.gva import G2L, L2G, UNMATCHED_STATE, GvaBackend
from ascend_dist.kv_store.backends.host_gva import HostGvaStore
from ascend_dist.kv_store.backends.memcache import MemcacheBackend
from ascend_dist.kv_store.keys.keys import gva_block_key
from ascend_dist.kv_store.scheduler.scheduler import RunningRequest
from ascend_dist.kv_store.transfer.gate import current_gate
from ascend_dist.kv_store.transfer.gva_layerwise import GvaLayerwiseTransfers
from ascend_dist.kv_store.transfer.strategy import LayerwiseStrategy

SPEC = PoolSpec(model="tiny-gva", block_sizes=(16,), num_kv_heads=2)
GVA = {"use_layerwise": True, "backend": "memcache"}
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


class FailingCopies(HostGvaStore):
    """Our reference store with copies in one direction failing (a device copy error)."""

    def __init__(self, fail_direction: int) -> None:
        super().__init__(4 << 20)
        self.fail_direction = fail_direction

    def batch_copy(self, gvas: list[int], addrs: list[int], sizes: list[int], direction: int) -> int:
        return -1 if direction == self.fail_direction else super().batch_copy(gvas, addrs, sizes, direction)


def _pair(store: HostGvaStore, extra: dict | None = None):  # type: ignore[no-untyped-def]
    cfg = PoolConfig.from_extra({**GVA, **(extra or {})})
    workers = [
        build_worker(SPEC, cfg, MemcacheBackend(store_factory=lambda: store), transfer_stats=TransferStats("pool"))
        for _ in range(2)
    ]
    return cfg, workers


def _take(worker):  # type: ignore[no-untyped-def]
    assert worker.stats.transfer is not None
    return worker.stats.transfer.take()


def _run_layers(worker, meta, *, layers=LAYERS, save=True) -> None:  # type: ignore[no-untyped-def]
    worker.start_load_kv(meta)
    for name in layers:
        worker.wait_for_layer_load(name)
        if save:
            worker.save_kv_layer(name)
    worker.wait_for_save(meta)


def _save(cfg, worker, prompt, blocks, req="a") -> None:  # type: ignore[no-untyped-def]
    sched = build_scheduler(SPEC, cfg, worker.safe_lookup)
    sched.get_num_new_matched_tokens(req, prompt, len(prompt), 0)
    _run_layers(worker, sched.build_meta(StepInput(new=[NewRequest(req, prompt, [blocks], 0, len(prompt))])))
    worker.drain(10)


def _load(cfg, worker, prompt, blocks, req="b"):  # type: ignore[no-untyped-def]
    sched = build_scheduler(SPEC, cfg, worker.safe_lookup)
    need, _ = sched.get_num_new_matched_tokens(req, prompt, len(prompt), 0)
    sched.update_state_after_alloc(req, [blocks], need)
    meta = sched.build_meta(StepInput(new=[NewRequest(req, prompt, [blocks], need, len(prompt) - need)]))
    return need, meta


def test_host_store_publishes_only_finished_objects() -> None:
    store = HostGvaStore(1 << 16)
    be = MemcacheBackend(store_factory=lambda: store)
    assert isinstance(be, GvaBackend)
    src, dst = bytearray(b"x" * 64 + b"y" * 64), bytearray(128)
    s_addr, d_addr = (ctypes.addressof((ctypes.c_char * 128).from_buffer(buf)) for buf in (src, dst))
    (gva,) = be.alloc(["k"], [128])
    assert gva > 0 and be.alloc(["k"], [128]) == [-1]  # an existing key is never re-reserved
    assert be.key_info(["k"]) == [(0, 0)] and be.add_lease(["k"], 1000) == [UNMATCHED_STATE]
    assert be.copy([gva, gva + 64], [s_addr, s_addr + 64], [64, 64], L2G) == 0
    assert be.write_finish(["k"], [0]) == [0] and be.key_info(["k"]) == [(128, gva)]
    assert be.copy([gva], [d_addr], [128], G2L) == 0 and bytes(dst) == bytes(src)
    assert be.add_lease(["k"], 60_000) == [0] and store.evict(["k"]) == []  # a leased object stays
    assert be.remove_lease(["k"]) == 0 and store.evict(["k"]) == ["k"] and be.key_info(["k"]) == [(0, 0)]
    (g2,) = be.alloc(["bad"], [8])
    assert be.write_finish(["bad"], [-1]) == [0] and be.exists(["bad"]) == [0]  # a failed write is dropped
    assert be.copy([g2 + (1 << 20)], [d_addr], [8], G2L) == -2  # outside global memory: refused, not copied
    assert be.put(["whole"], [[s_addr, s_addr + 64]], [[64, 64]]) == [0]
    assert be.get(["whole", "none"], [[d_addr]] * 2, [[128]] * 2) == [0, UNMATCHED_STATE]


def test_save_then_load_layer_by_layer_is_byte_exact(kvtools) -> None:
    store = HostGvaStore(4 << 20)
    cfg, (a, b) = _pair(store, {"layerwise_max_transfer_blocks": 1, "layerwise_max_transfer_bytes": 200})
    try:
        assert isinstance(a.transfers, LayerwiseStrategy) and isinstance(a.transfers.layers, GvaLayerwiseTransfers)
        src = kvtools.make(num_layers=3, num_blocks=8, seed=1)
        dst = kvtools.make(num_layers=3, num_blocks=8, seed=2)
        a.register_kv_caches(src, 8)
        b.register_kv_caches(dst, 8)
        prompt = list(range(50))
        _save(cfg, a, prompt, [1, 2, 3, 4])
        keys = [
            gva_block_key("tiny-gva", h, 0) for h in build_scheduler(SPEC, cfg, a.safe_lookup).hashes_for(prompt)[1]
        ]
        assert store.batch_is_exist(keys) == [1, 1, 1] and a.stats.saved_keys == 3
        copies = store.copies
        need, meta = _load(cfg, b, prompt, [5, 6, 7, 0])
        assert need == 48
        _run_layers(b, meta, save=False)
        assert b.get_block_ids_with_load_errors() == set()
        assert [kvtools.block_bytes(dst, blk) for blk in (5, 6, 7)] == [
            kvtools.block_bytes(src, blk) for blk in (1, 2, 3)
        ]
        # one window per block and layer, each piece (256 B) split into two packets: 3 blocks x 3 layers
        assert store.copies - copies == 9 and b.stats.loaded_keys == 3
        saved, loaded = _take(a), _take(b)
        assert saved is not None and loaded is not None and not saved.failures and not loaded.failures
        assert {t.direction for t in saved.transfers} == {"save"} and {t.direction for t in loaded.transfers} == {
            "load"
        }
        assert sum(t.nbytes for t in saved.transfers) == sum(len(kvtools.block_bytes(src, x)) for x in (1, 2, 3))
        assert sum(t.nbytes for t in loaded.transfers) == sum(len(kvtools.block_bytes(dst, x)) for x in (5, 6, 7))
        # one call per copy window (9): its K and V pieces (512 B each) in packets of at most 200 B: 3 + 3
        assert [(t.nbytes, t.descriptors) for t in loaded.transfers] == [(1024, 6)] * 9
        assert store.evict(keys) == keys  # every read lease was released after the last layer
    finally:
        a.close()
        b.close()


def test_objects_stay_invisible_until_the_last_layer_and_are_dropped_if_it_never_comes(kvtools) -> None:
    store = HostGvaStore(4 << 20)
    cfg, (a, b) = _pair(store)
    try:
        a.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8), 8)
        b.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8, seed=3), 8)
        prompt = list(range(40))
        sched = build_scheduler(SPEC, cfg, a.safe_lookup)
        sched.get_num_new_matched_tokens("a", prompt, 40, 0)
        meta = sched.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3]], 0, 40)]))
        _run_layers(a, meta, layers=LAYERS[:2])  # the step ends before the last layer was saved
        a.drain(10)
        assert _load(cfg, b, prompt, [4, 5, 6])[0] == 0  # half-written objects are never a hit
        a.start_load_kv(sched.build_meta(StepInput()))  # the next step drops them
        a.drain(10)
        assert store.batch_alloc([gva_block_key("tiny-gva", sched.hashes_for(prompt)[1][0], 0)], [8])[0] > 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("failing", ["evicted", "load-copy", "save-copy"])
def test_failures_become_exact_load_errors_or_unpublished_objects(kvtools, failing: str) -> None:
    store = FailingCopies(G2L if failing == "load-copy" else L2G if failing == "save-copy" else -1)
    cfg, (a, b) = _pair(store)
    try:
        a.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8), 8)
        b_caches = kvtools.make(num_layers=3, num_blocks=8, seed=4)
        b.register_kv_caches(b_caches, 8)
        prompt = list(range(48))
        _save(cfg, a, prompt, [1, 2, 3])
        need, meta = _load(cfg, b, prompt, [4, 5, 6])
        if failing == "save-copy":
            assert need == 0 and a.stats.saved_keys == 0  # nothing half-written was published
            saved = _take(a)
            assert saved is not None and not [t for t in saved.transfers if t.direction == "save"]  # no bytes
            assert {(f.direction, f.kind.value) for f in saved.failures} == {("save", "other")}  # the copy's -1
            return
        assert need == 47
        if failing == "evicted":  # gone between the lookup and the load
            store.evict(
                [
                    gva_block_key("tiny-gva", h, 0)
                    for h in build_scheduler(SPEC, cfg, a.safe_lookup).hashes_for(prompt)[1][1:]
                ]
            )
        _run_layers(b, meta, save=False)
        assert b.get_block_ids_with_load_errors() == ({5, 6} if failing == "evicted" else {4, 5, 6})
        loaded = _take(b)
        assert loaded is not None
        moved = sum(t.nbytes for t in loaded.transfers)
        kinds = {(f.kind.value, f.count) for f in loaded.failures}
        if failing == "evicted":  # two objects gone before their lease; the first block's 3 layers moved
            assert kinds == {("lease_expired", 2)} and moved == len(kvtools.block_bytes(b_caches, 4))
        else:  # every copy failed: failures of every block, no bytes
            assert {k for k, _ in kinds} == {"other"} and moved == 0
    finally:
        a.close()
        b.close()


def test_prefetched_loads_wait_for_the_attention_gate(kvtools) -> None:
    store = HostGvaStore(4 << 20)
    cfg, (a, b) = _pair(store, {"layerwise_attention_gate": True, "layerwise_prefetch_layers": 2})
    try:
        a.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8), 8)
        b.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8, seed=5), 8)
        prompt = list(range(33))
        _save(cfg, a, prompt, [1, 2, 3])
        need, meta = _load(cfg, b, prompt, [4, 5, 6])
        b.start_load_kv(meta)  # layer 0 loads at once; layer 1 waits for layer 0's attention
        b.wait_for_layer_load(LAYERS[0])
        copies = store.copies
        time.sleep(0.3)
        assert store.copies == copies  # no copy of a later layer before attention started
        current_gate().record()
        b.wait_for_layer_load(LAYERS[1])
        assert store.copies > copies
        current_gate().record()
        b.wait_for_layer_load(LAYERS[2])
        b.wait_for_save(meta)
        assert need == 32 and b.get_block_ids_with_load_errors() == set()
    finally:
        a.close()
        b.close()


def test_layers_sharing_a_buffer_reload_their_prefix_every_step(kvtools) -> None:
    """Layers 1 and 2 share one buffer (S=1): each step they find their own whole prefix
    in it when their turn comes, reloaded from the pool (whole blocks and last step's partial block),
    and layer 2's load waits until layer 1's KV was saved out of the buffer."""
    store = HostGvaStore(8 << 20)
    cfg = PoolConfig.from_extra({**GVA, "layerwise_num_shared_buffers": 1})
    worker = build_worker(SPEC, cfg, MemcacheBackend(store_factory=lambda: store))
    own = kvtools.make(num_layers=2, num_blocks=8, seed=1)
    caches = {LAYERS[0]: own[LAYERS[0]], LAYERS[1]: own[LAYERS[1]], LAYERS[2]: own[LAYERS[1]]}  # 1 and 2 share
    blocks = [1, 2, 3]
    seen: list[bool] = []

    def value(layer: int, pos: int, part: int) -> float:
        return float(layer * 100 + pos + part / 4)

    def compute(layer: int, start: int, end: int) -> None:
        for pos in range(start, end):
            for part, tensor in enumerate(caches[LAYERS[layer]]):
                tensor[blocks[pos // 16], pos % 16].fill_(value(layer, pos, part))

    def holds(layer: int, end: int) -> bool:
        return all(
            float(tensor[blocks[pos // 16], pos % 16, 0, 0]) == value(layer, pos, part)
            for pos in range(end)
            for part, tensor in enumerate(caches[LAYERS[layer]])
        )

    def step(meta, start: int, end: int) -> None:  # type: ignore[no-untyped-def]
        worker.start_load_kv(meta)
        for layer, name in enumerate(LAYERS):
            worker.wait_for_layer_load(name)
            seen.append(holds(layer, start))  # this layer's whole prefix is in its buffer now
            compute(layer, start, end)
            worker.save_kv_layer(name)
        worker.wait_for_save(meta)

    try:
        worker.register_kv_caches(caches, 8)
        sched = build_scheduler(SPEC, cfg, worker.safe_lookup)
        prompt = list(range(20))
        assert sched.get_num_new_matched_tokens("r", prompt, 20, 0) == (0, False)
        sched.update_state_after_alloc("r", [blocks[:2]], 0)
        step(sched.build_meta(StepInput(new=[NewRequest("r", prompt, [blocks[:2]], 0, 20)])), 0, 20)
        step(sched.build_meta(StepInput(running=[RunningRequest("r", list(range(20, 33)), [[3]], 20)])), 20, 33)
        step(sched.build_meta(StepInput(running=[RunningRequest("r", [33], None, 33)])), 33, 34)
        assert seen == [True] * 9 and worker.get_block_ids_with_load_errors() == set()
        assert not holds(1, 34)  # the buffer holds layer 2 now: layer 1 really lived in the pool in between
    finally:
        worker.close()


def test_shared_buffers_need_a_rank_that_saves(kvtools) -> None:
    cfg = PoolConfig.from_extra(
        {**GVA, "layerwise_num_shared_buffers": 1, "consumer_is_to_load": True}, kv_role="kv_consumer"
    )
    worker = build_worker(SPEC, cfg, MemcacheBackend(store_factory=lambda: HostGvaStore(1 << 16)))
    try:
        with pytest.raises(ConfigError, match="layerwise_num_shared_buffers"):
            worker.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8), 8)
    finally:
        worker.close()


class RaisingLoadCopies(HostGvaStore):
    """Our reference store whose load copies raise once ``raise_loads`` is set (an unexpected device error)."""

    def __init__(self) -> None:
        super().__init__(4 << 20)
        self.raise_loads = False

    def batch_copy(self, gvas: list[int], addrs: list[int], sizes: list[int], direction: int) -> int:
        if direction == G2L and self.raise_loads:
            raise RuntimeError("device copy error")
        return super().batch_copy(gvas, addrs, sizes, direction)


@pytest.mark.parametrize("raising", [True, False])
def test_read_leases_are_released_when_a_load_copy_raises(kvtools, raising: bool) -> None:
    store = RaisingLoadCopies()
    cfg, (a, b) = _pair(store)
    try:
        a.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8), 8)
        b.register_kv_caches(kvtools.make(num_layers=3, num_blocks=8, seed=9), 8)
        prompt = list(range(40))
        _save(cfg, a, prompt, [1, 2, 3])
        keys = [
            gva_block_key("tiny-gva", h, 0) for h in build_scheduler(SPEC, cfg, a.safe_lookup).hashes_for(prompt)[1]
        ]
        store.raise_loads = raising  # control (False): the same load copies and releases normally
        need, meta = _load(cfg, b, prompt, [4, 5, 6])
        assert need == 32 and len(keys) == 2
        _run_layers(b, meta, save=False)
        b.drain(10)
        assert store.evict(keys) == keys  # no read lease left behind, whatever the copies did
    finally:
        a.close()
        b.close()


def test_a_block_whose_load_failed_this_step_is_never_saved(kvtools) -> None:
    """x's load of chunks 1-2 fails (evicted after x's lookup); y, in the same step, hit x's blocks in
    vLLM's prefix cache and plans saves of chunks 1-3 from them (its own lookup saw only chunk 0).
    Blocks 5 and 6 hold no chunk: no object of theirs may be published; chunk 3 (block 7) still is.

    Control: before the fix the store ended up holding B's unwritten bytes under chunks 1 and 2.
    """
    store = HostGvaStore(4 << 20)
    cfg, (a, b) = _pair(store)
    try:
        src = kvtools.make(num_layers=3, num_blocks=8, seed=1)
        dst = kvtools.make(num_layers=3, num_blocks=8, seed=5)
        a.register_kv_caches(src, 8)
        b.register_kv_caches(dst, 8)
        prompt = list(range(48))
        _save(cfg, a, prompt, [1, 2, 3])
        longer = prompt + list(range(100, 116))  # y: x's 3 chunks and one of its own
        sched = build_scheduler(SPEC, cfg, b.safe_lookup)
        hashes = sched.hashes_for(longer)[1]
        need, _ = sched.get_num_new_matched_tokens("x", prompt, 48, 0)
        sched.update_state_after_alloc("x", [[4, 5, 6]], need)
        evicted = [gva_block_key("tiny-gva", h, 0) for h in hashes[1:3]]
        assert store.evict(evicted) == evicted  # gone between x's lookup and its load
        assert sched.get_num_new_matched_tokens("y", longer, 64, 48) == (0, False)
        sched.update_state_after_alloc("y", [[4, 5, 6, 7]], 0)
        meta = sched.build_meta(
            StepInput(new=[NewRequest("x", prompt, [[4, 5, 6]], need, 48 - need),
                           NewRequest("y", longer, [[4, 5, 6, 7]], 48, 16)])
        )  # fmt: skip
        (y,) = [r for r in meta.requests if r.req_id == "y"]
        assert y.can_save and y.save_start_token <= 16  # control: y plans saves from blocks 5 and 6
        _run_layers(b, meta)
        b.drain(10)
        assert b.get_block_ids_with_load_errors() == {5, 6}
        assert store.batch_is_exist(evicted) == [0, 0]  # never B's unwritten blocks under chunks 1-2
        assert store.batch_is_exist([gva_block_key("tiny-gva", hashes[3], 0)]) == [1]  # y's own chunk saved
        assert b.stats.unwritten_skipped == 2
    finally:
        a.close()
        b.close()
