"""AscendStoreConnector against the real vLLM classes, 0.32 and 0.33 (scheduler, requests, configs, factory).

Two "instances" share one real Mooncake Store: each has its own vLLM ``Scheduler`` (which creates the
SCHEDULER-role connector through vLLM's factory) and a WORKER-role connector over CPU caches. The
first instance computes and saves a prompt; the second one's scheduler finds it in the pool through
the lookup RPC, and its worker loads it byte-exact into the blocks vLLM allocated.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from pool_vllm_support import (  # noqa: E402
    BLOCK,
    LAYERS,
    NUM_BLOCKS,
    Instance,
    kv_cache_config,
    make_config,
)
from vllm import SamplingParams  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ascend_dist.common.errors import ConfigError  # noqa: E402
from ascend_dist.kv_store.vllm_connector import (  # noqa: E402
    AscendStoreConnector,
    MooncakeConnectorStoreV1,
)
from ascend_dist.testing import vllm_builders as vb  # noqa: E402


def test_second_instance_loads_first_instances_prefix(model_dir, mooncake_master, kvtools) -> None:
    a = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), seed=1)
    b = Instance(
        make_config(model_dir, mooncake_master.address, kvtools.free_port(), name="MooncakeConnectorStoreV1"), seed=2
    )
    try:
        assert type(a.scheduler.connector) is AscendStoreConnector
        assert isinstance(b.worker, MooncakeConnectorStoreV1)
        prompt = list(range(100, 170))  # 4 full chunks + 6 tokens
        a.scheduler.add_request(a.request("ra", prompt))
        out = a.step()
        blocks_a = out.scheduled_new_reqs[0].block_ids[0]
        a.worker._worker.drain(20)
        assert a.worker._worker.stats.saved_keys == 4

        b.scheduler.add_request(b.request("rb", prompt))
        out = b.step()
        new = out.scheduled_new_reqs[0]
        assert new.num_computed_tokens == 64  # the pool hit, floored to whole chunks
        assert out.num_scheduled_tokens["rb"] == 6
        assert b.worker.get_block_ids_with_load_errors() == set()
        blocks_b = new.block_ids[0]
        assert [b.block(x) for x in blocks_b[:4]] == [a.block(x) for x in blocks_a[:4]]
    finally:
        a.close()
        b.close()


def test_reset_cache_fences_kv_of_older_weights(model_dir, mooncake_master, kvtools) -> None:
    """Issue 25 item 5: without reset_cache (vLLM counted None as success) the pool kept serving KV
    computed under the weights before an update."""
    a = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), seed=1)
    b = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), seed=2)
    try:
        prompt = list(range(300, 370))  # 4 full chunks + 6 tokens
        a.scheduler.add_request(a.request("ra", prompt))
        a.step()
        a.worker._worker.drain(20)
        assert a.worker._worker.stats.saved_keys == 4
        connector = b.scheduler.connector
        assert isinstance(connector, AscendStoreConnector)
        assert connector.get_num_new_matched_tokens(b.request("before", prompt), 0)[0] == 64  # control: a hit
        assert b.scheduler.reset_prefix_cache(reset_connector=True)  # what vLLM does after a weight update
        assert connector.get_num_new_matched_tokens(b.request("after", prompt), 0)[0] == 0
        # KV b computes under its new weights is pooled under the new epoch and found again
        b.scheduler.add_request(b.request("rb", prompt))
        b.step()
        b.worker._worker.drain(20)
        assert connector.get_num_new_matched_tokens(b.request("again", prompt), 0)[0] == 64
    finally:
        a.close()
        b.close()


def test_layerwise_mode_through_the_connector(model_dir, mooncake_master, kvtools) -> None:
    cfg = {"use_layerwise": True}
    a = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port(), **cfg), seed=6)
    b = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port(), **cfg), seed=7)
    try:
        assert AscendStoreConnector.requires_piecewise_for_cudagraph(cfg)
        prompt = list(range(400, 470))
        a.scheduler.add_request(a.request("la", prompt))
        blocks_a = a.step(layerwise=True).scheduled_new_reqs[0].block_ids[0]
        a.worker._worker.drain(20)
        assert a.worker._worker.stats.saved_keys == 4 * len(LAYERS)  # one object per chunk and layer
        b.scheduler.add_request(b.request("lb", prompt))
        out = b.step(layerwise=True)
        new = out.scheduled_new_reqs[0]
        assert new.num_computed_tokens == 64
        assert b.worker.get_block_ids_with_load_errors() == set()
        assert [b.block(x) for x in new.block_ids[0][:4]] == [a.block(x) for x in blocks_a[:4]]
    finally:
        a.close()
        b.close()


def test_hybrid_groups_become_coordinator_rules(model_dir, kvtools) -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from ascend_dist.kv_store.vllm_connector import pool_spec_from_vllm

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=64)
    kcc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], swa)],
    )
    spec = pool_spec_from_vllm(make_config(model_dir, "127.0.0.1:1", kvtools.free_port()), kcc)
    assert spec.group_kinds == ("full", "sliding_window") and spec.sliding_windows == (0, 64)
    coord = spec.coordinator()
    assert coord is not None and coord.rules[1].contiguous(False) == 4
    plain = pool_spec_from_vllm(make_config(model_dir, "127.0.0.1:1", kvtools.free_port()), kv_cache_config())
    assert plain.group_kinds == () and plain.coordinator() is None


def test_bad_extra_config_names_the_key(model_dir, kvtools) -> None:
    config = make_config(model_dir, "127.0.0.1:1", kvtools.free_port(), backend="redis")
    with pytest.raises(ConfigError, match="backend"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config())
    config = make_config(model_dir, "127.0.0.1:1", kvtools.free_port())
    config.kv_transfer_config.kv_connector_extra_config["store_config"]["global_segment_size"] = "12 parsecs"
    with pytest.raises(ConfigError, match="global_segment_size"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config())


def test_unreachable_store_runs_with_zero_hits(model_dir, kvtools, caplog) -> None:
    dead = f"127.0.0.1:{kvtools.free_port()}"
    inst = Instance(make_config(model_dir, dead, kvtools.free_port()), seed=3)
    try:
        with caplog.at_level(logging.WARNING, logger="ascend_dist"):
            for i in range(2):
                inst.scheduler.add_request(inst.request(f"r{i}", list(range(200 + i, 264 + i))))
            out = inst.step()
        assert all(r.num_computed_tokens == 0 for r in out.scheduled_new_reqs)
        assert inst.worker.get_block_ids_with_load_errors() == set()
        assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1
    finally:
        inst.close()


def test_finished_request_blocks_held_until_saves_complete(model_dir, mooncake_master, kvtools) -> None:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    inst = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), seed=4)
    try:
        req = inst.request("done", list(range(300, 364)), max_tokens=1)
        inst.scheduler.add_request(req)
        free_before = inst.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        out = inst.step()
        runner_out = ModelRunnerOutput(req_ids=["done"], req_id_to_index={"done": 0}, sampled_token_ids=[[7]])
        inst.scheduler.update_from_output(out, runner_out)  # max_tokens=1: the request finishes
        assert "done" in inst.scheduler.requests  # blocks held: saves may still run
        held = inst.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        assert held < free_before
        out = inst.step()  # carries the delayed-free id to the worker
        inst.worker._worker.drain(20)
        sending, _ = inst.worker.get_finished(set())
        assert sending == {"done"}
        done_out = ModelRunnerOutput(
            req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(finished_sending=sending)
        )
        inst.scheduler.update_from_output(out, done_out)
        assert "done" not in inst.scheduler.requests
        assert inst.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() > held
    finally:
        inst.close()


def test_kv_events_reach_the_scheduler(model_dir, mooncake_master, kvtools) -> None:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.outputs import KVConnectorOutput

    config = make_config(model_dir, mooncake_master.address, kvtools.free_port())
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    inst = Instance(config, seed=5)
    try:
        prompt = list(range(700, 748))
        inst.scheduler.add_request(inst.request("ev", prompt))
        inst.step()
        inst.worker._worker.drain(20)
        reported = inst.worker.get_kv_connector_kv_cache_events()
        assert reported is not None and inst.worker.get_kv_connector_kv_cache_events() is None
        connector = inst.scheduler.connector
        connector.update_connector_output(KVConnectorOutput(kv_cache_events=reported))
        connector.update_connector_output(KVConnectorOutput(kv_cache_events=reported))  # a second rank, same chunks
        events = list(connector.take_events())
        assert [type(e) for e in events] == [BlockStored] * 3
        assert [e.token_ids for e in events] == [prompt[0:16], prompt[16:32], prompt[32:48]]
        assert events[1].parent_block_hash == events[0].block_hashes[0]
        assert list(connector.take_events()) == []
    finally:
        inst.close()


# ---- hybrid model (full attention + sliding window): loads are async, failures go by request ----


def hybrid_kv_cache_config(window: int = 32) -> KVCacheConfig:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16, sliding_window=window)
    page = full.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * NUM_BLOCKS, layers=[name], layer_stride=0, block_stride=page) for name in LAYERS
    ]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], swa)],
    )


def layer_block(inst: Instance, layer: str, block_id: int) -> bytes:
    return b"".join(inst.caches[layer][kv, block_id].numpy().tobytes() for kv in (0, 1))


def wait_recving(inst: Instance, want: set[str], timeout_s: float = 20.0) -> tuple[set[str], set[str]]:
    """Poll ``get_transfer_results`` (as vLLM does once per step) until ``want`` finished receiving."""
    import time

    finished: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not want <= finished and time.monotonic() < deadline:
        results = inst.worker.get_transfer_results(set())
        finished |= results.finished_recving
        failed |= results.failed_recving
        assert results.failed_recving <= results.finished_recving  # vLLM's contract: failed ones also finished
        assert inst.worker.get_block_ids_with_load_errors() == set()  # never block ids with two groups
        if not want <= finished:
            time.sleep(0.01)
    assert want <= finished, f"async loads of {want - finished} not finished in {timeout_s}s"
    return finished, failed


def pool_keys(inst: Instance, prompt: list[int]) -> list[str]:
    """Every pool key (both groups) of ``prompt``'s chunks for this instance."""
    connector = inst.scheduler.connector
    assert isinstance(connector, AscendStoreConnector) and connector._scheduler is not None
    hashes = connector._scheduler.hashes_for(prompt, salt="\x00")[1]  # no LoRA, no cache salt
    return [meta.pool_key(h) for meta in connector._spec.key_metadata() for h in hashes]


