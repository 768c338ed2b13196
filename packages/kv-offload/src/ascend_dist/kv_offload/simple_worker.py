"""Worker of the simple CPU offload connector on the device runtime.

Runs in: each worker process. Replaces only vLLM's worker handler: the upstream scheduler manager
and metadata are kept (the adapter passes vLLM's metadata object, read through `SimpleStepPlan`).

Every sub-tensor of every layer becomes one per-block view (``shape[0] >= num_blocks``: one view;
stacked ``[N, num_blocks, ...]``: N views); views are deduplicated by (data pointer, row stride,
row bytes), never by storage pointer, so sibling tensors of one allocation are all kept.
The host block count comes from the one capacity formula (`capacity.HostCapacity`), shared with the scheduler.

Copies run on a background copy thread (descriptor building stays off the step's critical path);
loads are submitted in ``start_load_kv``, stores in ``wait_for_save`` behind a compute-done event
recorded on the current stream, so a store never reads a block the step is still writing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ascend_dist.common.device import DeviceRuntime, Event
from ascend_dist.common.errors import DeadlineExceeded, LayoutError
from ascend_dist.kv_offload.block_views import BlockView, dedup_views, generic_block_view, logical_block_bytes
from ascend_dist.kv_offload.capacity import HostCapacity
from ascend_dist.kv_offload.layouts import layer_parts
from ascend_dist.kv_offload.offload_worker import OffloadWorker
from ascend_dist.kv_offload.transfer import DEFAULT_WAIT_S, DirectionHandler

if TYPE_CHECKING:
    import torch

__all__ = ["SimpleOffloadWorker", "SimpleStepPlan", "simple_block_views"]

logger = logging.getLogger(__name__)


class SimpleStepPlan(Protocol):
    """One step's plan (vLLM's ``SimpleCPUOffloadMetadata`` has exactly these attributes; read-only)."""

    @property
    def load_event(self) -> int:
        """Index of this step's load, or -1."""
        ...

    @property
    def load_gpu_blocks(self) -> Sequence[int]:
        """Load destinations."""
        ...

    @property
    def load_cpu_blocks(self) -> Sequence[int]:
        """Load sources."""
        ...

    @property
    def load_event_to_reqs(self) -> Mapping[int, Sequence[str]]:
        """Load event -> its requests."""
        ...

    @property
    def store_event(self) -> int:
        """Index of this step's store, or -1."""
        ...

    @property
    def store_gpu_blocks(self) -> Sequence[int]:
        """Store sources."""
        ...

    @property
    def store_cpu_blocks(self) -> Sequence[int]:
        """Store destinations."""
        ...

    @property
    def need_flush(self) -> bool:
        """Some request was preempted: wait for every transfer."""
        ...


def simple_block_views(kv_caches: Mapping[str, object], num_blocks: int) -> list[BlockView]:
    """Per-block views of every sub-tensor of every layer, deduplicated by (ptr, stride, row).

    Raises:
        LayoutError: a tensor whose dim 0 and dim 1 are both below ``num_blocks`` ("cannot locate
            blocks dim"), or a non-tensor value.
    """
    views: list[BlockView] = []
    for name, value in kv_caches.items():
        for part in layer_parts(value):
            if part.shape[0] >= num_blocks:
                views.append(generic_block_view(part, num_blocks, logical_block_bytes(part)))
            elif part.dim() > 1 and part.shape[1] >= num_blocks:
                for segment in part.unbind(0):
                    views.append(generic_block_view(segment, num_blocks, logical_block_bytes(segment)))
            else:
                raise LayoutError(f"kv_caches[{name!r}]", tuple(part.shape), f"a blocks dim of >= {num_blocks}")
    return dedup_views(views)


