"""Failed loads with two KV-cache groups, through vLLM 0.33.0's running ``Scheduler`` (nox session vllm).

vLLM maps block-level load errors (``invalid_block_ids``) back to requests only with one KV-cache
group; with several its scheduler raises ``RuntimeError`` and the engine dies. A failed load there
must be reported as a failed request (``failed_recving``): with ``kv_load_failure_policy="recompute"``
that request is computed again, with ``"fail"`` it alone finishes with an error; every other request
runs on, the engine lives, and every block returns to the pool.
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

from ascend_dist.common.device import CopyDirection  # noqa: E402
from ascend_dist.kv_offload.vllm_preempt_scheduler import PreemptSavingScheduler  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"), num_layers=2)


def _native(model_dir: Path, policy: str, **extra: Any) -> Loop:
    cfg = {"spec_name": "NPUOffloadingSpec", "spec_module_path": NATIVE, "cpu_bytes_to_use": 1 << 20, **extra}
    config = make_config(model_dir, "AscendOffloadingConnector", NATIVE, cfg, 64, failure_policy=policy)
    return Loop(config, 64, groups=2)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_native_failed_load_with_sync_loads_on_fails_its_request_alone(model_dir: Path, policy: str) -> None:
    """Issue 21 item 12: sync loads on, two groups, the first load fails: the engine lives."""
    loop = _native(model_dir, policy, sync_load_budget_bytes=1 << 30)
    try:
        # 56 tokens: a 48-token hit leaves tokens to compute, which a sync load needs
        loop.add("a", 100, 56)
        loop.add("b", 300, 56)
        list(loop.run())
        assert loop.free_blocks() == loop.free_at_start
        loop.shards[0].runtime.fail(CopyDirection.H2D)  # a2's load (the first one submitted) fails
        again_a = loop.add("a2", 100, 56)
        list(loop.run())
        again_b = loop.add("b2", 300, 56)  # after a2's failure was reported (see transfer.py)
        list(loop.run())
        assert loop.failed_recving == {"a2"} and loop.load_errors == set()
        assert again_b.is_finished() and again_b.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert loop.verified.get("b2") == 48  # b2's two groups loaded, every byte checked
        if policy == "recompute":  # computed again (or reloaded from the intact host copy), not failed
            assert again_a.status == RequestStatus.FINISHED_LENGTH_CAPPED
        else:
            assert again_a.status == RequestStatus.FINISHED_ERROR
        assert loop.free_blocks() == loop.free_at_start
        # the engine goes on: a third request still loads
        again_b2 = loop.add("b3", 300, 56)
        list(loop.run())
        assert again_b2.status == RequestStatus.FINISHED_LENGTH_CAPPED and loop.verified.get("b3") == 48
    finally:
        loop.close()


class _Saving(PreemptSavingScheduler):
    saved: list[tuple[str, bool]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.saved = []
        super().__init__(*args, **kwargs)

    def _save_before_preempt(self, request: Request) -> bool:
        accepted = super()._save_before_preempt(request)
        self.saved.append((request.request_id, accepted))
        return accepted


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_recompute_failed_restore_with_two_groups_reports_the_request(model_dir: Path, policy: str) -> None:
    """Issue 21 item 11: the preempted request's restore fails; vLLM must not see block ids."""
    num_blocks = 13  # block 0 is vLLM's null block: twelve usable, shared by both groups
    config = make_config(
        model_dir, "RecomputeCPUOffloadConnector", RECOMPUTE, {"cpu_bytes_to_use_per_rank": 1 << 20},
        num_blocks, failure_policy=policy,
    )  # fmt: skip
    loop = Loop(config, num_blocks, scheduler_cls=_Saving, groups=2)
    try:
        loop.shards[0].runtime.fail(CopyDirection.H2D)  # the first restore fails
        first, second = loop.add("r1", 100, 40, max_tokens=12), loop.add("r2", 500, 40, max_tokens=12)
        list(loop.run())
        assert loop.sched.saved == [("r2", True)] and second.num_preemptions >= 1
        assert loop.failed_recving == {"r2"} and loop.load_errors == set()
        assert first.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(first.output_token_ids) == 12
        if policy == "recompute":
            assert second.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(second.output_token_ids) == 12
        else:
            assert second.status == RequestStatus.FINISHED_ERROR
        assert loop.free_blocks() == loop.free_at_start
        assert not loop.sched.connector.manager.has_pending_transfers()
    finally:
        loop.close()
