"""The vLLM side of kv-store's connector tests: the tiny model's config and an `Instance`.

The tests take the tiny model from conftest's `model_dir` fixture. An instance is a real vLLM
``Scheduler`` (which builds the SCHEDULER-role connector through vLLM's factory) beside a
WORKER-role connector over CPU caches, stepped in the model runner's call order. A plain helper
module imported by name from this directory (conftest puts it on ``sys.path``): other members'
test modules share file names, so no test module imports another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ascend_dist.kv_store.vllm_connector import AscendStoreConnectorMetadata
from ascend_dist.testing import vllm_builders as vb

MODULE = "ascend_dist.kv_store.vllm_connector"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
NUM_BLOCKS = vb.NUM_BLOCKS
BLOCK = vb.BLOCK


def make_config(
    model_dir: Path, master: str, port: int, name: str = "AscendStoreConnector", **extra: Any
) -> VllmConfig:
    store = {
        "master_server_address": master,
        "protocol": "tcp",
        "global_segment_size": "32MB",
        "local_buffer_size": "8MB",
    }
    ktc = KVTransferConfig(
        kv_connector=name,
        kv_role="kv_both",
        kv_connector_module_path=MODULE,
        kv_connector_extra_config={"backend": "mooncake", "store_config": store, "lookup_rpc_port": port, **extra},
    )
    return vb.cpu_vllm_config(model_dir, ktc)


def kv_cache_config() -> KVCacheConfig:
    return vb.kv_cache_config([(LAYERS, vb.attention_spec(2, 16))])


class Instance:
    """A vLLM scheduler plus a worker-role connector over CPU caches."""

    def __init__(self, config: VllmConfig, seed: int, kcc: KVCacheConfig | None = None) -> None:
        self.kcc = kcc or kv_cache_config()
        self.hasher = vb.block_hasher(config, self.kcc)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kcc)
        gen = torch.Generator().manual_seed(seed)
        self.caches = {
            name: torch.randn(2, NUM_BLOCKS, BLOCK, 2, 16, generator=gen).to(torch.float16) for name in LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=self.kcc,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=False,
        )

    def request(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        """A request as this instance's engine builds it (hashed with its block hasher)."""
        return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=self.hasher)

    def block(self, block_id: int) -> bytes:
        return b"".join(self.caches[n][kv, block_id].numpy().tobytes() for n in LAYERS for kv in (0, 1))

    def step(self, layerwise: bool = False) -> Any:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, AscendStoreConnectorMetadata)
        self.worker.handle_preemptions(meta)  # vLLM's runner order
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in LAYERS if layerwise else ():  # what vLLM's maybe_transfer_kv_layer does per layer
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name, self.caches[name], None)  # type: ignore[arg-type]
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        return out

    def close(self) -> None:
        self.scheduler.connector.shutdown()  # type: ignore[union-attr]
        self.worker.shutdown()
