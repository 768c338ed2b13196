"""D's per-peer lanes: each P instance gets its own queue, reader, DONE thread and breaker.

Runs in: D worker processes (the `Receiver` and its pool threads; thread-safe). One shared pool
let a hung P hold every receive thread, so pulls from healthy Ps queued behind it. A `Lane` per P
instance (engine id, host, base port) has its own queue of pull tasks, drained in batches by its
readers (``recv_workers``, default two: each takes up to ``max_batch`` queued tasks at once
and hands them to the receiver, which reads them in one engine call per P rank), and one thread for
DONEs (sent apart from the reads, batched per P rank), so a slow or dead P delays only its own
requests and one lane has one thread waiting on Mooncake, not one per request.

The breaker: once a P stops answering (an RPC past its deadline, a failed read), its lane is
*open* for ``peer_retry_s``; requests to it fail at once instead of each waiting out the RPC
retries. After that time one request is let through as a probe; while it runs the others still
fail fast. P's answer to the probe closes the lane (a "not held" is an answer too: P is alive), its
silence opens it again; a probe that ends without asking P hands the probe to the next request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from ascend_dist.kv_mooncake.core.affinity import move_current_thread

__all__ = ["Lane", "Lanes", "PeerKey"]

logger = logging.getLogger(__name__)

PeerKey = tuple[str, str, int]
"""``(remote_engine_id, remote_host, remote_port)``: one P instance (its base port)."""

_MAX_IDLE_LANES: Final = 16  # idle lanes beyond this are closed (a D may see many short-lived Ps)


class Lane:
    """One P instance's threads and breaker."""

    def __init__(
        self,
        key: PeerKey,
        workers: int,
        retry_s: float,
        clock: Callable[[], float],
        cpus: frozenset[int] | None = None,
    ) -> None:
        """Create the lane; threads start on demand, each moving to ``cpus`` first (None: stays put)."""
        self.key = key
        name = f"kv-pull-{key[0]}"[:24]
        # Started from the forward thread, they would inherit its core binding (`core.affinity`).
        start = {"initializer": move_current_thread, "initargs": (cpus,)}
        self.reads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, **start)
        self.notes = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-done", **start)
        self.jobs = 0  # queued or running jobs and tasks (guarded by `Lanes`' lock)
        self.queued: list[Any] = []  # tasks waiting for a reader (guarded by `Lanes`' lock)
        self.readers = 0  # readers draining `queued` (guarded by `Lanes`' lock)
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._probe: object | None = None  # the request probing a half-open lane

    @property
    def is_open(self) -> bool:
        """Whether requests to this peer fail fast now (it stopped answering)."""
        with self._lock:
            return self._probe is not None or self._clock() < self._open_until

    def admit(self, token: object) -> bool:
        """Whether a new request (``token``) may go to the peer; it becomes the probe of a half-open lane."""
        with self._lock:
            if self._probe is not None or self._clock() < self._open_until:
                return False
            if self._open_until:  # half-open: this request probes the peer
                self._probe = token
            return True

    def passes(self, token: object) -> bool:
        """Whether a task of ``token``'s request may still talk to the peer (the probe always may)."""
        with self._lock:
            return self._probe is token or (self._probe is None and self._clock() >= self._open_until)

    def answered(self, token: object) -> None:
        """The peer answered a request: a probe's success closes the lane."""
        with self._lock:
            if self._probe is token or self._probe is None:
                self._probe = None
                self._open_until = 0.0

    def failed(self, token: object) -> None:
        """The peer stopped answering: open the lane for ``retry_s`` (again, for a failed probe)."""
        with self._lock:
            if self._probe is token:
                self._probe = None
            if self._open_until <= self._clock():
                host, port = self.key[1:]
                logger.error("P %s:%d stopped answering: its requests fail fast for %.1f s", host, port, self._retry_s)
            self._open_until = self._clock() + self._retry_s

    def release(self, token: object) -> None:
        """``token``'s request ended without a verdict on the peer: if it was the probe, the next probes.

        It had nothing to read, or failed on D's side before P was asked.
        """
        with self._lock:
            if self._probe is token:
                self._probe = None

    def expired(self, token: object) -> None:
        """``token``'s request timed out: if it was the probe, P did not answer it (open again)."""
        with self._lock:
            probing = self._probe is token
        if probing:
            self.failed(token)

    def close(self) -> None:
        """Cancel queued jobs and join the threads (each running job is bounded by its deadline)."""
        self.reads.shutdown(wait=True, cancel_futures=True)
        self.notes.shutdown(wait=True, cancel_futures=True)


class Lanes:
    """The lanes of one D worker, created on first use and closed when idle and too many."""

    def __init__(
        self,
        workers: int,
        retry_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        run_batch: Callable[[Lane, list[Any]], None] = lambda lane, items: None,
        max_batch: int = 64,
        thread_cpus: frozenset[int] | None = None,
    ) -> None:
        """No lane yet; ``run_batch(lane, tasks)`` reads a batch of queued tasks (at most ``max_batch``).

        Every lane's threads run on ``thread_cpus`` (None: where they start).
        """
        self._workers = workers
        self._run_batch = run_batch
        self._max_batch = max_batch
        self._thread_cpus = thread_cpus
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._lanes: dict[PeerKey, Lane] = {}
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._lanes)

    def get(self, key: PeerKey) -> Lane:
        """The peer's lane (created now if needed)."""
        idle: list[Lane] = []
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = Lane(key, self._workers, self._retry_s, self._clock, self._thread_cpus)
                if len(self._lanes) > _MAX_IDLE_LANES:
                    idle = [x for x in self._lanes.values() if x is not lane and x.jobs == 0 and not x.is_open]
                    for x in idle:
                        del self._lanes[x.key]
        for x in idle:  # idle: their threads exit at once, so joining them here is quick
            x.close()
        return lane

    def run(self, lane: Lane, job: Callable[[], None], *, note: bool = False) -> None:
        """Run ``job`` on the lane's read threads (or its DONE thread when ``note``)."""
        with self._lock:
            if self._closed:
                return
            lane.jobs += 1

        def wrapped() -> None:
            try:
                job()
            finally:
                with self._lock:
                    lane.jobs -= 1

        (lane.notes if note else lane.reads).submit(wrapped)

    def queue(self, lane: Lane, tasks: Sequence[object]) -> None:
        """Queue pull tasks on the lane; a reader (started now if fewer than ``workers`` run) takes them."""
        with self._lock:
            if self._closed or not tasks:
                return
            lane.jobs += len(tasks)
            lane.queued.extend(tasks)
            # Running readers are inside a batch: start as many more as the queue fills (up to workers).
            start = min(self._workers - lane.readers, -(-len(lane.queued) // self._max_batch))
            lane.readers += start
        for _ in range(start):
            lane.reads.submit(self._drain, lane)

    def _drain(self, lane: Lane) -> None:
        """A reader: take what is queued (up to ``max_batch``), read it, again until the queue is empty."""
        while True:
            with self._lock:
                if not lane.queued or self._closed:
                    lane.readers -= 1
                    return
                batch, lane.queued = lane.queued[: self._max_batch], lane.queued[self._max_batch :]
            try:
                self._run_batch(lane, batch)
            except Exception:  # the receiver fails its tasks itself; this must not end the reader
                logger.exception("a pull batch of %d tasks to %s:%d raised", len(batch), *lane.key[1:])
            finally:
                with self._lock:
                    lane.jobs -= len(batch)

    def close(self) -> None:
        """Close every lane."""
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close()
