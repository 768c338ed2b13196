"""Saves that never keep bytes vLLM may have reused, and failed puts that are retried (issue 21 faults 1, 7).

A preempted request's blocks may be given to another request in the very step that preempts it.
The worker waits (bounded) for the request's pending saves; past that deadline the saves are
cancelled: a queued save never reads the blocks, and a put already in flight is waited for before
the forward pass (``bind_step``), so it only copies the original bytes. Past that second deadline
(`WorkerWaits.fence_s`) the step fails with `DeadlineExceeded`, and the keys that put stored are
removed once it returns. Fakes of our own `PoolBackend` Protocol (an `InMemoryBackend` whose put
is held or fails once, recording every value it ever held) are injected through the worker's
constructor; the "forward pass" that reuses the blocks is a write into the CPU caches.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.kv_store import (
    InMemoryBackend,
    NewRequest,
    PoolConfig,
    PoolSpec,
    RunningRequest,
    StepInput,
    build_scheduler,
    build_worker,
)
from ascend_dist.kv_store.assembly import WorkerWaits
from ascend_dist.kv_store.step_metadata import PoolStepMeta

SPEC = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2)
REUSED = np.full(8, 7.0, dtype=np.float16).tobytes()  # what the next forward writes into reused blocks


class HeldPuts(InMemoryBackend):
    """Puts wait for ``release``; every key a put was asked for is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.in_put = threading.Event()
        self.asked: list[str] = []
        self.held: list[tuple[str, bytes]] = []

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        self.asked.extend(keys)
        self.in_put.set()
        assert self.release.wait(20)
        codes = super().put(keys, addrs, sizes)
        with self._lock:  # every (key, bytes) the store ever held, visible to any reader until removed
            self.held.extend((k, self._objects[k]) for k in keys if k in self._objects)
        return codes

    def values(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._objects)


def _worker(backend: InMemoryBackend, spec: PoolSpec = SPEC, **waits: float):  # type: ignore[no-untyped-def]
    return build_worker(spec, PoolConfig.from_extra({}), backend, waits=WorkerWaits(**waits))


def _step(sched, req: str, prompt: list[int], blocks: list[int]) -> PoolStepMeta:  # type: ignore[no-untyped-def]
    sched.get_num_new_matched_tokens(req, prompt, len(prompt), 0)
    return sched.build_meta(StepInput(new=[NewRequest(req, prompt, [blocks], 0, len(prompt))]))


def _reuse(caches, blocks: list[int]) -> None:  # type: ignore[no-untyped-def]
    """The forward pass writes another request's KV into ``blocks``."""
    for k, v in caches.values():
        for b in blocks:
            k[b].fill_(7.0)
            v[b].fill_(7.0)


@pytest.mark.parametrize("preempt", [True, False])
def test_a_put_still_in_flight_at_the_fence_deadline_fails_the_step_and_keeps_nothing(kvtools, preempt: bool) -> None:
    """Both deadlines pass with the put in flight: ``bind_step`` raises (no forward pass), its keys are dropped."""
    backend = HeldPuts()
    w = _worker(backend, preempt_s=0.2, fence_s=0.2)
    try:
        caches = kvtools.make(num_blocks=8)
        w.register_kv_caches(caches, 8)
        sched = build_scheduler(SPEC, PoolConfig.from_extra({}), lambda *_: 0)
        w.wait_for_save(_step(sched, "r", list(range(32)), [1, 2]))
        assert backend.in_put.wait(10)  # the put reads r's blocks 1, 2 ...
        original = {kvtools.block_bytes(caches, b) for b in (1, 2)}
        if preempt:  # ... when r is preempted: both waits give up, the step must not run
            with pytest.raises(DeadlineExceeded, match="still read their blocks"):
                w.bind_step(PoolStepMeta(preempted_req_ids=frozenset({"r"})))
        backend.release.set()
        w.drain(10)
        stored = backend.values()
        assert len(backend.asked) == 2
        if preempt:
            assert set(backend.asked).isdisjoint(stored)  # r's keys were dropped once the put returned
            assert w.stats.dropped_keys == 2
        else:  # control: the same put, nobody reuses the blocks: both chunks stored byte-exact
            assert set(stored) == set(backend.asked)
            assert set(stored.values()) == original
    finally:
        backend.release.set()
        w.close()


