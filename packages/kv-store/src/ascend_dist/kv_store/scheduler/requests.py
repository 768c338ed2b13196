"""The scheduler side's per-request table: one `PoolRequest` record per request, one state each, checked moves.

Runs in: the scheduler process (vLLM's scheduler thread; the table takes no lock, like
`ascend_dist.common.states.StateMachine`, which each record holds).

A request's life as vLLM drives it (`KVPoolScheduler` makes the moves):

* ``WAITING``: the pool was asked (`PoolRequest.lookup` holds the answer) or the ask was skipped;
  vLLM has not allocated its blocks yet. A request vLLM puts back to waiting and asks about again
  (a preemption this table did not see) comes back here from ``RUNNING``.
* ``LOADING``: its blocks are allocated and its load is armed; an async load waits here until the
  workers finished it and vLLM schedules the request.
* ``RUNNING``: scheduled; `PoolRequest.tracker` follows its tokens and saves.
* ``PREEMPTED``: vLLM preempted it; its tracker is dropped until it is looked up or scheduled again.
* ``LOAD_FAILED``: the workers reported its async load failed; vLLM recomputes it.
* ``FINISHED_SAVING``: finished with saves that may still run; vLLM holds its blocks until the
  workers report them sent.
* ``DONE``: finished; the record leaves the table as it gets here.

Every move goes through `POOL_TRANSITIONS`; a move the table forbids raises `InvalidTransition`
and changes nothing (a caller bug, e.g. scheduling a request that already finished).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

from ascend_dist.common.errors import InvalidTransition
from ascend_dist.common.states import StateMachine, validate_table
from ascend_dist.kv_store.scheduler.plan import RequestTracker
from ascend_dist.kv_store.step_metadata import LoadSpec

__all__ = ["ENTRY_STATES", "LIVE_STATES", "POOL_TRANSITIONS", "Lookup", "PoolRequest", "PoolRequests", "PoolState"]


class PoolState(enum.Enum):
    """Where a request stands on the scheduler side."""

    WAITING = enum.auto()
    LOADING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    LOAD_FAILED = enum.auto()
    FINISHED_SAVING = enum.auto()
    DONE = enum.auto()


_S = PoolState
_END = frozenset({_S.FINISHED_SAVING, _S.DONE})  # vLLM may finish (or abort) a request in any live state
POOL_TRANSITIONS: Final = {
    # Asked again while still waiting (vLLM could not allocate its blocks last step).
    _S.WAITING: frozenset({_S.WAITING, _S.LOADING, _S.RUNNING, _S.PREEMPTED, _S.LOAD_FAILED}) | _END,
    # LOADING -> LOADING: vLLM allocates again for a deferred or resumed load.
    _S.LOADING: frozenset({_S.LOADING, _S.WAITING, _S.RUNNING, _S.PREEMPTED, _S.LOAD_FAILED}) | _END,
    # RUNNING -> RUNNING: resumed as new without a reported preemption. Never straight to LOADING:
    # a load needs a fresh lookup (-> WAITING) first.
    _S.RUNNING: frozenset({_S.RUNNING, _S.WAITING, _S.PREEMPTED}) | _END,
    _S.PREEMPTED: frozenset({_S.WAITING, _S.RUNNING}) | _END,
    # Scheduled straight from LOAD_FAILED when vLLM kept the valid prefix (no new lookup).
    _S.LOAD_FAILED: frozenset({_S.WAITING, _S.RUNNING, _S.PREEMPTED}) | _END,
    _S.FINISHED_SAVING: frozenset({_S.DONE}),
    _S.DONE: frozenset(),
}
validate_table(POOL_TRANSITIONS)
LIVE_STATES: Final = frozenset({_S.WAITING, _S.LOADING, _S.RUNNING, _S.PREEMPTED, _S.LOAD_FAILED})
ENTRY_STATES: Final = frozenset({_S.WAITING, _S.RUNNING, _S.LOAD_FAILED})


@dataclass
class Lookup:
    """What the pool lookup found for a waiting request (kept until vLLM schedules it)."""

    prompt: list[int]
    root: bytes
    hashes: list[bytes]
    load: LoadSpec | None = None
    block_ids: list[list[int]] = field(default_factory=list)
    tail: bytes | None = None


@dataclass(eq=False)
class PoolRequest:
    """One request's scheduler-side state and the data each state needs."""

    req_id: str
    initial: PoolState
    lookup: Lookup | None = None  # WAITING / LOADING: the lookup's answer and the armed load
    async_load: bool = False  # LOADING: an async load whose load-only metadata is not built yet
    tracker: RequestTracker | None = None  # RUNNING: tokens, blocks, hashes, saved progress
    root: bytes | None = None  # RUNNING: the hash chain's root (decode steps rehash from it)
    saved_any: bool = False  # some step saved for it (kept across preemption): hold its blocks at the end
    skip_next_lookup: bool = False  # its load failed: the next lookup answers 0 (vLLM recomputes, no loop)
    machine: StateMachine[PoolState] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.machine = StateMachine(POOL_TRANSITIONS, self.initial, key=self.req_id, validate=False)

    @property
    def state(self) -> PoolState:
        """The current state."""
        return self.machine.state

    def drop_working_data(self) -> None:
        """Forget the lookup, armed load and tracker (preempted or finished); keep what outlives them."""
        self.lookup, self.async_load, self.tracker, self.root = None, False, None, None


class PoolRequests:
    """The scheduler's requests by id; every move goes through `POOL_TRANSITIONS`."""

    def __init__(self) -> None:
        """Create an empty table."""
        self._records: dict[str, PoolRequest] = {}

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[PoolRequest]:
        return iter(list(self._records.values()))

    def get(self, req_id: str) -> PoolRequest | None:
        """The record of ``req_id``, or None when it is not in the table."""
        return self._records.get(req_id)

    def state(self, req_id: str) -> PoolState | None:
        """The state of ``req_id``, or None when it is not in the table."""
        record = self._records.get(req_id)
        return None if record is None else record.state

    def in_state(self, state: PoolState) -> list[PoolRequest]:
        """Records now in ``state``, in the order they entered the table."""
        return [r for r in self._records.values() if r.state is state]

    def enter(self, req_id: str, state: PoolState) -> PoolRequest:
        """Move ``req_id`` to ``state``, adding it when it is not in the table.

        A request enters in ``WAITING`` (looked up), ``RUNNING`` (scheduled without a lookup) or
        ``LOAD_FAILED`` (a failure report for an id the table does not hold).

        Raises:
            InvalidTransition: The table forbids the move, or ``state`` is no entry state (nothing changes).
        """
        record = self._records.get(req_id)
        if record is not None:
            self.move(record, state)
            return record
        if state not in ENTRY_STATES:
            raise InvalidTransition(req_id, None, state)
        record = PoolRequest(req_id, state)
        self._records[req_id] = record
        return record

    def move(self, record: PoolRequest, state: PoolState) -> None:
        """Move ``record`` to ``state``; at ``DONE`` it leaves the table.

        Raises:
            InvalidTransition: The table forbids the move (nothing changes, the record stays).
        """
        record.machine.advance(state)
        if state is PoolState.DONE:
            del self._records[record.req_id]
