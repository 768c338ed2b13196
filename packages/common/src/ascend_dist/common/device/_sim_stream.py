"""Streams and events of the CPU simulation: FIFO queues of closures, one worker thread each.

Runs in: processes using the ``cpu`` device backend (tests, CPU-only development).

All state of one runtime (every queue, counter and event) is guarded by a single
`threading.Condition` in `SimCore`: the simulation favours obviously-correct ordering over
throughput. Closures run *outside* that lock, on the stream's worker thread (or, in manual mode, in
the thread calling `SimStream.step`).

Semantics (the CUDA ones except where noted):

- Operations on one stream run in FIFO order; streams run concurrently.
- An event records a *generation*; `SimEvent.query` is True once the latest recorded generation
  has fired. Unlike CUDA, an event never recorded is not complete: synchronizing on it, or a stream
  waiting on it, blocks until its first record fires or the deadline passes (`DeadlineExceeded`).
- A wait at the head of a stream blocks that stream only; in threaded mode it gives up after the
  runtime's wait timeout and leaves a `DeadlineExceeded` on the stream.
- Errors are sticky: the first failure on a stream (a `BatchCopyError`, a timed-out wait, a failed
  host function) is raised by the stream's next `SimStream.synchronize`, which then clears it, and by
  `SimEvent.synchronize` of every event that fired on the stream after the failure. Later
  operations still run, so waiters are never stranded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from ascend_dist.common.device.base import DEFAULT_TIMEOUT_S, Event, Stream
from ascend_dist.common.errors import AscendDistError, ConfigError, DeadlineExceeded, DeviceError

__all__ = ["SimCore", "SimEvent", "SimStream"]

logger = logging.getLogger(__name__)

_IDLE_POLL_S: Final = 0.25
"""How often an idle worker checks whether the interpreter is shutting down."""


def _deadline(timeout: float | None) -> float:
    """Absolute monotonic deadline for a wait of ``timeout`` seconds (None: the default)."""
    return time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else max(timeout, 0.0))


class SimCore:
    """State shared by one runtime's streams and events: one lock, the mode, the shutdown flag."""

    def __init__(self, *, manual: bool, wait_timeout_s: float) -> None:
        """Create the shared lock; ``wait_timeout_s`` bounds waits executed by worker threads."""
        self.cv = threading.Condition()
        self.manual = manual
        self.wait_timeout_s = wait_timeout_s
        self.closing = False

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Wait (holding ``cv``) until ``predicate`` holds, else raise `DeadlineExceeded`."""
        end = _deadline(timeout)
        while not predicate():
            remaining = end - time.monotonic()
            if remaining <= 0:
                limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
                raise DeadlineExceeded(f"{what} did not complete within {limit:g} s")
            self.cv.wait(remaining)


@dataclass
class _Op:
    """One queued closure; ``ready`` (checked under the lock) gates a wait."""

    label: str
    run: Callable[[], None]
    ready: Callable[[], bool] | None = None
    deadline: float | None = None


class SimEvent:
    """An event of the CPU simulation (see the module docstring for the semantics)."""

    def __init__(self, core: SimCore, current: Callable[[], SimStream], *, timing: bool) -> None:
        """Create an unrecorded event; ``current`` returns the calling thread's current stream."""
        self.core = core
        self._core = core
        self._current = current
        self.timing = timing
        self._recorded = 0
        self._fired = 0
        self._fired_at: float | None = None
        self._error: AscendDistError | None = None

    def record(self, stream: Stream | None = None) -> None:
        """Enqueue a marker on ``stream`` (default: the current stream) that fires this event."""
        target = self._current() if stream is None else stream
        if not isinstance(target, SimStream) or not target.shares(self._core):
            raise ConfigError("stream", target, "a stream of the same CpuSimRuntime")
        target.enqueue_marker(self)

    def next_generation(self) -> int:
        """Start a new record (caller holds the lock) and return its generation."""
        self._recorded += 1
        return self._recorded

    def fire(self, generation: int, error: AscendDistError | None) -> None:
        """Mark ``generation`` complete (caller holds the lock)."""
        self._fired = max(self._fired, generation)
        self._fired_at = time.monotonic()
        self._error = error
        self._core.cv.notify_all()

    def wait_target(self) -> int:
        """Generation a wait enqueued now must see (caller holds the lock); 1 when never recorded."""
        return max(self._recorded, 1)

    def fired(self, generation: int) -> bool:
        """Whether ``generation`` has fired (caller holds the lock)."""
        return self._fired >= generation

    def query(self) -> bool:
        """Return True once the latest record has fired (False if never recorded)."""
        with self._core.cv:
            return self._recorded > 0 and self._fired >= self._recorded

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the latest record fires; re-raise a sticky error of its stream.

        Raises:
            DeadlineExceeded: Not fired within ``timeout`` (None: `DEFAULT_TIMEOUT_S`).
            BatchCopyError: A copy failed on the stream before this event fired.
        """
        with self._core.cv:
            target = self.wait_target()
            self._core.wait_for(lambda: self._fired >= target, timeout, "event")
            error = self._error
        if error is not None:
            raise error

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event's firing to ``end``'s.

        Raises:
            DeviceError: Either event lacks ``timing=True`` or has not fired.
        """
        if not isinstance(end, SimEvent) or not (self.timing and end.timing):
            raise DeviceError("elapsed_ms needs two events of this runtime created with timing=True")
        with self._core.cv:
            start_at, end_at = self._fired_at, end._fired_at
        if start_at is None or end_at is None:
            raise DeviceError("elapsed_ms needs both events recorded and complete")
        return (end_at - start_at) * 1000.0


