"""Layer-wise pool transfers: per-layer loads and saves that overlap the forward pass (key-per-layer path).

Runs in: worker processes, owned by `KVPoolWorker` when ``use_layerwise`` is set.
Every chunk is stored as one object per layer (``...@layer_id:{L}@{hash}``), so layer L can
be loaded while layer L-1 computes and saved as soon as its attention wrote it. Order of calls per
step, as vLLM makes them:

* ``start_step(meta)`` (from ``bind_step``, when vLLM binds the metadata, before the forward pass;
  vLLM calls ``start_load_kv`` after it unless the step has synchronous loads): plan this step's
  loads and saves (layer independent), submit the loads of the first ``prefetch`` layers;
* ``wait_for_layer_load(name)`` before layer L's attention: submit the next layer's load, then wait
  until layer L's load finished, within ONE deadline per step (``layer_wait_s`` from
  ``start_step``, shared by every layer and ``finish_step``), so a hung store costs a step one
  deadline, not one per layer. A step that misses it is *fenced*: every block it loads is reported
  as a load error (vLLM recomputes them), its queued layer loads are skipped without calling the
  store, and the next ``start_step`` (before the next forward pass, the first moment vLLM can
  rewrite or reassign those blocks) waits for the one ``get`` still in flight to return. A ``get``
  cannot be cancelled and writes straight into the blocks, so that wait is the fence; if it outlasts
  ``fence_wait_s`` the next step fails with `DeadlineExceeded` rather than run over blocks a late
  ``get`` may still write;
* ``save_kv_layer(name)`` after layer L's attention: queue layer L's save (an ``exists`` filter, then
  puts of the missing layer objects, cut at the backend's piece cap by `run_puts`, each key once per
  layer even when two requests hold its chunk in different blocks) and return at once; on a device
  runtime the sending thread first waits for an event recorded on the compute stream at that point;
* ``finish_step()`` (from ``wait_for_save``): submit any layer that was never waited for and wait for
  every load of the step (same deadline), so no load writes into blocks after the step ended.

Saves of a request cancelled by the worker's `RequestFence` (a preemption past its deadline) skip
its chunks; a put in flight for it is waited for by the cancel (before the forward pass that may
reuse the blocks), and only if that wait gave up are the keys it stored removed once it returns.
A failed layer put (with ``failed_puts``) is put again with the request's next save of that layer.

Fixes of upstream defects: the layer index comes from the layer name, so a load-only
consumer advances it too; layer keys carry ``pp_rank``; replica-set ranks split the
writes once (round-robin over surviving chunks), not twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ascend_dist.common.errors import DeadlineExceeded, StoreError
from ascend_dist.common.log import log_once
from ascend_dist.common.timeouts import Deadline
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.config.sizes import floor_to
from ascend_dist.kv_store.keys.token_db import Chunk, ChunkedTokenDatabase
from ascend_dist.kv_store.step_metadata import PoolStepMeta, ReqMeta
from ascend_dist.kv_store.transfer.failures import LoadErrorRecorder
from ascend_dist.kv_store.transfer.gate import AttentionStartGate, reset_gate
from ascend_dist.kv_store.transfer.load_batches import run_gets, run_puts
from ascend_dist.kv_store.transfer.transfer import (
    CompletionTracker,
    FailedPuts,
    RequestFence,
    TransferThread,
    drop_cancelled_keys,
)
from ascend_dist.kv_store.transfer.worker_types import ComputeEvent, WorkerStats

__all__ = ["FailedLayerPut", "LayerwiseTransfers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Planned:
    """One chunk of one request, the same for every layer."""

    req_id: str
    chunk: Chunk
    block_ids: tuple[int, ...]
    req: ReqMeta | None = None  # kept for KV events of saved chunks


FailedLayerPut = tuple[int, _Planned]
"""A layer put that failed: ``(layer, chunk of a request)``, put again with that request's next save of the layer."""


