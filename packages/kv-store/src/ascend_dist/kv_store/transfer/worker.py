"""KVPoolWorker: registration, pool lookup (rank 0), loads, non-blocking saves, completion, failures.

Runs in: each worker process (one per TP/PP/CP rank). Order of calls per step, as vLLM makes them:
``handle_preemptions(meta)`` first (preemption waits, before the runner zeroes or copies blocks),
``bind_step(meta)`` when the metadata is bound (layer-wise planning),
``start_load_kv(meta)`` before the forward pass when the step has synchronous loads, after it
otherwise (async loads are queued to the receiving thread), ``wait_for_save(meta)`` after the
forward (queues saves and returns at once),
``get_transfer_results(finished_ids)`` (``get_finished`` plus the failed async loads) and
``get_block_ids_with_load_errors()`` at the end of the step.
At start-up: ``register_kv_caches`` once.

The worker holds no mode checks: every hook goes to the `TransferStrategy` (whole request, async,
or layer-wise) that `assembly.build_worker` chose once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from ascend_dist.common.errors import StoreError
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.keys.rekey import KeySplit
from ascend_dist.kv_store.keys.token_db import ChunkedTokenDatabase
from ascend_dist.kv_store.lookup.pool_lookup import PoolLookup
from ascend_dist.kv_store.step_metadata import PoolStepMeta
from ascend_dist.kv_store.transfer.events import EventCollector
from ascend_dist.kv_store.transfer.failures import LoadErrorRecorder
from ascend_dist.kv_store.transfer.registration import build_registration
from ascend_dist.kv_store.transfer.strategy import SaveGuard, TransferStrategy
from ascend_dist.kv_store.transfer.worker_types import ComputeEvent, WorkerStats

__all__ = ["ComputeEvent", "KVPoolWorker", "WorkerStats"]  # the last two re-exported from worker_types

logger = logging.getLogger(__name__)


class KVPoolWorker:
    """The worker side of the pool for one rank: vLLM's hooks over one `TransferStrategy`.

    Built by `assembly.build_worker` (the composition root), which picks the strategy once.
    """

    def __init__(
        self,
        *,
        token_db: ChunkedTokenDatabase,
        backend: PoolBackend,
        lookup: PoolLookup,
        transfers: TransferStrategy,
        guard: SaveGuard,
        errors: LoadErrorRecorder,
        events: EventCollector,
        stats: WorkerStats,
        key_split: KeySplit | None = None,
    ) -> None:
        """Wire the parts `assembly.build_worker` composed.

        Args:
            token_db: This rank's key/address database.
            backend: The store client (closed with the worker).
            lookup: Rank 0's all-rank pool lookup.
            transfers: How this rank moves KV (whole request, async, or layer-wise).
            guard: Save bookkeeping shared with ``transfers`` (delayed free, preemption fence).
            errors: Failed loads, reported to vLLM.
            events: KV events of stored chunks.
            stats: Counters for tests, the demo and the benchmark.
            key_split: TP-mismatch sub-keys / PP re-keying of every chunk (checked at registration).
        """
        self._db = token_db
        self._backend = backend
        self._lookup = lookup
        self._transfers = transfers
        self._guard = guard
        self.errors = errors
        self.events = events
        self.stats = stats
        self._split = key_split
        self._awaiting_free: set[str] = set()
        self._registered = False
        self._kv_caches: Mapping[str, object] = {}
        self._bound: PoolStepMeta | None = None  # bound by `bind_step`, not yet loaded by `start_load_kv`

    @property
    def transfers(self) -> TransferStrategy:
        """The transfer strategy the composition root chose."""
        return self._transfers

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
        self._transfers.set_layers(reg.groups[0].layer_names)
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

    # ---- the step, in vLLM's call order ----

    def handle_preemptions(self, meta: PoolStepMeta) -> None:
        """Settle preempted requests' saves before vLLM's runner touches their blocks (the step's first hook).

        vLLM 0.33's runner zeroes the step's new blocks (``new_block_ids_to_zero``) and copies
        ``kv_cache_block_copies`` after this and before ``bind_step``; a preempted request's blocks
        may be among them in the step that preempts it, so its saves must not read them any more.

        Raises:
            DeadlineExceeded: A put still reads a preempted request's blocks after `WorkerWaits.fence_s`.
        """
        self._guard.wait_preempted(meta.preempted_req_ids)

    def bind_step(self, meta: PoolStepMeta) -> None:
        """Start the step whose metadata vLLM just bound (before the forward pass, always).

        Preempted requests' saves are waited for or cancelled (their blocks may be reused by this
        forward; a cancelled save's put in flight is waited for too) unless `handle_preemptions`
        settled them already; layer-wise: the step is planned and its first layers' loads submitted.

        Raises:
            DeadlineExceeded: A put still reads a preempted request's blocks after
                `WorkerWaits.fence_s`, or a fenced layer-wise load still writes into blocks.
        """
        self._bound = meta
        self._transfers.bind_step(meta)

    def start_load_kv(self, meta: PoolStepMeta) -> None:
        """Load every request whose spec says so (`bind_step` first, if ``meta`` was not bound).

        Whole-request synchronous loads: vLLM calls this before the forward pass for them. Async
        loads: queued to the receiving thread. Layer-wise: started by `bind_step`.
        """
        if meta is not self._bound:
            self.bind_step(meta)
        self._bound = None  # one load per bound step
        self._transfers.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: block until ``layer_name``'s KV is loaded (the step's deadline); otherwise a no-op."""
        self._transfers.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        """Layer-wise: queue ``layer_name``'s save and return; otherwise a no-op."""
        self._transfers.save_layer(layer_name)

    def wait_for_save(self, meta: PoolStepMeta) -> None:
        """Queue this step's saves; returns without waiting for them.

        Hybrid models with sliding-window or Mamba groups wait (bounded) for the step's saves and
        cancel them past it: vLLM frees their out-of-window / stale blocks at the next step's
        allocation (a cancelled put in flight is waited for; past `WorkerWaits.fence_s` this raises
        `DeadlineExceeded`). Layer-wise: the saves were queued layer by layer; the step's loads end here.
        """
        self._awaiting_free |= meta.delayed_free_req_ids
        self._transfers.wait_for_save(meta)

    # ---- completion ----

    def get_finished(self, finished_req_ids: set[str] | frozenset[str]) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)`` for vLLM.

        ``done_sending``: requests whose blocks were held for a save and whose saves completed;
        ``done_recving``: async loads that completed.
        """
        done_sending = self._guard.settle(self._awaiting_free, finished_req_ids)
        self._awaiting_free -= done_sending
        return done_sending, self._transfers.finished_loads()

    def get_transfer_results(self, finished_req_ids: set[str] | frozenset[str]) -> tuple[set[str], set[str], set[str]]:
        """`get_finished` plus ``failed_recving``: the completed async loads that failed (a subset of them)."""
        done_sending, done_recving = self.get_finished(finished_req_ids)
        return done_sending, done_recving, self.errors.take_failed_requests(done_recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (every KV group).

        Failed requests that are no longer loading asynchronously (sync and layer-wise loads, or
        async ones already reported) are forgotten here, once per step.
        """
        self.errors.retain_requests(self._transfers.loading())
        return self.errors.take()

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued save and load finished (tests, demo, shutdown).

        Raises:
            DeadlineExceeded: Transfers still pending after ``timeout_s``.
        """
        saves = self._guard.saves
        saves.wait_idle(saves.pending_ids(), timeout_s)
        self._transfers.drain(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued transfers, join the threads and close the store client."""
        try:
            self._transfers.close(timeout_s)
        finally:
            self._backend.close()
