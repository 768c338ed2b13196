"""Native offloading adapter against the pinned vLLM's real offloading classes (nox session vllm)."""

from __future__ import annotations

import mmap
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm


def _config(extra: dict[str, Any], *, worker_bytes: int, world: int = 1, k: int = 1) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="e0",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=k),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=world, tp_size=world, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )  # fmt: skip


@pytest.fixture
def spec_cls() -> Any:
    from ascend_dist.common.device import CpuSimRuntime
    from ascend_dist.kv_offload.vllm_native import NPUOffloadingSpec

    class TestSpec(NPUOffloadingSpec):
        runtime = CpuSimRuntime(wait_timeout_s=10.0)

    yield TestSpec
    TestSpec.runtime.close()


@pytest.mark.skipif(mmap.PAGESIZE != 4096, reason="worked example assumes 4 KiB host pages")
def test_capacity_and_legacy_translation_without_mutating_the_config(spec_cls: Any) -> None:
    extra = {"cpu_bytes_to_use": 40960}
    spec = spec_cls(_config(extra, worker_bytes=64, world=2, k=2))
    assert spec.num_chunks == 10
    legacy = {"num_cpu_blocks": 10}
    spec = spec_cls(_config(legacy, worker_bytes=64, world=2, k=2))
    assert spec.num_chunks == 10 and spec.extra_config["cpu_bytes_to_use"] == 40960
    assert legacy == {"num_cpu_blocks": 10}  # the caller's dict is untouched
    scheduler_side = spec_cls(_config({"num_cpu_blocks": 7}, worker_bytes=0))
    assert scheduler_side.num_chunks == 7
    from ascend_dist.common.errors import ConfigError

    with pytest.raises(ConfigError, match="num_cpu_blocks"):
        spec_cls(_config({"num_cpu_blocks": 0}, worker_bytes=64))


def test_split_kv_store_and_load_through_the_real_manager(spec_cls: Any) -> None:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key

    from ascend_dist.kv_offload.vllm_native import canonicalise_kv_caches

    gen = torch.Generator().manual_seed(5)
    k = torch.randint(-128, 127, (16, 2, 8), dtype=torch.int8, generator=gen)
    v = torch.randint(-128, 127, (16, 2, 8), dtype=torch.int8, generator=gen)
    k0, v0 = k.clone(), v.clone()
    canonical = canonicalise_kv_caches({"l0": (k, v)}, [[("l0", 32)]], 16)
    assert len(canonical.tensors) == 2  # V is not dropped
    spec = spec_cls(_config({"cpu_bytes_to_use": 4096 * 8}, worker_bytes=32))
    manager, worker = spec.get_manager(), spec.get_worker(canonical)
    assert spec.get_worker(canonical) is worker
    ctx = ReqContext(req_id="r")
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(3)]
    out = manager.prepare_store(keys, ctx)
    assert out is not None and len(out.keys_to_store) == 3
    assert worker.submit_store(1, GPULoadStoreSpec([4, 5, 9], [3], [0]), out.store_spec)
    worker.wait({1})
    (result,) = worker.get_finished()
    assert result.success and result.transfer_size == 3 * 32
    manager.complete_store(keys, ctx)
    assert manager.lookup(keys[0], ctx) is LookupResult.HIT
    k.zero_()
    v.zero_()
    load_spec = manager.prepare_load(keys, ctx)
    assert worker.submit_load(2, load_spec, GPULoadStoreSpec([1, 2, 3], [3], [0]))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_load(keys, ctx)
    assert torch.equal(k[1:4], k0[[4, 5, 9]]) and torch.equal(v[1:4], v0[[4, 5, 9]])
    worker.shutdown()


def test_layout_adapter_covers_mla_and_mamba() -> None:
    from ascend_dist.kv_offload.vllm_native import canonicalise_kv_caches

    nope = torch.zeros(8, 4, 8, dtype=torch.int8)
    pe = torch.zeros(8, 4, 2, dtype=torch.int8)
    raw = torch.zeros(1 + 8 * 2 + 8 * 3, dtype=torch.int8)
    states = [raw[1:17].view(8, 2), raw[17:41].view(8, 3)]
    canonical = canonicalise_kv_caches(
        {"mla": (nope, pe), "mamba": states, "shared": (nope, pe)}, [[("mla", 40), ("shared", 40)], [("mamba", 5)]], 8
    )
    assert [t.page_size_bytes for t in canonical.tensors] == [32, 8, 2, 3]
    assert [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in canonical.group_data_refs] == [
        [(0, 32), (1, 8), (0, 32), (1, 8)], [(2, 2), (3, 3)],
    ]  # fmt: skip
    assert canonical.tensors[2].tensor.data_ptr() == states[0].data_ptr()


_NATIVE = "ascend_dist.kv_offload.vllm_native"
_SPEC_CHOICES = {
    "ours-explicit": {"spec_name": "NPUOffloadingSpec", "spec_module_path": _NATIVE},
    # vLLM's default and its explicit name: vLLM's CPUOffloadingSpec.get_worker raises on this CPU
    # ("only supported on CUDA-alike and XPU GPUs"), so these two pass only if ours replaced it.
    "default": {},
    "vllm-cpu-spec-named": {"spec_name": "CPUOffloadingSpec"},
}


