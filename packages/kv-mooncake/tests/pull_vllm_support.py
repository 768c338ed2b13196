"""Builders shared by the pull connector's vLLM tests (test_vllm_connector, _hostile_params, _lifecycle).

A plain module, not a test module: it imports vLLM at the top, so only vllm-marked modules import it,
after their ``pytest.importorskip("vllm")``. ``model_dir`` is a fixture: a user binds it to a name of
its own module so pytest finds it there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Set before torch and vLLM are first imported (this module is the first to import them).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

from vllm.config import VllmConfig
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig

from ascend_dist.kv_mooncake.pull.vllm_connector import MooncakeConnectorV1Metadata
from ascend_dist.testing import vllm_builders as vb

MODULE = "ascend_dist.kv_mooncake.pull.vllm_connector"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
NUM_BLOCKS = vb.NUM_BLOCKS
BLOCK = vb.BLOCK
blocks = vb.blocks
request = vb.request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vb.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def make_config(model_dir: Path, role: str, engine_id: str, kv_port: int, **extra: Any) -> VllmConfig:
    return vb.make_vllm_config(
        model_dir,
        connector="MooncakeConnectorV1",
        module=MODULE,
        role=role,
        engine_id=engine_id,
        kv_port=kv_port,
        extra=extra,
    )


def kv_cache_config() -> KVCacheConfig:
    return vb.kv_cache_config([(LAYERS, vb.attention_spec(2, 16))])


class Side(vb.Side):
    """One instance: scheduler-role and worker-role connectors from vLLM's factory, CPU caches."""

    def __init__(self, config: VllmConfig, seed: int) -> None:
        super().__init__(config, seed, LAYERS, kv_cache_config(), MooncakeConnectorV1Metadata)

    def step(self) -> None:
        self.run_step(SchedulerOutput.make_empty())
        self.worker.clear_connector_metadata()
