"""vLLM 0.33's running v1 ``Scheduler`` with worker-role connectors copying on the CPU simulation.

A helper module (no tests): the scheduler-loop, multi-group failure and soak tests import it by name
(the conftest puts this folder on ``sys.path``). `Loop` drives vLLM's real ``Scheduler`` (which builds
the SCHEDULER-role connector through the factory and binds its BlockPool) step by step in vLLM's
call order, and one `Shard` per worker: a WORKER-role connector from vLLM's factory over its own
split-K/V CPU caches (the Ascend tuple layout), one layer per KV-cache group. A stand-in model writes
each scheduled token's KV as a function of (token, position, group), so every block a load fills
is checked byte for byte; blocks awaiting a load are first poisoned, so a copy that did not happen
cannot pass.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from ascend_dist.common.device import CopyDirection, CpuSimRuntime, Event, Stream
from ascend_dist.common.errors import DeviceError

BLOCK = 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
LAYER = LAYERS[0]
POISON = 0x55
NATIVE = "ascend_dist.kv_offload.vllm_native"
SIMPLE = "ascend_dist.kv_offload.vllm_simple"
RECOMPUTE = "ascend_dist.kv_offload.vllm_recompute"


def write_model_dir(d: Path, num_layers: int = 1) -> Path:
    """A tiny Llama config vLLM's ``ModelConfig`` accepts offline."""
    (d / "config.json").write_text(
        json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": num_layers, "vocab_size": 1000, "max_position_embeddings": 512,
            "torch_dtype": "float16", "rms_norm_eps": 1e-5,
        })
    )  # fmt: skip
    return d


def make_config(
    model_dir: Path,
    connector: str,
    module: str,
    extra: dict[str, Any],
    num_blocks: int,
    *,
    tp: int = 1,
    prefix_caching: bool = False,
    failure_policy: str = "recompute",
    max_num_seqs: int = 8,
) -> VllmConfig:
    """A CPU ``VllmConfig`` selecting ``connector`` by module path."""
    ktc = KVTransferConfig(
        kv_connector=connector, kv_role="kv_both", kv_connector_module_path=module,
        kv_connector_extra_config=extra, kv_load_failure_policy=failure_policy,
    )  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=256),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=256, max_num_seqs=max_num_seqs, max_model_len=256, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