def test_hybrid_model_async_load_failure_is_reported_by_request_and_recomputed(
    model_dir, mooncake_master, kvtools, caplog
) -> None:
    """vLLM 0.33 raises on block-level load errors with two KV groups: the load is async, failing per request."""
    from mooncake.store import MooncakeDistributedStore
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    with caplog.at_level(logging.INFO, logger="ascend_dist"):
        a = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), 11, hybrid_kv_cache_config())
        b_config = make_config(model_dir, mooncake_master.address, kvtools.free_port())
        b_config.kv_transfer_config.kv_load_failure_policy = "recompute"  # type: ignore[union-attr]
        b = Instance(b_config, 12, hybrid_kv_cache_config())
    admin = MooncakeDistributedStore()
    assert admin.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_master.address) == 0
    try:
        assert sum("load_async=true" in r.getMessage() for r in caplog.records) == 1  # logged once per process
        assert b.worker._cfg.async_loads and b.scheduler.connector._cfg.async_loads  # both roles agree
        good, bad = list(range(1000, 1048)), list(range(2000, 2048))  # 3 chunks each
        a.scheduler.add_request(a.request("a-good", good))
        a.scheduler.add_request(a.request("a-bad", bad))
        out_a = a.step()  # a hybrid model's saves finish inside the step
        blocks_a = {r.req_id: r.block_ids for r in out_a.scheduled_new_reqs}
        assert all(x == 1 for x in b.worker._worker.backend.exists(pool_keys(b, good)[:3]))

        b.scheduler.add_request(b.request("b-good", good))
        b.scheduler.add_request(b.request("b-bad", bad))
        out = b.scheduler.schedule()  # the lookup hits both prompts: both wait for remote KV
        reqs = b.scheduler.requests
        assert {reqs["b-good"].status, reqs["b-bad"].status} == {RequestStatus.WAITING_FOR_REMOTE_KVS}
        assert out.num_scheduled_tokens == {}
        for key in pool_keys(b, bad):  # evicted between the lookup and the load (force: the lookup leased them)
            admin.remove(key, True)
        b.worker.handle_preemptions(out.kv_connector_metadata)
        b.worker.bind_connector_metadata(out.kv_connector_metadata)
        b.worker.start_load_kv(None)  # type: ignore[arg-type]
        b.worker.wait_for_save()
        b.worker.clear_connector_metadata()
        finished, failed = wait_recving(b, {"b-good", "b-bad"})
        assert finished == {"b-good", "b-bad"} and failed == {"b-bad"}

        with pytest.raises(RuntimeError, match="multiple KV cache groups"):  # what a block-level report does
            b.scheduler._handle_invalid_blocks({1}, {})
        invalid = b.worker.get_block_ids_with_load_errors()
        connector_output = KVConnectorOutput(
            finished_recving=finished, failed_recving=failed, invalid_block_ids=invalid
        )
        b.scheduler.update_from_output(  # raised RuntimeError with block-level reports and two groups
            out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=connector_output)
        )
        lookups = b.scheduler.connector._scheduler.lookups
        out = b.step()
        assert out.num_scheduled_tokens == {"b-good": 1, "b-bad": 48}  # the good hit kept, the failed one recomputed
        assert b.scheduler.connector._scheduler.lookups == lookups  # the pool is not asked again for b-bad
        new = {r.req_id: r for r in out.scheduled_new_reqs}
        assert new["b-good"].num_computed_tokens == 47 and new["b-bad"].num_computed_tokens == 0
        ids_a, ids_b = blocks_a["a-good"], new["b-good"].block_ids
        full, swa = LAYERS
        assert [layer_block(b, full, x) for x in ids_b[0]] == [layer_block(a, full, x) for x in ids_a[0]]
        assert layer_block(b, swa, ids_b[1][-1]) == layer_block(a, swa, ids_a[1][-1])  # the window's last block
        assert b.worker._worker.stats.failed_keys > 0
        b.worker._worker.drain(20)
        assert all(x == 1 for x in b.worker._worker.backend.exists(pool_keys(b, bad)[:3]))  # saved again
    finally:
        admin.close()
        a.close()
        b.close()