@pytest.mark.parametrize("choice", sorted(_SPEC_CHOICES))
def test_factory_created_connector_stores_and_restores_split_kv(tmp_path: Any, choice: str) -> None:
    """The real OffloadingConnector flow (deferred store, flush, async load) with tuple caches.

    Without ``spec_name`` (or naming vLLM's CPU spec) the connector builds `NPUOffloadingSpec`.
    """
    import json
    import os
    import time

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    (tmp_path / "config.json").write_text(
        json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
            "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 512,
            "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
        })
    )  # fmt: skip
    name = "AscendOffloadingConnectorTest"
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, "ascend_dist.kv_offload.vllm_native", "AscendOffloadingConnector")
    extra = {**_SPEC_CHOICES[choice], "cpu_bytes_to_use": 1 << 20}
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=256),
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(enable_prefix_caching=True, block_size=16),
        kv_transfer_config=KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra),
    )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=4, dtype=torch.int8)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=16 * page, layers=["l0"], layer_stride=16 * page, block_stride=page)
    kv_config = KVCacheConfig(16, [tensor], [KVCacheGroupSpec(["l0"], spec)])
    conn = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_config)
    from ascend_dist.kv_offload.vllm_native import NPUOffloadingSpec

    assert type(conn.connector_worker.spec) is NPUOffloadingSpec
    assert extra == {**_SPEC_CHOICES[choice], "cpu_bytes_to_use": 1 << 20}  # vLLM's config is not mutated
    gen = torch.Generator().manual_seed(9)
    k = torch.randint(-128, 127, (16, 16, 1, 4), dtype=torch.int8, generator=gen)
    v = torch.randint(-128, 127, (16, 16, 1, 4), dtype=torch.int8, generator=gen)
    conn.register_kv_caches({"l0": (k, v)})  # a tuple: the Ascend layout adapter runs
    store = TransferJob("r", GPULoadStoreSpec([2, 3], [2], [0]), CPULoadStoreSpec([0, 1]))
    conn.bind_connector_metadata(OffloadingConnectorMetadata(load_jobs={}, store_jobs={1: store}))
    conn.wait_for_save()  # deferred to the next step
    conn.clear_connector_metadata()
    flush = OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush={1})
    conn.bind_connector_metadata(flush)
    conn.handle_preemptions(flush)  # submits the deferred store and waits for it
    conn.get_finished(set())
    assert conn.build_connector_worker_meta().completed_jobs == {1: 1}
    conn.clear_connector_metadata()
    load = TransferJob("r", CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([8, 9], [2], [0]))
    conn.bind_connector_metadata(OffloadingConnectorMetadata(load_jobs={2: load}, store_jobs={}))
    conn.start_load_kv(None)
    deadline = time.monotonic() + 10
    recving: set[str] = set()
    while not recving and time.monotonic() < deadline:
        recving = conn.get_finished(set())[1]
        time.sleep(0.01)
    assert recving == {"r"}
    assert torch.equal(k[8:10], k[2:4]) and torch.equal(v[8:10], v[2:4])
    conn.shutdown()


def test_other_spec_names_are_left_to_vllms_factory() -> None:
    from ascend_dist.kv_offload.vllm_native import with_ascend_spec

    tiering = _config({"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4096}, worker_bytes=64)
    assert with_ascend_spec(tiering) is tiering
    default = _config({"cpu_bytes_to_use": 4096}, worker_bytes=64)
    ours = with_ascend_spec(default)
    assert ours.extra_config == {
        "cpu_bytes_to_use": 4096,
        "spec_name": "NPUOffloadingSpec",
        "spec_module_path": _NATIVE,
    }
    assert dict(default.extra_config) == {"cpu_bytes_to_use": 4096}


def _two_group_worker(tmp_path: Any) -> tuple[Any, Any]:
    """A factory-built worker-role AscendOffloadingConnector over two KV-cache groups (split K/V)."""
    import json
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from ascend_dist.common.device import CpuSimRuntime

    (tmp_path / "config.json").write_text(
        json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1,
            "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
            "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
        })
    )  # fmt: skip
    module = "ascend_dist.kv_offload.vllm_native"
    extra = {"spec_name": "NPUOffloadingSpec", "spec_module_path": module, "cpu_bytes_to_use": 1 << 20}
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=256),
        device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(enable_prefix_caching=True, block_size=16),
        kv_transfer_config=KVTransferConfig(
            kv_connector="AscendOffloadingConnector", kv_connector_module_path=module, kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )  # fmt: skip
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=4, dtype=torch.int8)
    page = spec.page_size_bytes
    tensors = [KVCacheTensor(size=16 * page, layers=[n], layer_stride=0, block_stride=page) for n in ("l0", "l1")]
    kv_config = KVCacheConfig(16, tensors, [KVCacheGroupSpec(["l0"], spec), KVCacheGroupSpec(["l1"], spec)])
    conn = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_config)
    runtime = CpuSimRuntime(wait_timeout_s=10.0)
    conn.connector_worker.spec.runtime = runtime  # our NPUOffloadingSpec copies on this runtime
    caches = {n: tuple(torch.zeros(16, 16, 1, 4, dtype=torch.int8) for _ in range(2)) for n in ("l0", "l1")}
    conn.register_kv_caches(caches)
    return conn, runtime


