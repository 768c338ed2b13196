"""Native and recompute connectors inside vLLM 0.33.0's running v1 ``Scheduler`` (nox session vllm).

Each test drives vLLM's real ``Scheduler`` (which builds the SCHEDULER-role connector through the
factory and binds its BlockPool) step by step, and a WORKER-role connector from the factory over CPU
K/V caches (the Ascend split-K/V tuple layout) that does the real copies on the CPU simulation. A
stand-in model writes each scheduled token's KV as a function of (token, position), so every block
a restore fills can be checked byte for byte; blocks awaiting a load are first poisoned, so a copy
that did not happen cannot pass.

- Native (``AscendOffloadingConnector``): a store that fails at descriptor 0 (the CPU simulation's
  fault injection), on the only worker or on one of two (their outputs merged by vLLM's
  ``KVOutputAggregator``), leaves its keys unloadable while another request's store is loadable; a load
  that fails is reported through ``get_block_ids_with_load_errors`` (exactly its blocks) in the
  step its receive finishes, vLLM takes the request back (and reloads it from the intact host
  copy), and a second request's load is untouched.
- Recompute (``RecomputeCPUOffloadConnector``): a pool too small for two requests forces a
  preemption; the connector saves the victim's blocks synchronously, restores them when it resumes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ascend_dist.common.device import CpuSimRuntime  # noqa: E402
from ascend_dist.kv_offload.vllm_preempt_scheduler import PreemptSavingScheduler  # noqa: E402

BLOCK = 16
LAYER = "model.layers.0.self_attn.attn"
POISON = 0x55
NATIVE = "ascend_dist.kv_offload.vllm_native"
RECOMPUTE = "ascend_dist.kv_offload.vllm_recompute"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(
        json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "vocab_size": 1000, "max_position_embeddings": 512,
            "torch_dtype": "float16", "rms_norm_eps": 1e-5,
        })
    )  # fmt: skip
    return d


def make_config(
    model_dir: Path, connector: str, module: str, extra: dict[str, Any], num_blocks: int, *, tp: int = 1
) -> VllmConfig:
    ktc = KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_connector_module_path=module,
        kv_connector_extra_config=extra, kv_load_failure_policy="recompute",
    )  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=256),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def expected_kv(token: int, pos: int, part: int) -> torch.Tensor:
    """The stand-in model's KV of one token: 4 int8 values of (token, position, K or V)."""
    base = token * 7 + pos * 3 + part * 101
    return torch.tensor([(base + i) % 256 - 128 for i in range(4)], dtype=torch.int8).view(1, 4)


class RecomputeHookScheduler(PreemptSavingScheduler):
    """Our preempt-saving scheduler, recording each save it asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.saved = []
        super().__init__(*args, **kwargs)

    saved: list[tuple[str, bool]]  # (request, whether the connector took its KV), per preemption

    def _save_before_preempt(self, request: Request) -> bool:
        accepted = super()._save_before_preempt(request)
        self.saved.append((request.request_id, accepted))
        return accepted


class Shard:
    """One worker: a worker-role connector from vLLM's factory over its own split K/V CPU caches."""

    def __init__(self, config: VllmConfig, kcc: KVCacheConfig) -> None:
        self.k = torch.zeros(kcc.num_blocks, BLOCK, 1, 4, dtype=torch.int8)
        self.v = torch.zeros(kcc.num_blocks, BLOCK, 1, 4, dtype=torch.int8)
        self.runtime = CpuSimRuntime(wait_timeout_s=10.0)
        self.conn: Any = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
        spec_obj = getattr(getattr(self.conn, "connector_worker", None), "spec", None)
        if spec_obj is not None:  # native: our NPUOffloadingSpec copies on this runtime
            spec_obj.runtime = self.runtime
        self.conn.register_kv_caches({LAYER: (self.k, self.v)})

    def write(self, block: int, slot: int, token: int, pos: int) -> None:
        self.k[block, slot] = expected_kv(token, pos, 0)
        self.v[block, slot] = expected_kv(token, pos, 1)

    def holds(self, block: int, slot: int, token: int, pos: int) -> bool:
        return torch.equal(self.k[block, slot], expected_kv(token, pos, 0)) and torch.equal(
            self.v[block, slot], expected_kv(token, pos, 1)
        )

    def poison(self, block: int) -> None:
        self.k[block].fill_(POISON)
        self.v[block].fill_(POISON)

    def close(self) -> None:
        self.conn.shutdown()
        self.runtime.close()


