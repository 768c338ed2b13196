"""Recompute, simple and UCM connectors against the pinned vLLM's real classes (nox session vllm).

One preempt/restore cycle runs through the real factory-registered connector class, vLLM's real
BlockPool, Request, KVCacheBlocks and KVConnectorOutput; a scheduler-role and a worker-role
connector talk only through vLLM's metadata objects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from ascend_dist.testing import vllm_builders

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 16
BLOCK = 16


def _register(name: str, module: str, cls: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, cls)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama ``config.json`` (no weights): vLLM's scheduler-side classes read the model config."""
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(
        json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
            "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": 512, "torch_dtype": "float16",
        })
    )  # fmt: skip
    return d


def _configs(
    name: str, extra: dict[str, Any], *, prefix_caching: bool = False, model_dir: Path | None = None
) -> tuple[Any, Any]:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    model: dict[str, Any] = {}
    if model_dir is not None:
        model["model_config"] = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=256)
    vllm_config = VllmConfig(
        **model,
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra),
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.int8)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=NUM_BLOCKS * page, layers=["l0"], layer_stride=NUM_BLOCKS * page, block_stride=page)
    return vllm_config, KVCacheConfig(NUM_BLOCKS, [tensor], [KVCacheGroupSpec(["l0"], spec)])


def _kv() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    shape = (NUM_BLOCKS, BLOCK, 1, 4)
    return (
        torch.randint(-128, 127, shape, dtype=torch.int8, generator=gen),
        torch.randint(-128, 127, shape, dtype=torch.int8, generator=gen),
    )


def test_recompute_preempt_reuse_restore_cycle() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    _register("RecomputeCPUOffloadConnector", "ascend_dist.kv_offload.vllm_recompute", "RecomputeCPUOffloadConnector")
    vllm_config, kv_config = _configs("RecomputeCPUOffloadConnector", {"cpu_bytes_to_use": "8 KiB"})
    sched = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_config)
    worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_config)
    pool = BlockPool(NUM_BLOCKS, enable_caching=False, hash_block_size=BLOCK)
    sched.bind_gpu_block_pool(pool)
    k, v = _kv()
    worker.register_kv_caches({"l0": (k, v)})
    hasher = vllm_builders.block_hasher(vllm_config, kv_config)
    request = Request("A", list(range(40)), SamplingParams(max_tokens=4), None, block_hasher=hasher)
    blocks = pool.get_new_blocks(3)
    ids = [b.block_id for b in blocks]
    saved = (k[ids].clone(), v[ids].clone())
    assert sched.update_state_before_preempt(request, [ids], 40)
    pool.free_blocks(blocks)  # the scheduler preempts A: its blocks are free at once
    meta = sched.build_connector_meta(None)
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions(meta)  # synchronous store
    k.fill_(1)  # another request reuses every block in this step
    v.fill_(1)
    assert worker.get_finished(set()) == (None, None)
    out = KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    sched.update_connector_output(out)
    assert sched.get_num_new_matched_tokens(request, 0) == (40, True)
    new_blocks = pool.get_new_blocks(3)
    sched.update_state_after_alloc(request, KVCacheBlocks((new_blocks,)), 40)
    assert all(b.ref_cnt == 2 for b in new_blocks)  # pinned during the restore
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_kv(None)
    worker.wait_for_layer_load("l0")
    worker.worker.transfers.wait(worker.worker.transfers.load.pending(), 10.0)
    assert worker.get_finished(set()) == (None, {"A"})
    new_ids = [b.block_id for b in new_blocks]
    assert torch.equal(k[new_ids], saved[0]) and torch.equal(v[new_ids], saved[1])
    sched.update_connector_output(KVConnectorOutput(finished_recving={"A"}))
    assert all(b.ref_cnt == 1 for b in new_blocks) and not sched.has_pending_push_work()
    worker.shutdown()


