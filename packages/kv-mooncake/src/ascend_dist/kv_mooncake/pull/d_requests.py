"""D's table of requests being pulled: one record per request, one state each, checked moves.

Runs in: D worker processes, under the `Receiver`'s lock (the table itself takes no lock, like
`ascend_dist.common.states.StateMachine`, which each record holds). It is D's counterpart of P's
`ascend_dist.kv_mooncake.pull.tracker`.

A request is ``PULLING`` while its tasks run. When the last one ends it is ``DONE`` (reported in
the next ``finished_recving``) or, if a read failed and may still write into its blocks (Mooncake
#4247), ``QUARANTINED`` until no read runs and ``quarantine_s`` has passed since the last failed
read. One still pulling at its deadline is failed and quarantined: its reads may still run. One
whose read still runs one more ``pull_timeout_s`` after the deadline is named once by
`DRequests.stuck`, so the receiver cuts its connections to that P (which ends the read), and stays
held until the read has returned: the blocks never go back to vLLM while a read into them runs. A failed
request, once reported finished, stays ``REPORTED`` until `DRequests.take_failed` names it. A
receive that only tells P to free (``notify_only``: vLLM no longer holds the request) is never
reported: it leaves the table instead of becoming ``DONE``.
"""

from __future__ import annotations

import enum
import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from ascend_dist.common.errors import InvalidTransition
from ascend_dist.common.states import StateMachine, validate_table
from ascend_dist.kv_mooncake.core.ranks import HeadSlice
from ascend_dist.kv_mooncake.pull.cp_plan import CpShard
from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta

__all__ = ["D_TRANSITIONS", "DRequest", "DRequests", "DState", "PullTask"]

logger = logging.getLogger(__name__)


class DState(enum.Enum):
    """Where a D request's pull stands."""

    PULLING = enum.auto()
    QUARANTINED = enum.auto()
    DONE = enum.auto()
    REPORTED = enum.auto()


D_TRANSITIONS: Final = {
    DState.PULLING: frozenset({DState.QUARANTINED, DState.DONE}),
    DState.QUARANTINED: frozenset({DState.DONE}),
    DState.DONE: frozenset({DState.REPORTED}),
    DState.REPORTED: frozenset(),
}
validate_table(D_TRANSITIONS)


@dataclass(eq=False)
class PullTask:
    """One read of a request from one P rank; ``notified`` once its DONE went (or was queued) to P."""

    global_rank: int
    shard: int
    notified: bool = False


@dataclass(eq=False)
class DRequest:
    """One request's pull: its plan, progress, deadline and failure."""

    meta: ReqMeta
    deadline: float
    pending: int = 0
    slices: list[HeadSlice] = field(default_factory=list)
    shards: list[CpShard] = field(default_factory=list)
    group_shards: list[list[CpShard]] = field(default_factory=list)
    pulled_layers: set[str] = field(default_factory=set)
    tasks: list[PullTask] = field(default_factory=list)
    failed: bool = False
    hold_until: float = 0.0
    sources: set[tuple[str, tuple[int, ...]]] = field(default_factory=set)
    """``(P host, its transport ports)`` of every read started for the request (what to cut if one hangs)."""
    severed: bool = False
    """Its connections were cut once because a read outlived the deadline and the grace."""
    reader: str = field(default_factory=lambda: secrets.token_hex(16))
    """The token this pull names itself with in each `Renew` and DONE (P serves one reader per slot)."""
    machine: StateMachine[DState] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.machine = StateMachine(D_TRANSITIONS, DState.PULLING, key=self.meta.request_id, validate=False)

    @property
    def request_id(self) -> str:
        """The request's id on D."""
        return self.meta.request_id

    @property
    def state(self) -> DState:
        """The current state."""
        return self.machine.state


