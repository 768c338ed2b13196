"""What peer authentication costs: time spent on deployment-secret cryptography in this process.

Runs in: every process that seals or checks side-channel frames (`ascend_dist.common.frame_auth`) or
signs or checks transfer capabilities (kv-mooncake's ``core.capability``). The P/D benchmark reads
it on both sides to show the cost beside the transfer it protects (issue 23 asks for under 2 %).
Counting takes two clock reads and one uncontended lock per operation (well under a microsecond),
against the 5-20 us an HMAC over a frame takes here.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

__all__ = ["AUTH_COST", "AuthCost", "AuthCostSnapshot"]


class AuthCostSnapshot(NamedTuple):
    """Totals since the process started: nanoseconds and operations (one MAC, one signature check...)."""

    ns: int
    ops: int

    def since(self, earlier: AuthCostSnapshot) -> AuthCostSnapshot:
        """What was spent between ``earlier`` and this snapshot."""
        return AuthCostSnapshot(self.ns - earlier.ns, self.ops - earlier.ops)


class AuthCost:
    """A thread-safe account of authentication work (use the process-wide `AUTH_COST`)."""

    def __init__(self) -> None:
        """Nothing spent yet."""
        self._lock = threading.Lock()
        self._ns = 0
        self._ops = 0

    @staticmethod
    def start() -> int:
        """The clock reading to pass to `add` when the operation ends."""
        return time.perf_counter_ns()

    def add(self, started_ns: int) -> None:
        """Count one operation that began at ``started_ns`` (from `start`) and ends now."""
        spent = time.perf_counter_ns() - started_ns
        with self._lock:
            self._ns += spent
            self._ops += 1

    def snapshot(self) -> AuthCostSnapshot:
        """The totals so far."""
        with self._lock:
            return AuthCostSnapshot(self._ns, self._ops)


AUTH_COST = AuthCost()
"""This process's account (frame MACs and capability signatures add to it)."""