def test_simple_worker_override_and_ucm_wrapper_without_ucm(model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata, SimpleCPUOffloadWorkerMetadata

    from ascend_dist.kv_offload.ucm import UcmUnavailable
    from ascend_dist.kv_offload.vllm_simple import AscendSimpleCPUOffloadConnector, AscendSimpleWorkerHandler
    from ascend_dist.kv_offload.vllm_ucm import UCMConnector

    _register("SimpleCPUOffloadConnector", "ascend_dist.kv_offload.vllm_simple", "AscendSimpleCPUOffloadConnector")
    _register("UCMConnector", "ascend_dist.kv_offload.vllm_ucm", "UCMConnector")
    extra = {"cpu_bytes_to_use": 4096}
    vllm_config, kv_config = _configs("SimpleCPUOffloadConnector", extra, prefix_caching=True, model_dir=model_dir)
    sched = AscendSimpleCPUOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_config)
    assert sched.scheduler_manager is not None
    sched.shutdown()
    conn = AscendSimpleCPUOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_config)
    assert isinstance(conn.worker_handler, AscendSimpleWorkerHandler)
    k, v = _kv()
    conn.register_kv_caches({"l0": (k, v)})
    # vLLM's own scheduler side (no worker count handed to it yet) plans over as many host blocks.
    assert sched.scheduler_manager.num_cpu_blocks == conn.worker_handler.num_cpu_blocks == 32
    if hasattr(conn, "get_aligned_num_cpu_blocks"):  # vLLM 0.33 also hands the workers' count to its scheduler
        assert conn.get_aligned_num_cpu_blocks() == 32
    meta = SimpleCPUOffloadMetadata(store_event=0, store_gpu_blocks=[3, 4], store_cpu_blocks=[0, 1])
    conn.bind_connector_metadata(meta)
    conn.wait_for_save()
    conn.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))
    conn.get_finished(set())
    worker_meta = conn.build_connector_worker_meta()
    assert isinstance(worker_meta, SimpleCPUOffloadWorkerMetadata) and worker_meta.completed_store_events == {0: 1}
    conn.clear_connector_metadata()
    load = SimpleCPUOffloadMetadata(
        load_event=0, load_gpu_blocks=[9, 10], load_cpu_blocks=[0, 1], load_event_to_reqs={0: ["r"]}
    )
    conn.bind_connector_metadata(load)
    conn.start_load_kv(None)  # type: ignore[arg-type]
    conn.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))
    assert conn.get_finished(set()) == (None, {"r"})
    assert torch.equal(k[9:11], k[3:5]) and torch.equal(v[9:11], v[3:5])
    conn.shutdown()
    ucm_config, _ = _configs("UCMConnector", {})
    with pytest.raises(UcmUnavailable, match="uc-manager"):
        UCMConnector(ucm_config, KVConnectorRole.SCHEDULER, kv_config)


def test_simple_num_cpu_blocks_is_honoured_on_vllm_0_33_and_refused_on_0_32() -> None:
    """vLLM 0.32's scheduler sizes its host pool alone: a worker-side override would disagree with it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector

    from ascend_dist.common.errors import ConfigError
    from ascend_dist.kv_offload.vllm_simple import AscendSimpleCPUOffloadConnector

    extra = {"cpu_bytes_to_use": 4096, "num_cpu_blocks": 8}
    vllm_config, kv_config = _configs("SimpleCPUOffloadConnector", extra, prefix_caching=True)
    if not hasattr(SimpleCPUOffloadConnector, "get_aligned_num_cpu_blocks"):  # vLLM 0.32
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ConfigError, match=r"num_cpu_blocks=8 .*vLLM 0\.32"):
                AscendSimpleCPUOffloadConnector(vllm_config, role, kv_config)
        return
    conn = AscendSimpleCPUOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_config)
    assert conn.worker_handler is not None and conn.worker_handler.num_cpu_blocks == 8
    assert conn.get_aligned_num_cpu_blocks() == 8
    conn.shutdown()


class _FakeUcm:
    """Our stand-in for UCM's dispatcher (two-argument constructor, like the 2026-04 snapshot)."""

    calls: ClassVar[list[tuple[str, tuple[Any, ...]]]] = []

    def __init__(self, vllm_config: Any, role: Any) -> None:
        self.connector = _FakeInner()

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        self.calls.append(("match", (request, num_computed)))
        return 32, False

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        self.calls.append(("finished", (request, tuple(block_ids))))
        return False, None

    def shutdown(self) -> None:  # the dispatcher's own: wins over the inner one
        self.calls.append(("shutdown", ()))