def test_one_group_async_load_failure_still_reports_blocks(model_dir, mooncake_master, kvtools) -> None:
    """One KV group: the failed block ids go to vLLM (it keeps the good prefix), no request-level failure."""
    from mooncake.store import MooncakeDistributedStore
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    a = Instance(make_config(model_dir, mooncake_master.address, kvtools.free_port()), seed=13)
    b_config = make_config(model_dir, mooncake_master.address, kvtools.free_port(), load_async=True)
    b_config.kv_transfer_config.kv_load_failure_policy = "recompute"  # type: ignore[union-attr]
    b = Instance(b_config, seed=14)
    admin = MooncakeDistributedStore()
    assert admin.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_master.address) == 0
    try:
        prompt = list(range(3000, 3048))
        a.scheduler.add_request(a.request("a1", prompt))
        a.step()
        a.worker._worker.drain(20)
        b.scheduler.add_request(b.request("b1", prompt))
        out = b.scheduler.schedule()
        assert admin.remove(pool_keys(b, prompt)[1], True) == 0  # the second chunk is gone before the load
        b.worker.handle_preemptions(out.kv_connector_metadata)
        b.worker.bind_connector_metadata(out.kv_connector_metadata)
        b.worker.start_load_kv(None)  # type: ignore[arg-type]
        b.worker.clear_connector_metadata()
        b.worker._worker.drain(20)
        results = b.worker.get_transfer_results(set())
        assert results.finished_recving == {"b1"} and results.failed_recving == set()
        bad = b.worker.get_block_ids_with_load_errors()
        assert bad == {b.scheduler.kv_cache_manager.get_block_ids("b1")[0][1]}
        connector_output = KVConnectorOutput(finished_recving=results.finished_recving, invalid_block_ids=bad)
        b.scheduler.update_from_output(
            out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=connector_output)
        )
        out = b.step()
        assert out.scheduled_new_reqs[0].num_computed_tokens == 16  # recomputed from the first bad block
        assert out.num_scheduled_tokens == {"b1": 32}
        b.worker._worker.drain(20)
        # the recomputed chunk was missing from the pool: B saved it again (its load state counted it pooled)
        assert admin.is_exist(pool_keys(b, prompt)[1]) == 1
    finally:
        admin.close()
        a.close()
        b.close()


