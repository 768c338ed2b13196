"""A byte-bounded, two-lane queue between a server's socket thread and its handler thread.

Runs in: every `ascend_dist.common.zmq_server.RpcServer`. The socket thread drains the socket at
once and puts each request here; a request that does not fit its lane's byte budget is refused on
the spot (the server drops it, the client times out and retries). So memory held by queued
requests is bounded by the budgets whatever peers send, and ZMQ's own buffers stay near empty.

Two lanes, because the side channels' real traffic is small (handshakes, renewals, DONEs, lookups
of short prompts): requests up to ``small_bytes`` go to the small lane, larger ones to the bulk
lane, each with its own budget. A flood of large frames then fills only the bulk lane, and the
handler takes small requests first (one bulk request after every ``_BULK_EVERY`` small ones, so
bulk traffic still progresses under a flood of small requests).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Final, Generic, TypeVar

from ascend_dist.common.errors import ConfigError

__all__ = ["FrameQueue"]

T = TypeVar("T")

# Bookkeeping bytes charged per queued request, so that a flood of empty frames is bounded too.
ITEM_OVERHEAD: Final = 256
_BULK_EVERY: Final = 8


class FrameQueue(Generic[T]):
    """FIFO per lane, bounded in bytes; thread-safe (one or more producers and consumers)."""

    def __init__(self, *, small_budget: int, bulk_budget: int, small_bytes: int) -> None:
        """Create the queue.

        Args:
            small_budget: Bytes the small lane may hold (item sizes plus `ITEM_OVERHEAD` each).
            bulk_budget: Bytes the bulk lane may hold.
            small_bytes: Largest item (in bytes) that goes to the small lane.

        Raises:
            ConfigError: A budget or ``small_bytes`` is not a positive int.
        """
        checked = (("small_budget", small_budget), ("bulk_budget", bulk_budget), ("small_bytes", small_bytes))
        for field, value in checked:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(field, value, "a positive int")
        self._budgets = (small_budget, bulk_budget)
        self._small_bytes = small_bytes
        self._lanes: tuple[deque[tuple[T, int]], deque[tuple[T, int]]] = (deque(), deque())
        self._held = [0, 0]
        self._smalls_in_a_row = 0
        self._refused = 0
        self._cond = threading.Condition()

    @property
    def queued_bytes(self) -> int:
        """Bytes charged for the requests queued now (both lanes)."""
        with self._cond:
            return self._held[0] + self._held[1]

    @property
    def refused(self) -> int:
        """Requests refused for lack of budget since start."""
        with self._cond:
            return self._refused

    def put(self, item: T, nbytes: int) -> bool:
        """Queue ``item`` of ``nbytes``; False (nothing queued) when its lane's budget is spent."""
        lane = 0 if nbytes <= self._small_bytes else 1
        cost = nbytes + ITEM_OVERHEAD
        with self._cond:
            if self._held[lane] + cost > self._budgets[lane]:
                self._refused += 1
                return False
            self._lanes[lane].append((item, cost))
            self._held[lane] += cost
            self._cond.notify()
            return True

    def get(self, timeout_s: float) -> T | None:
        """The next item (small lane first, see the module doc), or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not (self._lanes[0] or self._lanes[1]):
                left = deadline - time.monotonic()
                if (left <= 0 or not self._cond.wait(left)) and not (self._lanes[0] or self._lanes[1]):
                    return None
            bulk_turn = self._lanes[1] and (not self._lanes[0] or self._smalls_in_a_row >= _BULK_EVERY)
            lane = 1 if bulk_turn else 0
            self._smalls_in_a_row = 0 if lane else self._smalls_in_a_row + 1
            item, cost = self._lanes[lane].popleft()
            self._held[lane] -= cost
            return item

    def clear(self) -> int:
        """Drop every queued item; how many were dropped."""
        with self._cond:
            n = len(self._lanes[0]) + len(self._lanes[1])
            for lane in self._lanes:
                lane.clear()
            self._held = [0, 0]
            return n
