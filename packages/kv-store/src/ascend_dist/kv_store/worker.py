"""KVPoolWorker: registration, pool lookup (rank 0), loads, non-blocking saves, completion, failures.

Runs in: each worker process (one per TP/PP/CP rank). Order of calls per step, as vLLM makes them:
``bind_step(meta)`` when the metadata is bound (preemption waits, layer-wise planning),
``start_load_kv(meta)`` before the forward pass when the step has synchronous loads, after it
otherwise (async loads are queued to the receiving thread), ``wait_for_save(meta)`` after the
forward (queues saves and returns at once),
``get_transfer_results(finished_ids)`` (``get_finished`` plus the failed async loads) and
``get_block_ids_with_load_errors()`` at the end of the step.
At start-up: ``register_kv_caches`` once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, StoreError
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.chunk_plan import ChunkPlanner
from ascend_dist.kv_store.coordinator import HybridCoordinator
from ascend_dist.kv_store.events import EventCollector
from ascend_dist.kv_store.failures import LoadErrorRecorder
from ascend_dist.kv_store.gva_layerwise import GvaLayerwiseTransfers, make_layer_transfers
from ascend_dist.kv_store.keys import RankLayout
from ascend_dist.kv_store.layerwise import LayerwiseTransfers
from ascend_dist.kv_store.plan import PoolStepMeta, ReqMeta
from ascend_dist.kv_store.pool_lookup import PoolLookup
from ascend_dist.kv_store.registration import build_registration
from ascend_dist.kv_store.rekey import KeySplit
from ascend_dist.kv_store.token_db import ChunkedTokenDatabase
from ascend_dist.kv_store.transfer import CompletionTracker, TransferThread
from ascend_dist.kv_store.whole_request import WholeRequestIO
from ascend_dist.kv_store.worker_types import ComputeEvent, LayerwiseOptions, WorkerStats

__all__ = ["ComputeEvent", "KVPoolWorker", "WorkerStats"]  # the last two re-exported from worker_types

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _SaveJob:
    reqs: tuple[ReqMeta, ...]
    event: ComputeEvent | None


class KVPoolWorker:
    """The worker side of the pool for one rank."""

    def __init__(
        self,
        *,
        token_db: ChunkedTokenDatabase,
        layout: RankLayout,
        backend: PoolBackend,
        granularity: int,
        tp_rank: int = 0,
        put_step: int = 1,
        load_async: bool = False,
        can_save: bool = True,
        preempt_wait_s: float = 30.0,
        record_compute_event: Callable[[], ComputeEvent] | None = None,
        compute_wait_s: float = 60.0,
        layer_wait_s: float = 60.0,
        kv_events: bool = False,
        layerwise: bool = False,
        layerwise_options: LayerwiseOptions | None = None,
        stage_layers: Sequence[int] = (),
        coordinator: HybridCoordinator | None = None,
        key_split: KeySplit | None = None,
    ) -> None:
        """Create the worker and start its transfer threads.

        Args:
            token_db: This rank's key/address database.
            layout: Parallel layout (for all-rank lookups on rank 0).
            backend: The store client.
            granularity: Transfer granularity in tokens.
            tp_rank: This rank's TP rank (rotation and save sharding).
            put_step: Ranks sharing identical KV that split the writes.
            load_async: Load on the receiving thread (vLLM ``WAITING_FOR_REMOTE_KVS``).
            can_save: Whether this rank writes to the pool.
            preempt_wait_s: Bound on waiting for a preempted request's pending saves.
            record_compute_event: Records an event on the compute stream after the forward pass
                (device runtimes); the sending thread waits for it before reading the KV cache.
                None on CPU, where the forward pass has finished when ``wait_for_save`` is called.
            compute_wait_s: Bound on that wait; a save whose event misses it is dropped (logged).
            layer_wait_s: Layer-wise: bound on waiting for one layer's load; its blocks are then
                reported as load errors (recomputed) instead of stalling the forward pass.
            kv_events: Record a `BlockStoredEvent` per chunk put (drained with ``events.drain()``).
            layerwise: Move each layer on its own, overlapping the forward pass: one object per chunk
                and layer (`LayerwiseTransfers`), or with a `GvaBackend` one object per block whose
                layers are copied in turn (`GvaLayerwiseTransfers`).
            layerwise_options: Prefetch depth, attention gate, GVA copy limits and stagger.
            stage_layers: Layer-wise: layers of each PP stage (default: every stage has this rank's
                count); rank-0 lookups check every stage's layer keys.
            coordinator: Hybrid-model (sliding window, Mamba) and EAGLE rules for lookups, store
                masks and load ranges; None for plain prefix caching.
            key_split: TP-mismatch sub-keys / PP re-keying of every chunk (single-group models).

        Raises:
            ConfigError: Layer-wise mode for a model with several KV-cache groups.
        """
        self._db = token_db
        self._layout = layout
        self._backend = backend
        self._granularity = granularity
        self._tp_rank = tp_rank
        self._put_step = put_step
        self._preempt_wait_s = preempt_wait_s
        self._record_event = record_compute_event
        self._compute_wait_s = compute_wait_s
        self.errors = LoadErrorRecorder()
        self.events = EventCollector()
        self.stats = WorkerStats()
        self._saves = CompletionTracker()
        self._loads = CompletionTracker()
        self._stage_layers = tuple(stage_layers)
        self._split = key_split
        self._sync_saves = coordinator is not None and coordinator.is_sparse
        self._plan = ChunkPlanner(
            token_db,
            granularity=granularity,
            tp_rank=tp_rank,
            put_step=put_step,
            coordinator=coordinator,
            split=key_split,
        )
        self._io = WholeRequestIO(
            plan=self._plan, backend=backend, stats=self.stats, errors=self.errors,
            events=self.events if kv_events else None,
        )  # fmt: skip
        if key_split is not None and key_split.active and (layerwise or token_db.num_groups != 1):
            raise ConfigError(
                "prefill_tp_size/prefill_pp_size", key_split, "no TP/PP key split with layer-wise or hybrid"
            )
        self._layers: LayerwiseTransfers | None = None
        if layerwise:
            if token_db.num_groups != 1:
                raise ConfigError("use_layerwise", True, "false for models with several KV-cache groups")
            self._layers = make_layer_transfers(
                layerwise_options or LayerwiseOptions(),
                token_db=token_db, backend=backend, errors=self.errors, stats=self.stats, saves=self._saves,
                granularity=granularity, tp_rank=tp_rank, put_step=put_step, can_save=can_save,
                record_compute_event=record_compute_event, compute_wait_s=compute_wait_s, layer_wait_s=layer_wait_s,
                on_stored=(lambda chunks: self.events.add(self._plan.stored_events(chunks))) if kv_events else None,
            )  # fmt: skip
        layers = self._layers
        gva = isinstance(layers, GvaLayerwiseTransfers)
        if gva and layout.pp_size * layout.pcp_size * layout.dcp_size > 1:
            raise ConfigError("use_layerwise", True, "false with memcache under PP or context parallelism")
        self._lookup = PoolLookup(
            token_db=token_db, backend=backend, layout=layout, granularity=granularity, coordinator=coordinator,
            stage_layers=None if layers is None else self._stages, gva=gva,
        )  # fmt: skip
        whole = self._layers is None
        self._sender = (
            TransferThread[_SaveJob](f"kv-pool-send-{tp_rank}", self._save_job, self._saves)
            if can_save and whole
            else None
        )
        self._receiver = (
            TransferThread[Sequence[ReqMeta]](f"kv-pool-recv-{tp_rank}", self._load_async, self._loads)
            if load_async and whole
            else None
        )
        self._awaiting_free: set[str] = set()
        self._loading: set[str] = set()
        self._registered = False
        self._kv_caches: Mapping[str, object] = {}
        self._bound: PoolStepMeta | None = None  # bound by `bind_step`, not yet loaded by `start_load_kv`

    @property
    def backend(self) -> PoolBackend:
        """The store client."""
        return self._backend

    @property
    def num_groups(self) -> int:
        """KV-cache groups of the model (more than one: failures are reported by request)."""
        return self._db.num_groups

    def register_kv_caches(
        self, kv_caches: Mapping[str, object], num_blocks: int, group_layers: Sequence[Sequence[str]] | None = None
    ) -> None:
        """Describe the caches to the token database and register their memory with the store.

        Raises:
            LayoutError: Unsupported cache shapes.
            StoreError: The store refused a region.
        """
        reg = build_registration(kv_caches, num_blocks, group_layers)
        self._kv_caches = kv_caches  # transfers write to these addresses: the tensors must outlive the worker
        for g, buffers in enumerate(reg.groups):
            self._db.set_buffers(g, buffers)
        if self._layers is not None:
            self._layers.set_layers(reg.groups[0].layer_names)
        if self._split is not None and self._split.active:
            self._split.check(reg.groups[0], self._db.block_sizes[0])
        self._backend.register_buffer([s for s, _ in reg.regions], [n for _, n in reg.regions])
        self._registered = True
        logger.info(
            "registered %d KV group(s), %d region(s), page bytes %s",
            len(reg.groups),
            len(reg.regions),
            [g.page_bytes for g in reg.groups],
        )

    # ---- lookup (rank 0, via the lookup RPC) ----

    def lookup(
        self,
        token_len: int,
        hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        hbm_hit_tokens: int = 0,
        tail_hash: bytes = b"",
    ) -> int:
        """Leading tokens of the prompt held by the pool for every rank and group (`PoolLookup`).

        Raises:
            StoreError: The store cannot be asked (the RPC server turns it into 0 hits).
        """
        return self._lookup.lookup(token_len, hashes, group_ids, hbm_hit_tokens, tail_hash)

    def _stages(self) -> tuple[int, ...]:
        count = self._layers.num_layers if self._layers is not None else 0
        return self._stage_layers or (count,) * self._layout.pp_size

    def safe_lookup(
        self,
        token_len: int,
        hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        hbm_hit_tokens: int = 0,
        tail_hash: bytes = b"",
    ) -> int:
        """`lookup`, with a store failure turned into 0 hits and one warning (a miss, never a crash)."""
        try:
            return self.lookup(token_len, hashes, group_ids, hbm_hit_tokens, tail_hash)
        except StoreError as exc:
            log_once(logger, logging.WARNING, "pool lookup failed (%s); reporting misses", exc, key="lookup-store")
            return 0

    # ---- loads ----

    def _load_async(self, reqs: Sequence[ReqMeta]) -> None:
        """`_load` on the receiving thread: an unexpected error fails the requests' loads, never passes them."""
        try:
            self._io.load(reqs)
        except Exception as exc:  # the request is reported finished next: it must not look loaded
            logger.exception("async load of %s failed", [r.req_id for r in reqs])
            for req in reqs:
                self.errors.record(req.req_id, [b for ids in req.block_ids for b in ids if b > 0], repr(exc))

    def bind_step(self, meta: PoolStepMeta) -> None:
        """Start the step whose metadata vLLM just bound (before the forward pass, always).

        Waits for preempted requests' saves (their blocks may be reused by this forward); layer-wise:
        plans the step and submits the first layers' loads (see `LayerwiseTransfers`). This cannot
        wait for `start_load_kv`: vLLM 0.32/0.33 calls that after the forward pass unless the step
        has synchronous loads (``SchedulerOutput.has_sync_kv_loads``), so ``save_kv_layer`` would
        run on the previous step's plan and the step's own saves would be dropped.
        """
        self._bound = meta
        self._wait_preempted(meta.preempted_req_ids)
        if self._layers is not None:
            self._layers.start_step(meta)

    def start_load_kv(self, meta: PoolStepMeta) -> None:
        """Load every request whose spec says so (`bind_step` first, if ``meta`` was not bound).

        Whole-request synchronous loads: vLLM calls this before the forward pass for them. Async
        loads: queued to the receiving thread. Layer-wise: started by `bind_step`.
        """
        if meta is not self._bound:
            self.bind_step(meta)
        self._bound = None  # one load per bound step
        if self._layers is not None:
            return
        reqs = [r for r in meta.requests if r.load_spec is not None and r.load_spec.can_load]
        if not reqs:
            return
        if self._receiver is not None:
            for req in reqs:
                self._loading.add(req.req_id)
                self._receiver.submit((req.req_id,), [req])
        else:
            self._io.load(reqs)

    def _wait_preempted(self, preempted: frozenset[str]) -> None:
        if not preempted:
            return
        try:
            self._saves.wait_idle(preempted, self._preempt_wait_s)
        except DeadlineExceeded as exc:
            logger.warning("preempted requests' saves still running: %s", exc)

    # ---- saves ----

    def _save_job(self, job: _SaveJob) -> None:
        if job.event is not None:
            try:
                job.event.synchronize(self._compute_wait_s)
            except DeadlineExceeded as exc:
                logger.warning(
                    "forward pass not finished after %.0fs; %d save(s) dropped: %s",
                    self._compute_wait_s,
                    len(job.reqs),
                    exc,
                )
                return
        self._io.save(job.reqs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: block (bounded) until ``layer_name``'s KV is loaded; otherwise a no-op."""
        if self._layers is not None:
            self._layers.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        """Layer-wise: queue ``layer_name``'s save and return; otherwise a no-op."""
        if self._layers is not None:
            self._layers.save_kv_layer(layer_name)

    def wait_for_save(self, meta: PoolStepMeta) -> None:
        """Queue this step's saves; returns without waiting for them.

        Hybrid models with sliding-window or Mamba groups wait (bounded) for the step's saves:
        vLLM frees their out-of-window / stale blocks at the next step's allocation, and a save
        still reading such a block could copy another request's KV. Layer-wise: the saves were
        queued layer by layer; wait (bounded) for the step's loads.
        """
        self._awaiting_free |= meta.delayed_free_req_ids
        if self._layers is not None:
            self._layers.finish_step()
            return
        if self._sender is None:
            return
        reqs = tuple(req for req in meta.requests if req.can_save)
        if reqs:
            event = self._record_event() if self._record_event is not None else None
            ids = tuple(r.req_id for r in reqs)
            self._sender.submit(ids, _SaveJob(reqs, event))
            if self._sync_saves:
                try:
                    self._saves.wait_idle(ids, self._compute_wait_s)
                except DeadlineExceeded as exc:
                    logger.warning("saves of a hybrid step still running: %s", exc)

    # ---- completion ----

    def get_finished(self, finished_req_ids: set[str] | frozenset[str]) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)`` for vLLM.

        ``done_sending``: requests whose blocks were held for a save and whose saves completed;
        ``done_recving``: async loads that completed.
        """
        done_sending = self._saves.idle(self._awaiting_free)
        self._awaiting_free -= done_sending
        done_recving = self._loads.idle(self._loading) if self._receiver is not None else set()
        self._loading -= done_recving
        return done_sending, done_recving

    def get_transfer_results(self, finished_req_ids: set[str] | frozenset[str]) -> tuple[set[str], set[str], set[str]]:
        """`get_finished` plus ``failed_recving``: the completed async loads that failed (a subset of them)."""
        done_sending, done_recving = self.get_finished(finished_req_ids)
        return done_sending, done_recving, self.errors.take_failed_requests(done_recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (every KV group).

        Failed requests that are no longer loading asynchronously (sync and layer-wise loads, or
        async ones already reported) are forgotten here, once per step.
        """
        self.errors.retain_requests(self._loading)
        return self.errors.take()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued save and load finished (tests, demo, shutdown).

        Raises:
            DeadlineExceeded: Transfers still pending after ``timeout_s``.
        """
        self._saves.wait_idle(self._saves.pending_ids(), timeout_s)
        self._loads.wait_idle(self._loading, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued transfers, join the threads and close the store client."""
        for thread in (self._sender, self._receiver):
            if thread is not None:
                thread.stop(timeout_s)
        if self._layers is not None:
            self._layers.close(timeout_s)
        self._backend.close()
