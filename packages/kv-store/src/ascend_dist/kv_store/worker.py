"""KVPoolWorker: registration, pool lookup (rank 0), loads, non-blocking saves, completion, failures.

Runs in: each worker process (one per TP/PP/CP rank). Order of calls per step, as vLLM makes them:
``start_load_kv(meta)`` before the forward pass (synchronous loads, or queued to the receiving
thread with ``load_async``), ``wait_for_save(meta)`` after it (queues saves and returns at once),
``get_finished(finished_ids)`` and ``get_block_ids_with_load_errors()`` at the end of the step.
At start-up: ``register_kv_caches`` once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ascend_dist.common.errors import DeadlineExceeded, StoreError
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.backends.base import PoolBackend, TransferBatch
from ascend_dist.kv_store.events import BlockStoredEvent, EventCollector
from ascend_dist.kv_store.failures import LoadErrorRecorder
from ascend_dist.kv_store.keys import RankLayout
from ascend_dist.kv_store.plan import PoolStepMeta, ReqMeta, common_hit, continuous_hits
from ascend_dist.kv_store.registration import build_registration
from ascend_dist.kv_store.sizes import floor_to
from ascend_dist.kv_store.token_db import Chunk, ChunkedTokenDatabase
from ascend_dist.kv_store.transfer import CompletionTracker, TransferThread

__all__ = ["ComputeEvent", "KVPoolWorker", "WorkerStats"]

logger = logging.getLogger(__name__)


class ComputeEvent(Protocol):
    """A device event recorded after the forward pass (``ascend_dist.common.device`` events qualify)."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the recorded work finished.

        Raises:
            DeadlineExceeded: Not finished within ``timeout``.
        """
        ...


@dataclass(frozen=True)
class _SaveJob:
    reqs: tuple[ReqMeta, ...]
    event: ComputeEvent | None


@dataclass
class WorkerStats:
    """Counters for tests, the demo and the benchmark."""

    loaded_keys: int = 0
    loaded_bytes: int = 0
    failed_keys: int = 0
    saved_keys: int = 0
    saved_bytes: int = 0
    skipped_existing: int = 0


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
        kv_events: bool = False,
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
            kv_events: Record a `BlockStoredEvent` per chunk put (drained with ``events.drain()``).
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
        self._kv_events = kv_events
        self.stats = WorkerStats()
        self._saves = CompletionTracker()
        self._loads = CompletionTracker()
        self._sender = (
            TransferThread[_SaveJob](f"kv-pool-send-{tp_rank}", self._save_job, self._saves) if can_save else None
        )
        self._receiver = (
            TransferThread[Sequence[ReqMeta]](f"kv-pool-recv-{tp_rank}", self._load, self._loads)
            if load_async
            else None
        )
        self._awaiting_free: set[str] = set()
        self._loading: set[str] = set()
        self._registered = False

    @property
    def backend(self) -> PoolBackend:
        """The store client."""
        return self._backend

    def register_kv_caches(
        self, kv_caches: Mapping[str, object], num_blocks: int, group_layers: Sequence[Sequence[str]] | None = None
    ) -> None:
        """Describe the caches to the token database and register their memory with the store.

        Raises:
            LayoutError: Unsupported cache shapes.
            StoreError: The store refused a region.
        """
        reg = build_registration(kv_caches, num_blocks, group_layers)
        for g, buffers in enumerate(reg.groups):
            self._db.set_buffers(g, buffers)
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
        self, token_len: int, hashes: Sequence[bytes], group_ids: Sequence[int] = (0,), hbm_hit_tokens: int = 0
    ) -> int:
        """Leading tokens of the prompt held by the pool for every rank and group (spec §9.6).

        Chunks inside the HBM hit are taken as present without asking the store (fixes §19.6).

        Raises:
            StoreError: The store cannot be asked (the RPC server turns it into 0 hits).
        """
        per_group: list[list[int]] = []
        for g in group_ids:
            span = self._db.block_sizes[g]
            grouped = self._db.grouped_hashes(hashes, g)
            n = min(len(grouped), token_len // span)
            if n == 0:
                return 0
            known = min(floor_to(hbm_hit_tokens, span) // span, n)
            ask = [grouped[i] for i in range(known, n)]
            variants = self._layout.num_variants(g)
            codes = self._backend.exists(self._layout.expand(self._db.metadata[g], ask)) if ask else []
            rows = [[1] * known + codes[v * len(ask) : (v + 1) * len(ask)] for v in range(variants)]
            ends = [(i + 1) * span for i in range(n)]
            per_group.append(continuous_hits(ends, rows, self._granularity, token_len))
        return common_hit(per_group)

    def safe_lookup(
        self, token_len: int, hashes: Sequence[bytes], group_ids: Sequence[int] = (0,), hbm_hit_tokens: int = 0
    ) -> int:
        """`lookup`, with a store failure turned into 0 hits and one warning (a miss, never a crash)."""
        try:
            return self.lookup(token_len, hashes, group_ids, hbm_hit_tokens)
        except StoreError as exc:
            log_once(logger, logging.WARNING, "pool lookup failed (%s); reporting misses", exc, key="lookup-store")
            return 0

    # ---- loads ----

    def _load_batch(self, req: ReqMeta) -> tuple[TransferBatch, list[int]]:
        spec = req.load_spec
        assert spec is not None
        token_len = spec.load_token_len(self._granularity, req.save_end_token)
        keys: list[str] = []
        addrs: list[tuple[int, ...]] = []
        sizes: list[tuple[int, ...]] = []
        blocks: list[int] = []
        for g in range(self._db.num_groups):
            ids = req.block_ids[g] if g < len(req.block_ids) else ()
            mask = floor_to(spec.vllm_cached_tokens, self._db.block_sizes[g])
            for chunk in self._db.iter_chunks(token_len, req.block_hashes, g, mask_num=mask, block_ids=ids):
                a, s, block = self._db.prepare_value(chunk.start, chunk.end, ids, g, chunk.block_id)
                keys.append(self._db.key(chunk, g))
                addrs.append(tuple(a))
                sizes.append(tuple(s))
                blocks.append(block)
        batch = TransferBatch(tuple(keys), tuple(addrs), tuple(sizes))
        k = self._tp_rank % len(keys) if keys else 0
        return batch.rotated(k), blocks[k:] + blocks[:k]

    def _load(self, reqs: Sequence[ReqMeta]) -> None:
        """Load every request of one step with a single store call; record failed blocks per request."""
        parts = [(req, *self._load_batch(req)) for req in reqs]
        keys = tuple(k for _, b, _ in parts for k in b.keys)
        if not keys:
            return
        addrs = tuple(a for _, b, _ in parts for a in b.addrs)
        sizes = tuple(s for _, b, _ in parts for s in b.sizes)
        try:
            codes = self._backend.get(keys, addrs, sizes)
        except StoreError as exc:
            self.stats.failed_keys += len(keys)
            for req, _, blocks in parts:
                self.errors.record(req.req_id, blocks, f"store error: {exc}")
            return
        pos = 0
        for req, batch, blocks in parts:
            own = codes[pos : pos + len(batch.keys)]
            pos += len(batch.keys)
            failed = [b for b, c in zip(blocks, own, strict=True) if c != 0]
            self.stats.failed_keys += len(failed)
            self.stats.loaded_keys += len(own) - len(failed)
            self.stats.loaded_bytes += sum(sum(s) for s, c in zip(batch.sizes, own, strict=True) if c == 0)
            if failed:
                first = next(c for c in own if c != 0)
                self.errors.record(req.req_id, failed, f"get returned {first} for {len(failed)} of {len(own)} keys")

    def start_load_kv(self, meta: PoolStepMeta) -> None:
        """Wait for preempted requests' saves, then load every request whose spec says so."""
        self._wait_preempted(meta.preempted_req_ids)
        reqs = [r for r in meta.requests if r.load_spec is not None and r.load_spec.can_load]
        if not reqs:
            return
        if self._receiver is not None:
            for req in reqs:
                self._loading.add(req.req_id)
                self._receiver.submit((req.req_id,), [req])
        else:
            self._load(reqs)

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
        self._save(job.reqs)

    def _save(self, reqs: Sequence[ReqMeta]) -> None:
        """Save one step's requests: one exists over every chunk, one put of the missing ones."""
        keys: list[str] = []
        seen: set[str] = set()
        chunks = []
        for req, g in ((r, g) for r in reqs for g in range(self._db.num_groups)):
            ids = req.block_ids[g] if g < len(req.block_ids) else ()
            mask = floor_to(req.save_start_token, self._db.block_sizes[g])
            for chunk in self._db.iter_chunks(
                req.save_end_token,
                req.block_hashes,
                g,
                mask_num=mask,
                block_ids=ids,
                shard_rank=self._tp_rank % self._put_step,
                shard_size=self._put_step,
            ):
                key = self._db.key(chunk, g)
                if key not in seen:  # two requests of one step may share a prefix
                    seen.add(key)
                    keys.append(key)
                    chunks.append((g, ids, chunk, req))
        if not keys:
            return
        try:
            present = self._backend.exists(keys)
        except StoreError as exc:
            log_once(
                logger, logging.WARNING, "pool exists() failed before a save (%s); saving all", exc, key="save-exists"
            )
            present = [0] * len(keys)
        put_keys: list[str] = []
        put_addrs: list[list[int]] = []
        put_sizes: list[list[int]] = []
        put_chunks = []
        for key, (g, ids, chunk, req), here in zip(keys, chunks, present, strict=True):
            if here == 1:
                self.stats.skipped_existing += 1
                continue
            a, s, _ = self._db.prepare_value(chunk.start, chunk.end, ids, g, chunk.block_id)
            put_keys.append(key)
            put_addrs.append(a)
            put_sizes.append(s)
            put_chunks.append((g, chunk, req))
        if not put_keys:
            return
        try:
            codes = self._backend.put(put_keys, put_addrs, put_sizes)
        except StoreError as exc:
            log_once(logger, logging.WARNING, "pool put failed (%s); blocks stay local", exc, key="save-put")
            return
        ok = [c == 0 for c in codes]
        if self._kv_events:
            self.events.add(self._stored_events([pc for pc, good in zip(put_chunks, ok, strict=True) if good]))
        self.stats.saved_keys += sum(ok)
        self.stats.saved_bytes += sum(sum(s) for s, good in zip(put_sizes, ok, strict=True) if good)

    def _stored_events(self, chunks: Sequence[tuple[int, Chunk, ReqMeta]]) -> list[BlockStoredEvent]:
        out: list[BlockStoredEvent] = []
        for g, chunk, req in chunks:
            span = self._db.block_sizes[g]
            grouped = self._db.grouped_hashes(req.block_hashes, g)
            index = chunk.start // span
            parent = grouped[index - 1] if index > 0 else None
            out.append(BlockStoredEvent(
                block_hash=bytes.fromhex(chunk.chunk_hash) if isinstance(chunk.chunk_hash, str) else chunk.chunk_hash,
                parent_block_hash=bytes.fromhex(parent) if isinstance(parent, str) else parent,
                token_ids=req.token_ids[chunk.start : chunk.end], block_size=span,
            ))  # fmt: skip
        return out

    def wait_for_save(self, meta: PoolStepMeta) -> None:
        """Queue this step's saves; returns without waiting for them."""
        self._awaiting_free |= meta.delayed_free_req_ids
        if self._sender is None:
            return
        reqs = tuple(req for req in meta.requests if req.can_save)
        if reqs:
            event = self._record_event() if self._record_event is not None else None
            self._sender.submit(tuple(r.req_id for r in reqs), _SaveJob(reqs, event))

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

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (every KV group)."""
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
        self._backend.close()
