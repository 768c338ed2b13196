"""vLLM adapter: ``AscendStoreConnector`` (and the deprecated name ``MooncakeConnectorStoreV1``).

Runs in: the vLLM scheduler process (role SCHEDULER) and every worker process (role WORKER). The
only module of this package that imports vllm. It translates vLLM's objects into the package's own
types and delegates: `KVPoolScheduler` on the scheduler, `KVPoolWorker` (+ the lookup server on
global rank 0) on the workers.

Configuration: ``--kv-transfer-config '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"backend": "mooncake", ...}}'`` with the backend's own config file
(``MOONCAKE_CONFIG_PATH`` / ``YR_CONFIG_PATH``) or an inline ``store_config`` mapping.

Layer-wise mode (``use_layerwise``): ``wait_for_layer_load``/``save_kv_layer`` move each layer while
the forward pass runs (`ascend_dist.kv_store.transfer.layerwise`, `ascend_dist.kv_store.transfer.gva_layerwise`).
Hybrid models (several KV-cache groups: full attention with sliding window or Mamba) load
asynchronously: vLLM 0.33 takes a failed load of such a model only per request, through
``get_transfer_results(...).failed_recving``, which exists for async loads alone (it raises on
block-level reports, as block ids repeat across groups). ``load_async`` is therefore turned on for
them (logged once at INFO); ``use_layerwise`` (whose loads are synchronous) is refused.

Limits: requests with multimodal inputs or prompt embeddings are not pooled (tokens do not identify their KV).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ascend_dist.common.vllm_stats import TransferStatsReporting
from ascend_dist.kv_store.assembly import build_scheduler, build_worker
from ascend_dist.kv_store.backends.factory import create_backend_or_unavailable
from ascend_dist.kv_store.config.config import PoolConfig
from ascend_dist.kv_store.lookup.lookup_rpc import LookupClient, LookupServer
from ascend_dist.kv_store.lookup.messages import LookupRequest
from ascend_dist.kv_store.scheduler.scheduler import KVPoolScheduler, NewRequest, RunningRequest, StepInput
from ascend_dist.kv_store.step_metadata import PoolStepMeta
from ascend_dist.kv_store.transfer.worker import ComputeEvent, KVPoolWorker
from ascend_dist.kv_store.vllm_spec import pool_spec_from_vllm

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AscendStoreConnector", "AscendStoreConnectorMetadata", "MooncakeConnectorStoreV1", "pool_spec_from_vllm"]

logger = logging.getLogger(__name__)


class AscendStoreConnectorMetadata(KVConnectorMetadata):
    """vLLM's per-step connector metadata: wraps one immutable `PoolStepMeta`."""

    def __init__(self, step: PoolStepMeta) -> None:
        """Wrap ``step``."""
        self.step = step


class AscendStoreKVEvents(KVConnectorKVEvents):
    """``BlockStored`` events of the pool, merged across workers.

    Upstream kept only events reported by every worker, which dropped chunks stored by one rank of
    a replica set; here an event reported by any worker is kept once.
    """

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        """Hold ``events`` reported by ``num_workers`` workers."""
        self._events: list[KVCacheEvent] = list(events or [])
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Add another worker's events."""
        self._events.extend(events)

    def aggregate(self) -> AscendStoreKVEvents:
        """Collapse duplicates (the same chunk reported by several ranks), keeping first-seen order."""
        seen: dict[object, KVCacheEvent] = {}
        for e in self._events:
            key = (tuple(e.block_hashes), tuple(e.token_ids)) if isinstance(e, BlockStored) else id(e)
            seen.setdefault(key, e)
        self._events = list(seen.values())
        return self

    def increment_workers(self, count: int = 1) -> None:
        """Count more contributing workers."""
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        """Every event held."""
        return list(self._events)

    def get_number_of_workers(self) -> int:
        """Contributing workers."""
        return self._workers

    def clear_events(self) -> None:
        """Forget the events."""
        self._events = []


def _compute_event_recorder() -> Callable[[], ComputeEvent] | None:
    """Device runtimes: record an event on the compute stream so saves wait for the forward pass."""
    from ascend_dist.common.device import get_runtime
    from ascend_dist.common.device.detect import select_backend

    if select_backend().name == "cpu":
        return None  # the CPU forward pass has finished when wait_for_save runs
    runtime = get_runtime()
    return lambda: runtime.current_stream().record_event()