class FaultyRuntime:
    """A fake of our `DeviceRuntime` Protocol: the CPU simulation, with copy failures on demand.

    ``fail(direction, n)`` makes the next ``n`` batched copies of that direction fail at their
    first descriptor (reported asynchronously, as a device fault is); ``raise_on_submit(direction,
    n)`` makes the next ``n`` submissions raise at once (a driver refusing the call); ``rate`` fails
    that fraction of all copies at random (seeded). Copies are counted per direction.
    """

    def __init__(self, inner: CpuSimRuntime, *, rate: float = 0.0, seed: int = 0) -> None:
        self.inner = inner
        self.name = inner.name
        self.device_index = inner.device_index
        self.rate = rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # one fault armed and consumed per copy call
        self._fail: dict[int, int] = {}
        self._raise: dict[int, int] = {}
        self.copies: dict[int, int] = {int(d): 0 for d in CopyDirection}
        self.failed: dict[int, int] = {int(d): 0 for d in CopyDirection}

    def fail(self, direction: CopyDirection, n: int = 1) -> None:
        with self._lock:
            self._fail[int(direction)] = self._fail.get(int(direction), 0) + n

    def raise_on_submit(self, direction: CopyDirection, n: int = 1) -> None:
        with self._lock:
            self._raise[int(direction)] = self._raise.get(int(direction), 0) + n

    def batch_copy(
        self, src_ptrs: Any, dst_ptrs: Any, sizes: Any, direction: CopyDirection | int, *, stream: Stream | None = None
    ) -> None:
        d = int(direction)
        with self._lock:
            self.copies[d] += 1
            if self._raise.get(d, 0) > 0:
                self._raise[d] -= 1
                self.failed[d] += 1
                raise DeviceError(f"injected: {CopyDirection(d).name} submission refused")
            fail = self._fail.get(d, 0) > 0 or (self.rate > 0 and self._rng.random() < self.rate)
            if fail:
                self._fail[d] = max(0, self._fail.get(d, 0) - 1)
                self.failed[d] += 1
                self.inner.inject_copy_fault(0)
            self.inner.batch_copy(src_ptrs, dst_ptrs, sizes, direction, stream=stream)

    def new_stream(self, *, priority: int = 0) -> Stream:
        return self.inner.new_stream(priority=priority)

    def current_stream(self) -> Stream:
        return self.inner.current_stream()

    def compute_stream(self) -> Stream:
        return self.inner.compute_stream()

    def use_stream(self, stream: Stream) -> AbstractContextManager[Stream]:
        return self.inner.use_stream(stream)

    def new_event(self, *, timing: bool = False) -> Event:
        return self.inner.new_event(timing=timing)

    def empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.empty(shape, dtype)

    def pinned_empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.pinned_empty(shape, dtype)

    def launch_host_func(self, stream: Stream, fn: Callable[[], object]) -> None:
        self.inner.launch_host_func(stream, fn)

    def synchronize(self, timeout: float | None = None) -> None:
        self.inner.synchronize(timeout)

    def ipc_handle(self, tensor: torch.Tensor) -> Any:
        return self.inner.ipc_handle(tensor)

    def open_ipc_handle(self, handle: Any) -> torch.Tensor:
        return self.inner.open_ipc_handle(handle)

    def close(self) -> None:
        self.inner.close()


def expected_rows(tokens: torch.Tensor, positions: torch.Tensor, part: int) -> torch.Tensor:
    """The stand-in model's KV of ``n`` tokens: ``[n, 4]`` int8 of (token, position, K or V).

    Group g writes positions offset by ``g * 1000``, so the groups' bytes differ.
    """
    base = tokens * 7 + positions * 3 + part * 101
    return ((base[:, None] + torch.arange(4)) % 256 - 128).to(torch.int8)