class _FakeInner:
    def reset_cache(self) -> bool:
        return True


def test_ucm_adapter_delegates_to_the_dispatcher() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ascend_dist.kv_offload.vllm_ucm import UCMConnector

    class FakeUCMConnector(UCMConnector):
        dispatcher_cls = _FakeUcm

    _register("UCMConnector", "ascend_dist.kv_offload.vllm_ucm", "UCMConnector")
    ucm_config, kv_config = _configs("UCMConnector", {})
    conn = FakeUCMConnector(ucm_config, KVConnectorRole.SCHEDULER, kv_config)
    assert conn.get_num_new_matched_tokens("req", 0) == (32, False)
    assert conn.request_finished_all_groups("req", ([1, 2],)) == (False, None)
    assert conn.reset_cache() is True and conn.take_events() == () and conn.handle_preemptions(None) is None
    conn.shutdown()
    assert [c[0] for c in _FakeUcm.calls] == ["match", "finished", "shutdown"]


def test_simple_capacity_with_several_tensors_matches_vllms_scheduler() -> None:
    """Several `KVCacheTensor`s share one backing allocation of ``size`` bytes: count it once, as vLLM does."""
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheTensor
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    from ascend_dist.kv_offload.vllm_simple import simple_capacity

    vllm_config, kv_config = _configs("SimpleCPUOffloadConnector", {"cpu_bytes_to_use": 1 << 16})
    page = kv_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    backing = 4 * NUM_BLOCKS * page  # four layers, layer-outermost, in one allocation
    tensors = [
        KVCacheTensor(
            size=backing,
            layers=[f"l{i}"],
            layer_stride=NUM_BLOCKS * page,
            block_stride=page,
            offset=i * NUM_BLOCKS * page,
        )
        for i in range(4)
    ]
    several = dataclasses.replace(kv_config, kv_cache_tensors=tensors)
    ours = simple_capacity(vllm_config, several).num_cpu_blocks
    assert ours == NUM_BLOCKS * (1 << 16) // backing  # not a quarter of it
    vllms = SimpleCPUOffloadScheduler._derive_cpu_config(several, 1 << 16).num_blocks
    assert ours == vllms


def test_recompute_warns_once_per_unsaved_resume(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's own scheduler preempts without the hook: the resume is recomputed, and said so once."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    _register("RecomputeCPUOffloadConnector", "ascend_dist.kv_offload.vllm_recompute", "RecomputeCPUOffloadConnector")
    vllm_config, kv_config = _configs("RecomputeCPUOffloadConnector", {"cpu_bytes_to_use": "8 KiB"})
    sched = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_config)
    request = Request("B", list(range(40)), SamplingParams(max_tokens=4), None)
    with caplog.at_level("WARNING", logger="ascend_dist.kv_offload.vllm_recompute"):
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # never preempted: silent
        request.num_preemptions = 1
        for _ in range(2):  # vLLM may ask again while the request waits
            assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        request.num_preemptions = 2
        sched.get_num_new_matched_tokens(request, 0)
    warned = [r.getMessage() for r in caplog.records if "resumes after preemption" in r.getMessage()]
    assert len(warned) == 2 and "preemption 1 " in warned[0] and "preemption 2 " in warned[1]
    sched.request_finished(request, [])
    assert sched._warned_resumes == {}