class SimStream:
    """A stream of the CPU simulation: a FIFO of closures run by one worker thread (or by hand)."""

    def __init__(self, core: SimCore, name: str, priority: int, new_event: Callable[[], SimEvent]) -> None:
        """Create the queue and, unless the runtime is in manual mode, start the worker thread."""
        self._core = core
        self.name = name
        self.priority = priority
        self._new_event = new_event
        self._queue: deque[_Op] = deque()
        self._enqueued = 0
        self._completed = 0
        self._error: AscendDistError | None = None
        self._thread: threading.Thread | None = None
        if not core.manual:
            self._thread = threading.Thread(target=self._worker, name=f"ascend-dist-sim-{name}", daemon=False)
            self._thread.start()

    def __repr__(self) -> str:
        """Name the stream."""
        return f"SimStream({self.name!r})"

    def shares(self, core: SimCore) -> bool:
        """Whether this stream belongs to the runtime owning ``core``."""
        return self._core is core

    # -- enqueueing -------------------------------------------------------------------------------

    def enqueue(self, label: str, run: Callable[[], None], ready: Callable[[], bool] | None = None) -> None:
        """Append a closure; it runs after everything enqueued before it on this stream.

        Raises:
            DeviceError: The runtime is closed.
        """
        with self._core.cv:
            self._check_open_locked(label)
            self._queue.append(_Op(label, run, ready))
            self._enqueued += 1
            self._core.cv.notify_all()

    def enqueue_marker(self, event: SimEvent) -> None:
        """Enqueue the marker that fires ``event`` with this stream's sticky error, if any."""
        with self._core.cv:  # re-entrant: the generation and its marker are taken atomically
            self._check_open_locked("record")
            generation = event.next_generation()

            def fire() -> None:
                with self._core.cv:
                    event.fire(generation, self._error)

            self.enqueue("record", fire)

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait until ``event``'s latest record has fired."""
        if not isinstance(event, SimEvent) or not self.shares(event.core):
            raise ConfigError("event", event, "an event of the same CpuSimRuntime")
        with self._core.cv:
            target = event.wait_target()
        self.enqueue("wait_event", lambda: None, ready=lambda: event.fired(target))

    def wait_stream(self, other: Stream) -> None:
        """Make later work on this stream wait for everything enqueued on ``other`` so far."""
        self.wait_event(other.record_event())

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) on this stream and return it."""
        target = self._new_event() if event is None else event
        target.record(self)
        return target

    # -- progress ---------------------------------------------------------------------------------

    def pending(self) -> int:
        """Number of enqueued operations not yet completed."""
        with self._core.cv:
            return self._enqueued - self._completed

    def query(self) -> bool:
        """Return True when every enqueued operation has completed."""
        return self.pending() == 0

    def step(self, n: int = 1) -> int:
        """Manual mode: run up to ``n`` pending operations in the calling thread.

        Stops early at an operation waiting on an event that has not fired.

        Returns:
            How many operations ran.

        Raises:
            DeviceError: The runtime is not in manual mode.
        """
        if not self._core.manual:
            raise DeviceError("step() needs a CpuSimRuntime created with manual=True")
        ran = 0
        while ran < n:
            with self._core.cv:
                if not self._queue or not self._is_ready(self._queue[0]):
                    break
                op = self._queue.popleft()
            self._execute(op)
            ran += 1
        return ran

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until everything enqueued before this call has completed; raise a sticky error.

        In manual mode nothing progresses unless some thread calls `step`.

        Raises:
            DeadlineExceeded: Work still pending after ``timeout`` (None: `DEFAULT_TIMEOUT_S`).
            BatchCopyError: A copy on this stream failed since the last synchronize.
        """
        with self._core.cv:
            target = self._enqueued
            if self._completed < target:  # the common idle case skips building the deadline and predicate
                self._core.wait_for(lambda: self._completed >= target, timeout, f"stream {self.name}")
            error, self._error = self._error, None
        if error is not None:
            raise error

    def join(self, timeout: float) -> bool:
        """Join the worker thread (after the runtime set ``closing``); True if it ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- internals (the lock is held where the name ends in _locked) -------------------------------

    def _check_open_locked(self, label: str) -> None:
        if self._core.closing:
            raise DeviceError(f"cannot enqueue {label} on stream {self.name}: the runtime is closed")

    def _is_ready(self, op: _Op) -> bool:
        return op.ready is None or op.ready()

    def _execute(self, op: _Op) -> None:
        """Run one popped operation outside the lock, then count it complete."""
        error: AscendDistError | None = None
        try:
            op.run()
        except AscendDistError as exc:
            error = exc
        except Exception as exc:
            error = DeviceError(f"{op.label} failed on stream {self.name}: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        with self._core.cv:
            if error is not None:
                self._set_error_locked(error)
            self._completed += 1
            self._core.cv.notify_all()

    def _set_error_locked(self, error: AscendDistError) -> None:
        if self._error is None:
            self._error = error
        else:
            logger.warning("stream %s: further error while one is pending: %s", self.name, error)

    def _drop_head_locked(self, error: AscendDistError) -> None:
        op = self._queue.popleft()
        logger.warning("stream %s: dropped %s: %s", self.name, op.label, error)
        self._set_error_locked(error)
        self._completed += 1
        self._core.cv.notify_all()

    def _next_op_locked(self) -> _Op | None:
        """Block until the head operation may run and pop it; None when the worker should exit."""
        while True:
            if not self._queue:
                if self._core.closing or not threading.main_thread().is_alive():
                    return None
                self._core.cv.wait(_IDLE_POLL_S)
                continue
            head = self._queue[0]
            if self._is_ready(head):
                return self._queue.popleft()
            if self._core.closing:
                self._drop_head_locked(DeviceError(f"runtime closed while {head.label} was blocked"))
                continue
            now = time.monotonic()
            if head.deadline is None:
                head.deadline = now + self._core.wait_timeout_s
            if now >= head.deadline:
                self._drop_head_locked(
                    DeadlineExceeded(f"{head.label} on stream {self.name} blocked > {self._core.wait_timeout_s:g} s")
                )
                continue
            self._core.cv.wait(head.deadline - now)

    def _worker(self) -> None:
        """Thread body: run operations in FIFO order until the runtime closes and the queue is empty."""
        while True:
            with self._core.cv:
                op = self._next_op_locked()
            if op is None:
                return
            self._execute(op)
