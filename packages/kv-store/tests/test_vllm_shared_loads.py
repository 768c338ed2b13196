"""Requests of one step sharing pooled chunks, through vLLM 0.33's real ``Scheduler`` in runner order (issue 21).

Instance A pools prompts; instance B (prefix caching OFF, so vLLM gives every request its own
blocks) schedules two or three requests over A's chunks in ONE step, in each load mode. The step is
driven as vLLM's model runner drives it (the pattern of ``test_runner_order_*`` in
``test_vllm_connector.py``): schedule, overwrite the new blocks, bind, ``start_load_kv`` before the
forward only with synchronous loads, per-layer wait/save, ``wait_for_save``, results, load errors,
``update_from_output``. `LoadVerifier` fills every destination with a sentinel when vLLM allocates
it and checks, once the load is reported done, that each holds exactly A's bytes. Then a step of
5,376 pieces (2 requests x 28 chunks x 48 layers x K/V), more than twice what one Mooncake TCP get
carries (without the split: -800, see ``test_shared_loads.py``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ascend_dist.testing import vllm_builders as vb  # noqa: E402
from ascend_dist.testing.pool_checks import Destination, LoadVerifier  # noqa: E402

MODULE = "ascend_dist.kv_store.vllm_connector"
MODES: dict[str, dict[str, Any]] = {"sync": {}, "async": {"load_async": True}, "layerwise": {"use_layerwise": True}}
SENTINEL = -3.0


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block: int
    num_blocks: int

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]


SMALL = Shape(layers=2, kv_heads=2, head_dim=16, block=16, num_blocks=24)
MANY = Shape(layers=48, kv_heads=1, head_dim=16, block=16, num_blocks=64)  # 96 pieces of 512 B per chunk


def make_config(root: Path, shape: Shape, master: str, port: int, *, prefix_caching: bool, **extra: Any) -> VllmConfig:
    model = root / f"llama-{shape.layers}x{shape.kv_heads}x{shape.head_dim}"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.kv_heads * shape.head_dim,
        "head_dim": shape.head_dim, "intermediate_size": 128, "num_attention_heads": shape.kv_heads,
        "num_key_value_heads": shape.kv_heads, "num_hidden_layers": shape.layers, "vocab_size": 1000,
        "max_position_embeddings": 1024, "torch_dtype": "float16",
    }))  # fmt: skip
    store = {"master_server_address": master, "protocol": "tcp", "global_segment_size": "64MB",
             "local_buffer_size": "8MB"}  # fmt: skip
    ktc = KVTransferConfig(
        kv_connector="AscendStoreConnector", kv_role="kv_both", kv_connector_module_path=MODULE,
        kv_connector_extra_config={"backend": "mooncake", "store_config": store, "lookup_rpc_port": port, **extra},
    )  # fmt: skip
    config = vb.cpu_vllm_config(model, ktc, num_blocks=shape.num_blocks, enable_prefix_caching=prefix_caching)
    config.cache_config.block_size = shape.block
    return config


def kv_cache_config(shape: Shape) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=shape.block, num_kv_heads=shape.kv_heads, head_size=shape.head_dim, dtype=torch.float16
    )
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * shape.num_blocks, layers=[n], layer_stride=0, block_stride=page)
        for n in shape.layer_names
    ]
    return KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(shape.layer_names, spec)],
    )


class Runner:
    """vLLM's ``Scheduler`` and a factory-built worker connector over split (K, V) CPU caches, in runner order."""

    def __init__(self, config: VllmConfig, shape: Shape, seed: int) -> None:
        self.shape = shape
        self.kcc = kv_cache_config(shape)
        self.hasher = vb.block_hasher(config, self.kcc)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kcc)
        self.gen = torch.Generator().manual_seed(seed)
        dims = (shape.num_blocks, shape.block, shape.kv_heads, shape.head_dim)
        self.caches = {
            n: (torch.randn(*dims, generator=self.gen).half(), torch.randn(*dims, generator=self.gen).half())
            for n in shape.layer_names
        }
        self.worker.register_kv_caches(self.caches)  # type: ignore[arg-type]
        self.scheduler = Scheduler(
            vllm_config=config, kv_cache_config=self.kcc, structured_output_manager=StructuredOutputManager(config),
            block_size=shape.block, log_stats=False,
        )  # fmt: skip

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.scheduler.add_request(
            Request(req_id, prompt, SamplingParams(max_tokens=3), None, block_hasher=self.hasher)
        )

    def blocks_of(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def block(self, block_id: int) -> bytes:
        return b"".join(t[block_id].numpy().tobytes() for kv in self.caches.values() for t in kv)

    def fill(self, block_ids: Any) -> None:
        for k, v in self.caches.values():
            k[list(block_ids)] = SENTINEL
            v[list(block_ids)] = SENTINEL

    def _allocated(self) -> set[int]:
        return {b for r in self.scheduler.requests for b in self.blocks_of(r)}

    def _forward(self, out: Any) -> None:
        slots = [
            (r.block_ids[0][pos // self.shape.block], pos % self.shape.block)
            for r in out.scheduled_new_reqs
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + out.num_scheduled_tokens[r.req_id])
        ]
        for name, (k, v) in self.caches.items():
            self.worker.wait_for_layer_load(name)
            for blk, off in slots:  # the computed tokens' KV, this instance's own values
                k[blk, off] = torch.randn(k.shape[2:], generator=self.gen).half()
                v[blk, off] = torch.randn(v.shape[2:], generator=self.gen).half()
            self.worker.save_kv_layer(name, k, None)  # type: ignore[arg-type]

    def step(self, on_alloc: Callable[[Any], None] | None = None) -> tuple[Any, set[str], set[int]]:
        """One engine step; ``on_alloc(out)`` runs once vLLM allocated the step's blocks, before any load."""
        before_ids = self._allocated()
        out = self.scheduler.schedule()
        self.worker.handle_preemptions(out.kv_connector_metadata)  # vLLM's runner: first, before the zeroing
        self.fill(sorted(self._allocated() - before_ids))  # new blocks hold stale bytes: the load comes after
        if on_alloc is not None:
            on_alloc(out)
        w = self.worker
        w.bind_connector_metadata(out.kv_connector_metadata)
        sync = bool(out.has_sync_kv_loads)
        if sync:
            w.start_load_kv(None)  # type: ignore[arg-type]
        if out.total_num_scheduled_tokens:
            self._forward(out)
        if not sync:
            w.start_load_kv(None)  # type: ignore[arg-type]
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving, invalid_block_ids=invalid,
        )  # fmt: skip
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[5] for _ in ids], kv_connector_output=kv_out,
        ))  # fmt: skip
        return out, set(results.finished_recving or ()), set(invalid)

    def close(self) -> None:
        self.scheduler.connector.shutdown()  # type: ignore[union-attr]
        self.worker.shutdown()


