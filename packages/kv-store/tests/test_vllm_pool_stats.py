"""AscendStoreConnector's pool hit/miss stats read back through vLLM's own stats objects.

Two instances share one real Mooncake Store (as in test_vllm_connector): the first one's lookup
misses the whole prompt and saves it, the second one's hits its whole chunks. The scheduler-side
stats go to vLLM's `KVConnectorLogging` and `KVConnectorProm` (a private Prometheus registry).
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pool_vllm_support import Instance, make_config  # noqa: E402

from ascend_dist.testing.vllm_stats import read_back  # noqa: E402


def _payload(inst: Instance) -> dict | None:
    stats = inst.scheduler.connector.get_kv_connector_stats()  # type: ignore[union-attr]
    return None if stats is None else stats.to_dict()


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
