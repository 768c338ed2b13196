"""Per-phase timing of our D receiver, taken from outside the product code (bench only).

Runs in: the ``ascend-dist bench pd-vllm`` process. `Probe.attach` wraps collaborators of a D
worker's ``Receiver`` (its lanes' queue and batch runner, its side-channel client, its engine and
its per-task report) in timing proxies that forward every call unchanged, so the connector runs its
own code. D reads in batches (one per P lane reader: every queued task, one ``Renew`` for the
batch's requests before the reads, then one engine call per request in turn, one more ``Renew``
only after a read past half the lease), so a batch's lease checks count for every request in it
and each engine read for the request it moves. Per request (P's request id, summed over its tasks):
queue wait (queued -> its batch starts), metadata fetch, lease checks, the reads of the requests its
batch read before it, its own engine time, planning and bookkeeping (the rest of the batch's time
until the request was reported), and ``Done`` (sent by
the lane's DONE thread after the request was reported: off the read path, shown apart).
`RequestTimes.reported_at` is when the receiver marked the request's last task done, from which
the bench measures the gap until ``get_transfer_results`` reported it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PHASES", "Probe", "RequestTimes"]

PHASES = (
    "queue wait",
    "metadata",
    "lease check (Renew per batch)",
    "reads of earlier requests of its batch",
    "planning + bookkeeping",
    "engine read",
    "Done (DONE thread, after the report)",
)


@dataclass
class RequestTimes:
    """One request's phases in seconds (its tasks summed)."""

    queued_at: float = 0.0
    started_at: float = 0.0
    reported_at: float = 0.0
    metadata: float = 0.0
    renew: float = 0.0
    engine: float = 0.0
    behind: float = 0.0  # engine time of its batch's requests read before it (same thread)
    done: float = 0.0
    batch: int = 0  # requests in the batch that read it (the last one, for a request read in several)

    def phases(self) -> dict[str, float]:
        busy = max(0.0, self.reported_at - self.started_at)
        return {
            "queue wait": max(0.0, self.started_at - self.queued_at),
            "metadata": self.metadata,
            "lease check (Renew per batch)": self.renew,
            "reads of earlier requests of its batch": self.behind,
            "planning + bookkeeping": max(0.0, busy - self.metadata - self.renew - self.behind - self.engine),
            "engine read": self.engine,
            "Done (DONE thread, after the report)": self.done,
        }


@dataclass
class Probe:
    """The timing proxies' shared record, keyed by P's request id."""

    requests: dict[str, RequestTimes] = field(default_factory=dict)
    _local: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, receiver: Any) -> None:
        """Wrap ``receiver``'s lanes, peers, engine and task report (same objects underneath)."""
        lanes = receiver._lanes
        receiver._lanes = _Lanes(lanes, self)
        run_batch = lanes._run_batch
        lanes._run_batch = lambda lane, batch: self._batch(run_batch, lane, batch)
        receiver._peers = _Peers(receiver._peers, self)
        receiver._engine = _Engine(receiver._engine, self)
        task_done = receiver._task_done
        receiver._task_done = lambda pull: self._reported(task_done, pull)
        read_held = receiver._read_held

        def reading(agent: Any, host: str, port: int, items: list[Any], trusted_until: float) -> None:
            self._reading([item.pull.meta.remote_request_id for item in items])
            read_held(agent, host, port, items, trusted_until)

        receiver._read_held = reading

    def clear(self) -> None:
        with self._lock:
            self.requests = {}

    def times(self, rid: str) -> RequestTimes:
        with self._lock:
            return self.requests.setdefault(rid, RequestTimes())

    def by_request(self) -> dict[str, RequestTimes]:
        with self._lock:
            return dict(self.requests)

    # ---- hooks -------------------------------------------------------------------------------------

    def queued(self, items: list[Any]) -> None:
        now = time.perf_counter()
        for pull, _ in items:
            t = self.times(pull.meta.remote_request_id)
            t.queued_at = t.queued_at or now

    def _batch(self, run: Callable[[Any, list[Any]], None], lane: Any, batch: list[Any]) -> None:
        now = time.perf_counter()
        rids = [pull.meta.remote_request_id for pull, _ in batch]
        for rid in rids:
            t = self.times(rid)
            t.started_at = t.started_at or now
            t.batch = len(set(rids))
        self._local.batch = rids
        self._local.batch_engine = 0.0
        try:
            run(lane, batch)
        finally:
            self._local.batch = []

    def _reported(self, task_done: Callable[[Any], None], pull: Any) -> None:
        try:
            task_done(pull)
        finally:
            self.times(pull.meta.remote_request_id).reported_at = time.perf_counter()

    def _reading(self, rids: list[str]) -> None:
        """The receiver starts reading ``rids`` (after their `Renew`): this thread's next engine reads are theirs."""
        self.add(rids, "behind", getattr(self._local, "batch_engine", 0.0))
        self.set_chunk(rids)

    def read_took(self, seconds: float) -> None:
        """An engine read on this thread ended: its requests' engine time, the batch's time so far."""
        self.add(self.chunk_rids(), "engine", seconds)
        self._local.batch_engine = getattr(self._local, "batch_engine", 0.0) + seconds

    def add(self, rids: list[str], phase: str, seconds: float) -> None:
        for rid in rids:
            t = self.times(rid)
            setattr(t, phase, getattr(t, phase) + seconds)

    def batch_rids(self) -> list[str]:
        return list(getattr(self._local, "batch", []))

    def chunk_rids(self) -> list[str]:
        """The requests the receiver is reading on this thread (what the next engine read moves)."""
        return list(getattr(self._local, "chunk", []))

    def set_chunk(self, rids: list[str]) -> None:
        self._local.chunk = rids


class _Lanes:
    """The receiver's ``Lanes``: every queued task stamped with its queueing time."""

    def __init__(self, inner: Any, probe: Probe) -> None:
        self._inner = inner
        self._probe = probe

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def queue(self, lane: Any, items: list[Any]) -> None:
        self._probe.queued(items)
        self._inner.queue(lane, items)


class _Peers:
    """The side-channel client: ``metadata``, ``renew`` and ``send_dones`` timed per request."""

    def __init__(self, inner: Any, probe: Probe) -> None:
        self._inner = inner
        self._probe = probe

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def metadata(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._inner.metadata(*args, **kwargs)
        finally:
            self._probe.add(self._probe.batch_rids(), "metadata", time.perf_counter() - start)

    def renew(self, host: str, port: int, requests: list[Any], **kwargs: Any) -> list[float | None]:
        rids = [ask.request_id for ask in requests]
        start = time.perf_counter()
        try:
            return self._inner.renew(host, port, requests, **kwargs)
        finally:
            self._probe.add(rids, "renew", time.perf_counter() - start)

    def send_dones(self, host: str, port: int, items: list[Any]) -> None:
        start = time.perf_counter()
        try:
            self._inner.send_dones(host, port, items)
        finally:
            self._probe.add([i.request_id for i in items], "done", time.perf_counter() - start)


class _Engine:
    """The engine: each ``read`` timed for the requests of the chunk it moves."""

    def __init__(self, inner: Any, probe: Probe) -> None:
        self._inner = inner
        self._probe = probe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            self._inner.read(*args, **kwargs)
        finally:
            self._probe.read_took(time.perf_counter() - start)