def test_hybrid_model_refuses_layerwise_loads(model_dir, kvtools) -> None:
    config = make_config(model_dir, "127.0.0.1:1", kvtools.free_port(), use_layerwise=True)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"use_layerwise.*load_async"):
            KVConnectorFactory.create_connector(config, role, hybrid_kv_cache_config())


# ---- vLLM's model-runner order over Ascend split (K, V) caches ----
#
# vLLM 0.32/0.33 (``KVConnectorModelRunnerMixin._get_kv_connector_output``): the runner zeroes newly
# allocated blocks (``new_block_ids_to_zero``, in ``_update_states``), binds the metadata, calls
# ``start_load_kv`` before the forward only when ``SchedulerOutput.has_sync_kv_loads`` (else after it),
# runs the forward (``wait_for_layer_load``/``save_kv_layer`` per attention layer), then
# ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``, clear.


@dataclass(frozen=True)
class Shape:
    """A model's KV geometry: ``chunk_bytes`` is one block of every layer, K and V."""

    layers: int
    kv_heads: int
    head_dim: int
    block: int
    num_blocks: int

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * self.block * self.kv_heads * self.head_dim * 2  # K and V, fp16


SMALL = Shape(layers=2, kv_heads=2, head_dim=16, block=16, num_blocks=16)
LARGE = Shape(layers=16, kv_heads=8, head_dim=128, block=32, num_blocks=12)  # 2 MiB chunks
assert LARGE.chunk_bytes == 2 << 20


