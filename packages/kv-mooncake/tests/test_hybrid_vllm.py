"""``MooncakeHybridConnector`` against the real vLLM 0.33.0 classes with a hybrid KV-cache config.

One full-attention group and one Mamba (GDN-shaped) group, as vLLM's ``KVCacheConfig`` describes a
hybrid model. P and D connectors (scheduler and worker roles, built by vLLM's
``KVConnectorFactory`` under the name ``MooncakeHybridConnector``) run in this process over one
real Mooncake engine (TCP, loopback). P drops the last prompt token (``on_new_request``), D loads
``prompt - 1`` tokens: the attention blocks and the state block arrive byte-exact.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

import torch  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from ascend_dist.common.errors import ConfigError  # noqa: E402
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.pull.vllm_connector import MooncakeHybridConnector  # noqa: E402
from ascend_dist.testing import hostile as hr  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402
from ascend_dist.testing.vllm_stats import read_back  # noqa: E402

MODULE = "ascend_dist.kv_mooncake.pull.vllm_connector"
ATTN = "model.layers.0.self_attn.attn"
MAMBA = "model.layers.1.linear_attn"
NUM_BLOCKS = vb.NUM_BLOCKS
BLOCK = vb.BLOCK
blocks = vb.blocks
NK, DK, NV, DV, ROWS = 2, 4, 2, 8, 3
CONV_W = 2 * NK * DK + NV * DV


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vb.write_model_dir(
        tmp_path_factory.mktemp("tiny-hybrid"),
        linear_num_key_heads=NK,
        linear_key_head_dim=DK,
        linear_num_value_heads=NV,
        linear_value_head_dim=DV,
    )


def make_config(model_dir: Path, role: str, engine_id: str, kv_port: int, **extra: Any) -> VllmConfig:
    return vb.make_vllm_config(
        model_dir,
        connector="MooncakeHybridConnector",
        module=MODULE,
        role=role,
        engine_id=engine_id,
        kv_port=kv_port,
        extra=extra,
        enable_prefix_caching=False,  # Mamba "none" mode
    )


def hybrid_kv_cache_config() -> KVCacheConfig:
    mamba = MambaSpec(block_size=BLOCK, shapes=((ROWS, CONV_W), (NV, DV, DK)), dtypes=(torch.float16, torch.float16))
    return vb.kv_cache_config([([ATTN], vb.attention_spec(2, 16)), ([MAMBA], mamba)], block_stride=False)


class Side:
    """One instance: scheduler- and worker-role connectors, an attention and a state layer on CPU."""

    def __init__(self, config: VllmConfig, seed: int) -> None:
        kcc = hybrid_kv_cache_config()
        self.sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kcc)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
        gen = torch.Generator().manual_seed(seed)
        rand = lambda *shape: torch.randn(*shape, generator=gen).to(torch.float16)  # noqa: E731
        self.attn = rand(2, NUM_BLOCKS, BLOCK, 2, 16)
        self.conv, self.ssm = rand(NUM_BLOCKS, ROWS, CONV_W), rand(NUM_BLOCKS, NV, DV, DK)
        self.worker.register_kv_caches({ATTN: self.attn, MAMBA: [self.conv, self.ssm]})  # type: ignore[dict-item]

    def step(self) -> None:
        meta = self.sched.build_connector_meta(SchedulerOutput.make_empty())
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        self.worker.clear_connector_metadata()

    def attn_block(self, b: int) -> bytes:
        return self.attn[0, b].numpy().tobytes() + self.attn[1, b].numpy().tobytes()

    def state_block(self, b: int) -> bytes:
        return self.conv[b].numpy().tobytes() + self.ssm[b].numpy().tobytes()

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def request(rid: str, n: int, params: dict[str, Any]) -> Request:
    return vb.request(rid, n, params, max_tokens=8)


def wait(fn: Any, rid: str, deadline: float) -> set[str]:
    seen: set[str] = set()
    while rid not in seen and time.monotonic() < deadline:
        seen |= fn() or set()
        time.sleep(0.005)
    return seen


def test_hybrid_attention_and_mamba_pull_through_vllm(model_dir: Path) -> None:
    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-hyb", port), seed=1)
    d_config = make_config(model_dir, "kv_consumer", "D-hyb", port)
    d = Side(d_config, seed=2)
    try:
        assert isinstance(p.sched, MooncakeHybridConnector) and isinstance(d.worker, MooncakeHybridConnector)
        p.sched.set_xfer_handshake_metadata_pp_aware({(0, 0): None, (1, 0): None})  # PP-aware: stage 1 accepted
        # P: a 41-token prompt is truncated to 40 once (the state after token 40 is what D needs).
        req_p = request("p-req", 41, {"do_remote_decode": True})
        p.sched.on_new_request(req_p)
        p.sched.on_new_request(req_p)  # guarded: a preempted request is not truncated twice
        assert req_p.num_prompt_tokens == 40 and len(req_p.prompt_token_ids or []) == 40
        assert req_p.num_tokens == 40 and req_p.max_tokens == 1
        assert p.sched.get_num_new_matched_tokens(req_p, 0) == (0, False)
        p.sched.update_state_after_alloc(req_p, blocks([4, 5, 6, 7], [8, 9]), 0)
        p.step()
        req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p.sched.request_finished_all_groups(req_p, ([4, 5, 6, 7], [8, 9]))
        assert delay is True and params is not None
        assert params["remote_block_ids"] == [[4, 5, 6], [8, 9]]  # state groups are not clipped
        p.step()
        # D loads prompt - 1 = 40 tokens: 3 attention blocks and the state block (P's last: 9).
        req_d = request("d-req", 41, params)
        assert d.sched.get_num_new_matched_tokens(req_d, 0) == (40, True)
        d.sched.update_state_after_alloc(req_d, blocks([20, 21, 22], [25]), 40)
        d.step()
        deadline = time.monotonic() + 20
        assert "d-req" in wait(lambda: d.worker.get_finished(set())[1], "d-req", deadline)
        assert d.worker.get_block_ids_with_load_errors() == set()
        assert [d.attn_block(b) for b in (20, 21, 22)] == [p.attn_block(b) for b in (4, 5, 6)]
        assert d.state_block(25) == p.state_block(9) != p.state_block(8)
        assert wait(lambda: p.worker.get_finished(set())[0], "p-req", deadline) == {"p-req"}
        # transfer stats (issue 26): D's reads, read back through vLLM's objects: the bytes of both groups
        pulled = d.worker.get_kv_connector_stats()
        assert pulled is not None and p.worker.get_kv_connector_stats() is None  # P is read, it reads nothing
        out = read_back(d_config, pulled.to_dict())
        moved = sum(len(d.attn_block(b)) for b in (20, 21, 22)) + len(d.state_block(25))
        assert out.sample("vllm:mooncake_bytes_transferred_sum") == moved
        assert "p2p load: Num successful transfers=" in out.lines[0]
    finally:
        d.close()
        p.close()


def test_sliding_window_with_context_parallelism_is_refused_naming_the_field(model_dir: Path) -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    config = make_config(model_dir, "kv_consumer", "D-cp", 40000, prefill={"tp_size": 1, "pcp_size": 2})
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64)
    kcc = vb.kv_cache_config([([ATTN], swa)], block_stride=False)
    with pytest.raises(ConfigError, match="window_blocks"):
        MooncakeHybridConnector(config, KVConnectorRole.SCHEDULER, kcc)
    MooncakeHybridConnector(config, KVConnectorRole.SCHEDULER, hybrid_kv_cache_config())  # Mamba + CP is fine


def test_state_split_needs_p_tp_a_multiple_of_d_tp(model_dir: Path) -> None:
    config = make_config(model_dir, "kv_consumer", "D-tp", 40000, prefill={"tp_size": 1}, decode={"tp_size": 2})
    conn = MooncakeHybridConnector(config, KVConnectorRole.WORKER, hybrid_kv_cache_config())
    with pytest.raises(ConfigError, match=r"prefill\.tp_size"):
        conn.register_kv_caches(
            {
                ATTN: torch.zeros(2, NUM_BLOCKS, BLOCK, 1, 16, dtype=torch.float16),
                MAMBA: [torch.zeros(NUM_BLOCKS, ROWS, CONV_W // 2), torch.zeros(NUM_BLOCKS, NV // 2, DV, DK)],  # type: ignore[dict-item]
            }
        )
    conn.shutdown()


def test_d_scheduler_with_a_mamba_group_loads_prompt_minus_one(model_dir: Path) -> None:
    """D driven by vLLM's real v1 Scheduler with the hybrid KV-cache config: its own allocation per group."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-hs", port), seed=3)
    d_config = make_config(model_dir, "kv_consumer", "D-hs", port)
    kcc = hybrid_kv_cache_config()
    d = Side(d_config, seed=4)
    sched = Scheduler(
        vllm_config=d_config,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(d_config),
        block_size=BLOCK,
        log_stats=False,
    )
    try:
        req_p = request("p-req", 41, {"do_remote_decode": True})
        p.sched.on_new_request(req_p)
        p.sched.update_state_after_alloc(req_p, blocks([4, 5, 6], [9]), 0)
        p.step()
        req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p.sched.request_finished_all_groups(req_p, ([4, 5, 6], [9]))
        p.step()
        assert params is not None
        req_d = request("d-req", 41, params)
        sched.add_request(req_d)
        out = sched.schedule()
        assert req_d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        d.worker.bind_connector_metadata(out.kv_connector_metadata)
        d.worker.start_load_kv(None)  # type: ignore[arg-type]
        d.worker.clear_connector_metadata()
        done = wait(lambda: d.worker.get_finished(set())[1], "d-req", time.monotonic() + 20)
        assert done == {"d-req"} and d.worker.get_block_ids_with_load_errors() == set()
        attn_ids, state_ids = sched.kv_cache_manager.get_block_ids("d-req")
        assert [d.attn_block(b) for b in attn_ids[:3]] == [p.attn_block(b) for b in (4, 5, 6)]
        # vLLM pads the Mamba group's row with null blocks ([0, 0, b]); the state lands in b.
        assert state_ids[:-1] == [0] * (len(state_ids) - 1) and d.state_block(state_ids[-1]) == p.state_block(9)
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(finished_recving=done)
            ),
        )
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"d-req": 1}  # the last prompt token, from P's state h(40)
        assert req_d.num_computed_tokens == 41
    finally:
        sched.shutdown()
        d.close()
        p.close()


