"""vLLM 0.33's ``Scheduler`` on P and D with factory-built worker connectors, and the CPU-host shims.

Runs in: the ``ascend-dist bench pd-vllm`` process (imports vLLM at module level: import it only
after checking vLLM is installed). The approach of kv-store's ``pool-vllm`` driver: no model runs,
the "forward" is the per-layer connector calls over CPU caches, and one step does what vLLM's
``EngineCore.step`` and the model runner's connector mixin do (schedule, ``handle_preemptions``,
bind, ``start_load_kv``, per-layer ``wait_for_layer_load``/``save_kv_layer``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, clear, ``update_from_output``).
Caches are vLLM 0.33's one tensor per layer, ``[blocks, heads, tokens, K|V]`` (``LBHNC``, the
layout vLLM's ``MooncakeConnector`` requires; ours reads it from the strides).

Shims (bench only, never in the product; see the kv-mooncake README, *pd-vllm*):

* vLLM's ``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()``
  and ``current_platform.set_device`` (its sender threads too), and picks the attention backend of
  the model's layers (none are built here, so it asks the platform): on a host without a GPU
  driver (vLLM's CUDA wheel sees no platform) the first raises, the second is not implemented and
  the third answers no backend. `cpu_host_shims` answers device 0, makes ``set_device`` a no-op and
  answers vLLM's CPU attention backend (what vLLM's CPU platform picks for these caches) while
  the bench runs; only host memory is used.
* ``torch.cuda.Event`` (`host_events`), as vLLM's own CPU model runner swaps it, around every
  connector's ``wait_for_save`` alike.
* vLLM's P launches its bootstrap server on ``0.0.0.0`` unless ``bootstrap_server_address`` is
  set; the bench sets it and runs vLLM's own ``MooncakeBootstrapServer`` on 127.0.0.1 itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import MooncakeBootstrapServer
from vllm.platforms import current_platform
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.kv_mooncake._demo.pd_vllm_geometry import Shape

__all__ = [
    "BootstrapServer",
    "Instance",
    "StepResult",
    "cpu_host_shims",
    "distributed_env",
    "environment",
    "vllm_config",
    "write_model_dir",
]

BootstrapServer = MooncakeBootstrapServer


def write_model_dir(root: Path, shape: Shape) -> Path:
    """A Llama ``config.json`` of this shape (no weights: nothing runs the model)."""
    d = root / f"bench-llama-{shape.name}"
    d.mkdir(parents=True, exist_ok=True)
    # The bench ships in the product (`ascend-dist bench`), so it cannot use the dev-only testing
    # member's builders: the few lines it needs of them are here.
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.kv_heads * shape.head_dim,
        "intermediate_size": 128,
        "head_dim": shape.head_dim,
        "num_attention_heads": shape.kv_heads,
        "num_key_value_heads": shape.kv_heads,
        "num_hidden_layers": shape.layers,
        "vocab_size": 1 << 20,
        "max_position_embeddings": shape.tokens + 64,
        "torch_dtype": "float16",
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


def vllm_config(model_dir: Path, shape: Shape, transfer: Mapping[str, Any]) -> VllmConfig:
    """A CPU ``VllmConfig`` admitting a whole wave in one step; ``transfer``: the ``KVTransferConfig`` fields."""
    max_len = shape.tokens + 64
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=max_len
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=shape.requests * max_len,
            max_num_seqs=shape.requests,
            max_model_len=max_len,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=shape.block),
        kv_transfer_config=KVTransferConfig(**transfer),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = shape.num_blocks
    return config


def kv_cache_config(shape: Shape) -> Any:
    """One full-attention group, one tensor per layer (the testing builders' ``KVCacheConfig``)."""
    spec = FullAttentionSpec(
        block_size=shape.block, num_kv_heads=shape.kv_heads, head_size=shape.head_dim, dtype=torch.float16
    )
    assert spec.page_size_bytes == shape.block_bytes
    tensors = [
        KVCacheTensor(
            size=spec.page_size_bytes * shape.num_blocks,
            layers=[name],
            layer_stride=0,
            block_stride=spec.page_size_bytes,
        )
        for name in shape.layer_names
    ]
    return KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(shape.layer_names), spec)],
    )


def block_hasher(config: VllmConfig, kcc: Any) -> Any:
    """The block hasher vLLM's ``EngineCore`` gives each request (its hash function, hash block size)."""
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hash_block = resolve_kv_cache_block_sizes(kcc, config)[1]
    lookahead = getattr(config, "num_hash_lookahead_tokens", 0)  # vLLM 0.33: tokens after a block
    return (
        get_request_block_hasher(hash_block, hash_fn, lookahead)
        if lookahead
        else get_request_block_hasher(hash_block, hash_fn)
    )


def make_caches(shape: Shape) -> dict[str, torch.Tensor]:
    """Per-layer ``[blocks, heads, tokens, K|V]`` float16 caches (filled by the bench)."""
    dims = (shape.num_blocks, shape.kv_heads, shape.block, 2 * shape.head_dim)
    return {name: torch.empty(dims, dtype=torch.float16) for name in shape.layer_names}