def kv_cache_config(num_blocks: int, groups: int = 1) -> KVCacheConfig:
    """``groups`` full-attention KV-cache groups of one layer each, each in its own tensor."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.int8)
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(size=page * num_blocks, layers=[name], layer_stride=0, block_stride=page)
        for name in LAYERS[:groups]
    ]
    return KVCacheConfig(num_blocks, tensors, [KVCacheGroupSpec([name], spec) for name in LAYERS[:groups]])


class Shard:
    """One worker: a worker-role connector from vLLM's factory over its own split K/V CPU caches.

    Every transfer of this worker runs on ``runtime``, a `FaultyRuntime` over its own CPU simulation
    (``sim``), which injects copy failures on demand or at ``fault_rate``.
    """

    def __init__(self, config: VllmConfig, kcc: KVCacheConfig, *, fault_rate: float = 0.0, seed: int = 0) -> None:
        self.groups = len(kcc.kv_cache_groups)
        self.k = [torch.zeros(kcc.num_blocks, BLOCK, 1, 4, dtype=torch.int8) for _ in range(self.groups)]
        self.v = [torch.zeros(kcc.num_blocks, BLOCK, 1, 4, dtype=torch.int8) for _ in range(self.groups)]
        self.sim = CpuSimRuntime(wait_timeout_s=10.0)
        self.runtime = FaultyRuntime(self.sim, rate=fault_rate, seed=seed)
        self.conn: Any = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
        spec_obj = getattr(getattr(self.conn, "connector_worker", None), "spec", None)
        if spec_obj is not None:  # native: our NPUOffloadingSpec copies on this runtime
            spec_obj.runtime = self.runtime
        if hasattr(self.conn, "runtime"):  # simple and recompute: used at registration
            self.conn.runtime = self.runtime
        self.conn.register_kv_caches({LAYERS[g]: (self.k[g], self.v[g]) for g in range(self.groups)})

    def poison(self, group: int, block: int) -> None:
        self.k[group][block].fill_(POISON)
        self.v[group][block].fill_(POISON)

    def close(self) -> None:
        self.conn.shutdown()
        self.sim.close()


class Loop:
    """vLLM's Scheduler, one `Shard` per worker (world size), a stand-in model, vLLM's aggregator."""

    def __init__(
        self,
        config: VllmConfig,
        num_blocks: int,
        *,
        scheduler_cls: type[Scheduler] = Scheduler,
        groups: int = 1,
        fault_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.kcc = kv_cache_config(num_blocks, groups)
        self.groups = groups
        world = config.parallel_config.world_size
        self.shards: list[Shard] = []
        self.sched: Any = None
        try:
            for i in range(world):
                self.shards.append(Shard(config, self.kcc, fault_rate=fault_rate, seed=seed + i))
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
        self.failed_recving: set[str] = set()
        self.failed_steps: list[tuple[set[str], set[int]]] = []  # (finished_recving, load errors)
        self.verified: dict[str, int] = {}  # request -> tokens whose loaded KV was checked (every shard)
        self.verified_bytes = 0
        self._poisoned: set[str] = set()

    def add(
        self, rid: str, first_token: int, tokens: int, max_tokens: int = 1, prompt: list[int] | None = None
    ) -> Request:
        ids = prompt if prompt is not None else [(first_token + i) % 900 + 10 for i in range(tokens)]
        req = Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, block_hasher=self._hasher)
        self.sched.add_request(req)
        return req

    def free_blocks(self) -> int:
        return int(self.sched.kv_cache_manager.block_pool.get_num_free_blocks())

    def block_ids(self, rid: str, group: int = 0) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[group])

    def _write(self, req: Request, start: int, end: int) -> None:
        """The model: KV of positions ``[start, end)`` into the request's blocks of every group, every shard."""
        if end <= start:
            return
        tokens = torch.tensor(req.all_token_ids[start:end], dtype=torch.int64)
        positions = torch.arange(start, end, dtype=torch.int64)
        for g in range(self.groups):
            rows = self._rows(req.request_id, g, positions)
            k, v = expected_rows(tokens, positions + g * 1000, 0), expected_rows(tokens, positions + g * 1000, 1)
            for shard in self.shards:
                shard.k[g].view(-1, 4)[rows] = k
                shard.v[g].view(-1, 4)[rows] = v

    def _rows(self, rid: str, group: int, positions: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor(self.block_ids(rid, group), dtype=torch.int64)
        return ids[positions // BLOCK] * BLOCK + positions % BLOCK

    def kv_matches(self, shard: Shard, req: Request, upto: int) -> bool:
        """Whether the shard's blocks of the request hold the model's KV for positions ``[0, upto)``."""
        if upto <= 0:
            return True
        tokens = torch.tensor(req.all_token_ids[:upto], dtype=torch.int64)
        positions = torch.arange(upto, dtype=torch.int64)
        for g in range(self.groups):
            rows = self._rows(req.request_id, g, positions)
            if not torch.equal(shard.k[g].view(-1, 4)[rows], expected_rows(tokens, positions + g * 1000, 0)):
                return False
            if not torch.equal(shard.v[g].view(-1, 4)[rows], expected_rows(tokens, positions + g * 1000, 1)):
                return False
        return True

    def _poison_waiting(self) -> None:
        """Fill the blocks each request newly waiting for a load will receive with a sentinel."""
        for rid, req in self.sched.requests.items():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in self._poisoned:
                pool = self.sched.kv_cache_manager.block_pool
                for g in range(self.groups):
                    for b in self.block_ids(rid, g):
                        if pool.blocks[b].block_hash is not None:
                            continue  # a device prefix-cache hit (valid, maybe shared): not a load target
                        for shard in self.shards:
                            shard.poison(g, b)
                self._poisoned.add(rid)

    def _finish(self, shard: Shard, out: SchedulerOutput) -> ModelRunnerOutput:
        """One worker's hooks after the forward pass, and its output as the model runner builds it."""
        w = shard.conn
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        errors = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()  # vLLM's runner order: after the load errors
        for rid in results.finished_recving - results.failed_recving:
            req = self.sched.requests.get(rid)
            if req is not None and not req.is_finished() and not set(self.block_ids(rid)) & errors:
                assert self.kv_matches(shard, req, req.num_computed_tokens), self.explain(shard, req)
                self.verified_bytes += req.num_computed_tokens * 8 * self.groups
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        reqs = [self.sched.requests[r] for r in ids]
        sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in reqs]  # partial prefills: none
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=results.finished_recving or None, invalid_block_ids=errors,
                failed_recving=results.failed_recving, kv_connector_stats=stats,
                kv_connector_worker_meta=worker_meta,
            ),
        )  # fmt: skip

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, every worker's hooks around the stand-in model, aggregate, update."""
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        for shard in self.shards:  # the hooks before the forward pass, on every worker, in vLLM's order
            shard.conn.handle_preemptions(meta)  # vLLM's runner order: before the binding
            shard.conn.bind_connector_metadata(meta)
        # A reused block is first overwritten here in a real engine (nothing may read it after the
        # preemption flush above): the sentinel stands for that write, before loads are submitted.
        self._poison_waiting()
        for shard in self.shards:
            shard.conn.start_load_kv(None)
        for rid, n in out.num_scheduled_tokens.items():  # the forward pass
            req = self.sched.requests[rid]
            self._write(req, req.num_computed_tokens - n, req.num_computed_tokens)
        merged = self.aggregator.aggregate([self._finish(shard, out) for shard in self.shards])
        assert merged is not None and merged.kv_connector_output is not None
        kv_out = merged.kv_connector_output
        errors = kv_out.invalid_block_ids
        self.load_errors |= errors
        self.failed_recving |= kv_out.failed_recving
        if errors:
            self.failed_steps.append((set(kv_out.finished_recving or ()), set(errors)))
        for rid in (kv_out.finished_recving or set()) - kv_out.failed_recving:  # every shard finished (and checked)
            req = self.sched.requests.get(rid)
            if req is not None and not req.is_finished() and not set(self.block_ids(rid)) & errors:
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
                raise AssertionError(f"still busy after {timeout_s} s: {self.describe()}")
            out = self.step()
            if not out.num_scheduled_tokens:
                time.sleep(0.002)
            yield out

    def explain(self, shard: Shard, req: Request) -> str:
        """Which positions of a request's loaded KV differ, and whether they hold the sentinel."""
        upto = req.num_computed_tokens
        tokens = torch.tensor(req.all_token_ids[:upto], dtype=torch.int64)
        positions = torch.arange(upto, dtype=torch.int64)
        rows = self._rows(req.request_id, 0, positions)
        got = shard.k[0].view(-1, 4)[rows]
        bad = (got != expected_rows(tokens, positions, 0)).any(dim=1).nonzero().flatten().tolist()
        poisoned = [p for p in bad if bool((got[p] == POISON).all())]
        return (
            f"loaded KV of {req.request_id} differs at {len(bad)} of {upto} positions "
            f"(first {bad[:3]}, last {bad[-3:]}; {len(poisoned)} still the sentinel); blocks "
            f"{self.block_ids(req.request_id)}, preemptions {req.num_preemptions}, prompt {req.num_prompt_tokens}"
        )

    def describe(self) -> str:
        return ", ".join(f"{rid}:{req.status.name}" for rid, req in list(self.sched.requests.items())[:8])

    def close(self) -> None:
        if self.sched is not None:
            self.sched.shutdown()
        for shard in self.shards:
            shard.close()