def pool(a: Runner, prompts: dict[str, list[int]], chunks: dict[str, int]) -> dict[str, list[bytes]]:
    """A computes each prompt in its own step; the bytes of each full chunk it pooled."""
    pooled: dict[str, list[bytes]] = {}
    for rid, prompt in prompts.items():
        a.add(rid, prompt)
        out, _, _ = a.step()
        assert [r.req_id for r in out.scheduled_new_reqs] == [rid]
        pooled[rid] = [a.block(b) for b in a.blocks_of(rid)[: chunks[rid]]]
    a.worker._worker.drain(60)
    return pooled


def load_in_one_step(b: Runner, reqs: dict[str, tuple[list[int], list[bytes]]], mode: str) -> LoadVerifier:
    """B schedules every request of ``reqs`` (prompt, pooled chunk bytes) in one step and runs until loaded."""
    verifier = LoadVerifier(b.block, b.fill)

    def arm(out: Any) -> None:
        dests = [
            Destination(rid, blk, want)
            for rid, (_, wants) in reqs.items()
            for blk, want in zip(b.blocks_of(rid), wants, strict=False)
        ]
        assert len(dests) == sum(len(w) for _, w in reqs.values())
        assert len({d.block_id for d in dests}) == len(dests), "prefix caching off: every request has its own blocks"
        verifier.arm(dests)

    for rid, (prompt, _) in reqs.items():
        b.add(rid, prompt)
    out, done, invalid = b.step(on_alloc=arm)  # every request's blocks allocated (and loads issued) in this step
    assert invalid == set(), "the load reported failed blocks"
    scheduled = list(out.scheduled_new_reqs)
    if mode == "async":
        assert not scheduled  # all of them WAITING_FOR_REMOTE_KVS
        deadline = time.monotonic() + 60
        while done != set(reqs) and time.monotonic() < deadline:
            time.sleep(0.02)
            out, got, invalid = b.step()  # a request whose load finished is scheduled in the next step
            scheduled += out.scheduled_new_reqs
            done |= got
            assert invalid == set()
        assert done == set(reqs)
        verifier.check()
        out, _, _ = b.step()
        scheduled += out.scheduled_new_reqs
    else:
        assert out.has_sync_kv_loads
        verifier.check()
    assert sorted(r.req_id for r in scheduled) == sorted(reqs)
    for r in scheduled:
        assert r.num_computed_tokens == len(reqs[r.req_id][1]) * b.shape.block  # vLLM counts every loaded chunk
    return verifier


