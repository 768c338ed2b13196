"""Background transfer threads and per-request completion tracking.

Runs in: worker processes. A `TransferThread` owns no business state: it takes jobs from a FIFO,
runs the handler, and reports completion to a `CompletionTracker`. Saves therefore never block the
forward pass (upstream joined the queue every step); a finished request's blocks are
held (delayed free) until its pending saves completed, and a preempted request waits for its
pending saves before its blocks can be reused.

A `RequestFence` cancels a request's queued and running save jobs when vLLM may reuse its blocks
(a preemption whose saves missed their deadline): a job stamped before the cancellation reads no
block of that request, and the cancelling thread waits (bounded) for a put in flight to return
before the forward pass may overwrite the blocks; past that deadline it raises, and what the
abandoned put stored is dropped once it returns.
`FailedPuts` remembers (bounded) the chunks whose put failed, for that request's next save job.

Every wait is bounded; `TransferThread.stop` joins the thread with a deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ascend_dist.common.errors import DeadlineExceeded, InvalidTransition, StoreError
from ascend_dist.common.timeouts import Deadline
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.transfer.worker_types import RemovableBackend, WorkerStats

__all__ = ["CompletionTracker", "FailedPuts", "RequestFence", "TransferThread", "drop_cancelled_keys"]

logger = logging.getLogger(__name__)

J = TypeVar("J")
E = TypeVar("E")


class CompletionTracker:
    """Counts pending jobs per request; thread-safe; waits are bounded."""

    def __init__(self) -> None:
        """Create an empty tracker."""
        self._pending: dict[str, int] = {}
        self._cond = threading.Condition()

    def add(self, req_id: str) -> None:
        """One more job of ``req_id`` is queued."""
        with self._cond:
            self._pending[req_id] = self._pending.get(req_id, 0) + 1

    def done(self, req_id: str) -> None:
        """One job of ``req_id`` finished (successfully or not)."""
        with self._cond:
            left = self._pending.get(req_id, 0) - 1
            if left <= 0:
                self._pending.pop(req_id, None)
            else:
                self._pending[req_id] = left
            self._cond.notify_all()

    def pending(self, req_id: str) -> int:
        """Jobs of ``req_id`` still queued or running."""
        with self._cond:
            return self._pending.get(req_id, 0)

    def pending_ids(self) -> set[str]:
        """Every request with a pending job."""
        with self._cond:
            return set(self._pending)

    def idle(self, req_ids: Iterable[str]) -> set[str]:
        """The subset of ``req_ids`` with no pending job."""
        with self._cond:
            return {r for r in req_ids if r not in self._pending}

    def wait_idle(self, req_ids: Iterable[str], timeout_s: float) -> None:
        """Block until none of ``req_ids`` has a pending job.

        Raises:
            DeadlineExceeded: Still pending after ``timeout_s``.
        """
        ids = set(req_ids)
        deadline = Deadline.after(timeout_s)
        with self._cond:
            while any(r in self._pending for r in ids):
                if deadline.expired():
                    raise DeadlineExceeded(
                        f"transfers of {sorted(r for r in ids if r in self._pending)} still pending after {timeout_s}s"
                    )
                self._cond.wait(deadline.remaining())


class RequestFence:
    """Per-request generations that cancel the save jobs stamped before `cancel`; thread-safe.

    A job takes a `stamp` of its requests when it is queued. Before it reads a request's blocks it
    calls `begin_read` (the requests not cancelled since the stamp, now marked as being read) and
    `end_read` once its put returned. `cancel` runs on the forward pass's thread BEFORE the step
    that may reuse the blocks: it bumps the generations (queued jobs then skip these requests) and
    waits, bounded, until no job reads them any more, so a put in flight only ever copied the
    original bytes. If the wait passes its deadline, `cancel` raises `DeadlineExceeded` (the
    forward pass must not overwrite blocks a put still reads) and marks those reads abandoned:
    `end_read` returns them, and the caller drops what that put stored, as defence. A request
    resumed after a preemption gets fresh jobs with the new generation, which stay live.
    """

    def __init__(self) -> None:
        """Create a fence with no cancelled request."""
        self._gen: dict[str, int] = {}  # only requests ever cancelled (absent = generation 0)
        self._reading: dict[str, int] = {}  # requests whose blocks a job reads now (count)
        self._abandoned: set[str] = set()  # reads `cancel` stopped waiting for
        self._cond = threading.Condition()

    def stamp(self, req_ids: Iterable[str]) -> dict[str, int]:
        """The current generation of each of ``req_ids`` (kept on the job)."""
        with self._cond:
            return {r: self._gen.get(r, 0) for r in req_ids}

    def cancel(self, req_ids: Iterable[str], wait_s: float) -> None:
        """Cancel every job stamped so far for ``req_ids`` and wait until none of them reads their blocks.

        Raises:
            DeadlineExceeded: A job still reads them after ``wait_s`` (its read is abandoned).
        """
        ids = set(req_ids)
        deadline = Deadline.after(wait_s)
        with self._cond:
            for r in ids:
                self._gen[r] = self._gen.get(r, 0) + 1
            while reading := sorted(r for r in ids if r in self._reading):
                if deadline.expired():
                    self._abandoned.update(reading)
                    raise DeadlineExceeded(f"saves of {reading} still read their blocks after {wait_s}s")
                self._cond.wait(deadline.remaining())

    def cancelled(self, stamp: Mapping[str, int]) -> set[str]:
        """The requests of ``stamp`` cancelled since it was taken."""
        with self._cond:
            return self._cancelled_locked(stamp)

    def _cancelled_locked(self, stamp: Mapping[str, int]) -> set[str]:
        return {r for r, g in stamp.items() if self._gen.get(r, 0) != g}

    def begin_read(self, stamp: Mapping[str, int]) -> set[str]:
        """The requests of ``stamp`` still live, marked as read until `end_read` (checked and marked at once)."""
        with self._cond:
            live = set(stamp) - self._cancelled_locked(stamp)
            for r in live:
                self._reading[r] = self._reading.get(r, 0) + 1
            return live

    def end_read(self, live: Iterable[str]) -> set[str]:
        """``live`` (from `begin_read`) is no longer read; returns those whose read `cancel` abandoned."""
        with self._cond:
            abandoned: set[str] = set()
            for r in live:
                left = self._reading.get(r, 0) - 1
                if left > 0:
                    self._reading[r] = left
                    continue
                self._reading.pop(r, None)
                if r in self._abandoned:
                    self._abandoned.discard(r)
                    abandoned.add(r)
            self._cond.notify_all()
            return abandoned

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the generations of requests with no job left (a later stamp starts again at 0)."""
        with self._cond:
            for r in req_ids:
                self._gen.pop(r, None)

    def tracked(self) -> set[str]:
        """Requests with a generation (cancelled at least once and not forgotten)."""
        with self._cond:
            return set(self._gen)


