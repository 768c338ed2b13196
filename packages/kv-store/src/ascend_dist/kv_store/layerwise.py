"""Layer-wise pool transfers: per-layer loads and saves that overlap the forward pass (key-per-layer path).

Runs in: worker processes, owned by `KVPoolWorker` when ``use_layerwise`` is set.
Every chunk is stored as one object per layer (``...@layer_id:{L}@{hash}``), so layer L can
be loaded while layer L-1 computes and saved as soon as its attention wrote it. Order of calls per
step, as vLLM makes them:

* ``start_step(meta)`` (from ``bind_step``, when vLLM binds the metadata, before the forward pass;
  vLLM calls ``start_load_kv`` after it unless the step has synchronous loads): plan this step's
  loads and saves (layer independent), submit the loads of the first ``prefetch`` layers;
* ``wait_for_layer_load(name)`` before layer L's attention: submit the next layer's load, then wait
  (bounded) until layer L's load finished; a layer whose load misses the deadline has its blocks
  reported as load errors (vLLM recomputes them) instead of stalling the forward pass;
* ``save_kv_layer(name)`` after layer L's attention: queue layer L's save (an ``exists`` filter, then
  one put of the missing layer objects) and return at once; on a device runtime the sending thread
  first waits for an event recorded on the compute stream at that point;
* ``finish_step()`` (from ``wait_for_save``): submit any layer that was never waited for and wait for
  every load of the step, so no load writes into blocks after the step ended.

Fixes of upstream defects: the layer index comes from the layer name, so a load-only
consumer advances it too; layer keys carry ``pp_rank``; replica-set ranks split the
writes once (round-robin over surviving chunks), not twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import StoreError
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.failures import LoadErrorRecorder
from ascend_dist.kv_store.gate import AttentionStartGate, reset_gate
from ascend_dist.kv_store.plan import PoolStepMeta, ReqMeta
from ascend_dist.kv_store.sizes import floor_to
from ascend_dist.kv_store.token_db import Chunk, ChunkedTokenDatabase
from ascend_dist.kv_store.transfer import CompletionTracker, TransferThread
from ascend_dist.kv_store.worker_types import ComputeEvent, WorkerStats

__all__ = ["LayerwiseTransfers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Planned:
    """One chunk of one request, the same for every layer."""

    req_id: str
    chunk: Chunk
    block_ids: tuple[int, ...]
    req: ReqMeta | None = None  # kept for KV events of saved chunks


@dataclass(frozen=True)
class _LayerJob:
    layer: int
    chunks: tuple[_Planned, ...]
    event: ComputeEvent | None = None
    done: threading.Event | None = None
    gate: AttentionStartGate | None = None  # loads of later layers start once this layer's attention started
    state: object = None  # the step's transfer state of a subclass (GVA objects and leases)


class LayerwiseTransfers:
    """Per-layer loads and saves of one worker (group 0 of a single-group model)."""

    def __init__(
        self,
        *,
        token_db: ChunkedTokenDatabase,
        backend: PoolBackend,
        errors: LoadErrorRecorder,
        stats: WorkerStats,
        saves: CompletionTracker,
        granularity: int,
        tp_rank: int = 0,
        put_step: int = 1,
        can_save: bool = True,
        prefetch_layers: int = 1,
        record_compute_event: Callable[[], ComputeEvent] | None = None,
        compute_wait_s: float = 60.0,
        layer_wait_s: float = 60.0,
        on_stored: Callable[[Sequence[tuple[int, Chunk, ReqMeta]]], None] | None = None,
        attention_gate: bool = False,
        gate_wait_s: float = 10.0,
    ) -> None:
        """Start the sending (when this rank saves) and receiving threads.

        Args:
            token_db: This rank's key/address database (its group 0 must carry layer offsets).
            backend: The store client.
            errors: Where failed loads are recorded (``get_block_ids_with_load_errors``).
            stats: Counters shared with the worker.
            saves: The worker's save-completion tracker (delayed free waits on it).
            granularity: Transfer granularity in tokens.
            tp_rank: This rank's TP rank (rotation and save sharding).
            put_step: Ranks sharing identical KV that split the writes.
            can_save: Whether this rank writes to the pool.
            prefetch_layers: Layers whose loads are submitted ahead of the one being waited for.
            record_compute_event: Records an event on the compute stream (device runtimes).
            compute_wait_s: Bound on the sending thread's wait for that event.
            layer_wait_s: Bound on ``wait_for_layer_load`` for one layer.
            on_stored: Called with the chunks whose last layer was put (KV events).
            attention_gate: Start a prefetched layer's load only once the attention of the layer
                being waited for started (the attention backend calls
                ``current_gate().record()``); off where nothing records (vLLM on CPU).
            gate_wait_s: Bound on that wait; the load then starts anyway (logged once).
        """
        self._db = token_db
        self._backend = backend
        self._errors = errors
        self._stats = stats
        self._granularity = granularity
        self._tp_rank = tp_rank
        self._put_step = put_step
        self._prefetch = max(1, prefetch_layers)
        self._record_event = record_compute_event
        self._compute_wait_s = compute_wait_s
        self._layer_wait_s = layer_wait_s
        self._on_stored = on_stored
        self._attention_gate = attention_gate
        self._gate_wait_s = gate_wait_s
        self._gate: AttentionStartGate | None = None
        self._state: object = None
        self._loads = CompletionTracker()
        self._save_tracker = saves
        self._sender = (
            TransferThread[_LayerJob](f"kv-pool-layer-send-{tp_rank}", self._save_layer, saves) if can_save else None
        )
        self._receiver = TransferThread[_LayerJob](f"kv-pool-layer-recv-{tp_rank}", self._load_layer, self._loads)
        self._index: dict[str, int] = {}
        self._num_layers = 0
        self._load_plan: tuple[_Planned, ...] = ()
        self._save_plan: tuple[_Planned, ...] = ()
        self._done: list[threading.Event] = []
        self._submitted = 0
        self._waited: set[int] = set()
        self._layer_jobs = False

    @property
    def num_layers(self) -> int:
        """Layers of this rank (known after registration)."""
        return self._num_layers

    def set_layers(self, layer_names: Sequence[str]) -> None:
        """Layer names in entry order (from registration); the position is the key's ``layer_id``."""
        self._index = {name: i for i, name in enumerate(layer_names)}
        self._num_layers = len(layer_names)

    # ---- planning ----

    def start_step(self, meta: PoolStepMeta) -> None:
        """Plan this step's loads and saves and submit the first loads."""
        self.finish_step()
        loads: list[_Planned] = []
        saves: list[_Planned] = []
        span = self._db.block_sizes[0]
        for req in meta.requests:
            ids = tuple(req.block_ids[0]) if req.block_ids else ()
            spec = req.load_spec
            if spec is not None and spec.can_load:
                token_len = spec.load_token_len(self._granularity, req.save_end_token)
                mask = floor_to(spec.vllm_cached_tokens, span)
                loads.extend(
                    _Planned(req.req_id, c, ids)
                    for c in self._db.iter_chunks(token_len, req.block_hashes, 0, mask_num=mask, block_ids=ids)
                )
            if req.can_save and self._sender is not None:
                mask = floor_to(req.save_start_token, span)
                saves.extend(
                    _Planned(req.req_id, c, ids, req)
                    for c in self._db.iter_chunks(
                        req.save_end_token,
                        req.block_hashes,
                        0,
                        mask_num=mask,
                        block_ids=ids,
                        shard_rank=self._tp_rank % self._put_step,
                        shard_size=self._put_step,
                    )
                )
        self._load_plan, self._save_plan = tuple(loads), tuple(saves)
        self._done = [threading.Event() for _ in range(self._num_layers)]
        self._submitted = 0
        self._waited = set()
        self._gate = None
        self._state = self._prepare_step(meta)
        self._layer_jobs = self._needs_layer_jobs()
        if self._layer_jobs:
            # with the gate, later layers are submitted by wait_for_layer_load(0), after it armed the
            # gate that layer 0's attention records (a gate armed here would never be recorded)
            self._submit_loads(1 if self._attention_gate else self._prefetch, current=0)

    def _needs_layer_jobs(self) -> bool:
        """Whether this step runs a receiving job per layer (and ``wait_for_layer_load`` waits for it)."""
        return bool(self._load_plan)

    def _prepare_step(self, meta: PoolStepMeta) -> object:
        """Hook run once the step's plans are known, before any load is submitted; its result rides on every job."""
        del meta
        return None

    def _submit_loads(self, upto: int, current: int) -> None:
        """Submit loads up to layer ``upto``; those past ``current`` (the layer about to run) wait for its attention."""
        reqs = tuple(sorted({p.req_id for p in self._load_plan}))
        while self._submitted < min(upto, self._num_layers):
            layer = self._submitted
            gate = self._gate if layer > current else None
            job = _LayerJob(layer, self._load_plan, done=self._done[layer], gate=gate, state=self._state)
            self._receiver.submit(reqs, job)
            self._submitted += 1

    def _await_gate(self, job: _LayerJob) -> None:
        """Wait (bounded) until the attention before ``job``'s layer started."""
        if job.gate is not None and not job.gate.wait(self._gate_wait_s):
            log_once(
                logger, logging.WARNING, "attention-start gate not recorded within %.0fs; loading anyway",
                self._gate_wait_s, key="gate-timeout",
            )  # fmt: skip

    # ---- per layer, called around each layer's attention ----

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s load finished (bounded); no-op when nothing loads."""
        layer = self._index.get(layer_name)
        if layer is not None:
            self._wait(layer)

    def _wait(self, layer: int) -> None:
        if not self._layer_jobs or layer in self._waited:
            return
        self._waited.add(layer)
        if self._attention_gate:
            self._gate = reset_gate()  # later layers' loads wait for this layer's attention
        self._submit_loads(layer + 1 + self._prefetch, current=layer)
        if self._done[layer].wait(self._layer_wait_s):
            return
        by_req: dict[str, list[int]] = {}
        for p in self._load_plan:
            by_req.setdefault(p.req_id, []).append(p.chunk.block_id)
        for req_id, blocks in by_req.items():
            self._errors.record(req_id, blocks, f"layer {layer} not loaded within {self._layer_wait_s}s")

    def save_kv_layer(self, layer_name: str) -> None:
        """Queue ``layer_name``'s save; returns at once."""
        layer = self._index.get(layer_name)
        if layer is None or not self._save_plan or self._sender is None:
            return
        event = self._record_event() if self._record_event is not None else None
        reqs = tuple(sorted({p.req_id for p in self._save_plan}))
        self._sender.submit(reqs, _LayerJob(layer, self._save_plan, event=event, state=self._state))

    def finish_step(self) -> None:
        """Submit layers nobody waited for and wait (bounded) for every load of the step."""
        if not self._layer_jobs:
            return
        self._submit_loads(self._num_layers, current=self._num_layers)  # the step is over: no gate
        for layer in range(self._num_layers):
            self._wait(layer)
        self._load_plan = ()
        self._layer_jobs = False

    # ---- thread handlers ----

    def _layer_batch(self, job: _LayerJob) -> tuple[list[str], list[list[int]], list[list[int]], list[_Planned]]:
        all_keys, all_addrs, all_sizes = self._db.chunk_values([p.chunk for p in job.chunks], layer=job.layer)
        keys: list[str] = []
        addrs: list[list[int]] = []
        sizes: list[list[int]] = []
        planned: list[_Planned] = []
        seen: set[tuple[str, int]] = set()
        for p, key, a, s in zip(job.chunks, all_keys, all_addrs, all_sizes, strict=True):
            if (key, p.chunk.block_id) in seen:  # two requests of one step sharing a prefix and its blocks
                continue
            seen.add((key, p.chunk.block_id))
            keys.append(key)
            addrs.append(a)
            sizes.append(s)
            planned.append(p)
        return keys, addrs, sizes, planned

    def _load_layer(self, job: _LayerJob) -> None:
        try:
            self._await_gate(job)
            keys, addrs, sizes, planned = self._layer_batch(job)
            if not keys:
                return
            k = self._tp_rank % len(keys)
            keys, addrs, sizes, planned = (
                keys[k:] + keys[:k],
                addrs[k:] + addrs[:k],
                sizes[k:] + sizes[:k],
                planned[k:] + planned[:k],
            )
            try:
                codes = self._backend.get(keys, addrs, sizes)
            except StoreError as exc:
                codes = [-1] * len(keys)
                log_once(logger, logging.WARNING, "layer load failed (%s)", exc, key="layer-load")
            failed: dict[str, list[int]] = {}
            for p, s, code in zip(planned, sizes, codes, strict=True):
                if code != 0:
                    failed.setdefault(p.req_id, []).append(p.chunk.block_id)
                else:
                    self._stats.loaded_keys += 1
                    self._stats.loaded_bytes += sum(s)
            for req_id, blocks in failed.items():
                self._stats.failed_keys += len(blocks)
                self._errors.record(req_id, blocks, f"layer {job.layer}: {len(blocks)} object(s) missing or failed")
        finally:
            if job.done is not None:
                job.done.set()

    def _save_layer(self, job: _LayerJob) -> None:
        if job.event is not None:
            try:
                job.event.synchronize(self._compute_wait_s)
            except Exception as exc:  # DeadlineExceeded or a device error: the layer stays local
                logger.warning("layer %d: compute not finished (%s); its save is dropped", job.layer, exc)
                return
        keys, addrs, sizes, planned = self._layer_batch(job)
        if not keys:
            return
        try:
            present = self._backend.exists(keys)
        except StoreError:
            present = [0] * len(keys)
        todo = [i for i, here in enumerate(present) if here != 1]
        self._stats.skipped_existing += len(keys) - len(todo)
        if not todo:
            return
        try:
            codes = self._backend.put([keys[i] for i in todo], [addrs[i] for i in todo], [sizes[i] for i in todo])
        except StoreError as exc:
            log_once(logger, logging.WARNING, "layer put failed (%s); blocks stay local", exc, key="layer-put")
            return
        stored: list[tuple[int, Chunk, ReqMeta]] = []
        for i, code in zip(todo, codes, strict=True):
            if code == 0:
                self._stats.saved_keys += 1
                self._stats.saved_bytes += sum(sizes[i])
                p = planned[i]
                if p.req is not None:
                    stored.append((0, p.chunk, p.req))
        if stored and self._on_stored is not None and job.layer == self._num_layers - 1:
            self._on_stored(stored)  # a chunk is complete in the pool once its last layer is

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued transfers and join both threads."""
        for thread in (self._sender, self._receiver):
            if thread is not None:
                thread.stop(timeout_s)
