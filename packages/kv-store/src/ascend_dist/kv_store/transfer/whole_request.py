"""Whole-request loads and saves of one step against the store (the default, non-layer-wise path).

Runs in: worker processes, called by `KVPoolWorker` on the forward pass's thread (synchronous
loads), its receiving thread (``load_async``) or its sending thread (saves). No threads or waits
here: the gets of every request of a step, and one ``exists`` then the puts of the chunks the
store does not hold yet. `load_batches` cuts both into calls the transport executes faithfully: no
key twice in one get (two requests sharing a pooled chunk in different blocks), at most the
backend's piece cap per call. Failed loads are recorded per request and block, for vLLM to recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from ascend_dist.common.errors import StoreError
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.keys.token_db import Chunk
from ascend_dist.kv_store.step_metadata import ReqMeta
from ascend_dist.kv_store.transfer.chunk_plan import ChunkPlanner
from ascend_dist.kv_store.transfer.events import EventCollector
from ascend_dist.kv_store.transfer.failures import LoadErrorRecorder
from ascend_dist.kv_store.transfer.load_batches import STORE_ERROR, run_gets, run_puts
from ascend_dist.kv_store.transfer.worker_types import WorkerStats

__all__ = ["SaveEntry", "SaveOutcome", "WholeRequestIO"]

logger = logging.getLogger(__name__)

SaveEntry = tuple[str, tuple[list[int], list[int]], tuple[int, Chunk, ReqMeta]]
"""One key to save: ``(key, (addrs, sizes), (group, chunk, request))``, as `ChunkPlanner.save_entries`."""


@dataclass
class SaveOutcome:
    """What one save call did: the entries handed to ``put`` and those whose put failed."""

    put: list[SaveEntry] = field(default_factory=list)
    failed: list[SaveEntry] = field(default_factory=list)
    stored: list[SaveEntry] = field(default_factory=list)


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
        """Load every request of one step (`run_gets`: as few calls as the transport allows); record failed blocks."""
        parts = [(req, *self._plan.load_batch(req)) for req in reqs]
        keys = tuple(k for _, b, _ in parts for k in b.keys)
        if not keys:
            return
        addrs = tuple(a for _, b, _ in parts for a in b.addrs)
        sizes = tuple(s for _, b, _ in parts for s in b.sizes)
        result = run_gets(self._backend, keys, addrs, sizes, self._stats.transfer)
        pos = 0
        for req, batch, blocks in parts:
            own = result.codes[pos : pos + len(batch.keys)]
            pos += len(batch.keys)
            failed = [b for b, c in zip(blocks, own, strict=True) if c != 0]
            self._stats.failed_keys += len(failed)
            self._stats.loaded_keys += len(own) - len(failed)
            self._stats.loaded_bytes += sum(sum(s) for s, c in zip(batch.sizes, own, strict=True) if c == 0)
            if failed:
                first = next(c for c in own if c != 0)
                why = (
                    f"store error: {result.error}" if first == STORE_ERROR and result.error else f"get returned {first}"
                )
                self._errors.record(req.req_id, failed, f"{why} for {len(failed)} of {len(own)} keys")

    def emit_stored(self, entries: Sequence[SaveEntry]) -> None:
        """KV events for stored entries (KV events on); the caller leaves out keys it dropped again."""
        if self._events is not None and entries:
            self._events.add(self._plan.stored_events([e[2] for e in entries]))

    def save(
        self, reqs: Sequence[ReqMeta], retry: Sequence[SaveEntry] = (), *, skip_blocks: frozenset[int] = frozenset()
    ) -> SaveOutcome:
        """Save one step's requests: one exists over every chunk, then puts of the missing ones (`run_puts`).

        ``retry``: entries of these requests whose earlier put failed, saved again with them.
        ``skip_blocks``: group-0 blocks whose load failed this step (sync loads have one group):
        they hold no chunk, so no entry is read from them.
        Returns the entries put, stored and failed (a raising put fails every one of them); KV
        events are the caller's (`emit_stored`), which knows which stored keys it keeps.
        """
        keys, values, chunks = self._plan.save_entries(reqs)
        own = set(keys)
        for key, value, chunk in retry:
            if key not in own:
                own.add(key)
                keys.append(key)
                values.append(value)
                chunks.append(chunk)
        if skip_blocks:
            keep = [i for i, (g, chunk, _) in enumerate(chunks) if not (g == 0 and chunk.block_id in skip_blocks)]
            self._stats.unwritten_skipped += len(keys) - len(keep)
            keys, values, chunks = [keys[i] for i in keep], [values[i] for i in keep], [chunks[i] for i in keep]
        out = SaveOutcome()
        if not keys:
            return out
        try:
            present = self._backend.exists(keys)
        except StoreError as exc:
            log_once(
                logger, logging.WARNING, "pool exists() failed before a save (%s); saving all", exc, key="save-exists"
            )
            present = [0] * len(keys)
        for key, value, chunk, here in zip(keys, values, chunks, present, strict=True):
            if here == 1:
                self._stats.skipped_existing += 1
                continue
            out.put.append((key, value, chunk))
        if not out.put:
            return out
        result = run_puts(
            self._backend,
            [e[0] for e in out.put],
            [e[1][0] for e in out.put],
            [e[1][1] for e in out.put],
            self._stats.transfer,
        )
        if result.error is not None:
            log_once(logger, logging.WARNING, "pool put failed (%s); blocks stay local", result.error, key="save-put")
        ok = [c == 0 for c in result.codes]
        out.failed = [e for e, good in zip(out.put, ok, strict=True) if not good]
        out.stored = [e for e, good in zip(out.put, ok, strict=True) if good]
        self._stats.saved_keys += sum(ok)
        self._stats.saved_bytes += sum(sum(e[1][1]) for e, good in zip(out.put, ok, strict=True) if good)
        return out
