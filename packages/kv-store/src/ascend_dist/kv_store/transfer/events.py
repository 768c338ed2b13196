"""KV events (``BlockStored``) from the workers, aggregated on the scheduler.

Runs in: workers (collect) and the scheduler (aggregate). Upstream kept only events seen by every
worker, which dropped events of chunks stored by one rank of a replica set (MLA, ``put_step > 1``).
Here an event is kept once **any** worker reports it; duplicates from several ranks collapse into one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["BlockStoredEvent", "EventAggregator", "EventCollector"]


@dataclass(frozen=True)
class BlockStoredEvent:
    """One chunk put into the pool."""

    block_hash: bytes
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = "cpu"


class EventCollector:
    """Worker side: thread-safe list of events, drained once per step."""

    def __init__(self) -> None:
        """Create an empty collector."""
        self._events: list[BlockStoredEvent] = []
        self._lock = threading.Lock()

    def add(self, events: Iterable[BlockStoredEvent]) -> None:
        """Record events (called by the sending thread)."""
        with self._lock:
            self._events.extend(events)

    def drain(self) -> list[BlockStoredEvent]:
        """Return and forget the events recorded so far."""
        with self._lock:
            out, self._events = self._events, []
        return out


class EventAggregator:
    """Scheduler side: merges the workers' reports of one step, keeping first-seen order."""

    def __init__(self) -> None:
        """Create an empty aggregator."""
        self._seen: dict[BlockStoredEvent, None] = {}

    def add(self, events: Iterable[BlockStoredEvent]) -> None:
        """Merge one worker's events."""
        for event in events:
            self._seen.setdefault(event, None)

    def take(self) -> list[BlockStoredEvent]:
        """Return the merged events and reset."""
        out, self._seen = list(self._seen), {}
        return out