class DRequests:
    """D's requests by id; every move goes through `D_TRANSITIONS` (`InvalidTransition` otherwise)."""

    def __init__(self, *, pull_timeout_s: float) -> None:
        """Create an empty table; ``pull_timeout_s`` is also the grace for a read that never returns."""
        self._grace_s = pull_timeout_s
        self._records: dict[str, DRequest] = {}

    def __len__(self) -> int:
        return len(self._records)

    def count(self, state: DState) -> int:
        """Requests now in ``state``."""
        return sum(1 for r in self._records.values() if r.state is state)

    def state(self, request_id: str) -> DState | None:
        """The state of ``request_id``, or None when it is not in the table."""
        record = self._records.get(request_id)
        return None if record is None else record.state

    def live(self, request_id: str) -> DRequest | None:
        """The record of ``request_id`` unless it is absent or merely awaiting `take_failed`."""
        record = self._records.get(request_id)
        return record if record is not None and record.state is not DState.REPORTED else None

    def start(self, record: DRequest) -> None:
        """Track a new pull (``PULLING``).

        Raises:
            InvalidTransition: The id is still tracked and not merely awaiting `take_failed`
                (vLLM pulls a request once; a stale failure report is replaced).
        """
        existing = self.live(record.request_id)
        if existing is not None:
            raise InvalidTransition(record.request_id, existing.state, DState.PULLING)
        self._records[record.request_id] = record

    def finish_now(self, record: DRequest) -> None:
        """A pull with nothing to read (a virtual transfer): straight to ``DONE``."""
        self.start(record)
        record.machine.advance(DState.DONE)

    def pulling(self, request_id: str) -> DRequest | None:
        """The record if it is still ``PULLING`` (a timed-out request's late tasks get None)."""
        record = self._records.get(request_id)
        return record if record is not None and record.state is DState.PULLING else None

    @staticmethod
    def hold(record: DRequest, until: float) -> None:
        """A read failed and may still write: keep the blocks at least until ``until``."""
        record.hold_until = max(record.hold_until, until)

    @staticmethod
    def fail(record: DRequest) -> bool:
        """Mark the request failed; False if it already was (its failure is reported once)."""
        if record.failed:
            return False
        record.failed = True
        return True

    def end(self, record: DRequest, now: float) -> None:
        """The request's last task ended: ``DONE``, ``QUARANTINED`` or, for ``notify_only``, gone.

        A record no longer ``PULLING`` (it timed out meanwhile) or replaced is left as it is.
        """
        if self._records.get(record.request_id) is not record or record.state is not DState.PULLING:
            return
        if record.failed and now < record.hold_until:
            record.machine.advance(DState.QUARANTINED)
        elif record.meta.notify_only:
            del self._records[record.request_id]
        else:
            record.machine.advance(DState.DONE)

    def expire(self, now: float) -> list[DRequest]:
        """Fail and quarantine every ``PULLING`` request past its deadline; returns them."""
        expired = [r for r in self._records.values() if r.state is DState.PULLING and now >= r.deadline]
        for record in expired:
            record.failed = True
            record.machine.advance(DState.QUARANTINED)
        return expired

    def stuck(self, now: float) -> list[DRequest]:
        """``QUARANTINED`` requests whose read still runs ``pull_timeout_s`` after their deadline.

        Each is named once: the caller cuts its connections (the blocks stay held until the read returns).
        """
        out = [
            r
            for r in self._records.values()
            if r.state is DState.QUARANTINED and r.pending > 0 and not r.severed and now >= r.deadline + self._grace_s
        ]
        for record in out:
            record.severed = True
        return out

    def _release(self, now: float) -> None:
        for record in [r for r in self._records.values() if r.state is DState.QUARANTINED]:
            if record.pending > 0:
                continue  # a read into its blocks still runs
            if record.meta.notify_only:
                del self._records[record.request_id]  # vLLM holds no blocks of it: nothing to report
            elif now >= record.hold_until:
                record.machine.advance(DState.DONE)

    def take_finished(self, now: float) -> set[str]:
        """Release what quarantine allows, then hand out every ``DONE`` request once.

        Succeeded ones leave the table; failed ones stay ``REPORTED`` for `take_failed`.
        """
        self._release(now)
        out: set[str] = set()
        for record in [r for r in self._records.values() if r.state is DState.DONE]:
            out.add(record.request_id)
            if record.failed:
                record.machine.advance(DState.REPORTED)
            else:
                del self._records[record.request_id]
        return out

    def take_failed(self, finished: Iterable[str]) -> set[str]:
        """Which of ``finished`` (from `take_finished`) failed; they leave the table."""
        out = {rid for rid in finished if self.state(rid) is DState.REPORTED}
        for rid in out:
            del self._records[rid]
        return out
