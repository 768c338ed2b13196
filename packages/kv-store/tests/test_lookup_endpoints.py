"""Lookup endpoints per instance: two vLLM instances on one host each reach their own lookup server.

Both instances publish their endpoint (``lookup_rpc_port`` 0, the default) under one
``VLLM_RPC_BASE_PATH``; they serve different models, so a lookup that reaches the other instance's
worker is refused as an incompatible key scheme (a failure) instead of passing unnoticed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ascend_dist.testing import vllm_builders as vb  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


class Instance:
    """One engine's scheduler (vLLM's, which builds the scheduler connector) and rank-0 worker connector."""

    def __init__(self, model_dir: Path, master: str) -> None:
        ktc = KVTransferConfig(
            kv_connector="AscendStoreConnector",
            kv_role="kv_both",
            kv_connector_module_path="ascend_dist.kv_store.vllm_connector",
            kv_connector_extra_config={
                "backend": "mooncake",
                "store_config": {"master_server_address": master, "protocol": "tcp", "global_segment_size": "16MB",
                                 "local_buffer_size": "8MB"},
            },
        )  # fmt: skip
        self.config = vb.cpu_vllm_config(model_dir, ktc)
        self.kcc = vb.kv_cache_config([(LAYERS, vb.attention_spec(2, 16))])
        self.hasher = vb.block_hasher(self.config, self.kcc)
        self.worker: Any = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kcc)
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kcc,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=vb.BLOCK,
            log_stats=False,
        )

    def lookup_failures_after_one_step(self, rid: str) -> int:
        self.scheduler.add_request(Request(rid, list(range(100, 170)), SamplingParams(max_tokens=2), None,
                                           block_hasher=self.hasher))  # fmt: skip
        self.scheduler.schedule()  # asks the pool for the prompt's hits through the lookup client
        return self.scheduler.connector._client.failures  # type: ignore[union-attr]

    def close(self) -> None:
        self.scheduler.connector.shutdown()  # type: ignore[union-attr]
        self.worker.shutdown()


def test_two_instances_on_one_host_each_reach_their_own_server(
    tmp_path: Path, mooncake_master, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    dirs = [tmp_path / "model-a", tmp_path / "model-b"]
    for d in dirs:
        d.mkdir()
    a = Instance(vb.write_model_dir(dirs[0]), mooncake_master.address)
    b = None
    try:
        b = Instance(vb.write_model_dir(dirs[1]), mooncake_master.address)
        assert a.config.kv_transfer_config.engine_id != b.config.kv_transfer_config.engine_id
        with caplog.at_level(logging.WARNING, logger="ascend_dist.kv_store"):
            assert a.lookup_failures_after_one_step("ra") == 0, caplog.text  # today: b's server refused a's scheme
            assert b.lookup_failures_after_one_step("rb") == 0, caplog.text
        assert "incompatible key scheme" not in caplog.text
    finally:
        a.close()
        if b is not None:
            b.close()
