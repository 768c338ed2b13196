"""Layer-wise pool transfers over a GVA store (memcache): one object per block holds every layer.

Runs in: worker processes, owned by `KVPoolWorker` when ``use_layerwise`` is set and the backend is
a `GvaBackend`. The per-layer control flow (prefetch, bounded waits, the
attention-start gate) is `LayerwiseTransfers`'; this class changes what moves:

* at ``start_step``: loads ask `key_info` for each block's object and take read leases (a block
  whose object is missing, of another size or unleasable is reported as a load error at once);
  saves reserve an object per block not in the pool yet (`alloc`; a key that exists is skipped);
* per layer: that layer's slice of every object is copied with `GvaBackend.copy`, at most
  ``max_transfer_blocks`` blocks per call (0 = all) and in packets of ``max_transfer_bytes``
  (0 = whole pieces); TP ranks stagger their load copies by ``h2d_stagger_us`` per layer;
* after the last layer: saved objects are published (`write_finish`) or, if any of their copies
  failed or their request's saves were cancelled (a preemption past its deadline), dropped, so no
  reader ever sees a half-written block or one copied from reused blocks; read leases are released
  by the last layer's load job in a ``finally`` (a copy that raises, or a fenced step whose copies
  are skipped, still releases them).

Differences from upstream: a failed copy fails the blocks it carried (load errors, or a dropped
object) instead of killing the transfer thread; a step that ends before its last layer was saved
drops its reserved objects; the copy window counts one layer's pieces (upstream counted every
layer's). Shared layer buffers (``layerwise_num_shared_buffers``) are not supported: see `PoolConfig`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, StoreError
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.backends.gva import G2L, L2G, LEASE_TTL_MS, GvaBackend
from ascend_dist.kv_store.config.layerwise_options import LayerwiseOptions
from ascend_dist.kv_store.config.sizes import floor_to
from ascend_dist.kv_store.keys.keys import gva_block_key, gva_partial_key
from ascend_dist.kv_store.keys.token_db import Chunk
from ascend_dist.kv_store.step_metadata import PoolStepMeta, ReqMeta
from ascend_dist.kv_store.transfer.layerwise import LayerwiseTransfers, _LayerJob, _Planned
from ascend_dist.kv_store.transfer.layerwise_plan import (
    gva_layer_copies,
    shared_buffer_layout,
    split_packets,
    stagger_us,
)
from ascend_dist.kv_store.transfer.pool_stats import record_call

__all__ = ["GvaLayerwiseTransfers", "make_layer_transfers"]

logger = logging.getLogger(__name__)

_ABORT = -1  # a sender job with this layer drops the step's reserved objects


@dataclass(frozen=True)
class _Pair:
    """One block and the global object it moves to or from."""

    planned: _Planned
    key: str
    gva: int
    all_layers: bool = True  # False: only layers sharing a buffer load it (their prefix reload)


@dataclass
class _GvaStep:
    loads: tuple[_Pair, ...] = ()
    saves: tuple[_Pair, ...] = ()
    failed: set[str] = field(default_factory=set)  # keys with a failed save copy (sending thread only)
    # keys whose block's load failed this step (main thread rebinds it, the sending thread reads it)
    unwritten: frozenset[str] = frozenset()
    last_layer_saved: bool = False  # main thread: the last layer's save was queued
    layer_done: list[threading.Event] = field(default_factory=list)  # layer L's KV saved: its buffer may be reused
    stamp: Mapping[str, int] | None = None  # `RequestFence` generations of the saving requests


class GvaLayerwiseTransfers(LayerwiseTransfers):
    """Per-layer copies into and out of one global object per block."""

    def __init__(
        self,
        *,
        backend: GvaBackend,
        tp_size: int = 1,
        max_transfer_blocks: int = 0,
        max_transfer_bytes: int = 0,
        h2d_stagger_us: int = 0,
        lease_ms: int = LEASE_TTL_MS,
        num_shared_buffers: int = 0,
        independent_layers: tuple[int, ...] | str = (0,),
        **kwargs: Any,
    ) -> None:
        """Start the threads (other arguments: `LayerwiseTransfers`).

        Args:
            backend: The GVA store client.
            tp_size: TP ranks of this model (the stagger rotates over them).
            max_transfer_blocks: Blocks of one layer per copy call; 0 = one call per layer.
            max_transfer_bytes: Pieces larger than this are copied as packets; 0 = whole pieces.
            h2d_stagger_us: Busy-wait of ``((tp_rank + layer) % tp_size) * h2d_stagger_us`` us
                before a layer's load copy, so TP ranks do not all start at once.
            lease_ms: Read lease on the objects a step loads (released after its last layer).
            num_shared_buffers: ``layerwise_num_shared_buffers`` (0 = one buffer per layer).
            independent_layers: ``layerwise_independent_layers`` (both checked once the layers are known).
            **kwargs: The `LayerwiseTransfers` arguments (token database, errors, threads, waits).
        """
        super().__init__(backend=backend, **kwargs)
        self._gva = backend
        self._tp_size = max(1, tp_size)
        self._window = max(0, max_transfer_blocks)
        self._packet = max(0, max_transfer_bytes)
        self._stagger_us = max(0, h2d_stagger_us)
        self._lease_ms = lease_ms
        self._num_shared_buffers = num_shared_buffers
        self._independent_layers = independent_layers
        self._reused: frozenset[int] = frozenset()  # layers sharing a buffer
        self._reuse_source: dict[int, int] = {}  # layer -> the layer before it in its buffer

    def set_layers(self, layer_names: Sequence[str]) -> None:
        """Layer names in entry order, and which of them share a buffer.

        Raises:
            ConfigError: Shared buffers on a rank that does not save its KV or shares its writes
                with replica ranks (``put_step > 1``): the reused layers' KV must be in the pool.
        """
        layout = shared_buffer_layout(
            len(layer_names), num_shared_buffers=self._num_shared_buffers, independent_layers=self._independent_layers
        )
        if layout.has_reuse and (self._sender is None or self._put_step > 1):
            raise ConfigError(
                "layerwise_num_shared_buffers", layout.num_shared_buffers,
                "0 on ranks that do not save (kv_consumer without consumer_is_to_put) or share writes (MLA)",
            )  # fmt: skip
        self._reused = frozenset(range(len(layer_names))) - set(layout.independent) if layout.has_reuse else frozenset()
        self._reuse_source = dict(layout.prefetch_layer_map)
        super().set_layers(layer_names)

    # ---- planning (main thread, at start_step) ----

    def _key(self, planned: _Planned) -> str:
        chunk = planned.chunk
        if isinstance(chunk.chunk_hash, str) and "@partial@" in chunk.chunk_hash:
            return chunk.chunk_hash  # a partial block carries its request-scoped key as its hash
        meta = self._db.metadata[0]
        return gva_block_key(meta.model_name, chunk.chunk_hash, meta.head_or_tp_rank)

    def _prepare_step(self, meta: PoolStepMeta) -> object:
        previous = self._state
        if isinstance(previous, _GvaStep):
            # the last step never saved its last layer: its reserved objects must not stay half-written
            self._abort_unfinished(previous)
        loads = self._reload_plan(meta) if self._reused else [(p, self._key(p), True) for p in self._load_plan]
        self._load_plan = tuple(p for p, _, _ in loads)
        saves = self._reserve_saves(self._partial_saves(meta) if self._reused else [])
        reqs = {pair.planned.req_id for pair in saves}
        return _GvaStep(
            loads=self._lease(loads), saves=saves, layer_done=[threading.Event() for _ in range(self._num_layers)],
            stamp=self._fence.stamp(reqs) if self._fence is not None else None,
        )  # fmt: skip

    def _partial(self, req: ReqMeta, end: int) -> tuple[_Planned, str] | None:
        """The request-scoped object of the block holding tokens up to ``end`` (not a whole block)."""
        span, ids = self._db.block_sizes[0], (tuple(req.block_ids[0]) if req.block_ids else ())
        index = end // span
        if end % span == 0 or index >= len(ids) or ids[index] <= 0:
            return None
        meta = self._db.metadata[0]
        key = gva_partial_key(
            meta.model_name, req.req_id, group=0, block_index=index, end_token=end, head=meta.head_or_tp_rank
        )
        return _Planned(req.req_id, Chunk(index * span, end, key, ids[index]), ids, req), key

    def _reload_plan(self, meta: PoolStepMeta) -> list[tuple[_Planned, str, bool]]:
        """Shared buffers: reused layers load the whole prefix (and last step's partial block) every step."""
        span = self._db.block_sizes[0]
        out: list[tuple[_Planned, str, bool]] = []
        partial_reqs: list[str] = []
        for req in meta.requests:
            spec = req.load_spec
            if spec is None or not spec.can_load:
                continue
            ids = tuple(req.block_ids[0]) if req.block_ids else ()
            cached = spec.load_token_len(self._granularity, req.save_end_token)
            own = floor_to(spec.vllm_cached_tokens, span)  # independent layers still hold this much
            for c in self._db.iter_chunks(floor_to(cached, span), req.block_hashes, 0, block_ids=ids):
                planned = _Planned(req.req_id, c, ids)
                out.append((planned, self._key(planned), c.start >= own))
            tail = self._partial(req, cached) if cached == spec.vllm_cached_tokens else None
            if tail is not None:  # saved by the last step, reloaded for the reused layers only
                out.append((*tail, False))
                partial_reqs.append(req.req_id)
        try:  # last step's partial objects are published by its sending thread: let it finish
            self._save_tracker.wait_idle(partial_reqs, self._layer_wait_s)
        except DeadlineExceeded as exc:
            logger.warning("previous step's saves still running before a reload: %s", exc)
        return out

    def _partial_saves(self, meta: PoolStepMeta) -> list[_Planned]:
        """Shared buffers: each request's trailing partial block, saved every step for the next reload."""
        parts = (self._partial(req, req.target_token_len) for req in meta.requests)
        return [planned for planned, _ in filter(None, parts)]

    def _lease(self, items: Sequence[tuple[_Planned, str, bool]]) -> tuple[_Pair, ...]:
        """Find and lease every object to load; the blocks of the others become load errors now."""
        if not items:
            return ()
        keys = [key for _, key, _ in items]
        size = self._db.buffers(0).page_bytes
        try:
            infos = self._gva.key_info(keys)
            found = [i for i, (n, gva) in enumerate(infos) if n == size and gva > 0]
            codes = self._gva.add_lease([keys[i] for i in found], self._lease_ms)
        except StoreError as exc:
            infos, found, codes = [], [], []
            log_once(logger, logging.WARNING, "GVA load preparation failed (%s)", exc, key="gva-lease")
            record_call(self._stats.transfer, "load", 0.0, [[] for _ in keys], exc)  # unreachable: every key
        leased = {i for i, code in zip(found, codes, strict=True) if code == 0}
        if infos:  # missing or resized: gone from the pool (Mooncake's -704); found but not leasable: -706
            failed = {i: 0 if i in leased else -706 if i in found else -704 for i in range(len(keys))}
            record_call(self._stats.transfer, "load", 0.0, [[] for _ in keys], list(failed.values()))
        missing: dict[str, list[int]] = {}
        for i, (p, _, _) in enumerate(items):
            if i not in leased:
                missing.setdefault(p.req_id, []).append(p.chunk.block_id)
        for req_id, blocks in missing.items():
            self._stats.failed_keys += len(blocks)
            self._errors.record(req_id, blocks, f"{len(blocks)} GVA object(s) missing, resized or not leasable")
        return tuple(_Pair(items[i][0], keys[i], infos[i][1], items[i][2]) for i in sorted(leased))

    def _reserve_saves(self, partials: Sequence[_Planned]) -> tuple[_Pair, ...]:
        plan = self._save_plan
        if not (plan or partials) or self._sender is None:
            return ()
        first: dict[str, _Planned] = {}
        for p in (*plan, *partials):
            first.setdefault(self._key(p), p)  # two requests of one step may share a prefix block
        keys = list(first)
        try:
            gvas = self._gva.alloc(keys, [self._db.buffers(0).page_bytes] * len(keys))
        except StoreError as exc:
            log_once(logger, logging.WARNING, "GVA alloc failed (%s); blocks stay local", exc, key="gva-alloc")
            return ()
        pairs = tuple(_Pair(first[k], k, g) for k, g in zip(keys, gvas, strict=True) if g > 0)
        self._stats.skipped_existing += len(keys) - len(pairs)  # an existing key (or a full store)
        return pairs

    def save_kv_layer(self, layer_name: str) -> None:
        """Queue this layer's copies; after the last layer the step's objects get published."""
        layer = self._index.get(layer_name)
        state = self._state
        if layer is None or not isinstance(state, _GvaStep):
            return
        if state.saves and self._sender is not None:
            self._skip_unwritten(state)
            event = self._record_event() if self._record_event is not None else None
            reqs = tuple(sorted({pair.planned.req_id for pair in state.saves}))
            self._sender.submit(reqs, _LayerJob(layer, (), event=event, state=state))
        else:
            state.layer_done[layer].set()  # computed and nothing to save: its buffer may be reused
        if layer == self._num_layers - 1:
            state.last_layer_saved = True

    def _skip_unwritten(self, state: _GvaStep) -> None:
        """Objects of blocks whose load failed this step are never copied into nor published.

        Such a block holds no chunk (vLLM recomputes it), yet a request hitting it in vLLM's prefix
        cache plans a save from it. Checked at every layer (on the forward pass's thread, after that
        layer's load was waited for): a layer's failed load spoils the whole block's object.
        """
        blocks = self._errors.pending_blocks()
        if not blocks:
            return
        new = {p.key for p in state.saves if p.planned.chunk.block_id in blocks} - state.unwritten
        if new:
            self._stats.unwritten_skipped += len(new)
            state.unwritten = state.unwritten | new  # one rebinding: the sending thread reads a snapshot

    # ---- copies (transfer threads) ----

    def _copy(self, pairs: tuple[_Pair, ...], layer: int, direction: int) -> list[_Pair]:
        """Copy ``layer`` of every pair in windows and packets; the pairs of windows that failed."""
        buf = self._db.buffers(0)
        step = self._window or len(pairs)
        failed: list[_Pair] = []
        for start in range(0, len(pairs), step):
            window = pairs[start : start + step]
            gvas: list[int] = []
            addrs: list[int] = []
            sizes: list[int] = []
            for pair in window:
                a, s, g = gva_layer_copies(
                    bases=buf.base_addrs, block_lens=buf.block_lens, strides=buf.block_strides,
                    layer_offsets=buf.layer_offsets, layer=layer, block_id=pair.planned.chunk.block_id,
                    block_gva=pair.gva,
                )  # fmt: skip
                addrs += a
                sizes += s
                gvas += g
            packets = split_packets(gvas, addrs, sizes, self._packet)
            began = time.perf_counter()
            rc: int | StoreError
            try:
                rc = self._gva.copy(
                    [p[0] for p in packets], [p[1] for p in packets], [p[2] for p in packets], direction
                )
            except StoreError as exc:
                rc = exc
                log_once(logger, logging.WARNING, "GVA copy raised (%s)", exc, key=("gva-copy", direction))
            self._record_copy(direction, time.perf_counter() - began, len(window), [p[2] for p in packets], rc)
            if rc != 0:
                failed += window
        return failed

    def _record_copy(self, direction: int, seconds: float, blocks: int, sizes: list[int], rc: int | StoreError) -> None:
        """One copy call in the stats: all its blocks moved (its packets the descriptors), or each failed."""
        way = "load" if direction == G2L else "save"
        if rc == 0:
            record_call(self._stats.transfer, way, seconds, [sizes], [0])
        else:
            codes = rc if isinstance(rc, StoreError) else [rc] * blocks
            record_call(self._stats.transfer, way, seconds, [[] for _ in range(blocks)], codes)

    def _needs_layer_jobs(self) -> bool:
        # with shared buffers every layer's job also orders the buffer's reuse (see `_load_layer`)
        return bool(self._load_plan) or bool(self._reused)

    def _load_layer(self, job: _LayerJob) -> None:
        state = job.state
        try:
            if not isinstance(state, _GvaStep):
                return
            pairs = tuple(p for p in state.loads if p.all_layers or job.layer in self._reused)
            failed: list[_Pair] = []
            source = self._reuse_source.get(job.layer)
            if self._fenced(job):  # the step missed its deadline: no copy into its blocks any more
                pairs = ()
            # Shared buffer: layer `source` before it must be saved before this layer's load (or its
            # forward pass, which waits for this job) overwrites the buffer.
            elif source is not None and not state.layer_done[source].wait(self._layer_wait_s):
                logger.warning("layer %d still unsaved after %.0fs; layer %d cannot load", source, self._layer_wait_s,
                               job.layer)  # fmt: skip
                state.failed.update(pair.key for pair in state.saves)  # its objects would be overwritten: drop
                failed = list(pairs)
            elif pairs:
                self._await_gate(job)
                wait_us = stagger_us(self._tp_rank, job.layer, self._tp_size, self._stagger_us)
                deadline = time.perf_counter() + wait_us / 1e6
                while time.perf_counter() < deadline:  # a busy wait: sleeping would overshoot by ~50 us
                    pass
                failed = self._copy(pairs, job.layer, G2L)
                if self._fenced(job):  # returned after the step's deadline: its blocks were reported already
                    failed = []
            by_req: dict[str, list[int]] = {}
            for pair in failed:
                by_req.setdefault(pair.planned.req_id, []).append(pair.planned.chunk.block_id)
            for req_id, blocks in by_req.items():
                self._stats.failed_keys += len(blocks)
                self._errors.record(req_id, blocks, f"layer {job.layer}: GVA load failed for {len(blocks)} block(s)")
            if job.layer == self._num_layers - 1 and state.loads and not self._fenced(job):
                self._stats.loaded_keys += len(state.loads)
                self._stats.loaded_bytes += len(state.loads) * self._db.buffers(0).page_bytes
        finally:
            if isinstance(state, _GvaStep) and job.layer == self._num_layers - 1:
                self._release_leases(state)
            if job.done is not None:
                job.done.set()

    def _release_leases(self, state: _GvaStep) -> None:
        """Release the step's read leases once (after its last layer's load, however that ended)."""
        keys, state.loads = [pair.key for pair in state.loads], ()
        if not keys:
            return
        try:
            self._gva.remove_lease(keys)
        except StoreError as exc:  # the lease then expires after its TTL
            log_once(logger, logging.WARNING, "GVA remove_lease failed (%s)", exc, key="gva-unlease")

    def _save_layer(self, job: _LayerJob) -> None:
        state = job.state
        if not isinstance(state, _GvaStep):
            return
        if job.layer == _ABORT:
            if state.saves:
                self._publish(state, drop_all=True)
            return
        try:
            if state.saves:
                self._save_copies(job, state)
        finally:
            state.layer_done[job.layer].set()  # saved (or failed): the layer's buffer may be reused

    def _save_copies(self, job: _LayerJob, state: _GvaStep) -> None:
        if job.event is not None:
            try:
                job.event.synchronize(self._compute_wait_s)
            except Exception as exc:  # DeadlineExceeded or a device error: these objects are dropped
                logger.warning("layer %d: compute not finished (%s); the step's objects are dropped", job.layer, exc)
                state.failed.update(pair.key for pair in state.saves)
        self._drop_cancelled(state)
        state.failed.update(state.unwritten)
        todo = tuple(pair for pair in state.saves if pair.key not in state.failed)
        if todo:
            state.failed.update(pair.key for pair in self._copy(todo, job.layer, L2G))
        if job.layer == self._num_layers - 1:
            self._drop_cancelled(state)  # cancelled while copying: those objects may hold reused blocks
            state.failed.update(state.unwritten)
            self._publish(state)

    def _drop_cancelled(self, state: _GvaStep) -> None:
        """Objects of requests whose saves were cancelled are never copied again and never published."""
        if self._fence is None or state.stamp is None:
            return
        cancelled = self._fence.cancelled(state.stamp)
        if cancelled:
            state.failed.update(pair.key for pair in state.saves if pair.planned.req_id in cancelled)

    def _publish(self, state: _GvaStep, *, drop_all: bool = False) -> None:
        results = [-1 if drop_all or pair.key in state.failed else 0 for pair in state.saves]
        try:
            codes = self._gva.write_finish([pair.key for pair in state.saves], results)
        except StoreError as exc:
            log_once(logger, logging.WARNING, "GVA write_finish failed (%s)", exc, key="gva-finish")
            return
        ok = [pair for pair, result, code in zip(state.saves, results, codes, strict=True) if result == 0 and code == 0]
        self._stats.saved_keys += len(ok)
        self._stats.saved_bytes += len(ok) * self._db.buffers(0).page_bytes
        stored = [(0, pair.planned.chunk, pair.planned.req) for pair in ok if pair.planned.req is not None]
        if stored and self._on_stored is not None:
            self._on_stored(stored)
        state.saves = ()  # published (or dropped) once

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the step's loads, drop objects whose last layer was never saved, join both threads."""
        self.finish_step()
        if isinstance(self._state, _GvaStep):
            self._abort_unfinished(self._state)
        super().close(timeout_s)

    def _abort_unfinished(self, state: _GvaStep) -> None:
        if state.saves and not state.last_layer_saved and self._sender is not None:
            reqs = tuple(sorted({pair.planned.req_id for pair in state.saves}))  # drain() waits for the drop
            self._sender.submit(reqs, _LayerJob(_ABORT, (), state=state))


def make_layer_transfers(options: LayerwiseOptions, *, backend: PoolBackend, **kwargs: Any) -> LayerwiseTransfers:
    """The layer-wise flavour for ``backend``: one object per block on a `GvaBackend`, else per chunk and layer.

    ``kwargs`` are the `LayerwiseTransfers` arguments shared by both.
    """
    common = {"prefetch_layers": options.prefetch_layers, "attention_gate": options.attention_gate, **kwargs}
    if isinstance(backend, GvaBackend):
        return GvaLayerwiseTransfers(
            backend=backend, tp_size=options.tp_size, max_transfer_blocks=options.max_transfer_blocks,
            max_transfer_bytes=options.max_transfer_bytes, h2d_stagger_us=options.h2d_stagger_us,
            num_shared_buffers=options.num_shared_buffers, independent_layers=options.independent_layers,
            **common,
        )  # fmt: skip
    return LayerwiseTransfers(backend=backend, **common)
