"""AscendStoreConnector's pool stats read back through vLLM's own stats objects.

Two instances share one real Mooncake Store (as in test_vllm_connector): the first one's lookup
misses the whole prompt and saves it, the second one's hits its whole chunks and loads them. The
scheduler's stats (lookup hits and misses) and the worker's (every store get and put) are aggregated
as vLLM's scheduler aggregates them (`KVConnectorStats.aggregate`) and handed to vLLM's
`KVConnectorLogging` and `KVConnectorProm` (a private Prometheus registry).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pool_vllm_support import LAYERS, Instance, make_config  # noqa: E402

from ascend_dist.kv_store.vllm_connector import AscendStoreConnector  # noqa: E402
from ascend_dist.testing.vllm_stats import read_back  # noqa: E402

KINDS = ("lease_expired", "peer_unreachable", "timeout", "refused", "other")


def _payload(inst: Instance) -> dict[str, Any] | None:
    """What vLLM's scheduler reports for one interval: the workers' stats aggregated with its own."""
    worker = inst.worker.get_kv_connector_stats()
    scheduler = inst.scheduler.connector.get_kv_connector_stats()  # type: ignore[union-attr]
    if worker is None:
        stats = scheduler
    elif scheduler is not None and not scheduler.is_empty():
        stats = worker.aggregate(scheduler)
    else:
        stats = worker
    return None if stats is None else stats.to_dict()


def _failed(out: Any, direction: str) -> dict[str, float]:
    found = {k: out.sample("vllm:ascend_pool_num_failed_transfers_total", direction=direction, kind=k) for k in KINDS}
    return {k: v for k, v in found.items() if v}


def _pool_keys(inst: Instance, prompt: list[int]) -> list[str]:
    connector = inst.scheduler.connector
    assert isinstance(connector, AscendStoreConnector) and connector._scheduler is not None
    hashes = connector._scheduler.hashes_for(prompt, salt="\x00")[1]  # no LoRA, no cache salt
    return [meta.pool_key(h) for meta in connector._spec.key_metadata() for h in hashes]


def test_pool_misses_then_hits_reach_vllms_log_and_prometheus(model_dir, mooncake_master, kvtools) -> None:
    config_a = make_config(model_dir, mooncake_master.address, kvtools.free_port())
    a = Instance(config_a, seed=1)
    b = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), seed=2)
    try:
        assert _payload(a) is None  # control: no lookup yet, nothing to report
        prompt = list(range(300, 370))  # 4 full chunks + 6 tokens
        a.scheduler.add_request(a.request("ra", prompt))
        a.step()
        a.worker._worker.drain(20)
        out_a = read_back(config_a, _payload(a))
        assert out_a.sample("vllm:ascend_pool_hit_tokens_total") is None  # the empty pool found nothing
        assert out_a.sample("vllm:ascend_pool_miss_tokens_total") == 70
        b.scheduler.add_request(b.request("rb", prompt))
        b.step()
        out_b = read_back(config_a, _payload(b))
        assert out_b.sample("vllm:ascend_pool_hit_tokens_total") == 64
        assert out_b.sample("vllm:ascend_pool_miss_tokens_total") == 6
        assert "pool: Hit tokens=64, pool: Miss tokens=6" in out_b.lines[0]
        assert _payload(b) is None  # taken once
    finally:
        a.close()
        b.close()


def test_saves_and_loads_report_the_bytes_they_moved(model_dir, mooncake_master, kvtools) -> None:
    config = make_config(model_dir, mooncake_master.address, kvtools.free_port())
    a = Instance(config, seed=3)
    b = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), seed=4)
    try:
        prompt = list(range(500, 570))  # 4 full chunks (one block each) + 6 tokens
        a.scheduler.add_request(a.request("sa", prompt))
        blocks_a = a.step().scheduled_new_reqs[0].block_ids[0]
        a.worker._worker.drain(20)
        chunk = len(a.block(blocks_a[0]))  # every layer's K and V of one block: one pool object
        out_a = read_back(config, _payload(a))
        assert out_a.sample("vllm:ascend_pool_bytes_transferred_sum", direction="save") == 4 * chunk
        assert out_a.sample("vllm:ascend_pool_num_descriptors_sum", direction="save") == 4 * 2 * len(LAYERS)
        assert out_a.sample("vllm:ascend_pool_xfer_time_seconds_count", direction="save") >= 1
        assert out_a.sample("vllm:ascend_pool_bytes_transferred_sum", direction="load") is None  # it loaded nothing
        assert _failed(out_a, "save") == {}
        assert f"pool save: MB transferred={round(4 * chunk / 2**20, 3)}" in out_a.lines[0]

        b.scheduler.add_request(b.request("sb", prompt))
        new = b.step().scheduled_new_reqs[0]
        assert new.num_computed_tokens == 64
        assert [b.block(x) for x in new.block_ids[0][:4]] == [
            a.block(x) for x in blocks_a[:4]
        ]  # the bytes counted are these
        b.worker._worker.drain(20)
        out_b = read_back(config, _payload(b))
        assert out_b.sample("vllm:ascend_pool_bytes_transferred_sum", direction="load") == 4 * chunk
        assert out_b.sample("vllm:ascend_pool_xfer_time_seconds_count", direction="load") >= 1
        assert _failed(out_b, "load") == {}
        # b's own tail chunk is not pooled (partial) and its 4 full chunks exist: b saved nothing
        assert out_b.sample("vllm:ascend_pool_bytes_transferred_sum", direction="save") is None
    finally:
        a.close()
        b.close()


def test_a_load_of_evicted_objects_is_a_failure_of_its_kind_and_moves_no_bytes(
    model_dir, mooncake_master, kvtools
) -> None:
    from mooncake.store import MooncakeDistributedStore

    config = make_config(model_dir, mooncake_master.address, kvtools.free_port())
    a = Instance(config, seed=5)
    b = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), seed=6)
    admin = MooncakeDistributedStore()
    assert admin.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_master.address) == 0
    try:
        prompt = list(range(700, 770))
        a.scheduler.add_request(a.request("ea", prompt))
        a.step()
        a.worker._worker.drain(20)
        _payload(a)
        b.scheduler.add_request(b.request("eb", prompt))
        out = b.scheduler.schedule()  # the lookup found all 4 chunks
        assert out.scheduled_new_reqs[0].num_computed_tokens == 64
        for key in _pool_keys(b, prompt):  # evicted between the lookup and the load (force: it is leased)
            assert admin.remove(key, True) == 0
        b.worker.handle_preemptions(out.kv_connector_metadata)
        b.worker.bind_connector_metadata(out.kv_connector_metadata)
        b.worker.start_load_kv(None)  # type: ignore[arg-type]
        b.worker.clear_connector_metadata()
        assert len(b.worker.get_block_ids_with_load_errors()) == 4
        out_b = read_back(config, _payload(b))
        assert _failed(out_b, "load") == {"lease_expired": 4}  # Mooncake's OBJECT_NOT_FOUND, one per object
        assert out_b.sample("vllm:ascend_pool_bytes_transferred_sum", direction="load") is None
        assert "pool load: Num failed transfers (lease_expired)=4" in out_b.lines[0]
        assert "pool load: Num successful transfers" not in out_b.lines[0]
    finally:
        admin.close()
        a.close()
        b.close()