class _CopyThread:
    """One non-daemon thread running submissions in FIFO order; joined by `close`."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], object] | None] = queue.Queue()
        self._cv = threading.Condition()
        self._queued = 0
        self._done = 0
        self._thread = threading.Thread(target=self._run, name="ascend-dist-simple-copy")
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> None:
        with self._cv:
            self._queued += 1
        self._queue.put(fn)

    def drain(self, timeout: float) -> None:
        """Wait until everything submitted so far has been handed to the streams."""
        end = time.monotonic() + timeout
        with self._cv:
            target = self._queued
            while self._done < target:
                left = end - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"copy thread did not drain within {timeout:g} s")
                self._cv.wait(left)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("simple offload copy thread did not stop within %g s", timeout)

    def _run(self) -> None:
        while (fn := self._queue.get()) is not None:
            try:
                fn()
            except Exception:  # a bad submission must not kill the thread; the job is never reported
                logger.exception("simple offload copy submission failed")
            with self._cv:
                self._done += 1
                self._cv.notify_all()


class SimpleOffloadWorker:
    """vLLM's simple-offload worker contract over our handlers and the device runtime."""

    def __init__(self, runtime: DeviceRuntime, capacity: HostCapacity, *, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Remember the runtime and the host capacity (from the scheduler formula)."""
        self._runtime = runtime
        self.capacity = capacity
        self.num_cpu_blocks = capacity.num_cpu_blocks
        self._timeout_s = timeout_s
        self.transfers: OffloadWorker | None = None
        self._copier: _CopyThread | None = None
        self._plan: SimpleStepPlan | None = None
        self._compute_done: Event | None = None
        self._load_reqs: dict[int, tuple[str, ...]] = {}
        self._completed_stores: dict[int, int] = {}
        self.failed_store_events: list[int] = []
        self._load_errors: set[int] = set()

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], num_blocks: int
    ) -> None:
        """Build the views, allocate ``num_cpu_blocks`` host rows per view, start the copy thread."""
        views = simple_block_views(kv_caches, num_blocks)
        self.transfers = OffloadWorker(self._runtime, views, num_chunks=self.num_cpu_blocks)
        self._copier = _CopyThread()

    def _handlers(self) -> tuple[OffloadWorker, _CopyThread]:
        if self.transfers is None or self._copier is None:
            raise LayoutError("kv_caches", None, "register_kv_caches() called before transfers")
        return self.transfers, self._copier

    def bind_connector_metadata(self, plan: SimpleStepPlan) -> None:
        """Take this step's plan."""
        self._plan = plan
        if plan.load_event >= 0:
            self._load_reqs[plan.load_event] = tuple(plan.load_event_to_reqs.get(plan.load_event, ()))

    def clear_connector_metadata(self) -> None:
        """End of step."""
        self._plan = None

    def start_load_kv(self) -> None:
        """Hand this step's load to the copy thread (host source is stable: no wait)."""
        plan = self._plan
        if plan is None or not plan.load_cpu_blocks:
            return
        workers, copier = self._handlers()
        event, src, dst = plan.load_event, list(plan.load_cpu_blocks), list(plan.load_gpu_blocks)
        copier.submit(lambda: workers.load.transfer_async(event, dst, src))

    def wait_for_save(self) -> None:
        """Record compute-done on the current stream, then hand the store to the copy thread."""
        plan = self._plan
        if plan is None or not plan.store_gpu_blocks:
            return
        workers, copier = self._handlers()
        done = self._runtime.new_event()
        done.record(self._runtime.current_stream())
        event, src, dst = plan.store_event, list(plan.store_gpu_blocks), list(plan.store_cpu_blocks)
        copier.submit(lambda: workers.store.transfer_async(event, src, dst, after=done))

    def get_finished(self, finished_req_ids: set[str] | None = None) -> tuple[None, set[str] | None]:
        """``(None, requests whose load finished)``; finished stores go to the worker metadata."""
        del finished_req_ids  # stores are protected by device ref counts, not delayed frees
        if self.transfers is None:
            return None, None
        recving: set[str] = set()
        for result in self.transfers.load.get_finished():
            recving.update(self._load_reqs.pop(result.job_id, ()))
            if not result.success:
                self._load_errors.update(result.failed_block_ids)
        for result in self.transfers.store.get_finished():
            if result.success:
                self._completed_stores[result.job_id] = 1
            else:  # never acknowledged: the scheduler keeps the host block undiscoverable
                logger.error("simple offload store %d failed: %s", result.job_id, result.error)
                self.failed_store_events.append(result.job_id)
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> dict[int, int] | None:
        """``{store_event: 1}`` for stores finished since the last call, or None."""
        if not self._completed_stores:
            return None
        done, self._completed_stores = self._completed_stores, {}
        return done

    def handle_preemptions(self, plan: SimpleStepPlan) -> None:
        """If the plan asks for a flush, wait for every transfer submitted so far."""
        if not plan.need_flush or self.transfers is None or self._copier is None:
            return
        self._copier.drain(self._timeout_s)
        for handler in (self.transfers.load, self.transfers.store):
            _wait_all(handler, self._timeout_s)

    def shutdown(self) -> None:
        """Stop the copy thread and drain both directions."""
        if self._copier is not None:
            self._copier.close(self._timeout_s)
        if self.transfers is not None:
            self.transfers.shutdown(self._timeout_s)


def _wait_all(handler: DirectionHandler, timeout: float) -> None:
    handler.wait(handler.pending(), timeout)