class _CompletedEvent:
    """A CUDA event stand-in for host memory: the caches are already written when it is recorded."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@functools.cache
def _has_cuda() -> bool:
    return torch.cuda.is_available()


@contextmanager
def host_events() -> Iterator[None]:
    """``torch.cuda.Event`` as a completed event while a connector hook runs, on hosts without CUDA."""
    if _has_cuda():
        yield
        return
    original = torch.cuda.Event
    torch.cuda.Event = _CompletedEvent  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        torch.cuda.Event = original  # type: ignore[misc]


@contextmanager
def cpu_host_shims() -> Iterator[None]:
    """Device 0, a no-op ``set_device`` and vLLM's CPU attention backend without a GPU driver (see above).

    Held for the whole run: vLLM's sender threads call ``set_device`` when its pool starts them.
    """
    if _has_cuda():
        yield
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    accel = torch.accelerator
    platform: Any = current_platform
    saved = (accel.current_device_index, platform.set_device, platform.get_attn_backend_cls)
    cpu_attn = AttentionBackendEnum.CPU_ATTN.get_path()
    accel.current_device_index = lambda: 0  # type: ignore[assignment]
    platform.set_device = lambda device: None
    platform.get_attn_backend_cls = lambda *args, **kwargs: cpu_attn
    try:
        yield
    finally:
        accel.current_device_index, platform.set_device, platform.get_attn_backend_cls = saved  # type: ignore[assignment]


@contextmanager
def environment(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for None, unset) environment variables; restore them afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def distributed_env(config: VllmConfig, port: int) -> Iterator[None]:
    """A vLLM world of one rank over gloo on 127.0.0.1 (both connectors ask the TP/PP groups), torn down after."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():  # someone else's world (a test session): use it, leave it
        yield
        return
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
        )
        try:
            ensure_model_parallel_initialized(1, 1, backend="gloo")
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


@dataclass
class StepResult:
    """What one engine step did, as the bench needs it."""

    new_blocks: dict[str, list[int]] = field(default_factory=dict)  # req -> blocks at scheduling
    finished_params: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # finished req -> its params
    results_at: float = 0.0  # perf_counter when get_transfer_results returned
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


class PStepper(Protocol):
    """A P that D's loop lets step between D's steps (a no-op for a P with a loop of its own)."""

    def step_beside(self) -> None:
        """One step if P is stepped by D's loop and has work."""
        ...


