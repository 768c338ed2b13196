"""D's request table (`pull.d_requests`): every legal move, the illegal ones, deadlines and quarantine."""

from __future__ import annotations

import pytest

from ascend_dist.common.errors import InvalidTransition
from ascend_dist.kv_mooncake.pull.d_requests import D_TRANSITIONS, DRequest, DRequests, DState
from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta

TIMEOUT = 10.0


def _meta(rid: str, *, notify_only: bool = False) -> ReqMeta:
    return ReqMeta(
        request_id=rid,
        local_block_ids=[[] if notify_only else [1, 2]],
        remote_block_ids=[[5, 6]],
        num_computed_tokens=0,
        remote_request_id=f"p-{rid}",
        remote_engine_id="P",
        remote_host="127.0.0.1",
        remote_port=40000,
        remote_ptp_size=1,
        notify_only=notify_only,
    )


def _pull(table: DRequests, rid: str, *, pending: int = 1, notify_only: bool = False) -> DRequest:
    record = DRequest(_meta(rid, notify_only=notify_only), deadline=TIMEOUT, pending=pending)
    table.start(record)
    return record


def _finish_tasks(table: DRequests, record: DRequest, now: float) -> None:
    record.pending = 0
    table.end(record, now)


def test_the_table_is_closed_and_only_reported_is_terminal() -> None:
    assert set(D_TRANSITIONS) == set(DState)
    assert [s for s, targets in D_TRANSITIONS.items() if not targets] == [DState.REPORTED]


def test_pulling_to_done_to_gone() -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    record = _pull(table, "a")
    assert table.state("a") is DState.PULLING and table.pulling("a") is record
    _finish_tasks(table, record, now=1.0)
    assert table.state("a") is DState.DONE and table.pulling("a") is None
    assert table.take_finished(now=1.0) == {"a"}
    assert len(table) == 0 and table.take_finished(now=2.0) == set()  # reported once


def test_failed_without_hold_is_done_then_reported_until_taken() -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    record = _pull(table, "a")
    assert table.fail(record) and not table.fail(record)  # the failure counts once
    _finish_tasks(table, record, now=1.0)
    assert table.state("a") is DState.DONE
    assert table.take_finished(now=1.0) == {"a"}
    assert table.state("a") is DState.REPORTED
    assert table.take_failed({"b"}) == set() and table.take_failed({"a"}) == {"a"}
    assert len(table) == 0


def test_failed_read_quarantines_until_the_hold_ends() -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    record = _pull(table, "a")
    table.fail(record)
    table.hold(record, 3.0)
    table.hold(record, 2.0)  # a hold is only ever extended
    _finish_tasks(table, record, now=1.0)
    assert table.state("a") is DState.QUARANTINED and table.count(DState.QUARANTINED) == 1
    assert table.take_finished(now=2.9) == set()
    assert table.take_finished(now=3.0) == {"a"} and table.state("a") is DState.REPORTED


def test_deadline_fails_and_quarantines_until_the_reads_end() -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    record = _pull(table, "a", pending=2)
    assert table.expire(now=TIMEOUT - 0.1) == []
    assert table.expire(now=TIMEOUT) == [record]
    assert record.failed and table.state("a") is DState.QUARANTINED and table.pulling("a") is None
    table.end(record, now=TIMEOUT)  # a late task's end leaves a quarantined request alone
    assert table.state("a") is DState.QUARANTINED
    assert table.take_finished(now=TIMEOUT + 1) == set()  # reads still run
    record.pending = 0
    assert table.take_finished(now=TIMEOUT + 1) == {"a"}
    assert table.take_failed({"a"}) == {"a"}


