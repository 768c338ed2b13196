"""Native and recompute connectors inside vLLM 0.33.0's running v1 ``Scheduler`` (nox session vllm).

Each test drives vLLM's real ``Scheduler`` step by step with worker-role connectors from the factory
copying on the CPU simulation (`offload_vllm_loop.Loop`: restored bytes checked against a stand-in
model's, blocks awaiting a load poisoned first).

- Native (``AscendOffloadingConnector``): a store that fails at descriptor 0 (the CPU simulation's
  fault injection), on the only worker or on one of two (their outputs merged by vLLM's
  ``KVOutputAggregator``), leaves its keys unloadable while another request's store is loadable; a load
  that fails is reported through ``get_block_ids_with_load_errors`` (exactly its blocks) in the
  step its receive finishes, vLLM takes the request back (and reloads it from the intact host
  copy), and a second request's load is untouched.
- Recompute (``RecomputeCPUOffloadConnector``): a pool too small for two requests forces a
  preemption; the connector saves the victim's blocks synchronously, restores them when it resumes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from offload_vllm_loop import NATIVE, RECOMPUTE, Loop, make_config, write_model_dir  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from ascend_dist.kv_offload.vllm_preempt_scheduler import PreemptSavingScheduler  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


class RecomputeHookScheduler(PreemptSavingScheduler):
    """Our preempt-saving scheduler, recording each save it asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.saved = []
        super().__init__(*args, **kwargs)

    saved: list[tuple[str, bool]]  # (request, whether the connector took its KV), per preemption

    def _save_before_preempt(self, request: Request) -> bool:
        accepted = super()._save_before_preempt(request)
        self.saved.append((request.request_id, accepted))
        return accepted


def _native(model_dir: Path, num_blocks: int = 32, tp: int = 1) -> Loop:
    extra = {"spec_name": "NPUOffloadingSpec", "spec_module_path": NATIVE, "cpu_bytes_to_use": 1 << 20}
    return Loop(make_config(model_dir, "AscendOffloadingConnector", NATIVE, extra, num_blocks, tp=tp), num_blocks)


@pytest.mark.parametrize("tp", [1, 2], ids=["one-worker", "fails-on-one-of-two-workers"])
def test_native_failed_store_is_never_loadable_and_other_stores_are(model_dir: Path, tp: int) -> None:
    loop = _native(model_dir, tp=tp)
    try:
        # Worker 0's first copy (request a's store) fails; with two workers, worker 1's succeeds.
        loop.shards[0].sim.inject_copy_fault(0)
        loop.add("a", 100, 48)
        first = loop.step()
        assert [j.req_id for j in first.kv_connector_metadata.store_jobs.values()] == ["a"]
        list(loop.run())
        # b's store comes after a's failure was reported (a job completing while the stream still
        # holds that error is failed too: its bytes are unproven).
        loop.add("b", 300, 48)
        list(loop.run())
        assert loop.free_blocks() == loop.free_at_start
        # Same prompts again: a's keys miss (computed from scratch), b's hit (loaded, bytes checked).
        again_a, again_b = loop.add("a2", 100, 48), loop.add("b2", 300, 48)
        out = loop.step()
        assert again_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and again_b.num_computed_tokens == 48
        assert out.num_scheduled_tokens.get("a2") == 48 and "b2" not in out.num_scheduled_tokens
        list(loop.run())
        assert again_a.is_finished() and again_b.is_finished()
        assert loop.verified == {"b2": 48} and loop.load_errors == set()
        assert loop.free_blocks() == loop.free_at_start
    finally:
        loop.close()


def test_native_failed_load_is_reported_recomputed_and_touches_nothing_else(model_dir: Path) -> None:
    loop = _native(model_dir)
    try:
        loop.add("a", 100, 48)
        loop.add("b", 300, 48)
        list(loop.run())
        again_a = loop.add("a2", 100, 48)
        loop.shards[0].sim.inject_copy_fault(1)  # the first load submitted (a2's) fails at descriptor 1
        out = loop.step()
        assert out.num_scheduled_tokens == {}
        a_blocks = set(loop.block_ids("a2"))
        steps = list(loop.run())
        assert steps, "nothing ran after the load"
        # b2 loads after a2's failure was reported (a job completing while the stream still holds
        # that error is failed too: its bytes are unproven); it is untouched by it.
        again_b = loop.add("b2", 300, 48)
        list(loop.run())
        # a2: exactly its three blocks reported, in the step that finished its receive; b2 untouched.
        assert len(loop.failed_steps) == 1
        recv_in_that_step, reported = loop.failed_steps[0]
        assert "a2" in recv_in_that_step and reported == a_blocks
        # vLLM freed a2's blocks (no valid prefix) and asked again: the intact host copy loaded.
        assert loop.verified == {"b2": 48, "a2": 48}
        assert again_a.is_finished() and again_b.is_finished()
        assert again_a.num_computed_tokens >= 48 and again_a.num_preemptions == 0
        assert loop.free_blocks() == loop.free_at_start
    finally:
        loop.close()


def test_recompute_connector_saves_and_restores_inside_the_scheduler_loop(model_dir: Path) -> None:
    """Six blocks for two 40-token prompts decoding 12 tokens each: the pool runs out at 48 tokens."""
    num_blocks = 7  # block 0 is vLLM's null block: six usable
    extra = {"cpu_bytes_to_use_per_rank": 1 << 20}
    config = make_config(model_dir, "RecomputeCPUOffloadConnector", RECOMPUTE, extra, num_blocks)
    loop = Loop(config, num_blocks, scheduler_cls=RecomputeHookScheduler)
    try:
        first, second = loop.add("r1", 100, 40, max_tokens=12), loop.add("r2", 500, 40, max_tokens=12)
        list(loop.run())
        # vLLM preempted the newest request (its last block went to r1 in the same step); the connector
        # saved it synchronously, and on resume restored all 48 tokens (prompt + 8 decoded) byte-exact
        # into poisoned blocks, before vLLM recomputed only the last one.
        assert loop.sched.saved == [("r2", True)] and second.num_preemptions == 1
        assert loop.verified == {"r2": 48}
        assert first.is_finished() and second.is_finished()
        assert len(first.output_token_ids) == 12 and len(second.output_token_ids) == 12
        assert loop.load_errors == set() and loop.free_blocks() == loop.free_at_start
        manager = loop.sched.connector.manager
        assert not manager.has_pending_transfers()
    finally:
        loop.close()