@dataclass(frozen=True)
class _StepLoads:
    """One step's loads: ``fenced`` once the step's deadline passed (its queued loads must not run)."""

    req_ids: tuple[str, ...] = ()
    fenced: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _LayerJob:
    layer: int
    chunks: tuple[_Planned, ...]
    event: ComputeEvent | None = None
    done: threading.Event | None = None
    gate: AttentionStartGate | None = None  # loads of later layers start once this layer's attention started
    state: object = None  # the step's transfer state of a subclass (GVA objects and leases)
    loads: _StepLoads | None = None  # load jobs: the step they belong to
    stamp: Mapping[str, int] | None = None  # save jobs: `RequestFence` generations when queued


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
        fence: RequestFence | None = None,
        fence_wait_s: float = 300.0,
        failed_puts: FailedPuts[FailedLayerPut] | None = None,
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
            layer_wait_s: One step's deadline for all its layer loads (every ``wait_for_layer_load``
                and ``finish_step`` share it); past it the step is fenced (module docstring).
            on_stored: Called with the chunks whose last layer was put (KV events).
            attention_gate: Start a prefetched layer's load only once the attention of the layer
                being waited for started (the attention backend calls
                ``current_gate().record()``); off where nothing records (vLLM on CPU).
            gate_wait_s: Bound on that wait; the load then starts anyway (logged once).
            fence: The worker's save fence (cancelled requests' saves); None: never cancelled.
            fence_wait_s: Bound on the next step's wait for a fenced step's ``get`` in flight.
            failed_puts: Where failed layer puts wait for their request's next save of that layer
                (the worker's `SaveGuard` forgets preempted and finished requests); None: no retry.
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
        self._fence = fence
        self._fence_wait_s = fence_wait_s
        self._failed_puts = failed_puts
        self._deadline = Deadline.after(layer_wait_s)
        self._step_loads = _StepLoads()
        self._unsettled: _StepLoads | None = None  # a fenced step whose get may still be in flight
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
        """Plan this step's loads and saves and submit the first loads.

        Raises:
            DeadlineExceeded: A fenced step's ``get`` is still in flight after ``fence_wait_s``.
        """
        self.finish_step()
        self._settle()
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
        self._deadline = Deadline.after(self._layer_wait_s)
        self._step_loads = _StepLoads(tuple(sorted({p.req_id for p in loads})))
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
            job = _LayerJob(
                layer, self._load_plan, done=self._done[layer], gate=gate, state=self._state, loads=self._step_loads
            )
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
        if self._step_loads.fenced.is_set():
            return  # the step missed its deadline: its blocks are reported, no layer waits again
        if self._attention_gate:
            self._gate = reset_gate()  # later layers' loads wait for this layer's attention
        self._submit_loads(layer + 1 + self._prefetch, current=layer)
        if self._done[layer].wait(self._deadline.remaining()):
            return
        self._fence_step(f"layer {layer} not loaded within the step's {self._layer_wait_s}s")

    def _fence_step(self, reason: str) -> None:
        """Report every block of the step's loads and stop its queued loads (see the module docstring)."""
        self._step_loads.fenced.set()
        self._unsettled = self._step_loads
        by_req: dict[str, list[int]] = {}
        for p in self._load_plan:
            by_req.setdefault(p.req_id, []).append(p.chunk.block_id)
        for req_id, blocks in by_req.items():
            self._errors.record(req_id, blocks, reason)
        logger.warning("%s: the step's %d load(s) reported as errors and fenced", reason, len(self._load_plan))

    @staticmethod
    def _fenced(job: _LayerJob) -> bool:
        """Whether ``job`` is a load of a step past its deadline (it must not call the store)."""
        return job.loads is not None and job.loads.fenced.is_set()

    def _settle(self) -> None:
        """Before the next step: wait for a fenced step's ``get`` still in flight (it writes into the blocks)."""
        step = self._unsettled
        if step is None:
            return
        try:
            self._loads.wait_idle(step.req_ids, self._fence_wait_s)
        except DeadlineExceeded as exc:
            raise DeadlineExceeded(
                f"a timed-out layer load still runs after {self._fence_wait_s}s and may write into blocks vLLM "
                f"reuses; not starting the next step ({exc})"
            ) from exc
        self._unsettled = None

    def save_kv_layer(self, layer_name: str) -> None:
        """Queue ``layer_name``'s save; returns at once."""
        layer = self._index.get(layer_name)
        if layer is None or not self._save_plan or self._sender is None:
            return
        # a block whose load failed this step holds no chunk, yet a request that hit it in vLLM's
        # prefix cache plans a save from it: never read it (vLLM recomputes it, a later step saves it)
        unwritten = self._errors.pending_blocks()
        chunks = tuple(p for p in self._save_plan if p.chunk.block_id not in unwritten)
        self._stats.unwritten_skipped += len(self._save_plan) - len(chunks)
        if not chunks:
            return
        event = self._record_event() if self._record_event is not None else None
        reqs = tuple(sorted({p.req_id for p in chunks}))
        stamp = self._fence.stamp(reqs) if self._fence is not None else None
        self._sender.submit(reqs, _LayerJob(layer, chunks, event=event, state=self._state, stamp=stamp))

    def finish_step(self) -> None:
        """Submit layers nobody waited for and wait for every load of the step (the step's deadline)."""
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
            if (key, p.chunk.block_id) in seen:  # the same chunk in the same block (a shared prefix): once
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
            if self._fenced(job):  # the step missed its deadline: this load must not write into its blocks
                return
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
            # a key twice in one get (two requests sharing a chunk in different blocks) would be
            # written only into its last destination: run_gets splits it into rounds, and caps pieces
            result = run_gets(self._backend, keys, addrs, sizes, self._stats.transfer)
            if result.error is not None:
                log_once(logger, logging.WARNING, "layer load failed (%s)", result.error, key="layer-load")
            if self._fenced(job):  # returned after the step's deadline: its blocks were reported already
                return
            failed: dict[str, list[int]] = {}
            for p, s, code in zip(planned, sizes, result.codes, strict=True):
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
        fence, stamp = self._fence, job.stamp
        live = fence.begin_read(stamp) if fence is not None and stamp is not None else None
        try:  # a cancel (a preemption) from here on waits until end_read: the blocks are read until then
            if live is not None:  # requests cancelled before: their blocks may hold another request's KV
                job = replace(job, chunks=tuple(p for p in job.chunks if p.req_id in live))
            job = self._with_retries(job)
            put = self._put_layer(job)
        finally:
            abandoned = fence.end_read(live) if fence is not None and live is not None else set()
        if put is None:
            return
        keys, sizes, planned, code_of = put
        # a cancel that gave up waiting for this put: the forward pass may have overwritten its blocks
        dropped = {k for k, p in zip(keys, planned, strict=True) if p.req_id in abandoned and k in code_of}
        drop_cancelled_keys(self._backend, sorted(dropped), self._stats)
        rows = [(p, k, s, code_of[k]) for p, k, s in zip(planned, keys, sizes, strict=True) if k in code_of]
        self._account(job.layer, [row for row in rows if row[1] not in dropped])
        if self._failed_puts is not None:  # retried with the request's next save of this layer
            late = fence.cancelled(stamp) if fence is not None and stamp is not None else set()
            for p, _, _, code in rows:
                if code != 0 and p.req_id not in late:  # a cancelled request's blocks go: nothing to retry
                    self._failed_puts.add(p.req_id, [(job.layer, p)])

    def _with_retries(self, job: _LayerJob) -> _LayerJob:
        """``job`` plus the chunks of its requests whose put of this layer failed earlier (once each)."""
        if self._failed_puts is None or not job.chunks:
            return job
        reqs = {p.req_id for p in job.chunks}
        retry = self._failed_puts.take(reqs, where=lambda entry: entry[0] == job.layer)
        self._stats.retried_keys += len(retry)
        return replace(job, chunks=job.chunks + tuple(p for _, p in retry)) if retry else job

    def _put_layer(self, job: _LayerJob) -> tuple[list[str], list[list[int]], list[_Planned], dict[str, int]] | None:
        """``exists`` then the puts of one layer (each key once, cut at the piece cap); the code per key put."""
        keys, addrs, sizes, planned = self._layer_batch(job)
        if not keys:
            return None
        # two requests sharing a chunk in different blocks name one key twice: put it once (the same
        # key holds the same bytes by construction; Mooncake would store only the first copy anyway)
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        unique = list(first.values())
        try:
            present = self._backend.exists([keys[i] for i in unique])
        except StoreError:
            present = [0] * len(unique)
        todo = [i for i, here in zip(unique, present, strict=True) if here != 1]
        self._stats.skipped_existing += len(unique) - len(todo)
        if not todo:
            return None
        result = run_puts(
            self._backend,
            [keys[i] for i in todo],
            [addrs[i] for i in todo],
            [sizes[i] for i in todo],
            self._stats.transfer,
        )
        if result.error is not None:
            log_once(logger, logging.WARNING, "layer put failed (%s); blocks stay local", result.error, key="layer-put")
        return keys, sizes, planned, {keys[i]: code for i, code in zip(todo, result.codes, strict=True)}

    def _account(self, layer: int, results: Sequence[tuple[_Planned, str, list[int], int]]) -> None:
        """Count one layer's stored objects (each key once); KV events once a chunk's last layer is stored.

        ``results`` has one row per planned entry: an entry whose key another entry put shares its code.
        """
        stored: list[tuple[int, Chunk, ReqMeta]] = []
        counted: set[str] = set()
        for p, key, sizes, code in results:
            if code != 0:
                continue
            if key not in counted:
                counted.add(key)
                self._stats.saved_keys += 1
                self._stats.saved_bytes += sum(sizes)
            if p.req is not None:
                stored.append((0, p.chunk, p.req))
        if stored and self._on_stored is not None and layer == self._num_layers - 1:
            self._on_stored(stored)  # a chunk is complete in the pool once its last layer is

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the step's loads, wait (bounded) for a fenced step's get, join both threads."""
        self.finish_step()
        try:
            self._settle()
        except DeadlineExceeded as exc:
            logger.error("closing with a layer load in flight: %s", exc)
        for thread in (self._sender, self._receiver):
            if thread is not None:
                thread.stop(timeout_s)
