"""Whole-request loads and saves of one step against the store (the default, non-layer-wise path).

Runs in: worker processes, called by `KVPoolWorker` on the forward pass's thread (synchronous
loads), its receiving thread (``load_async``) or its sending thread (saves). No threads or waits
here: one ``get`` for every request of a step, and one ``exists`` then one ``put`` of the chunks
the store does not hold yet. Failed loads are recorded per request and block, for vLLM to recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ascend_dist.common.errors import StoreError
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.chunk_plan import ChunkPlanner
from ascend_dist.kv_store.events import EventCollector
from ascend_dist.kv_store.failures import LoadErrorRecorder
from ascend_dist.kv_store.plan import ReqMeta
from ascend_dist.kv_store.worker_types import WorkerStats

__all__ = ["WholeRequestIO"]

logger = logging.getLogger(__name__)


class WholeRequestIO:
    """One step's batched get and exists+put for a rank (see the module docstring)."""

    def __init__(
        self,
        *,
        plan: ChunkPlanner,
        backend: PoolBackend,
        stats: WorkerStats,
        errors: LoadErrorRecorder,
        events: EventCollector | None = None,
    ) -> None:
        """Share the worker's planner, store client, counters and failure record (``events``: KV events on)."""
        self._plan = plan
        self._backend = backend
        self._stats = stats
        self._errors = errors
        self._events = events

    def load(self, reqs: Sequence[ReqMeta]) -> None:
        """Load every request of one step with a single store call; record failed blocks per request."""
        parts = [(req, *self._plan.load_batch(req)) for req in reqs]
        keys = tuple(k for _, b, _ in parts for k in b.keys)
        if not keys:
            return
        addrs = tuple(a for _, b, _ in parts for a in b.addrs)
        sizes = tuple(s for _, b, _ in parts for s in b.sizes)
        try:
            codes = self._backend.get(keys, addrs, sizes)
        except StoreError as exc:
            self._stats.failed_keys += len(keys)
            for req, _, blocks in parts:
                self._errors.record(req.req_id, blocks, f"store error: {exc}")
            return
        pos = 0
        for req, batch, blocks in parts:
            own = codes[pos : pos + len(batch.keys)]
            pos += len(batch.keys)
            failed = [b for b, c in zip(blocks, own, strict=True) if c != 0]
            self._stats.failed_keys += len(failed)
            self._stats.loaded_keys += len(own) - len(failed)
            self._stats.loaded_bytes += sum(sum(s) for s, c in zip(batch.sizes, own, strict=True) if c == 0)
            if failed:
                first = next(c for c in own if c != 0)
                self._errors.record(req.req_id, failed, f"get returned {first} for {len(failed)} of {len(own)} keys")

    def save(self, reqs: Sequence[ReqMeta]) -> None:
        """Save one step's requests: one exists over every chunk, one put of the missing ones."""
        keys, values, chunks = self._plan.save_entries(reqs)
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
        for key, (a, s), (g, chunk, req), here in zip(keys, values, chunks, present, strict=True):
            if here == 1:
                self._stats.skipped_existing += 1
                continue
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
        if self._events is not None:
            self._events.add(self._plan.stored_events([pc for pc, good in zip(put_chunks, ok, strict=True) if good]))
        self._stats.saved_keys += sum(ok)
        self._stats.saved_bytes += sum(sum(s) for s, good in zip(put_sizes, ok, strict=True) if good)
