"""Scheduler + worker end to end over CPU tensors and the in-memory reference backend."""

from __future__ import annotations

import pytest
import torch

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
from ascend_dist.kv_store.step_metadata import PoolStepMeta

SPEC = PoolSpec(model="/models/tiny/", block_sizes=(16,), num_kv_heads=2)


class Instance:
    """One 'vLLM instance': scheduler + one worker over its own CPU caches, sharing ``backend``."""

    def __init__(
        self,
        backend: InMemoryBackend,
        kvtools,
        seed: int,
        spec: PoolSpec = SPEC,
        extra: dict[str, object] | None = None,
    ) -> None:
        self.cfg = PoolConfig.from_extra(extra or {})
        self.worker = build_worker(spec, self.cfg, backend)
        self.caches = kvtools.make(num_blocks=16, seed=seed)
        self.worker.register_kv_caches(self.caches, 16)
        self.scheduler = build_scheduler(spec, self.cfg, self.worker.safe_lookup)

    def close(self) -> None:
        self.worker.close()


@pytest.fixture
def backend() -> InMemoryBackend:
    return InMemoryBackend()


def run_prefill(inst: Instance, req_id: str, prompt: list[int], blocks: list[int]) -> PoolStepMeta:
    need, _ = inst.scheduler.get_num_new_matched_tokens(req_id, prompt, len(prompt), 0)
    inst.scheduler.update_state_after_alloc(req_id, [blocks], need)
    meta = inst.scheduler.build_meta(StepInput(new=[NewRequest(req_id, prompt, [blocks], 0, len(prompt))]))
    inst.worker.start_load_kv(meta)
    inst.worker.wait_for_save(meta)
    inst.worker.drain(10)
    return meta


def test_save_then_other_instance_loads_byte_exact(backend: InMemoryBackend, kvtools) -> None:
    a, b = Instance(backend, kvtools, seed=1), Instance(backend, kvtools, seed=2)
    try:
        prompt = list(range(100, 170))  # 70 tokens -> 4 full chunks of 16
        run_prefill(a, "ra", prompt, [1, 2, 3, 4, 5])
        assert a.worker.stats.saved_keys == 4 and len(backend.stored_keys()) == 4
        need, _ = b.scheduler.get_num_new_matched_tokens("rb", prompt, len(prompt), 0)
        assert need == 64
        b.scheduler.update_state_after_alloc("rb", [[9, 10, 11, 12, 13]], need)
        meta = b.scheduler.build_meta(StepInput(new=[NewRequest("rb", prompt, [[9, 10, 11, 12, 13]], 64, 6)]))
        b.worker.start_load_kv(meta)
        for src, dst in zip([1, 2, 3, 4], [9, 10, 11, 12], strict=True):
            assert kvtools.block_bytes(b.caches, dst) == kvtools.block_bytes(a.caches, src)
        assert kvtools.block_bytes(b.caches, 13) != kvtools.block_bytes(a.caches, 5)
        assert b.worker.get_block_ids_with_load_errors() == set()
        b.worker.wait_for_save(meta)
        b.worker.drain(10)
        assert b.worker.stats.saved_keys == 0  # everything it holds was already pooled
    finally:
        a.close()
        b.close()


def test_evicted_key_reports_exact_blocks(backend: InMemoryBackend, kvtools) -> None:
    a, b = Instance(backend, kvtools, seed=1), Instance(backend, kvtools, seed=2)
    try:
        prompt = list(range(64))
        run_prefill(a, "ra", prompt, [1, 2, 3, 4])
        need, _ = b.scheduler.get_num_new_matched_tokens("rb", prompt, 64, 0)
        assert need == 63
        third = sorted(
            backend.stored_keys(),
            key=lambda k: [h.hex() for h in b.scheduler.hashes_for(prompt)[1]].index(k.rsplit("@", 1)[1]),
        )[2]
        backend.remove([third])  # evicted between lookup and load
        b.scheduler.update_state_after_alloc("rb", [[5, 6, 7, 8]], need)
        meta = b.scheduler.build_meta(StepInput(new=[NewRequest("rb", prompt, [[5, 6, 7, 8]], 63, 1)]))
        b.worker.start_load_kv(meta)
        assert b.worker.get_block_ids_with_load_errors() == {7}
        assert b.worker.get_block_ids_with_load_errors() == set()  # drained once
    finally:
        a.close()
        b.close()


