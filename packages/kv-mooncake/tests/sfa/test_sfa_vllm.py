"""SfaRemoteD2HConnector against the real vLLM 0.33.0 classes (factory, configs, requests, blocks, outputs).

P and D connectors of both roles are built by vLLM's ``KVConnectorFactory`` from real
``VllmConfig``s in this process (one Mooncake engine over TCP on loopback). D's scheduler posts its
contact info to a real HTTP metaserver; P's scheduler gets it in ``kv_transfer_params`` and, fed
vLLM ``SchedulerOutput``s of a two-chunk prefill, drives P's worker layer by layer; D's read
threads fill the host pool and the indexer caches, checked byte for byte against P's caches.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

import sfa_vllm_support as support  # noqa: E402
import torch  # noqa: E402
from sfa_vllm_support import BLOCK, INDEXER, MAIN, NUM_BLOCKS, kv_cache_config, make_config  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dist.common.errors import ConfigError, DeviceUnavailable  # noqa: E402
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.sfa.vllm_connector import SfaRemoteD2HConnector, SfaRemoteD2HMetadata  # noqa: E402
from ascend_dist.testing import hostile as hr  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402

model_dir = support.model_dir  # the tiny MLA-like config directory fixture


@pytest.fixture
def metaserver() -> Iterator[hr.Metaserver]:
    m = hr.Metaserver()
    yield m
    m.close()


def caches(seed: int) -> dict[str, torch.Tensor]:
    """MLA-style caches: one ``[blocks, block, 64]`` main tensor and one ``[blocks, block, 16]`` indexer per layer."""
    gen = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(NUM_BLOCKS, BLOCK, 64, generator=gen).half() for n in MAIN}
    out |= {n: torch.randn(NUM_BLOCKS, BLOCK, 16, generator=gen).half() for n in INDEXER}
    return out


def blocks(main: list[int], idx: list[int]) -> KVCacheBlocks:
    return vb.blocks(main, idx)


def bind(connector: Any, meta: Any) -> None:
    assert isinstance(meta, SfaRemoteD2HMetadata)
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)


def test_layerwise_remote_d2h_through_the_vllm_connector(model_dir: Path, metaserver: hr.Metaserver) -> None:
    port = free_port_range(1)
    kcc = kv_cache_config()
    p_cfg = make_config(model_dir, "kv_producer", "P-sfa", port)
    d_cfg = make_config(model_dir, "kv_consumer", "D-sfa", port)
    hasher = vb.block_hasher(d_cfg, kcc)  # P and D hash alike: one block size and algorithm
    p_sched = KVConnectorFactory.create_connector(p_cfg, KVConnectorRole.SCHEDULER, kcc)
    p_work = KVConnectorFactory.create_connector(p_cfg, KVConnectorRole.WORKER, kcc)
    d_sched = KVConnectorFactory.create_connector(d_cfg, KVConnectorRole.SCHEDULER, kcc)
    d_work = KVConnectorFactory.create_connector(d_cfg, KVConnectorRole.WORKER, kcc)
    assert isinstance(d_work, SfaRemoteD2HConnector)
    p_caches, d_caches = caches(1), caches(2)
    try:
        p_work.register_kv_caches(p_caches)
        d_work.register_kv_caches(d_caches)
        # D: vLLM's internal id carries a 9-character suffix; the wire and the proxy use the external id.
        params = {"do_remote_prefill": True, "metaserver": metaserver.url}
        req_d = vb.request("cmpl-1-0-0123abcd", 40, params, max_tokens=4, hasher=hasher)
        assert d_sched.get_num_new_matched_tokens(req_d, 0) == (40, True)
        d_sched.update_state_after_alloc(req_d, blocks([7, 8, 9], [20, 21, 22]), 40)
        bind(d_work, d_sched.build_connector_meta(SchedulerOutput.make_empty()))
        deadline = time.monotonic() + 10
        while "cmpl-1-0" not in metaserver.got:
            assert time.monotonic() < deadline, "D's contact never reached the metaserver"
            time.sleep(0.01)
        # P: the proxy sends the original request with D's contact info.
        contact = {**metaserver.got["cmpl-1-0"], "do_remote_decode": True}
        req_p = vb.request("cmpl-1-0-89abcdef", 40, contact, hasher=hasher)
        assert p_sched.get_num_new_matched_tokens(req_p, 0) == (0, False)
        p_sched.update_state_after_alloc(req_p, blocks([3, 4], [11, 12]), 0)
        # Two prefill chunks: 24 tokens in blocks (3, 4)/(11, 12), then 16 more in block 5/13.
        out1 = SchedulerOutput.make_empty()
        out1.scheduled_new_reqs = [NewRequestData.from_request(req_p, ([3, 4], [11, 12]))]
        out1.num_scheduled_tokens = {req_p.request_id: 24}
        out2 = SchedulerOutput.make_empty()
        out2.scheduled_cached_reqs = CachedRequestData.make_empty()
        out2.scheduled_cached_reqs.req_ids = [req_p.request_id]
        out2.scheduled_cached_reqs.new_block_ids = [([5], [13])]
        out2.scheduled_cached_reqs.num_computed_tokens = [24]
        out2.num_scheduled_tokens = {req_p.request_id: 16}
        for out in (out1, out2):
            bind(p_work, p_sched.build_connector_meta(out))
            for layer in range(2):
                for name in (INDEXER[layer], MAIN[layer]):
                    p_work.wait_for_layer_load(name)
                p_work.save_kv_layer(MAIN[layer], p_caches[MAIN[layer]], None)
            p_work.clear_connector_metadata()
        assert p_sched.request_finished(req_p, [3, 4, 5]) == (False, None)
        done: set[str] = set()
        while req_d.request_id not in done:
            assert time.monotonic() < deadline + 10, "D never finished receiving"
            done |= d_work.get_finished(set())[1] or set()
            time.sleep(0.005)
        assert d_work.get_block_ids_with_load_errors() == set()
        for layer in range(2):
            pool = d_work.host_pool[MAIN[layer]][0]
            assert torch.equal(pool[[7, 8, 9]], p_caches[MAIN[layer]][[3, 4, 5]])
            assert torch.equal(d_caches[INDEXER[layer]][[20, 21, 22]], p_caches[INDEXER[layer]][[11, 12, 13]])
        assert d_sched.request_finished(req_d, [7, 8, 9]) == (False, None)
    finally:
        for c in (p_work, d_work, p_sched, d_sched):
            c.shutdown()


def test_invalid_config_is_a_typed_error_naming_the_field(model_dir: Path) -> None:
    config = make_config(model_dir, "kv_consumer", "D-bad", 40000, prefill={"tp_size": 1}, decode={"tp_size": 2})
    with pytest.raises(ConfigError, match=r"prefill\.tp_size"):
        SfaRemoteD2HConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_memfabric_worker_without_the_ascend_driver(model_dir: Path) -> None:
    config = make_config(model_dir, "kv_consumer", "D-mf", 40000, transfer_backend="memfabric")
    with pytest.raises(DeviceUnavailable, match="Ascend driver"):
        SfaRemoteD2HConnector(config, KVConnectorRole.WORKER, kv_cache_config())


def test_each_worker_uses_its_own_device(model_dir: Path) -> None:
    """Two D workers on simulated devices 1 and 3 (vLLM made each current): each engine and event on its own.

    Control: upstream opened device 0 on every rank; a cache on another device is refused by name.
    """
    from ascend_dist.common.device import current_device_index, set_current_device

    before = current_device_index()
    made: list[Any] = []
    try:
        for index in (1, 3):
            set_current_device(index)
            config = make_config(model_dir, "kv_consumer", f"D-dev{index}", free_port_range(1))
            made.append(SfaRemoteD2HConnector(config, KVConnectorRole.WORKER, kv_cache_config()))
        assert [c.device_index for c in made] == [1, 3]
        # A cache not on the worker's device (torch's meta device: a CPU host has no second one).
        wrong = {n: torch.empty(NUM_BLOCKS, BLOCK, 64, device="meta") for n in MAIN}
        with pytest.raises(ConfigError, match="kv_caches device"):
            made[0].register_kv_caches(wrong | {n: torch.empty(NUM_BLOCKS, BLOCK, 16) for n in INDEXER})
    finally:
        set_current_device(before)
        for c in made:
            c.shutdown()


def _scheduler(config: VllmConfig, kcc: KVCacheConfig) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=config,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=False,
    )


def _report(sched: Any, out: Any, d_work: Any, rid: str) -> Any:
    """Poll D's worker until ``rid`` is reported, hand vLLM the connector output, schedule again."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    deadline = time.monotonic() + 20
    results = d_work.get_transfer_results(set())
    errors = d_work.get_block_ids_with_load_errors()
    while rid not in results.finished_recving:
        assert time.monotonic() < deadline, f"{rid} never reported"
        time.sleep(0.01)
        got = d_work.get_transfer_results(set())
        results.finished_recving |= got.finished_recving
        results.failed_recving |= got.failed_recving
        errors |= d_work.get_block_ids_with_load_errors()
    output = KVConnectorOutput(
        finished_recving=results.finished_recving, invalid_block_ids=errors, failed_recving=results.failed_recving
    )
    sched.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=output))
    assert errors == set()  # two KV-cache groups: failures go by request (vLLM refuses block ids then)
    return results.failed_recving


