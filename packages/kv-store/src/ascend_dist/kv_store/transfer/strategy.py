"""How a worker moves KV: one `TransferStrategy` object per mode, chosen once by `assembly.build_worker`.

Runs in: worker processes, owned by `KVPoolWorker`. Three modes:

* `WholeRequestTransfers` with synchronous loads: one batched ``get`` per step on the forward pass's
  thread (vLLM calls ``start_load_kv`` before the forward pass for such steps);
* the same with ``load_async``: each request's load queued to a receiving thread, reported through
  ``finished`` (vLLM's ``WAITING_FOR_REMOTE_KVS``);
* `LayerwiseStrategy`: per-layer loads and saves overlapping the forward pass (`LayerwiseTransfers`,
  key per chunk and layer, or `GvaLayerwiseTransfers`, one object per block).

Whole-request saves run on a sending thread (`WholeRequestSaves`). Every mode shares one `SaveGuard`:
the per-request save tracker (delayed free), the `RequestFence` that cancels a preempted request's
saves past their deadline (queued jobs skip it) and then waits, before the step's forward pass, for
a put in flight to return, so no put ever reads blocks vLLM already reused; past that wait the step
fails with `DeadlineExceeded` (and what the abandoned put stores is removed once it returns).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.step_metadata import PoolStepMeta, ReqMeta
from ascend_dist.kv_store.transfer.failures import LoadErrorRecorder
from ascend_dist.kv_store.transfer.layerwise import FailedLayerPut, LayerwiseTransfers
from ascend_dist.kv_store.transfer.transfer import (
    CompletionTracker,
    FailedPuts,
    RequestFence,
    TransferThread,
    drop_cancelled_keys,
)
from ascend_dist.kv_store.transfer.whole_request import SaveEntry, WholeRequestIO
from ascend_dist.kv_store.transfer.worker_types import ComputeEvent, WorkerStats

__all__ = ["LayerwiseStrategy", "SaveGuard", "TransferStrategy", "WholeRequestSaves", "WholeRequestTransfers"]

logger = logging.getLogger(__name__)


class TransferStrategy(Protocol):
    """One worker's transfers, in vLLM's call order (see `KVPoolWorker`)."""

    @property
    def num_layers(self) -> int:
        """Layers moved one by one (0: whole-request modes)."""
        ...

    def set_layers(self, layer_names: Sequence[str]) -> None:
        """Layer names in entry order (from registration)."""
        ...

    def bind_step(self, meta: PoolStepMeta) -> None:
        """Before the forward pass: preemption waits; layer-wise, plan the step and start its loads."""
        ...

    def start_load(self, meta: PoolStepMeta) -> None:
        """Load (or queue the loads of) the step's requests."""
        ...

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer is loaded (layer-wise; within the step's deadline)."""
        ...

    def save_layer(self, layer_name: str) -> None:
        """Queue one layer's save (layer-wise)."""
        ...

    def wait_for_save(self, meta: PoolStepMeta) -> None:
        """After the forward pass: queue the step's saves (layer-wise: end the step's loads)."""
        ...

    def finished_loads(self) -> set[str]:
        """Asynchronous loads completed since the last call."""
        ...

    def loading(self) -> set[str]:
        """Requests whose asynchronous load is not reported yet."""
        ...

    def drain(self, timeout_s: float) -> None:
        """Wait until every queued load finished (saves: `SaveGuard`)."""
        ...

    def close(self, timeout_s: float) -> None:
        """Finish queued transfers and join the threads."""
        ...


class SaveGuard:
    """Save bookkeeping every mode shares: completion per request, the cancel fence, preemption waits."""

    def __init__(
        self, *, preempt_wait_s: float = 30.0, fence_wait_s: float = 300.0, retry_failed_puts: bool = True
    ) -> None:
        """Create it.

        Args:
            preempt_wait_s: Bound on the wait for a preempted request's pending saves (then cancelled).
            fence_wait_s: Bound on the wait for a cancelled save's put in flight (then `DeadlineExceeded`).
            retry_failed_puts: False where blocks may go between steps (sparse hybrid groups).
        """
        self.saves = CompletionTracker()
        self.fence = RequestFence()
        self.failed_puts: FailedPuts[SaveEntry] | None = FailedPuts() if retry_failed_puts else None
        self.failed_layer_puts: FailedPuts[FailedLayerPut] | None = FailedPuts() if retry_failed_puts else None
        self.preempt_wait_s = preempt_wait_s
        self.fence_wait_s = fence_wait_s
        self._finished_saving: set[str] = set()  # finished requests whose saves still ran at `settle`

    def wait_preempted(self, preempted: Iterable[str]) -> None:
        """No save may read a preempted request's blocks once vLLM may give them to others (this step).

        Waits (bounded) for the requests' pending saves; on the deadline cancels them (`cancel`).

        Raises:
            DeadlineExceeded: A cancelled save's put still reads the blocks after ``fence_wait_s``.
        """
        ids = set(preempted)
        if not ids:
            return
        try:
            try:
                self.saves.wait_idle(ids, self.preempt_wait_s)
            except DeadlineExceeded as exc:
                logger.warning("preempted requests' saves cancelled (%s); waiting for a put in flight", exc)
                self.cancel(ids, "preempted requests")
        finally:  # after the wait: a put that failed meanwhile has added its entries; their blocks go
            self._forget_failed(ids)

    def _forget_failed(self, ids: Iterable[str]) -> None:
        ids = set(ids)
        for failed in (self.failed_puts, self.failed_layer_puts):
            if failed is not None:
                failed.forget(ids)

    def cancel(self, ids: set[str], what: str) -> None:
        """Queued saves of ``ids`` skip them; wait (``fence_wait_s``) for a put in flight to return.

        Runs before the forward pass that may reuse the blocks, so a put that returns in time read
        only their original bytes (kept).

        Raises:
            DeadlineExceeded: The put still runs: the forward pass must not overwrite the blocks it
                reads (what it stores is removed once it returns).
        """
        try:
            self.fence.cancel(ids, self.fence_wait_s)
        except DeadlineExceeded as exc:
            raise DeadlineExceeded(
                f"{what}: {exc}; not running the forward pass over blocks a put still reads (its keys are "
                "removed once it returns)"
            ) from exc

    def settle(self, awaiting_free: set[str], finished_req_ids: Iterable[str]) -> set[str]:
        """The requests of ``awaiting_free`` whose saves are done; forgets what idle requests no longer need."""
        done = self.saves.idle(awaiting_free)
        self.fence.forget(self.saves.idle(self.fence.tracked()))  # no job left to cancel
        # vLLM names a finished request once; a save still running then may fail afterwards
        finished = self._finished_saving | set(finished_req_ids)
        idle = self.saves.idle(finished)
        self._forget_failed(idle)  # their blocks are freed
        self._finished_saving = finished - idle
        return done


@dataclass(frozen=True)
class _SaveJob:
    reqs: tuple[ReqMeta, ...]
    event: ComputeEvent | None
    stamp: dict[str, int]  # `RequestFence` generations when queued
    unwritten: frozenset[int] = frozenset()  # blocks whose load failed this step: never saved from


class WholeRequestSaves:
    """Whole-request saves of a rank: one job per step on the sending thread."""

    def __init__(
        self,
        *,
        io: WholeRequestIO,
        backend: PoolBackend,
        guard: SaveGuard,
        stats: WorkerStats,
        tp_rank: int = 0,
        record_compute_event: Callable[[], ComputeEvent] | None = None,
        compute_wait_s: float = 60.0,
        sync_saves: bool = False,
    ) -> None:
        """Start the sending thread.

        Args:
            io: The step's batched store calls.
            backend: The store client (to drop a cancelled put's keys).
            guard: The shared save bookkeeping.
            stats: Counters shared with the worker.
            tp_rank: For the thread's name.
            record_compute_event: Records an event after the forward pass (device runtimes); the
                sending thread waits for it before reading the KV cache. None on CPU.
            compute_wait_s: Bound on that wait (a save missing it is dropped, logged), and on a
                hybrid step's wait for its own saves.
            sync_saves: Sparse hybrid models (sliding window, Mamba): vLLM frees out-of-window and
                stale blocks at the next step's allocation, so the step waits (bounded) for its
                saves and cancels them past that deadline (`SaveGuard.cancel`: a put in flight is
                waited for; past the fence deadline ``wait_for_save`` raises `DeadlineExceeded`).
        """
        self._io = io
        self._backend = backend
        self._guard = guard
        self._stats = stats
        self._record_event = record_compute_event
        self._compute_wait_s = compute_wait_s
        self._sync = sync_saves
        self._thread = TransferThread[_SaveJob](f"kv-pool-send-{tp_rank}", self._save_job, guard.saves)

    def queue(self, meta: PoolStepMeta, unwritten: frozenset[int] = frozenset()) -> None:
        """Queue this step's saves; returns at once (hybrid: after them, bounded).

        ``unwritten``: blocks whose load failed this step. A request that hit such a block in vLLM's
        prefix cache in the same ``schedule()`` plans a save of its chunk from it; the block holds
        no chunk, so that save is skipped (vLLM recomputes the block, and a later step saves it).

        Raises:
            DeadlineExceeded: Hybrid: a cancelled save's put still runs after the fence deadline.
        """
        reqs = tuple(req for req in meta.requests if req.can_save)
        if not reqs:
            return
        event = self._record_event() if self._record_event is not None else None
        ids = tuple(r.req_id for r in reqs)
        self._thread.submit(ids, _SaveJob(reqs, event, self._guard.fence.stamp(ids), unwritten))
        if self._sync:
            try:
                self._guard.saves.wait_idle(ids, self._compute_wait_s)
            except DeadlineExceeded as exc:  # the next step frees blocks these saves read
                logger.warning("saves of a hybrid step cancelled (%s); waiting for a put in flight", exc)
                self._guard.cancel(set(ids), "a hybrid step's saves")

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
        fence, failed_puts = self._guard.fence, self._guard.failed_puts
        live = fence.begin_read(job.stamp)  # a cancel from now on waits until end_read
        try:
            reqs = [r for r in job.reqs if r.req_id in live]
            self._stats.cancelled_saves += len(job.reqs) - len(reqs)
            if not reqs:
                return
            retry = failed_puts.take(r.req_id for r in reqs) if failed_puts is not None else []
            self._stats.retried_keys += len(retry)
            out = self._io.save(reqs, retry, skip_blocks=job.unwritten)
        finally:
            abandoned = fence.end_read(live)
        # a cancel that gave up waiting for this put: the forward pass may have overwritten its blocks
        dropped = {key for key, _, (_, _, req) in out.put if req.req_id in abandoned}
        drop_cancelled_keys(self._backend, sorted(dropped), self._stats)
        self._io.emit_stored([e for e in out.stored if e[0] not in dropped])  # no event for a dropped key
        if failed_puts is not None:
            late = fence.cancelled(job.stamp)  # preempted meanwhile: its blocks go, nothing to retry from
            for key, value, chunk in out.failed:
                if chunk[2].req_id not in late:
                    failed_puts.add(chunk[2].req_id, [(key, value, chunk)])

    def close(self, timeout_s: float) -> None:
        """Finish queued saves and join the thread."""
        self._thread.stop(timeout_s)


class WholeRequestTransfers:
    """Whole-request loads (synchronous, or on a receiving thread) and saves (`WholeRequestSaves`)."""

    def __init__(
        self,
        *,
        io: WholeRequestIO,
        guard: SaveGuard,
        errors: LoadErrorRecorder,
        saves: WholeRequestSaves | None,
        load_async: bool = False,
        tp_rank: int = 0,
    ) -> None:
        """Load through ``io``; ``saves`` None on a rank that does not save; ``load_async``: a receiving thread."""
        self._io = io
        self._guard = guard
        self._errors = errors
        self._saves = saves
        self._loads = CompletionTracker()
        self._loading: set[str] = set()
        self._receiver = (
            TransferThread[Sequence[ReqMeta]](f"kv-pool-recv-{tp_rank}", self._load_async, self._loads)
            if load_async
            else None
        )

    @property
    def num_layers(self) -> int:
        """0: whole requests move at once."""
        return 0

    def set_layers(self, layer_names: Sequence[str]) -> None:
        """Nothing per layer."""
        del layer_names

    def bind_step(self, meta: PoolStepMeta) -> None:
        """Wait for (or cancel) preempted requests' saves before this step's forward pass reuses their blocks."""
        self._guard.wait_preempted(meta.preempted_req_ids)

    def start_load(self, meta: PoolStepMeta) -> None:
        """Load every request whose spec says so, or queue each to the receiving thread."""
        reqs = [r for r in meta.requests if r.load_spec is not None and r.load_spec.can_load]
        if not reqs:
            return
        if self._receiver is None:
            self._io.load(reqs)
            return
        for req in reqs:
            self._loading.add(req.req_id)
            self._receiver.submit((req.req_id,), [req])

    def _load_async(self, reqs: Sequence[ReqMeta]) -> None:
        """`load` on the receiving thread: an unexpected error fails the requests' loads, never passes them."""
        try:
            self._io.load(reqs)
        except Exception as exc:  # the request is reported finished next: it must not look loaded
            logger.exception("async load of %s failed", [r.req_id for r in reqs])
            for req in reqs:
                self._errors.record(req.req_id, [b for ids in req.block_ids for b in ids if b > 0], repr(exc))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing per layer."""
        del layer_name

    def save_layer(self, layer_name: str) -> None:
        """Nothing per layer."""
        del layer_name

    def wait_for_save(self, meta: PoolStepMeta) -> None:
        """Queue the step's saves (`WholeRequestSaves.queue`), none from a block whose load failed this step."""
        if self._saves is not None:
            self._saves.queue(meta, self._errors.pending_blocks())

    def finished_loads(self) -> set[str]:
        """Queued loads that completed since the last call."""
        if self._receiver is None:
            return set()
        done = self._loads.idle(self._loading)
        self._loading -= done
        return done

    def loading(self) -> set[str]:
        """Queued loads not reported yet."""
        return set(self._loading)

    def drain(self, timeout_s: float) -> None:
        """Wait for every queued load."""
        self._loads.wait_idle(self._loading, timeout_s)

    def close(self, timeout_s: float) -> None:
        """Finish queued transfers and join the threads."""
        try:
            if self._saves is not None:
                self._saves.close(timeout_s)
        finally:  # a sending thread that would not stop must not leave the receiving one running
            if self._receiver is not None:
                self._receiver.stop(timeout_s)


class LayerwiseStrategy:
    """Layer-wise transfers (`LayerwiseTransfers` or its GVA flavour) behind the strategy interface."""

    def __init__(self, layers: LayerwiseTransfers, guard: SaveGuard) -> None:
        """Drive ``layers``; ``guard`` is the save bookkeeping ``layers`` was built with."""
        self.layers = layers
        self._guard = guard

    @property
    def num_layers(self) -> int:
        """Layers of this rank (known after registration)."""
        return self.layers.num_layers

    def set_layers(self, layer_names: Sequence[str]) -> None:
        """Layer names in entry order; the position is the key's ``layer_id``."""
        self.layers.set_layers(layer_names)

    def bind_step(self, meta: PoolStepMeta) -> None:
        """Preemption waits, then plan the step and submit its first loads.

        This cannot wait for ``start_load``: vLLM 0.32/0.33 calls ``start_load_kv`` after the forward
        pass unless the step has synchronous loads, so ``save_kv_layer`` would run on the previous
        step's plan and the step's own saves would be dropped.
        """
        self._guard.wait_preempted(meta.preempted_req_ids)
        self.layers.start_step(meta)

    def start_load(self, meta: PoolStepMeta) -> None:
        """Started by `bind_step`."""
        del meta

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer is loaded, within the step's deadline."""
        self.layers.wait_for_layer_load(layer_name)

    def save_layer(self, layer_name: str) -> None:
        """Queue the layer's save; returns at once."""
        self.layers.save_kv_layer(layer_name)

    def wait_for_save(self, meta: PoolStepMeta) -> None:
        """The saves were queued layer by layer: end the step's loads (same deadline)."""
        del meta
        self.layers.finish_step()

    def finished_loads(self) -> set[str]:
        """Layer-wise loads finish within their step."""
        return set()

    def loading(self) -> set[str]:
        """Nothing loads across steps."""
        return set()

    def drain(self, timeout_s: float) -> None:
        """Loads end with their step (saves: `SaveGuard`)."""
        del timeout_s

    def close(self, timeout_s: float) -> None:
        """Finish the step, join both threads."""
        self.layers.close(timeout_s)