def test_load_failure_with_several_groups_fails_the_request_not_the_step(tmp_path: Any) -> None:
    """Block ids overlap across groups: the failed async load is reported as ``failed_recving``."""
    import time

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    conn, runtime = _two_group_worker(tmp_path)
    try:
        dst = GPULoadStoreSpec([8, 9, 8, 9], [2, 2], [0, 0])  # the same ids in both groups (one chunk each)
        jobs = {
            1: TransferJob("bad", CPULoadStoreSpec([0, 1, 2, 3]), dst),
            2: TransferJob("good", CPULoadStoreSpec([4, 5, 6, 7]), GPULoadStoreSpec([4, 5, 4, 5], [2, 2], [0, 0])),
        }
        runtime.inject_copy_fault(0)
        recving: set[str] = set()
        failed: set[str] = set()
        # one job per step: a job completing behind a pending failure is failed too (transfer.py)
        for job_id, job in jobs.items():
            conn.bind_connector_metadata(OffloadingConnectorMetadata(load_jobs={job_id: job}, store_jobs={}))
            conn.start_load_kv(None)
            deadline = time.monotonic() + 10
            while job.req_id not in recving and time.monotonic() < deadline:
                results = conn.get_transfer_results(set())
                recving |= results.finished_recving
                failed |= results.failed_recving
                time.sleep(0.005)
            if job_id == 1:
                conn.clear_connector_metadata()
        assert recving == {"bad", "good"} and failed == {"bad"}
        assert conn.get_block_ids_with_load_errors() == set()
        assert conn.build_connector_worker_meta().completed_jobs == {1: 1, 2: 1}
        conn.clear_connector_metadata()
    finally:
        conn.shutdown()
        runtime.close()


def test_failed_sync_load_with_several_groups_is_a_typed_error(tmp_path: Any) -> None:
    """The worker's guard: a failed sync load with several groups (which our scheduler side never plans,
    see test_vllm_multigroup_failures.py) is a typed error instead of vLLM's assertion."""
    import dataclasses

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from ascend_dist.common.errors import TransferError

    if "sync" not in {f.name for f in dataclasses.fields(TransferJob)}:
        pytest.skip("vLLM 0.32's scheduler never plans a synchronous load (TransferJob.sync is new in 0.33)")
    conn, runtime = _two_group_worker(tmp_path)
    try:
        dst = GPULoadStoreSpec([8, 9, 8, 9], [2, 2], [0, 0])  # the same ids in both groups (one chunk each)
        sync = TransferJob("s", CPULoadStoreSpec([0, 1, 2, 3]), dst, sync=True)  # type: ignore[call-arg]
        runtime.inject_copy_fault(0)
        conn.bind_connector_metadata(OffloadingConnectorMetadata(load_jobs={3: sync}, store_jobs={}))
        conn.start_load_kv(None)  # waits for the sync job
        with pytest.raises(TransferError, match="no report for it"):
            conn.get_transfer_results(set())
    finally:
        conn.shutdown()
        runtime.close()


def test_worker_metadata_aggregates_failed_stores() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata, TransferStats

    from ascend_dist.common.errors import IncompatiblePeer
    from ascend_dist.kv_offload.messages import NativeFailedStores
    from ascend_dist.kv_offload.vllm_native import AscendOffloadingWorkerMetadata

    a = AscendOffloadingWorkerMetadata.build({1: 1, 2: 1}, TransferStats(), {1})
    b = AscendOffloadingWorkerMetadata.build({1: 1, 2: 1}, TransferStats(), {2})
    merged = a.aggregate(b)
    assert isinstance(merged, AscendOffloadingWorkerMetadata)
    assert merged.completed_jobs == {1: 2, 2: 2} and merged.failed_jobs == {1, 2}
    plain = merged.aggregate(OffloadingWorkerMetadata(completed_jobs={3: 1}))
    assert isinstance(plain, AscendOffloadingWorkerMetadata)
    assert plain.completed_jobs == {1: 2, 2: 2, 3: 1} and plain.failed_jobs == {1, 2}
    assert AscendOffloadingWorkerMetadata.build({4: 1}, TransferStats()).failed_payload == b""
    import msgspec

    other_release = msgspec.msgpack.encode(NativeFailedStores(version=99, job_ids=(1,)))
    with pytest.raises(IncompatiblePeer, match="version"):
        _ = AscendOffloadingWorkerMetadata({1: 1}, TransferStats(), other_release).failed_jobs