def test_bad_state_conv_segments_are_a_typed_error(model_dir: Path) -> None:
    config = make_config(model_dir, "kv_consumer", "D-seg", 40000, state_conv_segments=[8, 0])
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.state_conv_segments"):
        MooncakeHybridConnector(config, KVConnectorRole.WORKER, hybrid_kv_cache_config())


def test_a_failed_load_with_a_mamba_group_is_reported_by_request_and_recomputed(model_dir: Path) -> None:
    """vLLM 0.33 raises on block-level failures with several KV groups: the pull reports the request instead."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    fast = {"rpc_timeout_s": 0.3, "rpc_retries": 1}
    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-hf", port, **fast), seed=5)
    d_config = make_config(model_dir, "kv_consumer", "D-hf", port, **fast)
    d_config.kv_transfer_config.kv_load_failure_policy = "recompute"  # type: ignore[union-attr]
    d = Side(d_config, seed=6)
    sched = Scheduler(
        vllm_config=d_config,
        kv_cache_config=hybrid_kv_cache_config(),
        structured_output_manager=StructuredOutputManager(d_config),
        block_size=BLOCK,
        log_stats=False,
    )
    p_open = True
    try:
        req_p = request("p-req", 41, {"do_remote_decode": True})
        p.sched.on_new_request(req_p)
        p.sched.update_state_after_alloc(req_p, blocks([4, 5, 6], [9]), 0)
        p.step()
        req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p.sched.request_finished_all_groups(req_p, ([4, 5, 6], [9]))
        assert params is not None
        p.close()  # P is gone before D pulls
        p_open = False
        req_d = request("d-req", 41, params)
        sched.add_request(req_d)
        out = sched.schedule()
        assert req_d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        d.worker.bind_connector_metadata(out.kv_connector_metadata)
        d.worker.start_load_kv(None)  # type: ignore[arg-type]
        d.worker.clear_connector_metadata()
        results = d.worker.get_transfer_results(set())
        deadline = time.monotonic() + 20
        while "d-req" not in results.finished_recving and time.monotonic() < deadline:
            time.sleep(0.01)
            results = d.worker.get_transfer_results(set())
        assert results.finished_recving == {"d-req"} and results.failed_recving == {"d-req"}
        assert d.worker.get_block_ids_with_load_errors() == set()  # never block ids with two groups
        connector_output = KVConnectorOutput(
            finished_recving=results.finished_recving, failed_recving=results.failed_recving
        )
        sched.update_from_output(
            out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=connector_output)
        )
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"d-req": 41}  # recomputed from the start, nothing pulled again
    finally:
        sched.shutdown()
        d.close()
        if p_open:
            p.close()


def _hybrid_tracked(engine: Any) -> int:
    connector = engine.connector
    assert isinstance(connector, MooncakeHybridConnector) and connector._scheduler is not None
    return connector._scheduler.tracked


def test_hostile_params_on_a_hybrid_p_and_d(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's real Scheduler on P and on D: a hostile request is neither truncated nor pulled, one warning each."""
    p = hr.Engine(make_config(model_dir, "kv_producer", "P-hh", 40300), hybrid_kv_cache_config(), BLOCK)
    d = hr.Engine(make_config(model_dir, "kv_consumer", "D-hh", 40300), hybrid_kv_cache_config(), BLOCK)
    try:
        good_p = {"do_remote_decode": True}
        a = p.add("good-a", 41, dict(good_p))
        bad = p.add("bad", 41, {"do_remote_decode": "yes"}, first=500)
        b = p.add("good-b", 41, dict(good_p), first=900)
        assert (a.num_prompt_tokens, bad.num_prompt_tokens, b.num_prompt_tokens) == (40, 41, 40)  # P-side truncation
        out = p.schedule()
        hr.assert_one_warning(caplog, "do_remote_decode")
        assert out.num_scheduled_tokens == {"good-a": 40, "bad": 41, "good-b": 40}
        p.step(out, sampled=["good-a", "bad", "good-b"])
        assert p.params["bad"] is None and len(p.params["good-a"]["remote_block_ids"]) == 2
        p.step(p.schedule(), sending=["good-a", "good-b"])
        p.assert_idle(lambda: _hybrid_tracked(p))
        caplog.clear()
        good_d = {**p.params["good-a"], "remote_prefill_cached_tokens": 0}
        d.add("good-a", 41, dict(good_d))
        d_bad = d.add("bad", 41, {**good_d, "remote_block_ids": [[4, 5, 6]]}, first=500)  # one group of two
        d.add("good-b", 41, {**p.params["good-b"], "remote_prefill_cached_tokens": 0}, first=900)
        out = d.schedule()
        hr.assert_one_warning(caplog, "remote_block_ids")
        assert d_bad.kv_transfer_params is None and out.num_scheduled_tokens == {"bad": 41}
        assert sorted(out.kv_connector_metadata.inner.requests) == ["good-a", "good-b"]
        d.step(out, sampled=["bad"], recving=["good-a", "good-b"])
        out = d.schedule()
        assert out.num_scheduled_tokens == {"good-a": 1, "good-b": 1}
        d.step(out, sampled=["good-a", "good-b"])
        d.assert_idle(lambda: _hybrid_tracked(d))
    finally:
        p.close()
        d.close()