class Instance:
    """One vLLM instance without a model: its ``Scheduler`` and a WORKER-role connector over CPU caches."""

    def __init__(self, config: VllmConfig, shape: Shape) -> None:
        """Build the worker connector, register the caches, then the scheduler (its connector from the factory)."""
        self.shape = shape
        self.caches = make_caches(shape)
        self.kcc = kv_cache_config(shape)
        self.hasher = block_hasher(config, self.kcc)
        with set_current_vllm_config(config):
            self.worker: KVConnectorBase_V1 = KVConnectorFactory.create_connector(
                config, KVConnectorRole.WORKER, self.kcc
            )
        self.scheduler: Scheduler | None = None
        try:
            self.worker.register_kv_caches(self.caches)  # type: ignore[arg-type]
            self.scheduler = Scheduler(
                vllm_config=config,
                kv_cache_config=self.kcc,
                structured_output_manager=StructuredOutputManager(config),
                block_size=shape.block,
                log_stats=False,
            )
        except BaseException:
            self.close()
            raise

    @property
    def sched(self) -> Scheduler:
        assert self.scheduler is not None
        return self.scheduler

    def add(self, req_id: str, prompt: list[int], params: dict[str, Any]) -> None:
        """A request of one output token carrying ``params`` as its kv_transfer_params."""
        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        self.sched.add_request(Request(req_id, prompt, sampling, None, block_hasher=self.hasher))

    def step(self) -> StepResult:
        """One engine step in the model runner's call order (see the module docstring)."""
        out = self.sched.schedule()
        result = StepResult()
        c = self.worker
        c.handle_preemptions(out.kv_connector_metadata)  # type: ignore[arg-type]
        for r in out.scheduled_new_reqs:
            result.new_blocks[r.req_id] = list(r.block_ids[0])
        for t in self.caches.values() if out.new_block_ids_to_zero else ():
            t[out.new_block_ids_to_zero] = 0
        c.bind_connector_metadata(out.kv_connector_metadata)  # type: ignore[arg-type]
        sync_loads = bool(out.has_sync_kv_loads)
        if sync_loads:
            c.start_load_kv(None)  # type: ignore[arg-type]  # neither connector reads the forward context
        if out.total_num_scheduled_tokens:
            for name, cache in self.caches.items():  # the attention layers; the caches already hold the KV
                c.wait_for_layer_load(name)
                c.save_kv_layer(name, cache, None)  # type: ignore[arg-type]
        if not sync_loads:
            c.start_load_kv(None)  # type: ignore[arg-type]
        with host_events():
            c.wait_for_save()
        transfers = c.get_transfer_results(out.finished_req_ids)
        result.results_at = time.perf_counter()
        invalid = c.get_block_ids_with_load_errors()
        kv_out = KVConnectorOutput(
            finished_sending=transfers.finished_sending,
            finished_recving=transfers.finished_recving,
            failed_recving=transfers.failed_recving,
            invalid_block_ids=invalid,
            kv_connector_stats=c.get_kv_connector_stats(),
            kv_cache_events=c.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=c.build_connector_worker_meta(),
        )
        c.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if self._prefill_done(r) else [] for r in ids]
        outputs = self.sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_out,
            ),
        )
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    result.finished_params[o.request_id] = o.kv_transfer_params
        result.finished_recving = set(transfers.finished_recving or ())
        result.failed_recving = set(transfers.failed_recving or ())
        result.invalid_block_ids = set(invalid)
        return result

    def _prefill_done(self, req_id: str) -> bool:
        request = self.sched.requests[req_id]
        return request.num_computed_tokens >= request.num_prompt_tokens

    def block(self, block_id: int, tokens: int) -> bytes:
        """The first ``tokens`` token rows of one block in every layer (every head, K and V)."""
        return b"".join(t[block_id, :, :tokens].contiguous().numpy().tobytes() for t in self.caches.values())

    def digests(self, blocks: Mapping[str, Sequence[int]]) -> dict[str, list[str]]:
        """Per request, a BLAKE2b digest of each of its first prompt blocks (`block`'s bytes, prompt tokens only).

        What a P in another process hands the bench for D's byte check (256 MiB per wave stay home).
        """
        out: dict[str, list[str]] = {}
        for rid, ids in blocks.items():
            rows = [min(self.shape.block, self.shape.tokens - j * self.shape.block) for j in range(len(ids))]
            out[rid] = [hashlib.blake2b(self.block(b, n)).hexdigest() for b, n in zip(ids, rows, strict=True)]
        return out

    def fill_random(self, seed: int) -> None:
        """Every cache byte from a seeded generator (P: each wave's KV is new)."""
        gen = torch.Generator().manual_seed(seed)
        for t in self.caches.values():
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, generator=gen, dtype=torch.int16))

    def fill(self, value: float) -> None:
        """Every cache element set to ``value`` (D: a sentinel no load may leave behind)."""
        for t in self.caches.values():
            t.fill_(value)

    def prefill(
        self, req_ids: Sequence[str], prompts: Sequence[list[int]], params: Sequence[dict[str, Any]], timeout_s: float
    ) -> tuple[dict[str, list[int]], dict[str, dict[str, Any] | None]]:
        """Compute ``prompts`` as P (one output token each), then step once more; each request's blocks and params.

        The extra step is where both connectors hand the finished requests' blocks to their workers.
        A request missing from the answer did not finish within ``timeout_s``.
        """
        for rid, prompt, p in zip(req_ids, prompts, params, strict=True):
            self.add(rid, prompt, p)
        blocks: dict[str, list[int]] = {}
        finished: dict[str, dict[str, Any] | None] = {}
        deadline = time.monotonic() + timeout_s
        while len(finished) < len(req_ids) and time.monotonic() < deadline:
            res = self.step()
            blocks.update(res.new_blocks)
            finished.update(res.finished_params)
        self.step()
        return blocks, finished

    def step_beside(self) -> None:
        """One step if the scheduler has work (a P stepped by the same loop as D, in turn)."""
        if self.sched.has_requests():
            self.step()

    def wait_idle(self, timeout_s: float) -> None:
        """Step until the scheduler has no work (see `run_until_idle`)."""
        self.run_until_idle(timeout_s)

    def run_until_idle(self, timeout_s: float, also: PStepper | None = None) -> None:
        """Step while vLLM's engine would (``Scheduler.has_requests``), letting ``also`` step beside it.

        ``also`` (a P) may still have work after this returns: its ``wait_idle`` waits for it.

        Raises:
            DeadlineExceeded: Still busy after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while self.sched.has_requests():
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"the scheduler still had work after {timeout_s:.0f}s")
            self.step()
            if also is not None:
                also.step_beside()
            time.sleep(0.0005)

    def close(self) -> None:
        """Shut both connector roles down, then close the event loops vLLM's connector leaves open."""
        connector = self.scheduler.connector if self.scheduler is not None else None
        if connector is not None:
            connector.shutdown()
        self.worker.shutdown()
        # vLLM 0.33's MooncakeConnectorWorker.shutdown stops its sender/receiver loops and joins their
        # threads but never closes the loops (their sockets stay open until garbage collection).
        inner = getattr(self.worker, "connector_worker", None)
        for name in ("sender_loop", "receiver_loop"):
            loop = getattr(inner, name, None)
            if loop is not None and not loop.is_running() and not loop.is_closed():
                loop.close()