def test_a_read_still_running_a_timeout_past_the_deadline_is_named_once_and_stays_held() -> None:
    """The blocks never go back while a read into them runs: past the deadline plus one more
    timeout the request is named once (the receiver cuts its connections), and only the read's
    return releases it (before, the table released it at that point with the read still running)."""
    table = DRequests(pull_timeout_s=TIMEOUT)
    record = _pull(table, "a", pending=1)
    table.expire(now=TIMEOUT)
    assert table.stuck(now=2 * TIMEOUT - 0.1) == []
    assert table.stuck(now=2 * TIMEOUT) == [record] and record.severed
    assert table.stuck(now=2 * TIMEOUT + 1) == []  # once
    assert table.take_finished(now=2 * TIMEOUT) == set()
    assert table.take_finished(now=100 * TIMEOUT) == set()  # however long the read runs
    table.hold(record, 100 * TIMEOUT + 1)  # it returned failed: the quarantine after a failed read
    record.pending = 0
    assert table.take_finished(now=100 * TIMEOUT) == set()
    assert table.take_finished(now=100 * TIMEOUT + 1) == {"a"}


def test_a_request_whose_reads_ended_is_never_named_stuck() -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    record = _pull(table, "a", pending=1)
    table.expire(now=TIMEOUT)
    record.pending = 0
    assert table.stuck(now=3 * TIMEOUT) == [] and not record.severed


def test_notify_only_is_never_reported() -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    quiet = _pull(table, "quiet", notify_only=True)
    _finish_tasks(table, quiet, now=1.0)
    held = _pull(table, "held", notify_only=True)
    table.fail(held)
    table.hold(held, 5.0)
    _finish_tasks(table, held, now=1.0)
    assert table.state("quiet") is None and table.state("held") is DState.QUARANTINED
    assert table.take_finished(now=1.0) == set() and len(table) == 0


def test_virtual_transfer_is_done_at_once() -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    table.finish_now(DRequest(_meta("v"), deadline=0.0))
    assert table.take_finished(now=0.0) == {"v"} and len(table) == 0


@pytest.mark.parametrize("state", [DState.PULLING, DState.QUARANTINED, DState.DONE])
def test_a_second_pull_of_a_live_request_is_refused(state: DState) -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    record = _pull(table, "a")
    if state is not DState.PULLING:
        record.machine.advance(state)
    with pytest.raises(InvalidTransition, match="a: illegal transition"):
        _pull(table, "a")
    assert table.state("a") is state


def test_a_reported_failure_is_replaced_by_a_new_pull() -> None:
    table = DRequests(pull_timeout_s=TIMEOUT)
    record = _pull(table, "a")
    table.fail(record)
    _finish_tasks(table, record, now=1.0)
    table.take_finished(now=1.0)
    _pull(table, "a")
    assert table.state("a") is DState.PULLING and table.take_failed({"a"}) == set()


@pytest.mark.parametrize(
    ("start", "target"),
    [(s, t) for s in DState for t in DState if t not in D_TRANSITIONS[s]],
    ids=lambda s: s.name,
)
def test_every_illegal_move_raises_and_changes_nothing(start: DState, target: DState) -> None:
    record = DRequest(_meta("a"), deadline=TIMEOUT)
    path = {
        DState.PULLING: [],
        DState.QUARANTINED: [DState.QUARANTINED],
        DState.DONE: [DState.DONE],
        DState.REPORTED: [DState.DONE, DState.REPORTED],
    }[start]
    for step in path:
        record.machine.advance(step)
    with pytest.raises(InvalidTransition):
        record.machine.advance(target)
    assert record.state is start


@pytest.mark.parametrize(("start", "target"), [(s, t) for s in DState for t in D_TRANSITIONS[s]], ids=lambda s: s.name)
def test_every_legal_move_is_allowed(start: DState, target: DState) -> None:
    record = DRequest(_meta("a"), deadline=TIMEOUT)
    for step in {DState.PULLING: [], DState.QUARANTINED: [DState.QUARANTINED], DState.DONE: [DState.DONE]}[start]:
        record.machine.advance(step)
    assert record.machine.advance(target) is start and record.state is target