def test_the_store_never_holds_bytes_of_reused_blocks(kvtools) -> None:
    """The preemption deadline passes with a put in flight: the forward pass must not run until it returned.

    The put returns 0.5 s after the preemption's 0.2 s deadline; the test's "forward pass" reuses the
    blocks as soon as ``bind_step`` returns. Had ``bind_step`` returned before the put copied the
    blocks, the fake's record would hold reused bytes (readable by any instance until removed).
    """
    backend = HeldPuts()
    w = _worker(backend, preempt_s=0.2, fence_s=10)
    try:
        caches = kvtools.make(num_blocks=8)
        w.register_kv_caches(caches, 8)
        sched = build_scheduler(SPEC, PoolConfig.from_extra({}), lambda *_: 0)
        w.wait_for_save(_step(sched, "r", list(range(32)), [1, 2]))
        assert backend.in_put.wait(10)
        original = {kvtools.block_bytes(caches, b) for b in (1, 2)}
        release = threading.Timer(0.5, backend.release.set)
        release.start()
        w.bind_step(PoolStepMeta(preempted_req_ids=frozenset({"r"})))
        _reuse(caches, [1, 2])  # the step's forward pass
        backend.release.set()
        release.join(5)
        w.drain(10)
        assert len(backend.held) == 2 and not any(REUSED in value for _, value in backend.held)
        assert set(backend.values().values()) == original  # read before the forward: kept, byte-exact
        assert w.stats.dropped_keys == 0
    finally:
        backend.release.set()
        w.close()


def test_no_kv_event_for_a_dropped_key(kvtools) -> None:
    backend = HeldPuts()
    waits = WorkerWaits(preempt_s=0.2, fence_s=0.2)
    w = build_worker(SPEC, PoolConfig.from_extra({}, kv_events=True), backend, waits=waits)
    try:
        w.register_kv_caches(kvtools.make(num_blocks=8), 8)
        sched = build_scheduler(SPEC, PoolConfig.from_extra({}, kv_events=True), lambda *_: 0)
        w.wait_for_save(_step(sched, "r", list(range(32)), [1, 2]))
        assert backend.in_put.wait(10)
        with pytest.raises(DeadlineExceeded):
            w.bind_step(PoolStepMeta(preempted_req_ids=frozenset({"r"})))
        backend.release.set()
        w.drain(10)
        assert backend.values() == {} and w.events.drain() == []  # dropped: consumers never hear of it
    finally:
        backend.release.set()
        w.close()


def test_a_queued_save_of_a_preempted_request_never_reads_its_blocks(kvtools) -> None:
    backend = HeldPuts()
    w = _worker(backend, preempt_s=0.2)
    try:
        caches = kvtools.make(num_blocks=8)
        w.register_kv_caches(caches, 8)
        sched = build_scheduler(SPEC, PoolConfig.from_extra({}), lambda *_: 0)
        w.wait_for_save(_step(sched, "q", list(range(32)), [1, 2]))  # q's put is held ...
        assert backend.in_put.wait(10)
        w.wait_for_save(_step(sched, "r", list(range(100, 132)), [3, 4]))  # ... r's save queued behind it
        w.bind_step(PoolStepMeta(preempted_req_ids=frozenset({"r"})))
        _reuse(caches, [3, 4])
        backend.release.set()
        w.drain(10)
        stored = backend.values()
        assert len(backend.asked) == 2 and set(stored) == set(backend.asked)  # only q's two chunks
        assert not any(REUSED in value for value in stored.values())
        assert w.stats.cancelled_saves == 1
        # r resumes later with fresh jobs: those save normally
        w.wait_for_save(
            _step(build_scheduler(SPEC, PoolConfig.from_extra({}), lambda *_: 0), "r", list(range(200, 216)), [5])
        )
        w.drain(10)
        assert len(backend.values()) == 3
    finally:
        backend.release.set()
        w.close()