def test_store_down_reports_misses_and_all_loading_blocks(backend: InMemoryBackend, kvtools) -> None:
    a = Instance(backend, kvtools, seed=1)
    try:
        prompt = list(range(48))
        run_prefill(a, "r1", prompt, [1, 2, 3])
        backend.available = False
        assert a.scheduler.get_num_new_matched_tokens("r2", prompt, 48, 0) == (0, False)
        backend.available = True
        need, _ = a.scheduler.get_num_new_matched_tokens("r3", prompt, 48, 0)
        assert need == 47
        a.scheduler.update_state_after_alloc("r3", [[4, 5, 6]], need)
        meta = a.scheduler.build_meta(StepInput(new=[NewRequest("r3", prompt, [[4, 5, 6]], 47, 1)]))
        backend.available = False
        a.worker.start_load_kv(meta)
        assert a.worker.get_block_ids_with_load_errors() == {4, 5, 6}
    finally:
        a.close()


def test_different_hash_inputs_give_no_false_hits(backend: InMemoryBackend, kvtools) -> None:
    a = Instance(backend, kvtools, seed=1)
    others = [
        Instance(backend, kvtools, seed=2, spec=PoolSpec(model="other", block_sizes=(16,), num_kv_heads=2)),
        Instance(backend, kvtools, seed=3, spec=PoolSpec(model="tiny", block_sizes=(16,), num_kv_heads=4)),
        Instance(backend, kvtools, seed=4, spec=PoolSpec(model="tiny", block_sizes=(16,), num_kv_heads=2, tp_size=2)),
    ]
    try:
        prompt = list(range(64))
        run_prefill(a, "ra", prompt, [1, 2, 3, 4])
        same = Instance(backend, kvtools, seed=5, spec=PoolSpec(model="/x/tiny", block_sizes=(16,), num_kv_heads=2))
        others.append(same)
        assert same.scheduler.get_num_new_matched_tokens("s", prompt, 64, 0)[0] == 63
        for inst in others[:3]:
            assert inst.scheduler.get_num_new_matched_tokens("o", prompt, 64, 0) == (0, False)
        assert a.scheduler.get_num_new_matched_tokens("p", [7, *prompt[1:]], 64, 0) == (0, False)
    finally:
        for inst in [a, *others]:
            inst.close()


def test_tail_chunk_saved_without_new_blocks(backend: InMemoryBackend, kvtools) -> None:
    """Chunked prefill 300/300/40 over G=128: step 3 allocates no block but completes [512, 640)."""
    spec = PoolSpec(model="tiny", block_sizes=(128,), num_kv_heads=1)
    inst = Instance(backend, kvtools, seed=1, spec=spec)
    inst.worker.close()
    caches = kvtools.make(num_blocks=8, block_size=128, heads=1, dim=4)
    from ascend_dist.kv_store import build_worker as bw

    inst.worker = bw(spec, inst.cfg, backend)
    inst.worker.register_kv_caches(caches, 8)
    try:
        prompt = list(range(640))
        sch = inst.scheduler
        assert sch.get_num_new_matched_tokens("r", prompt, 640, 0) == (0, False)
        steps = [
            StepInput(new=[NewRequest("r", prompt, [[1, 2, 3]], 0, 300)]),
            StepInput(running=[RunningRequest("r", prompt[300:600], [[4, 5]], 300)]),
            StepInput(running=[RunningRequest("r", prompt[600:640], None, 600)]),
        ]
        ends = []
        for step in steps:
            meta = sch.build_meta(step)
            ends.append([m.save_end_token for m in meta.requests])
            inst.worker.wait_for_save(meta)
        inst.worker.drain(10)
        assert ends == [[256], [512], [640]]
        assert len(backend.stored_keys()) == 5
    finally:
        inst.close()


def test_delayed_free_until_saves_complete(backend: InMemoryBackend, kvtools) -> None:
    inst = Instance(backend, kvtools, seed=1)
    try:
        prompt = list(range(32))
        run_prefill(inst, "r", prompt, [1, 2])
        assert inst.scheduler.request_finished("r") is True
        assert inst.scheduler.request_finished("never-saved") is False
        meta = inst.scheduler.build_meta(StepInput(finished_req_ids=frozenset({"r"})))
        assert meta.delayed_free_req_ids == {"r"}
        inst.worker.wait_for_save(meta)
        done_sending, _ = inst.worker.get_finished({"r"})
        assert done_sending == {"r"}
        inst.scheduler.mark_sent(done_sending)
        assert inst.scheduler.held_req_ids == frozenset()
        assert inst.scheduler.build_meta(StepInput()).delayed_free_req_ids == frozenset()  # set shrinks
    finally:
        inst.close()


