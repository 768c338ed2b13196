"""vLLM 0.33's own ``Scheduler`` and a factory-built worker connector, stepped in the model runner's order.

Runs in: the ``ascend-dist bench pool-vllm`` process (imports vLLM at module level: import it only
after checking vLLM is installed). No model runs: the "forward" is the per-layer connector calls;
the KV caches are CPU tensors, per layer either vLLM 0.33's one tensor (``[blocks, heads, tokens, K|V]``,
``KVCacheLayout.LBHNC``, what vLLM's runners register) or Ascend's split ``(K, V)`` pair of
``[blocks, tokens, heads, dim]`` tensors (what vllm-ascend's runner registers); same bytes per block.

One step does what ``KVConnectorModelRunnerMixin._get_kv_connector_output`` and
``EngineCore.step`` do: schedule, zero ``new_block_ids_to_zero``, bind, ``start_load_kv`` before
the forward only when ``has_sync_kv_loads`` (else after it), the per-layer
``wait_for_layer_load``/``save_kv_layer``, ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, stats, events, ``build_connector_worker_meta``, clear, then
``Scheduler.update_from_output``.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.kv_store._demo.bench_geometry import Geometry

__all__ = [
    "Cache",
    "Instance",
    "StepResult",
    "distributed_env",
    "environment",
    "host_events",
    "make_caches",
    "tensors",
    "write_model_dir",
]


def write_model_dir(root: Path, geo: Geometry, name: str = "bench-llama") -> Path:
    """A Llama ``config.json`` of this geometry (no weights: nothing runs the model)."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": geo.kv_heads * geo.head_dim,
        "head_dim": geo.head_dim,
        "intermediate_size": 128,
        "num_attention_heads": geo.kv_heads,
        "num_key_value_heads": geo.kv_heads,
        "num_hidden_layers": geo.layers,
        "vocab_size": 1 << 20,
        "max_position_embeddings": geo.prompt_tokens + 64,
        "torch_dtype": "float16",
    }
    (d / "config.json").write_text(json.dumps(config))
    return d


def vllm_config(model_dir: Path, geo: Geometry, transfer: Mapping[str, Any]) -> VllmConfig:
    """A CPU ``VllmConfig`` admitting a whole round in one step; ``transfer``: the ``KVTransferConfig`` fields."""
    ktc = KVTransferConfig(**transfer)
    max_len = geo.prompt_tokens + 64
    budget = geo.requests * max_len
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=max_len
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=geo.requests, max_model_len=max_len, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=geo.block),
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = geo.num_blocks
    return config


def kv_cache_config(geo: Geometry) -> KVCacheConfig:
    """One full-attention group, one ``[blocks, heads, tokens, K|V]`` tensor per layer."""
    spec = FullAttentionSpec(
        block_size=geo.block, num_kv_heads=geo.kv_heads, head_size=geo.head_dim, dtype=torch.float16
    )
    page = spec.page_size_bytes
    assert page * geo.layers == geo.chunk_bytes
    tensors = [
        KVCacheTensor(size=page * geo.num_blocks, layers=[name], layer_stride=0, block_stride=page)
        for name in geo.layer_names
    ]
    return KVCacheConfig(
        num_blocks=geo.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(geo.layer_names, spec)],
    )


Cache = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def make_caches(geo: Geometry, *, split_kv: bool) -> dict[str, Cache]:
    """Uninitialised per-layer caches (the bench fills them before every phase): split (K, V) or vLLM's one tensor."""
    if split_kv:
        half = (geo.num_blocks, geo.block, geo.kv_heads, geo.head_dim)
        return {
            n: (torch.empty(half, dtype=torch.float16), torch.empty(half, dtype=torch.float16)) for n in geo.layer_names
        }
    dims = (geo.num_blocks, geo.kv_heads, geo.block, 2 * geo.head_dim)
    return {name: torch.empty(dims, dtype=torch.float16) for name in geo.layer_names}


def tensors(caches: dict[str, Cache]) -> list[torch.Tensor]:
    """Every cache tensor in layer order (K before V)."""
    return [t for c in caches.values() for t in (c if isinstance(c, tuple) else (c,))]


class _CompletedEvent:
    """A CUDA event stand-in for host memory: the "forward" already wrote the caches when it is recorded."""

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
    # asked once: torch.cuda.is_available() dlopens the driver library on every call (~1 ms)
    return torch.cuda.is_available()


@contextmanager
def host_events() -> Iterator[None]:
    """``torch.cuda.Event`` as a completed event while a connector hook runs, on hosts without CUDA.

    vLLM's ``MooncakeStoreConnector.wait_for_save`` records a ``torch.cuda.Event`` for its save
    thread, which raises without a CUDA driver; vLLM's own CPU model runner swaps ``torch.Event``
    the same way (``cpu_model_runner._torch_cuda_wrapper``). CPU caches are written synchronously,
    so a completed event is exact. Applied around every connector's ``wait_for_save`` alike.
    """
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
    """A vLLM world of one rank over gloo on 127.0.0.1 (a worker's TP/PP/PCP/DCP groups), torn down after.

    vLLM's ``MooncakeStoreWorker`` asks the TP, PCP and DCP groups for its ranks, as a single-process
    executor's worker would after ``init_worker_distributed_environment``.
    """
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


def block_hasher(config: VllmConfig, kcc: KVCacheConfig) -> Any:
    """The block hasher vLLM's ``EngineCore`` gives every request of ``config``."""
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hash_block = resolve_kv_cache_block_sizes(kcc, config)[1]
    lookahead = getattr(config, "num_hash_lookahead_tokens", 0)
    if lookahead:
        return get_request_block_hasher(hash_block, hash_fn, lookahead)
    return get_request_block_hasher(hash_block, hash_fn)