def shape_model_dir(root: Path, shape: Shape) -> Path:
    d = root / f"llama-{shape.layers}x{shape.kv_heads}x{shape.head_dim}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": shape.kv_heads * shape.head_dim,
                "head_dim": shape.head_dim,
                "intermediate_size": 128,
                "num_attention_heads": shape.kv_heads,
                "num_key_value_heads": shape.kv_heads,
                "num_hidden_layers": shape.layers,
                "vocab_size": 1000,
                "max_position_embeddings": 1024,
                "torch_dtype": "float16",
            }
        )
    )
    return d


def shape_config(root: Path, shape: Shape, master: str, port: int, segment: str = "64MB", **extra: Any) -> VllmConfig:
    config = make_config(shape_model_dir(root, shape), master, port, **extra)
    config.kv_transfer_config.kv_connector_extra_config["store_config"]["global_segment_size"] = segment
    config.cache_config.block_size = shape.block
    config.cache_config.num_gpu_blocks = shape.num_blocks
    return config


def shape_kv_cache_config(shape: Shape) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=shape.block, num_kv_heads=shape.kv_heads, head_size=shape.head_dim, dtype=torch.float16
    )
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * shape.num_blocks, layers=[name], layer_stride=0, block_stride=page)
        for name in shape.layer_names
    ]
    return KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(shape.layer_names, spec)],
    )