def _layerwise_saving(kvtools, backend: HeldPuts, **waits: float):  # type: ignore[no-untyped-def]
    """A layer-wise worker whose layer 0 put (of r's blocks 1, 2) is in flight, layers 1 and 2 queued."""
    cfg = PoolConfig.from_extra({"use_layerwise": True})
    w = build_worker(SPEC, cfg, backend, waits=WorkerWaits(**waits))
    caches = kvtools.make(num_layers=3, num_blocks=8)
    w.register_kv_caches(caches, 8)
    meta = _step(build_scheduler(SPEC, cfg, lambda *_: 0), "r", list(range(32)), [1, 2])
    w.start_load_kv(meta)
    for name in caches:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    w.wait_for_save(meta)
    assert backend.in_put.wait(10)
    return w, caches


def test_layerwise_saves_of_a_preempted_request_never_store_reused_bytes(kvtools) -> None:
    """The preemption's wait gives up; its cancel waits for layer 0's put; layers 1, 2 never read."""
    backend = HeldPuts()
    w, caches = _layerwise_saving(kvtools, backend, preempt_s=0.2, fence_s=10)
    try:
        k, v = caches[next(iter(caches))]
        layer0 = {k[b].numpy().tobytes() + v[b].numpy().tobytes() for b in (1, 2)}
        release = threading.Timer(0.5, backend.release.set)
        release.start()
        w.bind_step(PoolStepMeta(preempted_req_ids=frozenset({"r"})))
        _reuse(caches, [1, 2])  # the step's forward pass
        release.join(5)
        w.drain(10)
        assert len(backend.asked) == 2 and not any(REUSED in value for _, value in backend.held)
        assert set(backend.values().values()) == layer0  # layer 0 kept byte-exact; layers 1, 2 never put
        assert w.stats.dropped_keys == 0
    finally:
        backend.release.set()
        w.close()


def test_layerwise_put_in_flight_past_the_fence_deadline_fails_the_step_and_is_dropped(kvtools) -> None:
    backend = HeldPuts()
    w, _ = _layerwise_saving(kvtools, backend, preempt_s=0.2, fence_s=0.2)
    try:
        with pytest.raises(DeadlineExceeded, match="still read their blocks"):
            w.bind_step(PoolStepMeta(preempted_req_ids=frozenset({"r"})))
        backend.release.set()
        w.drain(10)
        assert len(backend.asked) == 2 and backend.values() == {}  # layer 0 dropped, layers 1, 2 never put
        assert w.stats.dropped_keys == 2
    finally:
        backend.release.set()
        w.close()


def test_the_preempted_wait_still_lets_a_prompt_save_finish(kvtools) -> None:
    """Control for the deadline: a save that ends within it is kept."""
    backend = HeldPuts()
    w = _worker(backend, preempt_s=10)
    try:
        w.register_kv_caches(kvtools.make(num_blocks=8), 8)
        sched = build_scheduler(SPEC, PoolConfig.from_extra({}), lambda *_: 0)
        w.wait_for_save(_step(sched, "r", list(range(32)), [1, 2]))
        assert backend.in_put.wait(10)
        threading.Timer(0.2, backend.release.set).start()
        w.bind_step(PoolStepMeta(preempted_req_ids=frozenset({"r"})))  # waits for the put
        assert len(backend.values()) == 2
    finally:
        backend.release.set()
        w.close()


HYBRID = PoolSpec(
    model="hybrid-swa", block_sizes=(64, 16), num_kv_heads=2, group_kinds=("full", "sliding_window"),
    sliding_windows=(0, 32),
)  # fmt: skip


