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

Every store and load ends and is reported, failed or not (vLLM's scheduler side pins a store's
blocks until every worker acknowledges it, and holds a loading request until its load finishes):
a submission that raises on the copy thread fails its job like a copy fault does. A failed store
is acknowledged *and* listed by `take_failed_stores` (the adapter drops its host blocks before
vLLM would make them discoverable); a failed load finishes its requests and is reported as device
block ids (one KV-cache group) or as the requests (`take_failed_recving`, several groups).

Given a `TransferStats` recorder, each ended job is recorded there (direction ``save``: device ->
host, ``load``: host -> device): a successful one's device-timed seconds, bytes and descriptors, a
failed one as a failure (a copy fault: kind ``other``; a refused submission: by its error's type).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ascend_dist.common.device import DeviceRuntime, Event, tensors_runtime
from ascend_dist.common.errors import DeadlineExceeded, LayoutError
from ascend_dist.common.transfer_stats import Direction, FailureKind, TransferStats
from ascend_dist.kv_offload.block_views import BlockView, dedup_views, generic_block_view, logical_block_bytes
from ascend_dist.kv_offload.capacity import HostCapacity
from ascend_dist.kv_offload.layouts import layer_parts
from ascend_dist.kv_offload.offload_worker import OffloadWorker
from ascend_dist.kv_offload.transfer import DEFAULT_WAIT_S, DirectionHandler, TransferResult

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
    """One non-daemon thread running submissions in FIFO order; joined by `close`.

    A submission that raises hands its exception to its ``on_error`` (the job then fails); it never
    kills the thread.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[[], object], Callable[[BaseException], None]] | None] = queue.Queue()
        self._cv = threading.Condition()
        self._queued = 0
        self._done = 0
        self._thread = threading.Thread(target=self._run, name="ascend-dist-simple-copy")
        self._thread.start()

    def submit(self, fn: Callable[[], object], on_error: Callable[[BaseException], None]) -> None:
        with self._cv:
            self._queued += 1
        self._queue.put((fn, on_error))

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
        while (item := self._queue.get()) is not None:
            fn, on_error = item
            try:
                fn()
            except Exception as exc:  # a bad submission must not kill the thread: its job fails instead
                logger.exception("simple offload copy submission failed")
                on_error(exc)
            with self._cv:
                self._done += 1
                self._cv.notify_all()


class SimpleOffloadWorker:
    """vLLM's simple-offload worker contract over our handlers and the device runtime."""

    def __init__(
        self,
        runtime: DeviceRuntime | None,
        capacity: HostCapacity,
        *,
        timeout_s: float = DEFAULT_WAIT_S,
        block_level_errors: bool = True,
        stats: TransferStats | None = None,
    ) -> None:
        """Remember the runtime and the host capacity (from the scheduler formula).

        Args:
            runtime: the device runtime (may be replaced until ``register_kv_caches``); None: the
                process's runtime of the caches' device, taken at registration (so a worker given its
                own never starts it).
            capacity: host blocks per rank.
            timeout_s: deadline of the flush on preemption and of shutdown.
            block_level_errors: report a failed load's device blocks (one KV-cache group, where
                block ids name requests); False: its requests (`take_failed_recving`).
            stats: where each ended store and load is recorded (None: nowhere).
        """
        self._stats = stats
        self.runtime: DeviceRuntime | None = runtime  # may be replaced until register_kv_caches
        self.capacity = capacity
        self.num_cpu_blocks = capacity.num_cpu_blocks
        self._timeout_s = timeout_s
        self.transfers: OffloadWorker | None = None
        self._copier: _CopyThread | None = None
        self._plan: SimpleStepPlan | None = None
        self._compute_done: Event | None = None
        self._load_reqs: dict[int, tuple[str, ...]] = {}
        self._completed_stores: dict[int, int] = {}
        self._failed_stores: dict[int, int] = {}  # also acknowledged; taken by `take_failed_stores`
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        self._block_level_errors = block_level_errors
        # Jobs whose submission raised on the copy thread: (event, device block ids, error text).
        self._lock = threading.Lock()
        self._refused_loads: list[tuple[int, tuple[int, ...], str]] = []
        self._refused_stores: list[tuple[int, str]] = []

    def register_kv_caches(
        self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], num_blocks: int
    ) -> None:
        """Build the views, allocate ``num_cpu_blocks`` host rows per view, start the copy thread."""
        views = simple_block_views(kv_caches, num_blocks)
        if self.runtime is None:  # the caches' device: each rank copies on its own device's streams
            self.runtime = tensors_runtime(v.tensor for v in views)
        self.transfers = OffloadWorker(self.runtime, views, num_chunks=self.num_cpu_blocks)
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

        def refused(exc: BaseException) -> None:
            if self._stats is not None:
                self._stats.record_failure("load", exc)
            with self._lock:
                self._refused_loads.append((event, tuple(dst), str(exc)))

        copier.submit(lambda: workers.load.transfer_async(event, dst, src), refused)

    def wait_for_save(self) -> None:
        """Record compute-done on the current stream, then hand the store to the copy thread."""
        plan = self._plan
        if plan is None or not plan.store_gpu_blocks:
            return
        workers, copier = self._handlers()
        runtime = workers.store.runtime
        done = runtime.new_event()
        done.record(runtime.current_stream())
        event, src, dst = plan.store_event, list(plan.store_gpu_blocks), list(plan.store_cpu_blocks)

        def refused(exc: BaseException) -> None:
            if self._stats is not None:
                self._stats.record_failure("save", exc)
            with self._lock:
                self._refused_stores.append((event, str(exc)))

        copier.submit(lambda: workers.store.transfer_async(event, src, dst, after=done), refused)

    def get_finished(self, finished_req_ids: set[str] | None = None) -> tuple[None, set[str] | None]:
        """``(None, requests whose load ended)``, failed loads included; ended stores go to the worker metadata."""
        del finished_req_ids  # stores are protected by device ref counts, not delayed frees
        if self.transfers is None:
            return None, None
        with self._lock:
            refused_loads, self._refused_loads = self._refused_loads, []
            refused_stores, self._refused_stores = self._refused_stores, []
        recving: set[str] = set()
        for result in self.transfers.load.get_finished():
            self._record("load", result)
            reqs = self._load_reqs.pop(result.job_id, ())
            recving.update(reqs)
            if not result.success:
                self._fail_load(result.job_id, reqs, result.failed_block_ids, result.error)
        for event, blocks, error in refused_loads:
            reqs = self._load_reqs.pop(event, ())
            recving.update(reqs)
            self._fail_load(event, reqs, blocks, error)
        for result in self.transfers.store.get_finished():
            self._record("save", result)
            if result.success:
                self._completed_stores[result.job_id] = 1
            else:
                self._fail_store(result.job_id, result.error)
        for event, error in refused_stores:
            self._fail_store(event, error)
        return None, recving or None

    def _record(self, direction: Direction, result: TransferResult) -> None:
        """One ended job in the stats: its time, bytes and descriptors, or a failure (a copy fault: ``other``)."""
        if self._stats is None:
            return
        if result.success:  # (untimed: 0 s; the bytes still moved)
            seconds = result.transfer_time or 0.0
            self._stats.record_transfer(direction, seconds, result.transfer_size, result.num_descriptors)
        else:
            self._stats.record_failure(direction, FailureKind.OTHER)

    def _fail_load(self, event: int, reqs: tuple[str, ...], blocks: tuple[int, ...], error: str | None) -> None:
        logger.warning("simple offload load %d failed for %s (recomputed): %s", event, list(reqs), error)
        if self._block_level_errors:
            self._load_errors.update(blocks)
        else:
            self._failed_recving.update(reqs)

    def _fail_store(self, event: int, error: str | None) -> None:
        """Acknowledge the store (so vLLM unpins its blocks) and list it failed (so they are dropped)."""
        logger.error("simple offload store %d failed; its host blocks are dropped: %s", event, error)
        self._failed_stores[event] = 1
        self._completed_stores[event] = 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call (one KV-cache group)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_recving(self) -> set[str]:
        """Requests whose load failed since the last call (several KV-cache groups); also finished."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def take_failed_stores(self) -> dict[int, int]:
        """``{store_event: 1}`` for stores failed since the last call (also in the completed ones)."""
        failed, self._failed_stores = self._failed_stores, {}
        return failed

    def build_connector_worker_meta(self) -> dict[int, int] | None:
        """``{store_event: 1}`` for stores ended (failed ones too) since the last call, or None."""
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
