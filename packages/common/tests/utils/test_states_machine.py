"""Generic state machines: checked transitions, terminal states, table validation, keyed tables."""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Mapping

import pytest

from ascend_dist.common.errors import ConfigError, InvalidTransition
from ascend_dist.common.states import StateMachine, StateTable, validate_table


class Recv(enum.Enum):
    WAITING = enum.auto()
    PULLING = enum.auto()
    DONE = enum.auto()
    FAILED = enum.auto()


class Other(enum.Enum):
    X = enum.auto()


TABLE: Mapping[Recv, frozenset[Recv]] = {
    Recv.WAITING: frozenset({Recv.PULLING, Recv.FAILED}),
    Recv.PULLING: frozenset({Recv.DONE, Recv.FAILED}),
    Recv.DONE: frozenset(),
    Recv.FAILED: frozenset(),
}


def test_machine_follows_the_table_and_logs_each_move(caplog: pytest.LogCaptureFixture) -> None:
    machine = StateMachine(TABLE, Recv.WAITING, key="req-1")
    assert machine.state is Recv.WAITING
    assert machine.can(Recv.PULLING) and not machine.can(Recv.DONE)
    with caplog.at_level(logging.DEBUG, logger="ascend_dist.common.states"):
        assert machine.advance(Recv.PULLING) is Recv.WAITING
        machine.advance(Recv.DONE)
    assert machine.state is Recv.DONE
    assert [r.getMessage() for r in caplog.records] == [
        "key=req-1 WAITING -> PULLING",
        "key=req-1 PULLING -> DONE",
    ]


def test_illegal_transition_names_key_and_states_and_changes_nothing() -> None:
    machine = StateMachine(TABLE, Recv.WAITING, key="req-7")
    with pytest.raises(InvalidTransition) as info:
        machine.advance(Recv.DONE)
    assert (info.value.key, info.value.old, info.value.new) == ("req-7", Recv.WAITING, Recv.DONE)
    assert "req-7" in str(info.value)
    assert machine.state is Recv.WAITING


def test_self_transition_is_illegal_unless_listed() -> None:
    machine = StateMachine(TABLE, Recv.PULLING, key=1)
    with pytest.raises(InvalidTransition):
        machine.advance(Recv.PULLING)


@pytest.mark.parametrize("terminal", [Recv.DONE, Recv.FAILED])
def test_terminal_states_have_no_exit(terminal: Recv) -> None:
    machine = StateMachine(TABLE, terminal, key="r")
    assert machine.is_terminal
    for target in Recv:
        assert not machine.can(target)
        with pytest.raises(InvalidTransition):
            machine.advance(target)
    assert not StateMachine(TABLE, Recv.WAITING, key="r").is_terminal


def test_validate_table_returns_the_enum() -> None:
    assert validate_table(TABLE) is Recv


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({}, "table"),
        ({Recv.WAITING: frozenset()}, "table"),  # missing members
        ({**TABLE, Other.X: frozenset()}, "table"),  # mixed enums
        ({**TABLE, Recv.DONE: frozenset({Other.X})}, "table[DONE]"),  # target not a member
        ({**TABLE, Recv.DONE: {Recv.FAILED}}, "table[DONE]"),  # not a frozenset
        ({"a": frozenset()}, "table"),  # not an enum
    ],
)
def test_validate_table_rejects_malformed_tables(table: Mapping[Recv, frozenset[Recv]], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_table(table)
    assert info.value.field == field


def test_machine_rejects_initial_state_from_another_enum() -> None:
    with pytest.raises(ConfigError) as info:
        StateMachine(TABLE, Other.X, key="r")  # type: ignore[arg-type]
    assert info.value.field == "initial"


def test_state_table_tracks_many_keys() -> None:
    table = StateTable(TABLE, name="recv")
    table.add("a", Recv.WAITING)
    table.add("b", Recv.WAITING)
    table.add("c", Recv.PULLING)
    assert len(table) == 3 and "a" in table and "z" not in table
    assert table.advance("a", Recv.PULLING) is Recv.WAITING
    assert table.in_state(Recv.PULLING) == ["a", "c"]
    assert table.in_state(Recv.WAITING) == ["b"]
    assert table.state("a") is Recv.PULLING
    assert table.get("z") is None
    assert table.can("b", Recv.FAILED) and not table.can("b", Recv.DONE) and not table.can("z", Recv.DONE)
    table.advance("c", Recv.FAILED)
    assert table.pop("c") is Recv.FAILED
    assert table.keys() == ["a", "b"]


def test_state_table_errors() -> None:
    table = StateTable(TABLE)
    table.add("a", Recv.WAITING)
    with pytest.raises(InvalidTransition) as info:
        table.add("a", Recv.PULLING)  # already tracked
    assert info.value.old is Recv.WAITING
    assert table.state("a") is Recv.WAITING
    with pytest.raises(InvalidTransition):
        table.advance("a", Recv.DONE)
    with pytest.raises(KeyError):
        table.advance("missing", Recv.PULLING)
    with pytest.raises(KeyError):
        table.pop("missing")
    with pytest.raises(ConfigError):
        StateTable({Recv.WAITING: frozenset()})


def test_state_table_is_thread_safe() -> None:
    table = StateTable(TABLE)
    for i in range(200):
        table.add(i, Recv.WAITING)
    wins: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for i in range(200):
            try:
                table.advance(i, Recv.PULLING)
            except InvalidTransition:
                continue
            with lock:
                wins.append(i)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert sorted(wins) == list(range(200)), "each key moved exactly once despite four racing threads"
    assert len(table.in_state(Recv.PULLING)) == 200