def _hybrid(kvtools, backend: HeldPuts, **waits: float):  # type: ignore[no-untyped-def]
    w = _worker(backend, HYBRID, **waits)
    full, swa = kvtools.make(num_layers=2, num_blocks=16, block_size=64), kvtools.make(num_blocks=16)
    caches = {"model.layers.0.self_attn.attn": full["model.layers.0.self_attn.attn"],
              "model.layers.1.self_attn.attn": swa["model.layers.1.self_attn.attn"]}  # fmt: skip
    w.register_kv_caches(caches, 16, [["model.layers.0.self_attn.attn"], ["model.layers.1.self_attn.attn"]])
    sched = build_scheduler(HYBRID, PoolConfig.from_extra({}), lambda *_: 0)
    prompt = list(range(500, 628))
    sched.get_num_new_matched_tokens("a", prompt, 128, 0)
    ids = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10]]
    return w, caches, sched.build_meta(StepInput(new=[NewRequest("a", prompt, ids, 0, 128)]))


def test_a_hybrid_steps_save_past_its_deadline_never_stores_reused_bytes(kvtools) -> None:
    """Sliding-window models wait for the step's saves (vLLM frees out-of-window blocks next step)."""
    backend = HeldPuts()
    w, caches, meta = _hybrid(kvtools, backend, compute_s=0.2, fence_s=10)
    try:
        release = threading.Timer(0.5, backend.release.set)
        release.start()
        w.wait_for_save(meta)  # gives up on the saves, then waits for the put in flight
        assert backend.release.is_set()
        _reuse(caches, list(range(1, 11)))  # the next step reuses the freed blocks
        release.join(5)
        w.drain(10)
        assert len(backend.asked) == 6 and len(backend.values()) == 6  # read before the reuse: kept
        assert not any(REUSED in value for _, value in backend.held)
    finally:
        backend.release.set()
        w.close()


def test_a_hybrid_steps_put_past_the_fence_deadline_fails_the_step_and_is_dropped(kvtools) -> None:
    backend = HeldPuts()
    w, _, meta = _hybrid(kvtools, backend, compute_s=0.2, fence_s=0.2)
    try:
        with pytest.raises(DeadlineExceeded, match="a hybrid step's saves"):
            w.wait_for_save(meta)
        backend.release.set()
        w.drain(10)
        assert len(backend.asked) == 6 and backend.values() == {} and w.stats.dropped_keys == 6
    finally:
        backend.release.set()
        w.close()