def drop_cancelled_keys(backend: PoolBackend, keys: Sequence[str], stats: WorkerStats) -> None:
    """Remove keys an abandoned save's put stored: it may have read blocks vLLM had reused (sending thread).

    A backend without ``remove`` or a failing remove is logged as an error: nothing else can undo it.
    """
    if not keys:
        return
    if not isinstance(backend, RemovableBackend):
        logger.error("cannot drop %d key(s) of a cancelled save: backend %s has no remove", len(keys), backend.name)
        return
    try:
        backend.remove(keys)
    except StoreError as exc:
        logger.error("dropping %d key(s) of a cancelled save failed: %s", len(keys), exc)
        return
    stats.dropped_keys += len(keys)


class FailedPuts(Generic[E]):
    """Per request, the save entries whose put failed, bounded; thread-safe.

    At most ``per_request`` entries per request and ``max_requests`` requests (the oldest request
    is forgotten first): a retry is best effort, the memory is not.
    """

    def __init__(self, *, per_request: int = 256, max_requests: int = 1024) -> None:
        """Create an empty record with these bounds."""
        self._by_req: OrderedDict[str, list[E]] = OrderedDict()
        self._per_request = per_request
        self._max_requests = max_requests
        self._lock = threading.Lock()

    def add(self, req_id: str, entries: Iterable[E]) -> None:
        """Remember ``entries`` of ``req_id`` for its next save job."""
        with self._lock:
            held = self._by_req.setdefault(req_id, [])
            held.extend(entries)
            del held[self._per_request :]
            if not held:
                del self._by_req[req_id]
            while len(self._by_req) > self._max_requests:
                self._by_req.popitem(last=False)

    def take(self, req_ids: Iterable[str], where: Callable[[E], bool] | None = None) -> list[E]:
        """Remove and return the remembered entries of ``req_ids`` (retried once, then forgotten).

        ``where``: only the entries it accepts (e.g. of one layer); the others stay.
        """
        with self._lock:
            if where is None:
                return [e for r in req_ids for e in self._by_req.pop(r, [])]
            taken: list[E] = []
            for r in req_ids:
                held = self._by_req.get(r)
                if not held:
                    continue
                taken.extend(e for e in held if where(e))
                held[:] = [e for e in held if not where(e)]
                if not held:
                    del self._by_req[r]
            return taken

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop the entries of requests whose blocks may be reused (preempted, finished)."""
        with self._lock:
            for r in req_ids:
                self._by_req.pop(r, None)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_req.values())


@dataclass(frozen=True)
class _Job(Generic[J]):
    req_ids: tuple[str, ...]
    payload: J


class TransferThread(Generic[J]):
    """One named thread running ``handler(payload)`` for each submitted job, in order."""

    def __init__(self, name: str, handler: Callable[[J], None], tracker: CompletionTracker) -> None:
        """Start the thread.

        Args:
            name: Thread name (shown in logs and stack dumps).
            handler: Runs one job; an exception is logged and the job counts as done (the handler
                itself records failures, e.g. as load errors).
            tracker: Completion counters shared with the worker.
        """
        self._handler = handler
        self._tracker = tracker
        self._queue: queue.Queue[_Job[J] | None] = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, req_ids: tuple[str, ...], payload: J) -> None:
        """Queue one job covering ``req_ids`` (one step's requests are moved in one batch).

        Raises:
            InvalidTransition: The thread was stopped.
        """
        if self._stopping:
            raise InvalidTransition(self._thread.name, "stopped", "submit")
        for req_id in req_ids:
            self._tracker.add(req_id)
        self._queue.put(_Job(req_ids, payload))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._handler(job.payload)
            except Exception:  # a failed job must not kill the thread; the handler records its effect
                logger.exception("%s: job of requests %s failed", self._thread.name, list(job.req_ids))
            finally:
                for req_id in job.req_ids:
                    self._tracker.done(req_id)

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish queued jobs, then join the thread. Idempotent.

        Raises:
            DeadlineExceeded: The thread did not finish within ``timeout_s``.
        """
        if not self._stopping:
            self._stopping = True
            self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise DeadlineExceeded(f"{self._thread.name} did not stop within {timeout_s}s")