def test_d_driven_by_vllms_scheduler_loads_or_recomputes(model_dir: Path, metaserver: hr.Metaserver) -> None:
    """D's real v1 Scheduler: WAITING_FOR_REMOTE_KVS until the reads end; a P that never sends -> recompute."""
    port = free_port_range(1)
    kcc = kv_cache_config()
    p_cfg = make_config(model_dir, "kv_producer", "P-s", port)
    d_cfg = make_config(model_dir, "kv_consumer", "D-s", port, recv_timeout_s=2.0, quarantine_s=0.05)
    d_cfg.kv_transfer_config.kv_load_failure_policy = "recompute"  # type: ignore[union-attr]
    hasher = vb.block_hasher(d_cfg, kcc)  # P and D hash alike: one block size and algorithm
    p_sched = KVConnectorFactory.create_connector(p_cfg, KVConnectorRole.SCHEDULER, kcc)
    p_work = KVConnectorFactory.create_connector(p_cfg, KVConnectorRole.WORKER, kcc)
    d_work = KVConnectorFactory.create_connector(d_cfg, KVConnectorRole.WORKER, kcc)
    sched = _scheduler(d_cfg, kcc)
    p_caches, d_caches = caches(3), caches(4)
    try:
        p_work.register_kv_caches(p_caches)
        d_work.register_kv_caches(d_caches)
        params = {"do_remote_prefill": True, "metaserver": metaserver.url}
        ok = vb.request("ok-0123abcd", 40, dict(params), max_tokens=4, hasher=hasher)
        lost = vb.request("lost-0123abcd", 30, dict(params), max_tokens=4, first=200, hasher=hasher)
        sched.add_request(ok)
        sched.add_request(lost)
        out = sched.schedule()
        assert ok.status == lost.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        bind(d_work, out.kv_connector_metadata)
        d_main, d_idx = sched.kv_cache_manager.get_block_ids(ok.request_id)
        deadline = time.monotonic() + 10
        while "ok" not in metaserver.got:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        contact = {**metaserver.got["ok"], "do_remote_decode": True}
        req_p = vb.request("ok-89abcdef", 40, contact, hasher=hasher)
        p_sched.update_state_after_alloc(req_p, blocks([3, 4, 5], [11, 12, 13]), 0)
        p_out = SchedulerOutput.make_empty()
        p_out.scheduled_new_reqs = [NewRequestData.from_request(req_p, ([3, 4, 5], [11, 12, 13]))]
        p_out.num_scheduled_tokens = {req_p.request_id: 40}
        bind(p_work, p_sched.build_connector_meta(p_out))
        for layer in range(2):
            p_work.wait_for_layer_load(INDEXER[layer])
            p_work.wait_for_layer_load(MAIN[layer])
            p_work.save_kv_layer(MAIN[layer], p_caches[MAIN[layer]], None)
        assert _report(sched, out, d_work, ok.request_id) == set()
        for layer in range(2):
            assert torch.equal(d_work.host_pool[MAIN[layer]][0][d_main], p_caches[MAIN[layer]][[3, 4, 5]])
            assert torch.equal(d_caches[INDEXER[layer]][d_idx], p_caches[INDEXER[layer]][[11, 12, 13]])
        out = sched.schedule()
        assert out.num_scheduled_tokens.get(ok.request_id) == 1  # only the last prompt token is recomputed
        sched.finish_requests(ok.request_id, RequestStatus.FINISHED_ABORTED)  # (no model runs here)
        # 'lost' never reaches a P: after recv_timeout_s it is a failed receive and vLLM recomputes it.
        assert _report(sched, out, d_work, lost.request_id) == {lost.request_id}
        out = sched.schedule()
        assert out.num_scheduled_tokens.get(lost.request_id) == 30  # the whole prompt, locally
    finally:
        sched.shutdown()
        for c in (p_work, d_work, p_sched):
            c.shutdown()