class FailsFirstPut(InMemoryBackend):
    """The first put of the first key it is asked for fails (-800) and stores nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.victim = ""
        self.failed = 0

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        self.victim = self.victim or keys[0]
        fail = [k == self.victim and not self.failed for k in keys]
        self.failed += sum(fail)
        keep = [i for i, f in enumerate(fail) if not f]
        codes = super().put([keys[i] for i in keep], [addrs[i] for i in keep], [sizes[i] for i in keep])
        out = [-800] * len(keys)
        for i, code in zip(keep, codes, strict=True):
            out[i] = code
        return out

    def values(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self._objects)


def test_a_failed_put_is_retried_with_the_requests_next_save(kvtools) -> None:
    backend = FailsFirstPut()
    cfg = PoolConfig.from_extra({"save_decode_cache": True})
    w = build_worker(SPEC, cfg, backend)
    try:
        caches = kvtools.make(num_blocks=8)
        w.register_kv_caches(caches, 8)
        s = build_scheduler(SPEC, cfg, w.safe_lookup)
        prompt = list(range(20))
        s.get_num_new_matched_tokens("r", prompt, 20, 0)
        w.wait_for_save(s.build_meta(StepInput(new=[NewRequest("r", prompt, [[1, 2]], 0, 20)])))
        w.drain(10)
        assert backend.stored_keys() == [] and backend.failed == 1  # chunk 0's put failed
        for t in range(12):  # decode 20..31: chunk 1 completes at 32 and is saved with chunk 0 again
            w.wait_for_save(
                s.build_meta(StepInput(running=[RunningRequest("r", [100 + t], [[3]] if t == 0 else None, 20 + t)]))
            )
        w.drain(10)
        assert backend.victim in backend.stored_keys() and len(backend.stored_keys()) == 2
        assert w.stats.retried_keys == 1  # once, with the next save job
    finally:
        w.close()


class HeldFailingPuts(HeldPuts):
    """A held put whose first key fails (-800, nothing stored) the first time."""

    def __init__(self) -> None:
        super().__init__()
        self.victim = ""

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        first = not self.victim
        self.victim = self.victim or keys[0]
        if not first:
            return super().put(keys, addrs, sizes)
        codes = super().put(keys[1:], addrs[1:], sizes[1:])
        return [-800, *codes]


def test_a_failed_put_of_a_preempted_request_is_never_retried_from_reused_blocks(kvtools) -> None:
    """r's put fails while the preemption waits for it; r resumes in other blocks; nothing reads the old ones."""
    backend = HeldFailingPuts()
    w = _worker(backend, preempt_s=10)
    try:
        caches = kvtools.make(num_blocks=8)
        w.register_kv_caches(caches, 8)
        w.wait_for_save(
            _step(build_scheduler(SPEC, PoolConfig.from_extra({}), lambda *_: 0), "r", list(range(32)), [1, 2])
        )
        assert backend.in_put.wait(10)
        release = threading.Timer(0.3, backend.release.set)
        release.start()
        w.bind_step(PoolStepMeta(preempted_req_ids=frozenset({"r"})))  # the put returns (one key failed) meanwhile
        release.join(5)
        _reuse(caches, [1, 2])  # the step's forward pass gives r's blocks to another request
        resumed = _step(build_scheduler(SPEC, PoolConfig.from_extra({}), lambda *_: 0), "r", list(range(200, 216)), [5])
        w.wait_for_save(resumed)
        w.drain(10)
        assert not any(REUSED in value for _, value in backend.held)
        assert backend.victim not in backend.values() and w.stats.retried_keys == 0
    finally:
        backend.release.set()
        w.close()


def test_a_failed_layer_put_is_retried_with_the_requests_next_save_of_that_layer(kvtools) -> None:
    backend = FailsFirstPut()
    cfg = PoolConfig.from_extra({"save_decode_cache": True, "use_layerwise": True})
    w = build_worker(SPEC, cfg, backend)
    try:
        caches = kvtools.make(num_layers=2, num_blocks=8)
        w.register_kv_caches(caches, 8)
        s = build_scheduler(SPEC, cfg, w.safe_lookup)

        def step(meta: PoolStepMeta) -> None:
            w.bind_step(meta)
            w.start_load_kv(meta)
            for name in caches:
                w.wait_for_layer_load(name)
                w.save_kv_layer(name)
            w.wait_for_save(meta)

        prompt = list(range(20))
        s.get_num_new_matched_tokens("r", prompt, 20, 0)
        step(s.build_meta(StepInput(new=[NewRequest("r", prompt, [[1, 2]], 0, 20)])))
        w.drain(10)
        assert len(backend.stored_keys()) == 1 and backend.failed == 1  # chunk 0: layer 0 failed, layer 1 stored
        for t in range(12):  # decode 20..31: chunk 1 completes at 32; layer 0's save retries chunk 0
            step(s.build_meta(StepInput(running=[RunningRequest("r", [100 + t], [[3]] if t == 0 else None, 20 + t)])))
        w.drain(10)
        assert backend.victim in backend.stored_keys() and len(backend.stored_keys()) == 4  # 2 chunks x 2 layers
        assert w.stats.retried_keys == 1
        k, v = caches[next(iter(caches))]
        assert backend.values()[backend.victim] == k[1].numpy().tobytes() + v[1].numpy().tobytes()
    finally:
        w.close()