def test_async_load_completes_via_get_finished(backend: InMemoryBackend, kvtools) -> None:
    a = Instance(backend, kvtools, seed=1)
    b = Instance(backend, kvtools, seed=2, extra={"load_async": True})
    try:
        prompt = list(range(48))
        run_prefill(a, "ra", prompt, [1, 2, 3])
        need, is_async = b.scheduler.get_num_new_matched_tokens("rb", prompt, 48, 0)
        assert (need, is_async) == (47, True)
        b.scheduler.update_state_after_alloc("rb", [[4, 5, 6]], need)
        meta = b.scheduler.build_meta(StepInput())  # not scheduled while it waits for remote KV
        assert [m.req_id for m in meta.requests] == ["rb"]
        b.worker.start_load_kv(meta)
        b.worker.drain(10)
        assert b.worker.get_finished(set())[1] == {"rb"}
        assert torch.equal(
            b.caches["model.layers.0.self_attn.attn"][0][6], a.caches["model.layers.0.self_attn.attn"][0][3]
        )
    finally:
        a.close()
        b.close()


def test_two_kv_groups_report_failures_of_every_group(backend: InMemoryBackend, kvtools) -> None:
    """Hybrid-style layout (two groups): a failed load in group 1 is reported, not only logged."""
    spec = PoolSpec(model="hybrid", block_sizes=(16, 16), num_kv_heads=2)
    cfg = PoolConfig.from_extra({})
    caches_a, caches_b = kvtools.make(num_blocks=16, seed=1), kvtools.make(num_blocks=16, seed=2)
    layers = [[n] for n in caches_a]  # one layer per group
    wa, wb = build_worker(spec, cfg, backend), build_worker(spec, cfg, backend)
    try:
        wa.register_kv_caches(caches_a, 16, layers)
        wb.register_kv_caches(caches_b, 16, layers)
        sa, sb = build_scheduler(spec, cfg, wa.safe_lookup), build_scheduler(spec, cfg, wb.safe_lookup)
        prompt = list(range(48))
        sa.get_num_new_matched_tokens("a", prompt, 48, 0)
        wa.wait_for_save(sa.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3], [4, 5, 6]], 0, 48)])))
        wa.drain(10)
        assert len(backend.stored_keys()) == 6 and {k.split("@")[5] for k in backend.stored_keys()} == {
            "group:0",
            "group:1",
        }
        need, _ = sb.get_num_new_matched_tokens("b", prompt, 48, 0)
        assert need == 47
        backend.remove([k for k in backend.stored_keys() if "group:1" in k][:1])
        sb.update_state_after_alloc("b", [[7, 8, 9], [10, 11, 12]], need)
        wb.start_load_kv(sb.build_meta(StepInput(new=[NewRequest("b", prompt, [[7, 8, 9], [10, 11, 12]], 47, 1)])))
        failed = wb.get_block_ids_with_load_errors()
        assert len(failed) == 1 and failed <= {10, 11, 12}
    finally:
        wa.close()
        wb.close()


def test_two_groups_async_failure_is_reported_by_request_once(backend: InMemoryBackend, kvtools) -> None:
    """Several KV groups: an async load that failed is named with its completion; the next lookup is skipped."""
    spec = PoolSpec(model="hybrid", block_sizes=(16, 16), num_kv_heads=2)
    cfg = PoolConfig.from_extra({"load_async": True})
    caches_a, caches_b = kvtools.make(num_blocks=16, seed=1), kvtools.make(num_blocks=16, seed=2)
    layers = [[n] for n in caches_a]
    wa, wb = build_worker(spec, cfg, backend), build_worker(spec, cfg, backend)
    try:
        wa.register_kv_caches(caches_a, 16, layers)
        wb.register_kv_caches(caches_b, 16, layers)
        assert wb.num_groups == 2
        sa, sb = build_scheduler(spec, cfg, wa.safe_lookup), build_scheduler(spec, cfg, wb.safe_lookup)
        prompt = list(range(48))
        sa.get_num_new_matched_tokens("a", prompt, 48, 0)
        wa.wait_for_save(sa.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3], [4, 5, 6]], 0, 48)])))
        wa.drain(10)
        for req in ("ok", "bad"):
            assert sb.get_num_new_matched_tokens(req, prompt, 48, 0) == (47, True)
        backend.remove([k for k in backend.stored_keys() if "group:1" in k][:1])
        sb.update_state_after_alloc("bad", [[7, 8, 9], [10, 11, 12]], 47)
        wb.start_load_kv(sb.build_meta(StepInput()))
        wb.drain(10)
        assert wb.get_transfer_results(set()) == (set(), {"bad"}, {"bad"})
        assert wb.get_transfer_results(set()) == (set(), set(), set())  # reported once
        assert len(wb.get_block_ids_with_load_errors()) == 1  # still recorded (the vLLM adapter drops them)
        assert wb.errors.total_failed_requests == 1

        lookups = sb.lookups
        sb.mark_load_failed({"bad"})
        assert sb.get_num_new_matched_tokens("bad", prompt, 48, 0) == (0, False)  # recompute: no retry loop
        assert sb.lookups == lookups
        meta = sb.build_meta(StepInput(new=[NewRequest("bad", prompt, [[13, 14, 15], [10, 11, 12]], 0, 48)]))
        assert meta.requests[0].load_spec is None and meta.requests[0].save_start_token == 0  # saved again
        sb.get_num_new_matched_tokens("bad", prompt, 48, 0)  # a later attempt (after a preemption) asks again
        assert sb.lookups == lookups + 1
    finally:
        wa.close()
        wb.close()


