"""P's bookkeeping of lent blocks: each finished request waits for D's DONEs under a lease.

Runs in: P worker processes (fed by the side-channel server thread and the model-runner thread).
Each request has one state in an explicit table. A request D pulls from this rank waits for as
many DONEs as D ranks pull from it (computed per request, never cached per engine); if they do
not come before its lease ends, its blocks are force-freed. D extends a lease with `Renew`. DONEs
for unknown, duplicate or already-freed requests are harmless.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from ascend_dist.common.states import StateTable

__all__ = ["SendState", "SendTracker"]

logger = logging.getLogger(__name__)


class SendState(enum.Enum):
    """Life of a request's blocks on one P worker."""

    PROCESSING = enum.auto()
    AWAITING_DONE = enum.auto()
    FINISHED = enum.auto()


SEND_TRANSITIONS: Final = {
    SendState.PROCESSING: frozenset({SendState.AWAITING_DONE, SendState.FINISHED}),
    SendState.AWAITING_DONE: frozenset({SendState.FINISHED}),
    SendState.FINISHED: frozenset(),
}


class SendTracker:
    """Thread-safe per-request state, DONE counts and leases of one P worker."""

    def __init__(self, lease_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        """Create an empty tracker; ``clock`` is injectable for tests."""
        self._lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._states: StateTable[SendState] = StateTable(SEND_TRANSITIONS, name="send")
        self._expected: dict[str, int] = {}
        self._dones: dict[str, int] = {}
        self._deadline: dict[str, float] = {}
        self._expired = 0
        self._late_dones = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._states) + len(self._dones)

    @property
    def expired_count(self) -> int:
        """Requests force-freed by an expired lease since start."""
        return self._expired

    @property
    def late_dones(self) -> int:
        """DONEs for requests already freed or never seen since start (too low a fan-in shows here)."""
        return self._late_dones

    def add_processing(self, request_id: str) -> None:
        """A request entered a batch on this rank (idempotent)."""
        with self._lock:
            if request_id not in self._states:
                self._states.add(request_id, SendState.PROCESSING)

    def add_delayed(self, request_id: str, expected_dones: int) -> None:
        """The request finished on P; hold its blocks until ``expected_dones`` DONEs or lease end."""
        with self._lock:
            if request_id not in self._states:
                self._states.add(request_id, SendState.PROCESSING)
            if self._states.state(request_id) is not SendState.PROCESSING:
                return
            early = self._dones.pop(request_id, 0)
            if expected_dones <= early:
                self._states.advance(request_id, SendState.FINISHED)
                return
            self._expected[request_id] = expected_dones - early
            self._deadline[request_id] = self._clock() + self._lease_s
            self._states.advance(request_id, SendState.AWAITING_DONE)

    def renew(self, request_id: str) -> bool:
        """Whether this rank still holds the request's blocks (extending a waiting request's lease).

        A request still in P's batch is held too: D may reach P before P's worker has seen the
        delayed-free notice. A finished, expired or never-seen request is not, so D must not read it.
        """
        with self._lock:
            state = self._states.get(request_id)
            if state is SendState.AWAITING_DONE:
                self._deadline[request_id] = self._clock() + self._lease_s
            return state in (SendState.PROCESSING, SendState.AWAITING_DONE)

    def done(self, request_id: str) -> bool:
        """Count one DONE; return whether the request was known."""
        with self._lock:
            state = self._states.get(request_id)
            if state is SendState.AWAITING_DONE:
                self._expected[request_id] -= 1
                if self._expected[request_id] <= 0:
                    self._finish(request_id)
                return True
            if state is SendState.PROCESSING:
                # DONE before the delayed-free notice reached this worker: remember it.
                self._dones[request_id] = self._dones.get(request_id, 0) + 1
                return True
            logger.debug("DONE for unknown or finished request %s ignored", request_id)
            self._late_dones += 1
            return False

    def _finish(self, request_id: str) -> None:
        self._expected.pop(request_id, None)
        self._deadline.pop(request_id, None)
        self._states.advance(request_id, SendState.FINISHED)

    def take_finished(self) -> set[str]:
        """Requests whose blocks may be freed now (DONE complete or lease expired); forgets them."""
        now = self._clock()
        with self._lock:
            for rid, deadline in list(self._deadline.items()):
                if now >= deadline:
                    logger.error(
                        "request %s: no DONE from D within the %.1f s lease; blocks force-freed", rid, self._lease_s
                    )
                    self._expired += 1
                    self._finish(rid)
            out = {str(k) for k in self._states.in_state(SendState.FINISHED)}
            for rid in out:
                self._states.pop(rid)
            return out
