"""How long a read from each peer should take, so that its waiter sleeps through most of it.

Runs in: worker processes (`ascend_dist.kv_mooncake.core.engine.MooncakeEngine`). Mooncake's Python
binding waits for a batch only by polling its status in a loop that never sleeps
(``batch_transfer_sync_read`` and ``get_batch_transfer_status`` alike), so every thread waiting for
a read spins a core while Mooncake's own I/O threads move the bytes. On a host with few cores those
spinners take the CPU from the I/O threads and from the engine loop beside them. The engine
therefore submits a read without waiting, sleeps for most of the time the read is expected to take
and only then enters the spinning wait for the rest.

The expectation is deliberately optimistic: the fastest seconds per byte among the last reads from
that peer, times the read's bytes, times ``share``. A read never waits longer for this than it
would have taken at that rate, so a sleep adds latency only when the link became faster than every
recent read, and such a read teaches the sleep it took as its time (the engine tells an overslept
read by a status wait that did not spin), so the next sleep is shorter. Small reads, whose time is
mostly fixed cost, are slower per byte and so never set the rate; reads expected under
``min_sleep_s`` are not slept at all (one call, one wait).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

__all__ = ["TransferPace"]


@dataclass
class TransferPace:
    """The fastest recent seconds per byte per peer, and the sleep it allows before a spinning wait.

    Attributes:
        share: Part of the expected time slept (the rest is spent in Mooncake's spinning wait).
        window: Reads per peer the fastest rate is taken from; a slower link shows after this many.
        min_sleep_s: A read expected to take less than this is waited for at once: waking from the
            sleep means taking the interpreter lock once more, which waits up to Python's switch
            interval (5 ms) while the engine loop runs Python.
        max_sleep_s: Longest sleep before the spinning wait, whatever the estimate.
        max_peers: Peers remembered; the one heard from least recently is forgotten first (a P
            that restarts comes back under a new session, so the table would otherwise grow).
    """

    share: float = 0.85
    window: int = 16
    min_sleep_s: float = 0.005
    max_sleep_s: float = 0.25
    max_peers: int = 256
    _recent: dict[str, deque[float]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def sleep_s(self, peer: str, nbytes: int) -> float:
        """Seconds to sleep after submitting a read of ``nbytes`` from ``peer`` (0 to wait at once)."""
        with self._lock:
            recent = self._recent.get(peer)
            fastest = min(recent) if recent else None
        if fastest is None or nbytes <= 0:
            return 0.0
        expected = fastest * nbytes * self.share
        return 0.0 if expected < self.min_sleep_s else min(expected, self.max_sleep_s)

    def observe(self, peer: str, nbytes: int, elapsed_s: float) -> None:
        """Record a read that succeeded: ``nbytes`` from ``peer`` in ``elapsed_s`` from submit to end."""
        if nbytes <= 0 or elapsed_s <= 0:
            return
        with self._lock:
            recent = self._recent.pop(peer, None)
            if recent is None:
                recent = deque(maxlen=self.window)
                while len(self._recent) >= self.max_peers:
                    del self._recent[next(iter(self._recent))]
            self._recent[peer] = recent  # re-inserted: the dict's order is least recently heard first
            recent.append(elapsed_s / nbytes)