class Loop:
    """vLLM's Scheduler, one `Shard` per worker (world size), a stand-in model, vLLM's aggregator."""

    def __init__(self, config: VllmConfig, num_blocks: int, *, scheduler_cls: type[Scheduler] = Scheduler) -> None:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.int8)
        page = spec.page_size_bytes
        tensor = KVCacheTensor(size=page * num_blocks, layers=[LAYER], layer_stride=0, block_stride=page)
        self.kcc = KVCacheConfig(num_blocks, [tensor], [KVCacheGroupSpec([LAYER], spec)])
        world = config.parallel_config.world_size
        self.shards: list[Shard] = []
        self.sched: Any = None
        try:
            for _ in range(world):
                self.shards.append(Shard(config, self.kcc))
            self.sched = scheduler_cls(
                vllm_config=config, kv_cache_config=self.kcc,
                structured_output_manager=StructuredOutputManager(config), block_size=BLOCK, log_stats=False,
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.aggregator = KVOutputAggregator(world)
        self.free_at_start = self.free_blocks()
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.load_errors: set[int] = set()
        self.failed_steps: list[tuple[set[str], set[int]]] = []  # (finished_recving, load errors)
        self.verified: dict[str, int] = {}  # request -> tokens whose restored KV was checked (every shard)
        self._poisoned: set[str] = set()

    def add(self, rid: str, first_token: int, tokens: int, max_tokens: int = 1) -> Request:
        req = Request(
            rid, [(first_token + i) % 900 + 10 for i in range(tokens)],
            SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, block_hasher=self._hasher,
        )  # fmt: skip
        self.sched.add_request(req)
        return req

    def free_blocks(self) -> int:
        return int(self.sched.kv_cache_manager.block_pool.get_num_free_blocks())

    def block_ids(self, rid: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def _write(self, req: Request, start: int, end: int) -> None:
        """The model: KV of positions ``[start, end)`` into the request's blocks on every shard."""
        ids = self.block_ids(req.request_id)
        for pos in range(start, end):
            for shard in self.shards:
                shard.write(ids[pos // BLOCK], pos % BLOCK, req.all_token_ids[pos], pos)

    def kv_matches(self, shard: Shard, req: Request, upto: int) -> bool:
        """Whether the shard's blocks of the request hold the model's KV for positions ``[0, upto)``."""
        ids = self.block_ids(req.request_id)
        return all(shard.holds(ids[p // BLOCK], p % BLOCK, req.all_token_ids[p], p) for p in range(upto))

    def _poison_waiting(self) -> None:
        for rid, req in self.sched.requests.items():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in self._poisoned:
                for b in self.block_ids(rid):
                    for shard in self.shards:
                        shard.poison(b)
                self._poisoned.add(rid)

    def _finish(self, shard: Shard, out: SchedulerOutput) -> ModelRunnerOutput:
        """One worker's hooks after the forward pass, and its output as the model runner builds it."""
        w = shard.conn
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        for rid in results.finished_recving:
            req = self.sched.requests.get(rid)
            if req is not None and not set(self.block_ids(rid)) & errors:
                assert self.kv_matches(shard, req, req.num_computed_tokens), f"restored KV of {rid} differs"
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        reqs = [self.sched.requests[r] for r in ids]
        sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in reqs]  # partial prefills: none
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=results.finished_recving or None, invalid_block_ids=errors,
                failed_recving=results.failed_recving, kv_connector_worker_meta=worker_meta,
            ),
        )  # fmt: skip

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, every worker's hooks around the stand-in model, aggregate, update."""
        out = self.sched.schedule()
        self._poison_waiting()
        meta = out.kv_connector_metadata
        for shard in self.shards:  # the hooks before the forward pass, on every worker
            shard.conn.bind_connector_metadata(meta)
            shard.conn.handle_preemptions(meta)
            shard.conn.start_load_kv(None)
        for rid, n in out.num_scheduled_tokens.items():  # the forward pass
            req = self.sched.requests[rid]
            self._write(req, req.num_computed_tokens - n, req.num_computed_tokens)
        merged = self.aggregator.aggregate([self._finish(shard, out) for shard in self.shards])
        assert merged is not None and merged.kv_connector_output is not None
        kv_out = merged.kv_connector_output
        errors = kv_out.invalid_block_ids
        self.load_errors |= errors
        if errors:
            self.failed_steps.append((set(kv_out.finished_recving or ()), set(errors)))
        for rid in kv_out.finished_recving or ():  # every shard finished (and checked) its receive
            req = self.sched.requests.get(rid)
            if req is not None and not set(self.block_ids(rid)) & errors:
                self.verified[rid] = req.num_computed_tokens
        self.sched.update_from_output(out, merged)
        return out

    def run(self, timeout_s: float = 20.0) -> Iterator[SchedulerOutput]:
        """Step until vLLM has nothing left (finished requests and connector work included).

        Copies run on the simulation's stream threads, so idle steps pause briefly; bounded in time.
        """
        deadline = time.monotonic() + timeout_s
        while self.sched.has_requests():
            if time.monotonic() > deadline:
                raise AssertionError(f"still busy after {timeout_s} s")
            out = self.step()
            if not out.num_scheduled_tokens:
                time.sleep(0.002)
            yield out

    def close(self) -> None:
        if self.sched is not None:
            self.sched.shutdown()
        for shard in self.shards:
            shard.close()


def _native(model_dir: Path, num_blocks: int = 32, tp: int = 1) -> Loop:
    extra = {"spec_name": "NPUOffloadingSpec", "spec_module_path": NATIVE, "cpu_bytes_to_use": 1 << 20}
    return Loop(make_config(model_dir, "AscendOffloadingConnector", NATIVE, extra, num_blocks, tp=tp), num_blocks)


@pytest.mark.parametrize("tp", [1, 2], ids=["one-worker", "fails-on-one-of-two-workers"])
def test_native_failed_store_is_never_loadable_and_other_stores_are(model_dir: Path, tp: int) -> None:
    loop = _native(model_dir, tp=tp)
    try:
        # Worker 0's first copy (request a's store, b's is next) fails; with two workers, worker 1's succeeds.
        loop.shards[0].runtime.inject_copy_fault(0)
        loop.add("a", 100, 48)
        loop.add("b", 300, 48)
        first = loop.step()
        assert [j.req_id for j in first.kv_connector_metadata.store_jobs.values()] == ["a", "b"]
        list(loop.run())
        assert loop.free_blocks() == loop.free_at_start
        # Same prompts again: a's keys miss (computed from scratch), b's hit (loaded, bytes checked).
        again_a, again_b = loop.add("a2", 100, 48), loop.add("b2", 300, 48)
        out = loop.step()
        assert again_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS and again_b.num_computed_tokens == 48
        assert out.num_scheduled_tokens.get("a2") == 48 and "b2" not in out.num_scheduled_tokens
        list(loop.run())
        assert again_a.is_finished() and again_b.is_finished()
        assert loop.verified == {"b2": 48} and loop.load_errors == set()
        assert loop.free_blocks() == loop.free_at_start
    finally:
        loop.close()


def test_native_failed_load_is_reported_recomputed_and_touches_nothing_else(model_dir: Path) -> None:
    loop = _native(model_dir)
    try:
        loop.add("a", 100, 48)
        loop.add("b", 300, 48)
        list(loop.run())
        again_a, again_b = loop.add("a2", 100, 48), loop.add("b2", 300, 48)
        loop.shards[0].runtime.inject_copy_fault(1)  # the first load submitted (a2's) fails at descriptor 1
        out = loop.step()
        assert out.num_scheduled_tokens == {}
        a_blocks = set(loop.block_ids("a2"))
        steps = list(loop.run())
        assert steps, "nothing ran after the loads"
        # a2: exactly its three blocks reported, in the step that finished its receive; b2 untouched.
        assert len(loop.failed_steps) == 1
        recv_in_that_step, reported = loop.failed_steps[0]
        assert "a2" in recv_in_that_step and reported == a_blocks
        # vLLM freed a2's blocks (no valid prefix) and asked again: the intact host copy loaded.
        assert loop.verified == {"b2": 48, "a2": 48}
        assert again_a.is_finished() and again_b.is_finished()
        assert again_a.num_computed_tokens >= 48 and again_a.num_preemptions == 0
        assert loop.free_blocks() == loop.free_at_start
    finally:
        loop.close()


def test_recompute_connector_saves_and_restores_inside_the_scheduler_loop(model_dir: Path) -> None:
    """Six blocks for two 40-token prompts decoding 12 tokens each: the pool runs out at 48 tokens."""
    num_blocks = 7  # block 0 is vLLM's null block: six usable
    extra = {"cpu_bytes_to_use_per_rank": 1 << 20}
    config = make_config(model_dir, "RecomputeCPUOffloadConnector", RECOMPUTE, extra, num_blocks)
    loop = Loop(config, num_blocks, scheduler_cls=RecomputeHookScheduler)
    try:
        first, second = loop.add("r1", 100, 40, max_tokens=12), loop.add("r2", 500, 40, max_tokens=12)
        list(loop.run())
        # vLLM preempted the newest request (its last block went to r1 in the same step); the connector
        # saved it synchronously, and on resume restored all 48 tokens (prompt + 8 decoded) byte-exact
        # into poisoned blocks, before vLLM recomputed only the last one.
        assert loop.sched.saved == [("r2", True)] and second.num_preemptions == 1
        assert loop.verified == {"r2": 48}
        assert first.is_finished() and second.is_finished()
        assert len(first.output_token_ids) == 12 and len(second.output_token_ids) == 12
        assert loop.load_errors == set() and loop.free_blocks() == loop.free_at_start
        manager = loop.sched.connector.manager
        assert not manager.has_pending_transfers()
    finally:
        loop.close()