@dataclass
class StepResult:
    out: Any
    load_before_forward: bool
    finished_recving: set[str]
    invalid_block_ids: set[int]


class RunnerInstance:
    """A vLLM ``Scheduler`` and a worker connector over Ascend split (K, V) caches, driven in runner order."""

    def __init__(self, config: VllmConfig, shape: Shape, seed: int) -> None:
        self.shape = shape
        self.kcc = shape_kv_cache_config(shape)
        self.hasher = vb.block_hasher(config, self.kcc)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kcc)
        gen = self.gen = torch.Generator().manual_seed(seed)
        dims = (shape.num_blocks, shape.block, shape.kv_heads, shape.head_dim)
        self.caches = {
            name: (
                torch.randn(*dims, generator=gen).to(torch.float16),
                torch.randn(*dims, generator=gen).to(torch.float16),
            )
            for name in shape.layer_names
        }
        self.worker.register_kv_caches(self.caches)  # type: ignore[arg-type]
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=self.kcc,
            structured_output_manager=StructuredOutputManager(config),
            block_size=shape.block,
            log_stats=False,
        )
        self.zero_fill = 0.0

    def request(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
        return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=self.hasher)

    def block(self, block_id: int) -> bytes:
        return b"".join(t[block_id].numpy().tobytes() for kv in self.caches.values() for t in kv)

    def _allocated(self) -> set[int]:
        manager = self.scheduler.kv_cache_manager
        return {b for r in self.scheduler.requests for b in manager.get_block_ids(r)[0]}

    def _zero(self, block_ids: list[int]) -> None:
        """What the runner's ``_zero_block_ids`` does to freshly allocated blocks (any fill works)."""
        for k, v in self.caches.values():
            k[block_ids] = self.zero_fill
            v[block_ids] = self.zero_fill

    def _forward(self, out: Any) -> None:
        """The attention layers: wait for each layer's load, write the scheduled tokens' KV, save the layer."""
        slots: list[tuple[int, int]] = []
        for r in out.scheduled_new_reqs:
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + out.num_scheduled_tokens[r.req_id]):
                slots.append((r.block_ids[0][pos // self.shape.block], pos % self.shape.block))
        for name, (k, v) in self.caches.items():
            self.worker.wait_for_layer_load(name)
            for blk, off in slots:  # computed tokens get values of this instance's own, slot by slot
                k[blk, off] = torch.randn(k.shape[2:], generator=self.gen).to(torch.float16)
                v[blk, off] = torch.randn(v.shape[2:], generator=self.gen).to(torch.float16)
            self.worker.save_kv_layer(name, k, None)  # type: ignore[arg-type]

    def step(self) -> StepResult:
        """One engine step as vLLM's scheduler, ``_update_states`` and ``_get_kv_connector_output`` make it."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        before_ids = self._allocated()
        out = self.scheduler.schedule()
        self.worker.handle_preemptions(out.kv_connector_metadata)  # vLLM's runner: first, before the zeroing
        # vLLM zeroes only with new_block_ids_to_zero (Mamba, mixed precision); any allocation may
        # hold stale bytes, so overwrite every block this step allocated: the load must come after.
        self._zero(sorted(self._allocated() - before_ids))
        connector = self.worker
        connector.bind_connector_metadata(out.kv_connector_metadata)
        before = bool(out.has_sync_kv_loads)
        if before:
            connector.start_load_kv(None)  # type: ignore[arg-type]
        if out.total_num_scheduled_tokens:
            self._forward(out)
        if not before:
            connector.start_load_kv(None)  # type: ignore[arg-type]
        connector.wait_for_save()
        results = connector.get_transfer_results(out.finished_req_ids)
        invalid = connector.get_block_ids_with_load_errors()
        connector.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=invalid,
        )
        runner_out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[5] for _ in ids],
            kv_connector_output=kv_out,
        )
        self.scheduler.update_from_output(out, runner_out)
        return StepResult(out, before, set(results.finished_recving or ()), set(invalid))

    def close(self) -> None:
        self.scheduler.connector.shutdown()  # type: ignore[union-attr]
        self.worker.shutdown()


MODES = {"sync": {}, "async": {"load_async": True}, "layerwise": {"use_layerwise": True}}


def fill_block(inst: RunnerInstance) -> bytes:
    """One block as it is right after the runner's zeroing (every element ``zero_fill``)."""
    s = inst.shape
    one = torch.full((s.block, s.kv_heads, s.head_dim), inst.zero_fill, dtype=torch.float16).numpy().tobytes()
    return one * (2 * s.layers)


@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "16x8x128-2MiB"])
@pytest.mark.parametrize("mode", list(MODES))
def test_runner_order_loads_first_instances_bytes_over_split_kv(
    shape: Shape, mode: str, tmp_path, mooncake_master, kvtools
) -> None:
    """B loads A's chunks into freshly overwritten blocks, in vLLM's runner order, byte for byte."""
    import time

    extra = MODES[mode]
    a = RunnerInstance(
        shape_config(tmp_path, shape, mooncake_master.address, kvtools.free_port(), **extra), shape, seed=21
    )
    b = RunnerInstance(
        shape_config(tmp_path, shape, mooncake_master.address, kvtools.free_port(), **extra), shape, seed=22
    )
    chunks = 3
    objects = chunks * (shape.layers if mode == "layerwise" else 1)  # layer-wise: one object per chunk and layer
    try:
        base = 5000 + 100 * shape.layers + 1000 * list(MODES).index(mode)
        prompt = list(range(base, base + chunks * shape.block + 5))  # 3 full chunks + 5 tokens
        a.scheduler.add_request(a.request("ra", prompt))
        first = a.step()
        assert first.load_before_forward is False  # nothing to load: start_load_kv runs after the forward
        blocks_a = first.out.scheduled_new_reqs[0].block_ids[0]
        a.worker._worker.drain(30)
        assert a.worker._worker.stats.saved_keys == objects, "A's saves did not all reach the pool"
        stored = [a.block(x) for x in blocks_a[:chunks]]
        assert len(set(stored)) == chunks  # control: a chunk loaded into the wrong block cannot pass

        b.scheduler.add_request(b.request("rb", prompt))
        b.zero_fill = -3.0  # what the blocks hold before the load: must not survive it
        assert fill_block(b) not in stored  # control: an absent load cannot pass
        res = b.step()
        if mode == "async":
            assert res.load_before_forward is False and not res.out.scheduled_new_reqs  # WAITING_FOR_REMOTE_KVS
            deadline = time.monotonic() + 30
            while "rb" not in res.finished_recving and time.monotonic() < deadline:
                time.sleep(0.02)
                res = b.step()
            assert "rb" in res.finished_recving and res.invalid_block_ids == set()
            res = b.step()  # the request is scheduled with its loaded tokens
        else:
            assert res.load_before_forward is True  # has_sync_kv_loads: start_load_kv before the forward
            assert res.invalid_block_ids == set(), "the synchronous load reported failed blocks"
        new = res.out.scheduled_new_reqs[0]
        assert new.req_id == "rb" and new.num_computed_tokens == chunks * shape.block  # vLLM counts the hit
        stats = b.worker._worker.stats
        assert (stats.loaded_keys, stats.failed_keys) == (objects, 0)
        loaded = [b.block(x) for x in new.block_ids[0][:chunks]]
        assert [got == want for got, want in zip(loaded, stored, strict=True)] == [True] * chunks
    finally:
        a.close()
        b.close()
