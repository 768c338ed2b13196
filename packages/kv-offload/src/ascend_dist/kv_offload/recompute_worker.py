"""Worker side of the recompute (preempt) CPU offload connector.

Runs in: each worker process. Copies go through the batched, ordered `OffloadWorker` handlers
instead of upstream's per-block copies after a full device synchronize, but the store stays
synchronous inside ``handle_preemptions``: the preempted request's device blocks are already free
and may be written by another request later in this same step.

Host block ids run ``1..num_cpu_blocks`` (0 is the null block), so the host tensors hold
``num_cpu_blocks + 1`` rows; the count comes from the scheduler's `HostCapacity`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ascend_dist.common.device import DeviceRuntime
from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.common.transfer_stats import Direction, FailureKind, TransferStats
from ascend_dist.kv_offload.block_views import BlockView
from ascend_dist.kv_offload.capacity import HostCapacity, check_worker_capacity
from ascend_dist.kv_offload.messages import NO_EVENT, RecomputeMetadata, RecomputeWorkerMeta
from ascend_dist.kv_offload.offload_worker import OffloadWorker
from ascend_dist.kv_offload.transfer import DEFAULT_WAIT_S, TransferResult

__all__ = ["RecomputeWorker"]

logger = logging.getLogger(__name__)


class RecomputeWorker:
    """Synchronous stores on preemption, asynchronous restores polled once per step."""

    def __init__(
        self,
        runtime: DeviceRuntime,
        views: Sequence[BlockView],
        capacity: HostCapacity,
        *,
        timeout_s: float = DEFAULT_WAIT_S,
        block_level_errors: bool = True,
        stats: TransferStats | None = None,
    ) -> None:
        """Allocate the host blocks (the scheduler's count) and the two handlers.

        Args:
            runtime: the device runtime.
            views: the unique canonical views of every KV-cache tensor.
            capacity: the host capacity computed once by the scheduler-side formula.
            timeout_s: deadline of the synchronous store.
            block_level_errors: report a failed restore's device blocks (one KV-cache group, where
                block ids name requests); False: report its requests (`take_failed_recving`), as
                vLLM requires with several groups.
            stats: where each store (``save``: device -> host) and restore (``load``: host -> device)
                job is recorded (the connector's recorder, channel ``offload``); None: nowhere.
        """
        self.transfers = OffloadWorker(runtime, views, num_chunks=capacity.num_cpu_blocks + 1)
        check_worker_capacity(self.transfers.mirror.num_chunks - 1, capacity)
        self._timeout_s = timeout_s
        self._meta: RecomputeMetadata | None = None
        self._submitted_loads: dict[int, tuple[str, ...]] = {}
        self._fenced_this_step = False
        self._completed_stores: dict[int, int] = {}
        self._failed_stores: list[int] = []
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._block_level_errors = block_level_errors
        self._stats = stats

    def bind_connector_metadata(self, meta: RecomputeMetadata) -> None:
        """Take this step's plan."""
        self._meta = meta
        self._fenced_this_step = False

    def clear_connector_metadata(self) -> None:
        """End of step."""
        self._meta = None

    def handle_preemptions(self, meta: RecomputeMetadata | None = None) -> None:
        """Finish in-flight loads, then store this step's preempted blocks and wait for them.

        Raises:
            DeadlineExceeded: the store did not finish within the deadline.
        """
        meta = meta or self._meta
        if meta is None or not meta.need_flush:
            return
        self.transfers.load.wait(self._submitted_loads, self._timeout_s)
        event = meta.store_event
        if event == NO_EVENT:
            return
        if not meta.store_gpu_blocks:
            self._completed_stores[event] = 1
            return
        self.transfers.submit_store(event, meta.store_gpu_blocks, meta.store_cpu_blocks)
        try:
            self.transfers.store.wait([event], self._timeout_s)
        except DeadlineExceeded:
            if self._stats is not None:
                self._stats.record_failure("save", FailureKind.TIMEOUT)
            raise
        for result in self.transfers.store.get_finished():
            self._record("save", result)
            if result.success:
                self._completed_stores[result.job_id] = 1
            else:
                logger.warning("recompute store %d failed: %s", result.job_id, result.error)
                self._failed_stores.append(result.job_id)

    def start_load_kv(self) -> None:
        """Submit this step's restore (once per event, however often this is called)."""
        meta = self._meta
        if meta is None or meta.load_event == NO_EVENT or meta.load_event in self._submitted_loads:
            return
        reqs = meta.load_event_to_reqs.get(meta.load_event, ())
        self._submitted_loads[meta.load_event] = reqs
        self.transfers.submit_load(meta.load_event, meta.load_cpu_blocks, meta.load_gpu_blocks)

    def wait_for_layer_load(self) -> None:
        """Once per step: the compute stream waits for the restores submitted so far."""
        if not self._fenced_this_step and self._submitted_loads:
            self.transfers.load.fence(self._submitted_loads)
            self._fenced_this_step = True

    def get_finished(self) -> set[str] | None:
        """Request ids whose restore finished (successfully or not) since the last call."""
        done: set[str] = set()
        for result in self.transfers.load.get_finished():
            reqs = self._submitted_loads.pop(result.job_id, ())
            self._record("load", result)
            if not result.success:
                logger.warning("recompute load %d failed for %s: recompute them", result.job_id, list(reqs))
                if self._block_level_errors:
                    self._load_errors.update(result.failed_block_ids)
                else:
                    self._failed_recving.update(reqs)
            done.update(reqs)
        return done or None

    def _record(self, direction: Direction, result: TransferResult) -> None:
        """One finished job in the stats: its bytes, time and descriptors, or a failure (a copy error: ``other``)."""
        if self._stats is None:
            return
        if result.success and result.transfer_time is not None:
            self._stats.record_transfer(direction, result.transfer_time, result.transfer_size, result.num_descriptors)
        else:
            self._stats.record_failure(direction, FailureKind.OTHER)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose restore failed since the last call (the scheduler recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_recving(self) -> set[str]:
        """Requests whose restore failed since the last call (several KV-cache groups); also in `get_finished`."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def build_connector_worker_meta(self) -> RecomputeWorkerMeta | None:
        """Stores finished (or failed) since the last call, or None."""
        if not self._completed_stores and not self._failed_stores:
            return None
        meta = RecomputeWorkerMeta(completed_stores=self._completed_stores, failed_stores=tuple(self._failed_stores))
        self._completed_stores, self._failed_stores = {}, []
        return meta

    def shutdown(self) -> None:
        """Drain both directions."""
        self.transfers.shutdown(self._timeout_s)