def prompt_of(base: int, chunks: int, block: int, tail: int) -> list[int]:
    return list(range(base, base + chunks * block)) + [base + 90_000 + tail + t for t in range(5)]


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("mode", list(MODES))
def test_requests_sharing_pooled_chunks_in_one_step(tmp_path, long_lease_master, kvtools, mode, count) -> None:
    """Two or three requests over A's chunks, own blocks (prefix caching off): every block holds A's bytes."""
    shape, chunks = SMALL, 3
    a = Runner(make_config(tmp_path, shape, long_lease_master.address, kvtools.free_port(), prefix_caching=True,
                           **MODES[mode]), shape, seed=41)  # fmt: skip
    b = Runner(make_config(tmp_path, shape, long_lease_master.address, kvtools.free_port(), prefix_caching=False,
                           **MODES[mode]), shape, seed=42)  # fmt: skip
    try:
        base = 40_000 + 1000 * list(MODES).index(mode) + 100 * count
        pooled = pool(a, {"a": prompt_of(base, chunks, shape.block, 0)}, {"a": chunks})["a"]
        assert len(set(pooled)) == chunks  # control: a chunk in another chunk's block cannot pass
        reqs = {
            f"r{i}": (prompt_of(base, chunks - (i == 2), shape.block, i + 1), pooled[: chunks - (i == 2)])
            for i in range(count)
        }  # the third request shares one chunk fewer
        load_in_one_step(b, reqs, mode)
        stats = b.worker._worker.stats
        objects = sum(len(w) for _, w in reqs.values()) * (shape.layers if mode == "layerwise" else 1)
        assert (stats.loaded_keys, stats.failed_keys) == (objects, 0)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_step_of_5376_pieces_loads_byte_exact(tmp_path, long_lease_master, kvtools, mode) -> None:
    """2 requests x 28 chunks x 48 layers x K/V in one step (each request alone is 2,688 pieces): byte-exact."""
    shape, chunks = MANY, 28
    a = Runner(make_config(tmp_path, shape, long_lease_master.address, kvtools.free_port(), prefix_caching=True,
                           **MODES[mode]), shape, seed=43)  # fmt: skip
    b = Runner(make_config(tmp_path, shape, long_lease_master.address, kvtools.free_port(), prefix_caching=False,
                           **MODES[mode]), shape, seed=44)  # fmt: skip
    try:
        base = 60_000 + 2000 * list(MODES).index(mode)
        prompts = {f"p{i}": prompt_of(base + 1000 * i, chunks, shape.block, i) for i in range(2)}
        pooled = pool(a, prompts, dict.fromkeys(prompts, chunks))
        assert a.worker._worker.stats.saved_keys == 2 * chunks * (shape.layers if mode == "layerwise" else 1)
        reqs = {f"r{i}": (prompts[f"p{i}"], pooled[f"p{i}"]) for i in range(2)}
        assert sum(len(w) for _, w in reqs.values()) * 2 * shape.layers == 5376
        load_in_one_step(b, reqs, mode)
        assert b.worker._worker.stats.failed_keys == 0
    finally:
        a.close()
        b.close()