def test_p_and_d_both_driven_by_vllms_scheduler_with_chunked_prefill(
    model_dir: Path, metaserver: hr.Metaserver
) -> None:
    """P's real v1 Scheduler prefills in 16-token chunks; each chunk's layers are read by D at once."""
    from vllm.v1.outputs import ModelRunnerOutput

    port = free_port_range(1)
    kcc = kv_cache_config()
    p_cfg = make_config(model_dir, "kv_producer", "P-c", port)
    p_cfg.scheduler_config.max_num_batched_tokens = 16
    p_cfg.scheduler_config.enable_chunked_prefill = True
    d_cfg = make_config(model_dir, "kv_consumer", "D-c", port)
    hasher = vb.block_hasher(d_cfg, kcc)  # P and D hash alike: one block size and algorithm
    p_work = KVConnectorFactory.create_connector(p_cfg, KVConnectorRole.WORKER, kcc)
    d_work = KVConnectorFactory.create_connector(d_cfg, KVConnectorRole.WORKER, kcc)
    p_sched, d_sched = _scheduler(p_cfg, kcc), _scheduler(d_cfg, kcc)
    p_caches, d_caches = caches(5), caches(6)
    try:
        p_work.register_kv_caches(p_caches)
        d_work.register_kv_caches(d_caches)
        params = {"do_remote_prefill": True, "metaserver": metaserver.url}
        req_d = vb.request("c-0123abcd", 45, params, max_tokens=4, first=300, hasher=hasher)
        d_sched.add_request(req_d)
        d_out = d_sched.schedule()
        bind(d_work, d_out.kv_connector_metadata)
        deadline = time.monotonic() + 10
        while "c" not in metaserver.got:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        contact = {**metaserver.got["c"], "do_remote_decode": True}
        req_p = vb.request("c-89abcdef", 45, contact, first=300, hasher=hasher)
        p_sched.add_request(req_p)
        chunks = 0
        while req_p.request_id in p_sched.requests and not req_p.is_finished():
            out = p_sched.schedule()
            n = out.num_scheduled_tokens.get(req_p.request_id, 0)
            assert n > 0
            p_blocks = p_sched.kv_cache_manager.get_block_ids(req_p.request_id)
            bind(p_work, out.kv_connector_metadata)
            for layer in range(2):
                p_work.wait_for_layer_load(INDEXER[layer])
                p_work.wait_for_layer_load(MAIN[layer])
                p_work.save_kv_layer(MAIN[layer], p_caches[MAIN[layer]], None)
            p_work.clear_connector_metadata()
            chunks += 1
            last = req_p.num_computed_tokens >= 45  # schedule() already counted this chunk
            runner = ModelRunnerOutput(
                req_ids=[req_p.request_id],
                req_id_to_index={req_p.request_id: 0},
                sampled_token_ids=[[7] if last else []],
            )
            p_sched.update_from_output(out, runner)
        assert chunks == 3  # 16 + 16 + 13 tokens
        assert _report(d_sched, d_out, d_work, req_d.request_id) == set()
        d_main, d_idx = d_sched.kv_cache_manager.get_block_ids(req_d.request_id)
        for layer in range(2):
            assert torch.equal(d_work.host_pool[MAIN[layer]][0][d_main], p_caches[MAIN[layer]][list(p_blocks[0])])
            assert torch.equal(d_caches[INDEXER[layer]][d_idx], p_caches[INDEXER[layer]][list(p_blocks[1])])
        assert d_sched.schedule().num_scheduled_tokens.get(req_d.request_id) == 1
    finally:
        p_sched.shutdown()
        d_sched.shutdown()
        for c in (p_work, d_work):
            c.shutdown()
