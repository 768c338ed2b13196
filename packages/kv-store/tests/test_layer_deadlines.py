"""Layer-wise loads against a hung store: one deadline per step, and a fenced step's loads never land late.

A fake of our own `PoolBackend` Protocol (an `InMemoryBackend` whose get blocks on an Event) is
injected through the worker's constructor. The "forward pass" that rewrites a failed request's
blocks (vLLM recomputes them, or gives them to another request) is a write into the CPU caches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

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
from ascend_dist.kv_store.step_metadata import PoolStepMeta

SPEC = PoolSpec(model="tiny-lw", block_sizes=(16,), num_kv_heads=2)
CFG = PoolConfig.from_extra({"use_layerwise": True})
NUM_LAYERS = 6
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
DEADLINE_S = 0.4
REUSED = np.full(8, 7.0, dtype=np.float16).tobytes()


class HungGets(InMemoryBackend):
    """Gets wait for ``gate``; the time each get wrote its destinations is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.wrote_at: list[float] = []

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        assert self.gate.wait(20)
        codes = super().get(keys, addrs, sizes)
        self.wrote_at.append(time.monotonic())
        return codes


class Rig:
    def __init__(self, kvtools) -> None:  # type: ignore[no-untyped-def]
        self.backend = HungGets()
        self.worker = build_worker(SPEC, CFG, self.backend, waits=WorkerWaits(step_load_s=DEADLINE_S))
        self.caches = kvtools.make(num_layers=NUM_LAYERS, num_blocks=8)
        self.block_bytes = kvtools.block_bytes
        self.worker.register_kv_caches(self.caches, 8)
        self.sched = build_scheduler(SPEC, CFG, self.worker.safe_lookup)

    def step(self, meta: PoolStepMeta, *, save: bool = True) -> float:
        t0 = time.monotonic()
        self.worker.start_load_kv(meta)
        for name in LAYERS:
            self.worker.wait_for_layer_load(name)
            if save:
                self.worker.save_kv_layer(name)
        self.worker.wait_for_save(meta)
        return time.monotonic() - t0

    def load_meta(self, req: str, prompt: list[int], blocks: list[int]) -> PoolStepMeta:
        need, _ = self.sched.get_num_new_matched_tokens(req, prompt, len(prompt), 0)
        assert need == len(prompt) - 1
        self.sched.update_state_after_alloc(req, [blocks], need)
        return self.sched.build_meta(StepInput(new=[NewRequest(req, prompt, [blocks], need, len(prompt) - need)]))

    def prefill(self, prompt: list[int], blocks: list[int]) -> None:
        self.sched.get_num_new_matched_tokens("a", prompt, len(prompt), 0)
        self.step(self.sched.build_meta(StepInput(new=[NewRequest("a", prompt, [blocks], 0, len(prompt))])))
        self.worker.drain(10)

    def reuse(self, blocks: list[int]) -> None:
        for k, v in self.caches.values():
            for b in blocks:
                k[b].fill_(7.0)
                v[b].fill_(7.0)

    def holds_reused(self, block: int) -> bool:
        return self.block_bytes(self.caches, block) == REUSED * (len(self.block_bytes(self.caches, block)) // 16)


def test_a_hung_store_costs_a_step_one_deadline_not_one_per_layer(kvtools) -> None:
    rig = Rig(kvtools)
    try:
        prompt = list(range(32))
        rig.prefill(prompt, [1, 2])
        # control: with the store answering, the same load is byte-exact and reports nothing
        rig.step(rig.load_meta("c", prompt, [5, 6]), save=False)
        assert rig.worker.get_block_ids_with_load_errors() == set()
        assert [rig.block_bytes(rig.caches, b) for b in (5, 6)] == [rig.block_bytes(rig.caches, b) for b in (1, 2)]
        rig.backend.gate.clear()  # the store hangs from now on
        elapsed = rig.step(rig.load_meta("b", prompt, [3, 4]), save=False)
        assert rig.worker.get_block_ids_with_load_errors() == {3, 4}
        assert DEADLINE_S * 0.9 < elapsed < DEADLINE_S * 2.5, elapsed  # one deadline, not 6 x 0.4 s
    finally:
        rig.backend.gate.set()
        rig.worker.close()


def test_a_fenced_steps_loads_never_write_after_the_next_step_began(kvtools) -> None:
    rig = Rig(kvtools)
    try:
        prompt = list(range(32))
        rig.prefill(prompt, [1, 2])
        gets_before = len(rig.backend.wrote_at)
        rig.backend.gate.clear()
        rig.step(rig.load_meta("b", prompt, [3, 4]), save=False)
        assert rig.worker.get_block_ids_with_load_errors() == {3, 4}
        rig.reuse([3, 4])  # vLLM recomputes b (or reassigns the blocks) ...
        threading.Timer(0.3, rig.backend.gate.set).start()  # ... while the hung get finally returns
        rig.worker.bind_step(PoolStepMeta())  # the next step: waits for the get in flight before its forward
        began = time.monotonic()
        rig.reuse([3, 4])  # the next forward pass writes the blocks
        assert rig.backend.gate.wait(10)
        time.sleep(0.5)  # room for any late get to land
        assert all(t <= began for t in rig.backend.wrote_at)  # nothing landed once the next step began
        assert rig.holds_reused(3) and rig.holds_reused(4)
        assert len(rig.backend.wrote_at) - gets_before == 1  # the queued layers' gets never ran
    finally:
        rig.backend.gate.set()
        rig.worker.close()


def test_close_joins_every_thread(kvtools) -> None:
    before = set(threading.enumerate())
    rig = Rig(kvtools)
    rig.prefill(list(range(32)), [1, 2])
    assert len(set(threading.enumerate()) - before) >= 2  # the layer sending and receiving threads
    rig.worker.close()
    assert set(threading.enumerate()) - before == set()
