"""Explicit state machines: an enum, a transition table, and one checked `advance` per move.

Runs in: scheduler and worker processes (per-request and per-layer bookkeeping). This replaces
"membership in five dicts" bookkeeping: each tracked item has exactly one state, every move is
checked against a table, and every move is logged at DEBUG with the item's key.

A table maps each state to the frozenset of states it may move to; a state mapping to the empty
set is terminal. Example::

    class RecvState(enum.Enum):
        WAITING = enum.auto()
        PULLING = enum.auto()
        DONE = enum.auto()
        FAILED = enum.auto()

    RECV: Final[Mapping[RecvState, frozenset[RecvState]]] = {
        RecvState.WAITING: frozenset({RecvState.PULLING, RecvState.FAILED}),
        RecvState.PULLING: frozenset({RecvState.DONE, RecvState.FAILED}),
        RecvState.DONE: frozenset(),
        RecvState.FAILED: frozenset(),
    }
    requests = StateTable(RECV, name="recv")
    requests.add("req-1", RecvState.WAITING)
    requests.advance("req-1", RecvState.PULLING)

Time-outs are not hidden in here: callers feed them in as ordinary transitions (to ``FAILED``)
driven by an injected clock.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Hashable, Mapping
from typing import Generic, TypeVar

from ascend_dist.common.errors import ConfigError, InvalidTransition

__all__ = ["StateMachine", "StateTable", "TransitionTable", "validate_table"]

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=enum.Enum)

TransitionTable = Mapping[S, frozenset[S]]


def validate_table(table: Mapping[S, frozenset[S]]) -> type[S]:
    """Check that a transition table is complete and closed over one enum.

    Args:
        table: State -> states reachable in one move.

    Returns:
        The enum class of the states.

    Raises:
        ConfigError: The table is empty, mixes enums, misses an entry for some member, has a
            value that is not a frozenset, or names a target that is not a member.
    """
    if not table:
        raise ConfigError("table", {}, "one entry per member of a state enum")
    states = list(table)
    enum_cls = type(states[0])
    if not issubclass(enum_cls, enum.Enum) or any(type(s) is not enum_cls for s in states):
        raise ConfigError("table", states, "keys that are all members of one enum")
    missing = [m.name for m in enum_cls if m not in table]
    if missing:
        raise ConfigError("table", f"no entry for {', '.join(missing)}", f"an entry for every {enum_cls.__name__}")
    for state, targets in table.items():
        if not isinstance(targets, frozenset):
            raise ConfigError(f"table[{state.name}]", targets, "a frozenset of target states")
        strangers = [t for t in targets if type(t) is not enum_cls]
        if strangers:
            raise ConfigError(f"table[{state.name}]", strangers, f"members of {enum_cls.__name__}")
    return enum_cls


class StateMachine(Generic[S]):
    """The state of one tracked item (a request, a layer, a peer) and its checked transitions.

    Not locked: a machine has one owner. Use `StateTable` to share many machines across threads.
    """

    __slots__ = ("_enum", "_key", "_state", "_table")

    def __init__(self, table: Mapping[S, frozenset[S]], initial: S, *, key: Hashable, validate: bool = True) -> None:
        """Start a machine in ``initial``.

        Args:
            table: The transition table (see `validate_table`).
            initial: Starting state; must be a member of the table's enum.
            key: What the machine tracks (e.g. a request id); appears in logs and errors.
            validate: Check ``table`` now. `StateTable` validates once and passes False.

        Raises:
            ConfigError: The table is malformed or ``initial`` is not one of its states.
        """
        enum_cls = validate_table(table) if validate else type(next(iter(table)))
        if type(initial) is not enum_cls:
            raise ConfigError("initial", initial, f"a member of {enum_cls.__name__}")
        self._table = table
        self._enum = enum_cls
        self._key = key
        self._state = initial

    @property
    def key(self) -> Hashable:
        """What this machine tracks."""
        return self._key

    @property
    def state(self) -> S:
        """The current state."""
        return self._state

    @property
    def is_terminal(self) -> bool:
        """Whether no transition leaves the current state."""
        return not self._table[self._state]

    def can(self, new: S) -> bool:
        """Whether moving to ``new`` is allowed from the current state."""
        return new in self._table[self._state]

    def advance(self, new: S) -> S:
        """Move to ``new``.

        Args:
            new: Target state.

        Returns:
            The state left behind.

        Raises:
            InvalidTransition: The table does not allow ``current -> new`` (a caller bug; the state
                is unchanged).
        """
        old = self._state
        if new not in self._table[old]:
            raise InvalidTransition(self._key, old, new)
        self._state = new
        logger.debug("key=%s %s -> %s", self._key, old.name, new.name)
        return old

    def __repr__(self) -> str:
        return f"StateMachine(key={self._key!r}, state={self._state.name})"


class StateTable(Generic[S]):
    """Many keyed `StateMachine` instances over one table; every method is thread-safe."""

    def __init__(self, table: Mapping[S, frozenset[S]], *, name: str = "state") -> None:
        """Create an empty collection.

        Args:
            table: The shared transition table, validated once here.
            name: Label for log lines (e.g. ``"recv"``).

        Raises:
            ConfigError: The table is malformed.
        """
        validate_table(table)
        self._table = table
        self._name = name
        self._machines: dict[Hashable, StateMachine[S]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._machines)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._machines

    def add(self, key: Hashable, initial: S) -> None:
        """Start tracking ``key`` in ``initial``.

        Raises:
            InvalidTransition: ``key`` is already tracked (reported as a move from its current
                state to ``initial``; nothing changes).
            ConfigError: ``initial`` is not a member of the table's enum.
        """
        with self._lock:
            existing = self._machines.get(key)
            if existing is not None:
                raise InvalidTransition(key, existing.state, initial)
            self._machines[key] = StateMachine(self._table, initial, key=key, validate=False)
        logger.debug("%s key=%s added in %s", self._name, key, initial.name)

    def state(self, key: Hashable) -> S:
        """The current state of ``key``.

        Raises:
            KeyError: ``key`` is not tracked.
        """
        with self._lock:
            return self._machines[key].state

    def get(self, key: Hashable) -> S | None:
        """The current state of ``key``, or None if it is not tracked."""
        with self._lock:
            machine = self._machines.get(key)
            return None if machine is None else machine.state

    def can(self, key: Hashable, new: S) -> bool:
        """Whether ``key`` is tracked and may move to ``new``."""
        with self._lock:
            machine = self._machines.get(key)
            return machine is not None and machine.can(new)

    def advance(self, key: Hashable, new: S) -> S:
        """Move ``key`` to ``new``; returns the state left behind.

        Raises:
            KeyError: ``key`` is not tracked.
            InvalidTransition: The table forbids the move (the state is unchanged).
        """
        with self._lock:
            return self._machines[key].advance(new)

    def pop(self, key: Hashable) -> S:
        """Stop tracking ``key`` and return its last state.

        Raises:
            KeyError: ``key`` is not tracked.
        """
        with self._lock:
            machine = self._machines.pop(key)
        logger.debug("%s key=%s removed in %s", self._name, key, machine.state.name)
        return machine.state

    def in_state(self, state: S) -> list[Hashable]:
        """Keys currently in ``state``, in the order they were added (a snapshot)."""
        with self._lock:
            return [k for k, m in self._machines.items() if m.state is state]

    def keys(self) -> list[Hashable]:
        """All tracked keys, in the order they were added (a snapshot)."""
        with self._lock:
            return list(self._machines)
