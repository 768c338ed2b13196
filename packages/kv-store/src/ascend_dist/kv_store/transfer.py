"""Background transfer threads and per-request completion tracking.

Runs in: worker processes. A `TransferThread` owns no business state: it takes jobs from a FIFO,
runs the handler, and reports completion to a `CompletionTracker`. Saves therefore never block the
forward pass (upstream joined the queue every step); a finished request's blocks are
held (delayed free) until its pending saves completed, and a preempted request waits for its
pending saves before its blocks can be reused.

Every wait is bounded; `TransferThread.stop` joins the thread with a deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ascend_dist.common.errors import DeadlineExceeded, InvalidTransition
from ascend_dist.common.timeouts import Deadline

__all__ = ["CompletionTracker", "TransferThread"]

logger = logging.getLogger(__name__)

J = TypeVar("J")


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
