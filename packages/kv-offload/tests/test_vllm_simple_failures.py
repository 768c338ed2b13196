"""Simple CPU offload: every store and load ends and is reported, through vLLM 0.33.0's ``Scheduler``.

vLLM's simple scheduler side (``SimpleCPUOffloadScheduler``) pins a store's device and host blocks
until every worker acknowledges the store event, and keeps a loading request in
``WAITING_FOR_REMOTE_KVS`` until its load event finishes. A store that failed (a copy fault, or a
submission that raised on the copy thread) must still end: its blocks unpinned, its host blocks
never discoverable; a load that failed or whose submission raised must still finish, reported as a
failure (block ids with one KV-cache group, the request with several), so vLLM recomputes (or
fails) that request alone. Copies run on the CPU simulation through a `FaultyRuntime`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from offload_vllm_loop import SIMPLE, Loop, make_config, write_model_dir  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dist.common.device import CopyDirection  # noqa: E402

NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"), num_layers=2)


def _simple(model_dir: Path, *, tp: int = 1, groups: int = 1, policy: str = "recompute") -> Loop:
    config = make_config(
        model_dir, "AscendSimpleCPUOffloadConnector", SIMPLE, {"cpu_bytes_to_use": 1 << 20}, NUM_BLOCKS,
        tp=tp, prefix_caching=True, failure_policy=policy,
    )  # fmt: skip
    return Loop(config, NUM_BLOCKS, groups=groups)


def _forget_device_cache(loop: Loop) -> None:
    """Drop vLLM's device prefix cache, so a repeated prompt can only hit the host copy."""
    assert loop.sched.reset_prefix_cache()


def _cpu_hits(loop: Loop) -> int:
    manager = loop.sched.connector.scheduler_manager
    return len(manager.cpu_block_pool.cached_block_hash_to_block)


@pytest.mark.parametrize("how", ["copy-fault", "submit-raises"])
@pytest.mark.parametrize("tp", [1, 2], ids=["one-worker", "fails-on-one-of-two-workers"])
def test_a_failed_store_ends_unpinned_and_is_never_loadable(model_dir: Path, tp: int, how: str) -> None:
    loop = _simple(model_dir, tp=tp)
    try:
        runtime = loop.shards[0].runtime
        if how == "copy-fault":
            runtime.fail(CopyDirection.D2H)
        else:
            runtime.raise_on_submit(CopyDirection.D2H)
        loop.add("a", 100, 48)  # a's blocks are stored first (in its own step), and fail
        list(loop.run())
        assert runtime.failed[int(CopyDirection.D2H)] == 1
        loop.add("b", 300, 48)
        list(loop.run())
        assert loop.free_blocks() == loop.free_at_start  # every device pin released
        assert _cpu_hits(loop) == 3  # b's three blocks; none of a's
        _forget_device_cache(loop)
        again_a, again_b = loop.add("a2", 100, 48), loop.add("b2", 300, 48)
        out = loop.step()
        assert out.num_scheduled_tokens.get("a2") == 48  # a2 computed from scratch
        assert again_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        list(loop.run())
        assert again_a.is_finished() and again_b.is_finished()
        assert loop.verified == {"b2": 32} and loop.load_errors == set() and loop.failed_recving == set()
        assert loop.free_blocks() == loop.free_at_start
    finally:
        loop.close()


@pytest.mark.parametrize("how", ["copy-fault", "submit-raises"])
@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "two-groups"])
def test_a_failed_load_finishes_and_is_reported_the_way_vllm_expects(model_dir: Path, groups: int, how: str) -> None:
    loop = _simple(model_dir, groups=groups)
    try:
        loop.add("a", 100, 48)
        loop.add("b", 300, 48)
        list(loop.run())
        _forget_device_cache(loop)
        runtime = loop.shards[0].runtime
        if how == "copy-fault":
            runtime.fail(CopyDirection.H2D)
        else:
            runtime.raise_on_submit(CopyDirection.H2D)
        again_a = loop.add("a2", 100, 48)
        list(loop.run())
        assert runtime.failed[int(CopyDirection.H2D)] == 1
        if groups == 1:  # block ids name the request: exactly a2's loaded blocks
            assert loop.failed_steps and loop.failed_recving == set()
        else:  # vLLM refuses block ids with several groups: the request is reported
            assert loop.failed_recving == {"a2"} and loop.load_errors == set()
        assert again_a.status == RequestStatus.FINISHED_LENGTH_CAPPED  # recomputed (or reloaded)
        # the engine goes on: b2 loads its two full blocks below the last token, every byte checked
        again_b = loop.add("b2", 300, 48)
        list(loop.run())
        assert again_b.is_finished() and loop.verified.get("b2") == 32
        assert loop.free_blocks() == loop.free_at_start
    finally:
        loop.close()
