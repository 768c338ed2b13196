"""Per-phase timing of our D receiver, taken from outside the product code (bench only).

Runs in: the ``ascend-dist bench pd-vllm`` process. `Probe.attach` swaps three collaborators of a
D worker's ``Receiver`` (its lane pool, side-channel client and engine) for timing proxies that
forward every call unchanged, so the connector runs its own code. Per task (one request's read
from one P rank) it records: queue wait (queued -> a lane thread starts it), metadata fetch,
lease checks (``Renew`` before and after the read), engine time (the ``batch_transfer_sync_read``
calls), ``Done``, and the rest of the task's own time (planning: ``task_batch``, checks and the
request table). `Probe.reads_done` is when the request's last task finished its reads (the
moment its ``Done`` starts, which the task sends after marking the request done), from which the
bench measures the gap until ``get_transfer_results`` reported the request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PHASES", "Probe", "TaskTimes"]

PHASES = ("queue wait", "metadata", "lease check (Renew x2)", "planning + bookkeeping", "engine read", "Done")


@dataclass
class TaskTimes:
    """One task's phases in seconds; ``request`` is P's request id (from its first ``Renew``)."""

    queued_at: float
    started_at: float = 0.0
    ended_at: float = 0.0
    request: str = ""
    metadata: float = 0.0
    renew: float = 0.0
    engine: float = 0.0
    done: float = 0.0
    done_started_at: float = 0.0

    def phases(self) -> dict[str, float]:
        busy = self.ended_at - self.started_at
        return {
            "queue wait": self.started_at - self.queued_at,
            "metadata": self.metadata,
            "lease check (Renew x2)": self.renew,
            "planning + bookkeeping": max(0.0, busy - self.metadata - self.renew - self.engine - self.done),
            "engine read": self.engine,
            "Done": self.done,
        }


@dataclass
class Probe:
    """The timing proxies' shared record."""

    tasks: list[TaskTimes] = field(default_factory=list)
    _local: threading.local = field(default_factory=threading.local)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach(self, receiver: Any) -> None:
        """Wrap ``receiver``'s lanes, peers and engine (same objects underneath)."""
        receiver._lanes = _Lanes(receiver._lanes, self)
        receiver._peers = _Timed(receiver._peers, self, {"metadata": "metadata", "renew": "renew", "send_done": "done"})
        receiver._engine = _Timed(receiver._engine, self, {"read": "engine"})

    def clear(self) -> None:
        with self._lock:
            self.tasks = []

    def current(self) -> TaskTimes | None:
        return getattr(self._local, "task", None)

    def run(self, job: Callable[[], None], queued_at: float) -> None:
        task = TaskTimes(queued_at, started_at=time.perf_counter())
        self._local.task = task
        try:
            job()
        finally:
            task.ended_at = time.perf_counter()
            self._local.task = None
            with self._lock:
                self.tasks.append(task)

    def by_request(self) -> dict[str, list[TaskTimes]]:
        with self._lock:
            out: dict[str, list[TaskTimes]] = {}
            for t in self.tasks:
                if t.request:
                    out.setdefault(t.request, []).append(t)
            return out


class _Lanes:
    """The receiver's ``Lanes``: every read job timed from its queueing."""

    def __init__(self, inner: Any, probe: Probe) -> None:
        self._inner = inner
        self._probe = probe

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def run(self, lane: Any, job: Callable[[], None], *, note: bool = False) -> None:
        if note:  # DONEs of timed-out requests: not a pull
            self._inner.run(lane, job, note=True)
            return
        queued_at = time.perf_counter()
        self._inner.run(lane, lambda: self._probe.run(job, queued_at))


class _Timed:
    """Forwards every attribute; the named methods add their duration to the running task's phase."""

    def __init__(self, inner: Any, probe: Probe, methods: dict[str, str]) -> None:
        self._inner = inner
        self._probe = probe
        self._methods = methods

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        phase = self._methods.get(name)
        if phase is None:
            return target

        def timed(*args: Any, **kwargs: Any) -> Any:
            task = self._probe.current()
            start = time.perf_counter()
            if task is not None and phase == "renew" and not task.request:
                task.request = str(args[2] if len(args) > 2 else kwargs.get("remote_request_id", ""))
            if task is not None and phase == "done":
                task.done_started_at = start
            try:
                return target(*args, **kwargs)
            finally:
                if task is not None:
                    setattr(task, phase, getattr(task, phase) + time.perf_counter() - start)

        return timed
