"""P's bookkeeping of lent blocks: each finished request waits for D's DONEs under a lease.

Runs in: P worker processes (fed by the side-channel server thread and the model-runner thread).
Each request has one state in an explicit table. A request D pulls from this rank waits for as
many DONEs as D tasks pull from it (computed per request, never cached per engine); if they do
not come before its lease ends, its blocks are force-freed. D extends a lease with `Renew`. DONEs
count once per sender (D rank and task): the RPC client resends a DONE whose reply timed out, and
counting the copy would free blocks another D rank still reads. Each such sender slot is bound to
the first reader (a D pull's token) that renews it or sends its DONE: a `renew` or DONE naming
another reader (the same params replayed to a second D request) is refused, so the blocks stay
lent until the bound reader is done or the lease ends. DONEs for unknown or already-freed
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
        self._readers: dict[str, dict[Hashable, str]] = {}  # sender slot -> the reader bound to it
        self._deadline: dict[str, float] = {}
        self._processing_until: dict[str, float] = {}
        self._expired = 0
        self._late_dones = 0
        self._refused_readers = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._states) + len(self._senders) + len(self._processing_until) + len(self._readers)

    @property
    def expired_count(self) -> int:
        """Requests force-freed by an expired lease since start."""
        return self._expired

    @property
    def late_dones(self) -> int:
        """DONEs for requests already freed or never seen since start (too low a fan-in shows here)."""
        return self._late_dones

    @property
    def refused_readers(self) -> int:
        """Renewals and DONEs refused since start because another reader holds the slot (replayed params)."""
        return self._refused_readers

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
        self._readers.pop(request_id, None)
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

    def renew(self, request_id: str, sender: Hashable = "", reader: str = "") -> bool:
        """Whether this rank still holds the request's blocks for ``reader`` (extending the lease).

        A request still in P's batch is held too: D may reach P before P's worker has seen the
        delayed-free notice. A finished, expired or never-seen request is not, so D must not read it;
        nor is one whose ``sender`` slot is bound to another reader (nothing is extended then).
        """
        return self.lease(request_id, sender, reader) is not None

    def lease(self, request_id: str, sender: Hashable = "", reader: str = "") -> float | None:
        """`renew`, answering what P promises D in one step: None if not held, else `held_for`."""
        with self._lock:
            state = self._states.get(request_id)
            if state not in (SendState.PROCESSING, SendState.AWAITING_DONE) or not self._bind(
                request_id, sender, reader
            ):
                return None
            if state is SendState.PROCESSING:
                return 0.0
            self._deadline[request_id] = self._clock() + self._lease_s
            return self._lease_s

    def held_for(self, request_id: str) -> float:
        """Seconds from now this rank keeps the request's blocks at the least (its lease's rest).

        0 for a request not lent yet (its lease has not begun: its end on P decides) or not held.
        """
        with self._lock:
            deadline = self._deadline.get(request_id)
            return 0.0 if deadline is None else max(0.0, deadline - self._clock())

    def _bind(self, request_id: str, sender: Hashable, reader: str) -> bool:
        """Bind ``sender``'s slot of a known request to ``reader`` unless bound; whether it is ``reader``'s."""
        bound = self._readers.setdefault(request_id, {}).setdefault(sender, reader)
        if bound != reader:
            self._refused_readers += 1
            logger.debug("request %s: slot %s is bound to another reader than %.8s", request_id, sender, reader)
        return bound == reader

    def done(self, request_id: str, sender: Hashable = "", reader: str = "") -> bool:
        """Count one DONE from ``sender`` (once per sender); return whether it counted or was known.

        ``sender`` names the D task that sent it (D rank, CP rank and shard): a resent copy of its
        DONE (an RPC retry after a lost reply) is the same sender and is not counted again. A DONE
        from a reader other than the one ``sender``'s slot is bound to is not counted (False).
        """
        with self._lock:
            state = self._states.get(request_id)
            if state in (SendState.PROCESSING, SendState.AWAITING_DONE) and not self._bind(request_id, sender, reader):
                return False
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
        self._readers.pop(request_id, None)
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
                self._readers.pop(rid, None)  # finished straight from add_delayed: never via _finish
            return out