class _FailingGet(InMemoryBackend):
    """The reference backend whose ``get`` raises an unexpected (non-store) error when ``broken``."""

    broken = False

    def get(self, keys, addrs, sizes):  # type: ignore[override]
        if self.broken:
            raise RuntimeError("unexpected failure below the worker")
        return super().get(keys, addrs, sizes)


def test_unexpected_async_load_error_fails_the_load(kvtools) -> None:
    """An exception on the receiving thread must not report the request as loaded."""
    backend = _FailingGet()
    a = Instance(backend, kvtools, seed=1)
    b = Instance(backend, kvtools, seed=2, extra={"load_async": True})
    try:
        prompt = list(range(48))
        run_prefill(a, "ra", prompt, [1, 2, 3])
        need, _ = b.scheduler.get_num_new_matched_tokens("rb", prompt, 48, 0)
        b.scheduler.update_state_after_alloc("rb", [[4, 5, 6]], need)
        backend.broken = True
        b.worker.start_load_kv(b.scheduler.build_meta(StepInput()))
        b.worker.drain(10)
        assert b.worker.get_transfer_results(set()) == (set(), {"rb"}, {"rb"})
        assert b.worker.get_block_ids_with_load_errors() == {4, 5, 6}
    finally:
        a.close()
        b.close()


def test_sync_load_failures_are_forgotten_after_the_step(backend: InMemoryBackend, kvtools) -> None:
    """A sync load's failed request is never reported by request: it is dropped once its blocks are taken."""
    a, b = Instance(backend, kvtools, seed=1), Instance(backend, kvtools, seed=2)
    try:
        prompt = list(range(48))
        run_prefill(a, "ra", prompt, [1, 2, 3])
        need, _ = b.scheduler.get_num_new_matched_tokens("rb", prompt, 48, 0)
        backend.remove(backend.stored_keys()[:1])
        b.scheduler.update_state_after_alloc("rb", [[4, 5, 6]], need)
        b.worker.start_load_kv(b.scheduler.build_meta(StepInput(new=[NewRequest("rb", prompt, [[4, 5, 6]], 47, 1)])))
        assert b.worker.errors.failed_request_ids == {"rb"}
        assert b.worker.get_transfer_results(set()) == (set(), set(), set())
        assert b.worker.get_block_ids_with_load_errors() == {4}
        assert b.worker.errors.failed_request_ids == frozenset()
    finally:
        a.close()
        b.close()


def test_blocks_vllm_reports_invalid_are_saved_again_once_recomputed() -> None:
    """A sync load that failed at block 1: vLLM recomputes from there, and the saves resume there too.

    Without this the request's load state (store_skip = the whole hit) kept counting the chunk that
    was missing from the pool as pooled, so its recomputed KV was never saved again.
    """
    sched = build_scheduler(SPEC, PoolConfig.from_extra({}), lambda *args: 48)  # the pool claims 48 tokens
    prompt = list(range(7000, 7050))
    need, _ = sched.get_num_new_matched_tokens("r", prompt, 50, 0)
    sched.update_state_after_alloc("r", [[1, 2, 3, 4]], need)
    meta = sched.build_meta(StepInput(new=[NewRequest("r", prompt, [[1, 2, 3, 4]], 48, 2)]))
    assert not meta.requests[0].can_save  # everything up to 48 counted as pooled
    sched.mark_blocks_invalid({2})  # vLLM: block 2 (tokens 16..32) failed to load, recompute from 16
    # the recompute step schedules tokens 16..50 again (they write block 2 whole before the save reads it)
    meta = sched.build_meta(StepInput(running=[RunningRequest("r", prompt[16:50], None, 16)]))
    saved = meta.requests[0]
    assert saved.can_save and (saved.save_start_token, saved.save_end_token) == (16, 48)