def _salt(request: Request, weights_epoch: str = "") -> str:
    lora = request.lora_request.lora_name if request.lora_request is not None else ""
    base = f"{lora}\x00{request.cache_salt or ''}"
    # After a reset_cache (a weight update) the epoch joins every key: KV of older weights never matches.
    return f"{base}\x00{weights_epoch}" if weights_epoch else base


def _poolable(request: Request) -> bool:
    return request.prompt_token_ids is not None and not request.mm_features


class AscendStoreConnector(TransferStatsReporting, KVConnectorBase_V1, SupportsHMA):
    """The AscendStore KV-cache pool as a vLLM v1 KV connector."""

    # ``pool`` (vllm:ascend_pool_*): the scheduler records lookups' hit and miss tokens, the workers
    # every store get/put (GVA copy) with its bytes, time, pieces and failed keys by kind
    stats_channels = ("pool",)

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        """Build the scheduler or the worker side.

        Raises:
            ConfigError: A bad ``kv_connector_extra_config`` or backend setting (names the key).
        """
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        events_cfg = vllm_config.kv_events_config
        kv_events = bool(events_cfg is not None and events_cfg.enable_kv_cache_events)
        self._cfg = PoolConfig.from_extra(extra, kv_role=str(ktc.kv_role or "kv_both"), kv_events=kv_events)
        self._events = AscendStoreKVEvents(num_workers=0)
        unknown = PoolConfig.unknown_keys(extra)
        if unknown:
            logger.warning("AscendStoreConnector ignores unknown kv_connector_extra_config keys %s", unknown)
        self._spec = pool_spec_from_vllm(vllm_config, kv_cache_config, self._cfg)
        self._num_groups = len(self._spec.block_sizes)
        self._cfg = self._cfg.for_groups(self._num_groups)  # same rule on the scheduler and workers
        self._kv_cache_config = kv_cache_config
        self._scheduler: KVPoolScheduler | None = None
        self._worker: KVPoolWorker | None = None
        self._client: LookupClient | None = None
        self._server: LookupServer | None = None
        self._requests: dict[str, Request] = {}
        # "" until the first reset_cache, so instances started on the same weights share keys.
        self._weights_epoch = ""
        self._request_epoch: dict[str, str] = {}  # the epoch a request was (re)scheduled under
        self._lookup_misses: dict[str, int] = {}  # request -> prompt tokens the last lookup did not find
        if role == KVConnectorRole.SCHEDULER:
            self._client = LookupClient(
                self._spec.compat_hash(),
                port=self._cfg.lookup_rpc_port,
                dp_rank=self._spec.dp_rank,
                instance=str(ktc.engine_id),  # vLLM's per-instance id: one endpoint file per instance
                timeout_s=self._cfg.lookup_timeout_s,
            )
            self._scheduler = build_scheduler(self._spec, self._cfg, self._client.lookup)
        else:
            store_cfg = extra.get("store_config")
            backend = create_backend_or_unavailable(
                self._cfg.backend,
                contribute_memory=True,
                local_rank=self._spec.tp_rank,
                global_rank=vllm_config.parallel_config.rank,
                backend_config=store_cfg if isinstance(store_cfg, dict) else None,
            )
            self._worker = build_worker(
                self._spec,
                self._cfg,
                backend,
                record_compute_event=_compute_event_recorder(),
                transfer_stats=self.transfer_stats,
            )
            if vllm_config.parallel_config.rank == 0:
                self._server = LookupServer(
                    self._serve_lookup,
                    self._spec.compat_hash(),
                    port=self._cfg.lookup_rpc_port,
                    dp_rank=self._spec.dp_rank,
                    instance=str(ktc.engine_id),
                )

    # ---------------- worker side ----------------

    def _serve_lookup(self, req: LookupRequest) -> int:
        assert self._worker is not None
        return self._worker.lookup(req.token_len, req.block_hashes, req.group_ids, req.hbm_hit_tokens, req.tail_hash)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the paged KV caches with the store (once)."""
        assert self._worker is not None
        cfg = self._kv_cache_config
        num_blocks = int(cfg.num_blocks) if cfg is not None else int(next(iter(kv_caches.values())).shape[0])
        groups = [list(g.layer_names) for g in cfg.kv_cache_groups] if cfg is not None and cfg.kv_cache_groups else None
        self._worker.register_kv_caches(kv_caches, num_blocks, groups)

    def _step(self) -> PoolStepMeta:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendStoreConnectorMetadata)
        return meta.step

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Settle preempted requests' saves: vLLM's runner zeroes or copies new blocks right after this.

        The step's first worker hook (before ``_update_states`` and the binding): a preempted
        request's blocks may be handed to another request, zeroed, in the step that preempts it.
        """
        if self._worker is not None:
            assert isinstance(kv_connector_metadata, AscendStoreConnectorMetadata)
            self._worker.handle_preemptions(kv_connector_metadata.step)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step and start it on the worker (vLLM binds before every forward pass).

        Layer-wise steps are planned here, not in `start_load_kv`, which vLLM calls after the
        forward unless the step has synchronous loads.
        """
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind_step(self._step())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's pool hits: before the forward for synchronous loads, after it for async ones."""
        assert self._worker is not None
        self._worker.start_load_kv(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: wait (bounded) for this layer's load; whole-request mode loaded in `start_load_kv`."""
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Layer-wise: queue this layer's save; whole-request mode saves in `wait_for_save`."""
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """Queue this step's saves; returns at once (completion is reported by `get_finished`)."""
        assert self._worker is not None
        self._worker.wait_for_save(self._step())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose held blocks may be freed, and async loads that completed."""
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Saves and async loads that completed; with several KV groups, the failed loads among them.

        With one group the failed block ids (`get_block_ids_with_load_errors`) say more: vLLM then
        recomputes from the first bad block instead of the whole request.
        """
        assert self._worker is not None
        sending, recving, failed = self._worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed if self._num_groups > 1 else set()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed this step, with one KV group; always empty with several.

        Block ids repeat across groups, so vLLM 0.33 raises on a block-level report for a model with
        several; their loads are asynchronous and fail by request in `get_transfer_results`.
        """
        assert self._worker is not None
        failed = self._worker.get_block_ids_with_load_errors()  # drained either way
        return failed if self._num_groups == 1 else set()

    def get_kv_connector_kv_cache_events(self) -> AscendStoreKVEvents | None:
        """This worker's ``BlockStored`` events since the last call (None when there are none)."""
        if self._worker is None:
            return None
        events: list[KVCacheEvent] = [
            BlockStored(
                block_hashes=[e.block_hash], parent_block_hash=e.parent_block_hash, token_ids=list(e.token_ids),
                block_size=e.block_size, lora_id=None, medium=MEDIUM_STORAGE, lora_name=None,
            )
            for e in self._worker.events.drain()
        ]  # fmt: skip
        return AscendStoreKVEvents(events) if events else None

    def shutdown(self) -> None:
        """Stop the lookup server, finish queued transfers, join threads, close the store client."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` the pool can provide."""
        assert self._scheduler is not None
        self._requests[request.request_id] = request
        if not _poolable(request):
            return 0, False
        prompt = request.prompt_token_ids
        assert prompt is not None
        self._request_epoch[request.request_id] = self._weights_epoch
        hit, is_async = self._scheduler.get_num_new_matched_tokens(
            request.request_id, prompt, request.num_tokens, num_computed_tokens, salt=self._salt(request)
        )
        # vLLM may ask again before it allocates: the stats count the answer it acts on (update_state_after_alloc).
        self._lookup_misses[request.request_id] = max(0, request.num_prompt_tokens - num_computed_tokens - (hit or 0))
        return hit, is_async

    def _salt(self, request: Request) -> str:
        return _salt(request, self._request_epoch.get(request.request_id, self._weights_epoch))

    def reset_cache(self) -> bool:
        """Fence the pool's KV computed under older weights (vLLM calls this after a weight update).

        Pool entries cannot be deleted from every instance reliably, so they are made unreachable:
        a fresh random epoch joins the keys of every request scheduled from now on (requests
        re-enter through `get_num_new_matched_tokens` when vLLM preempts them for the reset). A
        random epoch, not a counter: another instance's epoch 1 may hold other weights.
        """
        self._weights_epoch = secrets.token_hex(8)
        logger.info("AscendStoreConnector: pool keys fenced with weights epoch %s", self._weights_epoch)
        return True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Arm the load once vLLM allocated the request's blocks."""
        assert self._scheduler is not None
        self._requests[request.request_id] = request
        miss = self._lookup_misses.pop(request.request_id, None)
        if miss is not None:  # a poolable request the pool was asked about
            self.transfer_stats.record_pool_lookup(num_external_tokens, miss)
        self._scheduler.update_state_after_alloc(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Translate the scheduler output and build this step's metadata."""
        assert self._scheduler is not None
        so = scheduler_output
        new: list[NewRequest] = []
        for r in so.scheduled_new_reqs:
            req = self._requests.get(r.req_id)
            if r.prompt_token_ids is None or (req is not None and not _poolable(req)):
                continue
            new.append(
                NewRequest(
                    r.req_id,
                    r.prompt_token_ids,
                    r.block_ids,
                    r.num_computed_tokens,
                    so.num_scheduled_tokens.get(r.req_id, 0),
                    salt=self._salt(req) if req else "",
                )
            )
        running: list[RunningRequest] = []
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is None or not _poolable(req):
                continue
            computed = cached.num_computed_tokens[i]
            scheduled = so.num_scheduled_tokens.get(req_id, 0)
            tokens = list(req.all_token_ids)
            if req_id in cached.resumed_req_ids:
                blocks = cached.new_block_ids[i] or ()
                new.append(
                    NewRequest(
                        req_id,
                        req.prompt_token_ids or [],
                        blocks,
                        computed,
                        scheduled,
                        all_token_ids=tokens,
                        salt=self._salt(req),
                    )
                )
            else:
                running.append(
                    RunningRequest(req_id, tokens[computed : computed + scheduled], cached.new_block_ids[i], computed)
                )
        preempted = frozenset(so.preempted_req_ids or ())
        step = self._scheduler.build_meta(StepInput(new, running, frozenset(so.finished_req_ids), preempted))
        for req_id in so.finished_req_ids:
            self._requests.pop(req_id, None)
            self._request_epoch.pop(req_id, None)
        return AscendStoreConnectorMetadata(step)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks while saves of this request may still be running."""
        assert self._scheduler is not None
        self._lookup_misses.pop(request.request_id, None)
        return self._scheduler.request_finished(request.request_id), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA variant of `request_finished` (same rule for every group)."""
        assert self._scheduler is not None
        self._lookup_misses.pop(request.request_id, None)
        return self._scheduler.request_finished(request.request_id), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget held requests saved or failed to load, resume saves at failed blocks; collect KV events."""
        if self._scheduler is not None and connector_output.finished_sending:
            self._scheduler.mark_sent(connector_output.finished_sending)
        if self._scheduler is not None and connector_output.failed_recving:
            self._scheduler.mark_load_failed(connector_output.failed_recving)
        if self._scheduler is not None and connector_output.invalid_block_ids:
            self._scheduler.mark_blocks_invalid(connector_output.invalid_block_ids)
        reported = connector_output.kv_cache_events
        if reported is not None:
            self._events.add_events(reported.get_all_events())
            self._events.increment_workers(reported.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The pool's ``BlockStored`` events since the last call, duplicates collapsed."""
        events = self._events.aggregate().get_all_events()
        self._events = AscendStoreKVEvents(num_workers=0)
        yield from events

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise mode hooks every attention layer, so graphs must be piecewise."""
        return bool(extra_config.get("use_layerwise", False))


class MooncakeConnectorStoreV1(AscendStoreConnector):
    """Deprecated name of `AscendStoreConnector`, kept so existing deployment configs keep working."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        """Log the deprecation once per process and build the connector."""
        logger.warning("MooncakeConnectorStoreV1 is deprecated; use AscendStoreConnector (same class)")
        super().__init__(vllm_config, role, kv_cache_config)