@dataclass
class StepResult:
    """What one engine step did, as the bench needs it."""

    new_blocks: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # req -> (computed tokens, blocks)
    loaded_before_forward: bool = False
    loads_started_at: float = 0.0  # perf_counter when start_load_kv returned
    results_at: float = 0.0  # perf_counter when get_transfer_results returned
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


class Instance:
    """One vLLM instance without a model: its ``Scheduler`` and a WORKER-role connector over ``caches``."""

    def __init__(self, config: VllmConfig, geo: Geometry, caches: dict[str, Cache]) -> None:
        """Build the worker connector (it serves lookups), register the caches, then the scheduler."""
        self.geo = geo
        self.caches = caches
        self.kcc = kv_cache_config(geo)
        self.hasher = block_hasher(config, self.kcc)
        worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kcc)
        self.worker: KVConnectorBase_V1 = worker
        self.scheduler: Scheduler | None = None
        try:
            worker.register_kv_caches(caches)  # type: ignore[arg-type]  # vllm-ascend's runner passes (K, V)
            self.scheduler = Scheduler(
                vllm_config=config,
                kv_cache_config=self.kcc,
                structured_output_manager=StructuredOutputManager(config),
                block_size=geo.block,
                log_stats=False,
            )
        except BaseException:
            self.close()
            raise

    @property
    def sched(self) -> Scheduler:
        assert self.scheduler is not None
        return self.scheduler

    def add(self, req_id: str, prompt: list[int]) -> None:
        """A new request of one output token (it finishes in the step that computes its prompt)."""
        self.sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=self.hasher))

    def block(self, block_id: int) -> bytes:
        """Every layer's bytes of one block, in layer order."""
        return b"".join(t[block_id].numpy().tobytes() for t in tensors(self.caches))

    def step(self) -> StepResult:
        """One engine step in the model runner's call order (see the module docstring)."""
        out = self.sched.schedule()
        result = StepResult()
        # vLLM's runner: handle_preemptions first, every step, before it zeroes or copies new blocks.
        self.worker.handle_preemptions(out.kv_connector_metadata)  # type: ignore[arg-type]
        for r in out.scheduled_new_reqs:
            result.new_blocks[r.req_id] = (r.num_computed_tokens, list(r.block_ids[0]))
        for t in tensors(self.caches) if out.new_block_ids_to_zero else ():
            t[out.new_block_ids_to_zero] = 0
        c = self.worker
        c.bind_connector_metadata(out.kv_connector_metadata)  # type: ignore[arg-type]
        result.loaded_before_forward = bool(out.has_sync_kv_loads)
        if result.loaded_before_forward:
            c.start_load_kv(None)  # type: ignore[arg-type]  # neither connector reads the forward context
            result.loads_started_at = time.perf_counter()
        if out.total_num_scheduled_tokens:
            for name, cache in self.caches.items():  # the attention layers; the caches already hold the KV
                c.wait_for_layer_load(name)
                c.save_kv_layer(name, cache, None)  # type: ignore[arg-type]
        if not result.loaded_before_forward:
            c.start_load_kv(None)  # type: ignore[arg-type]
            result.loads_started_at = time.perf_counter()
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
        self.sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_out,
            ),
        )
        result.finished_recving = set(transfers.finished_recving or ())
        result.failed_recving = set(transfers.failed_recving or ())
        result.invalid_block_ids = set(invalid)
        return result

    def _prefill_done(self, req_id: str) -> bool:
        # schedule() already advanced num_computed_tokens by this step's tokens (_update_after_schedule)
        request = self.sched.requests[req_id]
        return request.num_computed_tokens >= request.num_prompt_tokens

    def run_until_idle(self, timeout_s: float) -> None:
        """Step while vLLM's engine would: ``Scheduler.has_requests`` (requests, delayed frees, pinned saves).

        Raises:
            DeadlineExceeded: Still busy after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while self.sched.has_requests():
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"the scheduler still had work after {timeout_s:.0f}s")
            self.step()

    def close(self) -> None:
        """Shut both connector roles down (the scheduler's first: it talks to the worker's lookup server)."""
        connector = self.scheduler.connector if self.scheduler is not None else None
        _release_vllm_lookup_channel(connector, self.worker)
        if connector is not None:
            connector.shutdown()
        self.worker.shutdown()


def _release_vllm_lookup_channel(scheduler_side: object, worker_side: object, timeout_s: float = 5.0) -> None:
    """Close what vLLM's ``MooncakeStoreConnector.shutdown`` leaves open (no-op for other connectors).

    vLLM 0.33 closes only the store client: the scheduler's ``LookupKeyClient`` (a ZMQ REQ socket and
    context) and the worker's ``LookupKeyServer`` (a REP socket, its context and a thread blocked in
    ``recv``) live until the process exits. The server loop checks its ``running`` flag after each
    reply, so clearing it and sending one message of an unknown type (answered with an error, no
    side effect) ends the thread; then both sockets close and their contexts terminate. vLLM's
    transfer threads have no stop at all: they stay idle (daemon threads) until the process exits.
    """
    client = getattr(getattr(scheduler_side, "connector_scheduler", None), "client", None)
    server = getattr(getattr(worker_side, "connector_worker", None), "lookup_server", None)
    if client is None or server is None:
        return
    server.running = False
    client.socket.send(b"ascend-dist-bench-stop")
    if client.socket.poll(int(timeout_s * 1000)):  # POLLIN by default
        client.socket.recv()
    server.thread.join(timeout_s)
    client.close()
    client.ctx.term()
    if not server.thread.is_alive():
        server.close()
        server.ctx.term()