@pytest.mark.mooncake
def test_mooncake_remove_drops_keys_and_ignores_absent_ones(mooncake_master) -> None:
    import ctypes

    from ascend_dist.kv_store.backends.mooncake import MooncakeBackend
    from ascend_dist.kv_store.config.config import MooncakeStoreConfig
    from ascend_dist.kv_store.transfer.worker_types import RemovableBackend

    backend = MooncakeBackend(MooncakeStoreConfig.load(mooncake_master.config(), env={}))
    buf = (ctypes.c_char * 4096)()
    addr = ctypes.addressof(buf)
    try:
        assert isinstance(backend, RemovableBackend)
        backend.register_buffer([addr], [4096])
        assert backend.put(["drop-a", "keep-b"], [[addr], [addr + 1024]], [[1024], [1024]]) == [0, 0]
        backend.remove(["drop-a", "never-stored"])
        assert backend.exists(["drop-a", "keep-b"]) == [0, 1]
    finally:
        backend.close()


@pytest.mark.parametrize("extra", [{}, {"load_async": True}, {"use_layerwise": True}])
def test_close_leaves_no_thread_in_any_mode(kvtools, extra: dict[str, object]) -> None:
    before = set(threading.enumerate())
    w = build_worker(SPEC, PoolConfig.from_extra(extra), InMemoryBackend())
    w.register_kv_caches(kvtools.make(num_blocks=8), 8)
    sched = build_scheduler(SPEC, PoolConfig.from_extra(extra), w.safe_lookup)
    meta = _step(sched, "r", list(range(32)), [1, 2])
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    assert set(threading.enumerate()) - before  # the mode's transfer threads run ...
    w.close()
    assert set(threading.enumerate()) - before == set()  # ... and none is left after close


def test_failed_puts_of_a_request_that_finished_with_a_save_pending_are_forgotten_once_it_settles() -> None:
    """vLLM names a finished request once; its save may still run then and fail afterwards."""
    from ascend_dist.kv_store.transfer.strategy import SaveGuard

    guard = SaveGuard()
    assert guard.failed_puts is not None and guard.failed_layer_puts is not None
    guard.saves.add("r")  # r's save job is in flight ...
    assert guard.settle(set(), {"r"}) == set()  # ... when vLLM reports r finished
    guard.failed_puts.add("r", [("k", ([0], [1]), (0, None, None))])  # type: ignore[list-item]
    guard.failed_layer_puts.add("r", [(0, None)])  # type: ignore[list-item]
    guard.saves.done("r")  # the job failed its put and ended
    guard.settle(set(), set())
    assert len(guard.failed_puts) == 0 and len(guard.failed_layer_puts) == 0  # nothing left of r
    guard.saves.add("q")  # control: a request not finished keeps its entries for its next save
    guard.failed_puts.add("q", [("k", ([0], [1]), (0, None, None))])  # type: ignore[list-item]
    guard.saves.done("q")
    guard.settle(set(), set())
    assert len(guard.failed_puts) == 1


def test_a_put_failing_after_its_request_finished_is_forgotten() -> None:
    """vLLM names a finished request once; a put of it still running then must not leave it behind (soak leak)."""
    from ascend_dist.kv_store.transfer.strategy import SaveGuard

    guard = SaveGuard()
    failed = guard.failed_puts
    assert failed is not None
    guard.saves.add("r")  # its save job is running when vLLM reports it finished
    guard.saves.add("live")
    assert guard.settle(set(), {"r"}) == set()
    failed.add("r", [("key-r", ([1], [2]), None)])  # the puts fail, then the jobs end
    failed.add("live", [("key-live", ([1], [2]), None)])
    guard.saves.done("r")
    guard.saves.done("live")
    guard.settle(set(), set())  # later steps name other requests only
    assert failed.take(["r"]) == []  # forgotten: its blocks are gone
    assert len(failed.take(["live"])) == 1  # control: a live request's failed put stays for its retry
