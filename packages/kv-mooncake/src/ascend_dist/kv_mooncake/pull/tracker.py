"""P's bookkeeping of lent blocks: each finished request waits for D's DONEs under a lease.

Runs in: P worker processes (fed by the side-channel server thread and the model-runner thread).
Each request has one state in an explicit table. A request D pulls from this rank waits for as
many DONEs as D tasks pull from it (computed per request, never cached per engine); if they do
not come before its lease ends, its blocks are force-freed. D extends a lease with `Renew`. DONEs
count once per sender (D rank and task): the RPC client resends a DONE whose reply timed out, and
counting the copy would free blocks another D rank still reads. DONEs for unknown or already-freed
requests are harmless. A request that ends on P without lending its blocks (stopped, aborted) is
dropped; one still in P's batch after ``processing_s`` (its end never reached this worker) is
dropped too, so `renew` never answers "held" forever.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Hashable
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

    def __init__(
        self, lease_s: float, *, processing_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Create an empty tracker; ``clock`` is injectable for tests.

        Args:
            lease_s: How long a finished request's blocks wait for D's DONEs (renewed by `renew`).
            processing_s: How long a request may stay in P's batch before it is forgotten (its
                end was lost); default ``lease_s``.
            clock: Monotonic seconds.
        """
        self._lease_s = lease_s
        self._processing_s = lease_s if processing_s is None else processing_s
        self._clock = clock
        self._lock = threading.Lock()
        self._states: StateTable[SendState] = StateTable(SEND_TRANSITIONS, name="send")
        self._expected: dict[str, int] = {}
        self._senders: dict[str, set[Hashable]] = {}  # DONE senders seen (AWAITING_DONE and early ones)
        self._deadline: dict[str, float] = {}
        self._processing_until: dict[str, float] = {}
        self._expired = 0
        self._late_dones = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._states) + len(self._senders) + len(self._processing_until)

    @property
    def expired_count(self) -> int:
        """Requests force-freed by an expired lease since start."""
        return self._expired

    @property
    def late_dones(self) -> int:
        """DONEs for requests already freed or never seen since start (too low a fan-in shows here)."""
        return self._late_dones

    def add_processing(self, request_id: str) -> None:
        """A request entered (or is again in) a batch on this rank; its processing deadline restarts."""
        with self._lock:
            if request_id not in self._states:
                self._states.add(request_id, SendState.PROCESSING)
            if self._states.state(request_id) is SendState.PROCESSING:
                self._processing_until[request_id] = self._clock() + self._processing_s

    def drop(self, request_id: str) -> None:
        """The request ended on P without lending its blocks (stopped, aborted): forget it.

        Only a request still ``PROCESSING`` is dropped; one already lent keeps its lease.
        """
        with self._lock:
            if self._states.get(request_id) is SendState.PROCESSING:
                self._forget_processing(request_id)

    def _forget_processing(self, request_id: str) -> None:
        self._states.pop(request_id)
        self._senders.pop(request_id, None)
        self._processing_until.pop(request_id, None)

    def add_delayed(self, request_id: str, expected_dones: int) -> None:
        """The request finished on P; hold its blocks until ``expected_dones`` DONEs or lease end."""
        with self._lock:
            if request_id not in self._states:
                self._states.add(request_id, SendState.PROCESSING)
            if self._states.state(request_id) is not SendState.PROCESSING:
                return
            self._processing_until.pop(request_id, None)
            senders = self._senders.setdefault(request_id, set())
            if expected_dones <= len(senders):
                self._senders.pop(request_id, None)
                self._states.advance(request_id, SendState.FINISHED)
                return
            self._expected[request_id] = expected_dones
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

    def done(self, request_id: str, sender: Hashable = "") -> bool:
        """Count one DONE from ``sender`` (once per sender); return whether the request was known.

        ``sender`` names the D task that sent it (D rank, CP rank and shard): a resent copy of its
        DONE (an RPC retry after a lost reply) is the same sender and is not counted again.
        """
        with self._lock:
            state = self._states.get(request_id)
            if state is SendState.AWAITING_DONE:
                senders = self._senders.setdefault(request_id, set())
                senders.add(sender)
                if len(senders) >= self._expected[request_id]:
                    self._finish(request_id)
                return True
            if state is SendState.PROCESSING:
                # DONE before the delayed-free notice reached this worker: remember its sender.
                self._senders.setdefault(request_id, set()).add(sender)
                return True
            logger.debug("DONE for unknown or finished request %s ignored", request_id)
            self._late_dones += 1
            return False

    def _finish(self, request_id: str) -> None:
        self._expected.pop(request_id, None)
        self._senders.pop(request_id, None)
        self._deadline.pop(request_id, None)
        self._states.advance(request_id, SendState.FINISHED)

    def take_finished(self) -> set[str]:
        """Requests whose blocks may be freed now (DONE complete or lease expired); forgets them.

        A request ``PROCESSING`` past its deadline is forgotten without being returned (P's
        scheduler never lent its blocks, so there is nothing to free).
        """
        now = self._clock()
        with self._lock:
            for rid, until in list(self._processing_until.items()):
                if now >= until:
                    logger.warning("request %s: in the batch %.1f s, no end seen; forgotten", rid, self._processing_s)
                    self._forget_processing(rid)
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
