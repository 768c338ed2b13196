"""The scheduler's per-request table: every legal move made, every illegal one refused unchanged.

First the table on its own (each transition of `POOL_TRANSITIONS`, and each pair it leaves out),
then worked examples through `KVPoolScheduler` as vLLM drives it (pool lookups answered by a
plain function; the hit is what the test says).
"""

from __future__ import annotations

import itertools

import pytest

from ascend_dist.common.errors import InvalidTransition
from ascend_dist.kv_store import NewRequest, PoolConfig, PoolSpec, RunningRequest, StepInput, build_scheduler
from ascend_dist.kv_store.scheduler.requests import (
    ENTRY_STATES,
    POOL_TRANSITIONS,
    PoolRequests,
    PoolState,
)
from ascend_dist.kv_store.scheduler.scheduler import KVPoolScheduler

S = PoolState
SPEC = PoolSpec(model="/models/tiny/", block_sizes=(16,), num_kv_heads=2)
PROMPT = list(range(7000, 7050))  # 50 tokens: 3 whole chunks of 16


def _path_to(state: PoolState) -> list[PoolState]:
    """A legal route from an entry state to ``state`` (breadth-first over the table)."""
    routes = [[s] for s in ENTRY_STATES]
    seen = set(ENTRY_STATES)
    while routes:
        route = routes.pop(0)
        if route[-1] is state:
            return route
        for nxt in sorted(POOL_TRANSITIONS[route[-1]], key=lambda s: s.value):
            if nxt not in seen and nxt is not S.DONE:
                seen.add(nxt)
                routes.append([*route, nxt])
    raise AssertionError(f"{state} unreachable")


def _table_in(state: PoolState) -> PoolRequests:
    table = PoolRequests()
    route = _path_to(state)
    record = table.enter("r", route[0])
    for step in route[1:]:
        table.move(record, step)
    assert table.state("r") is state
    return table


LEGAL = [(a, b) for a, targets in POOL_TRANSITIONS.items() for b in sorted(targets, key=lambda s: s.value)]
ILLEGAL = [(a, b) for a, b in itertools.product(list(S), list(S)) if b not in POOL_TRANSITIONS[a] and a is not S.DONE]


def test_every_state_is_reachable_and_the_table_forbids_something() -> None:
    # Controls for the two parametrised tests below: neither list may be empty or partial.
    assert {a for a, _ in LEGAL} == set(S) - {S.DONE}
    assert len(ILLEGAL) > 10
    assert (S.FINISHED_SAVING, S.RUNNING) in ILLEGAL and (S.RUNNING, S.LOADING) in ILLEGAL


@pytest.mark.parametrize(("old", "new"), LEGAL, ids=lambda s: s.name)
def test_each_legal_transition_is_made(old: PoolState, new: PoolState) -> None:
    table = _table_in(old)
    record = table.get("r")
    assert record is not None
    table.move(record, new)
    if new is S.DONE:
        assert table.get("r") is None and len(table) == 0  # DONE leaves the table
    else:
        assert table.state("r") is new and table.get("r") is record


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=lambda s: s.name)
def test_each_illegal_transition_raises_and_changes_nothing(old: PoolState, new: PoolState) -> None:
    table = _table_in(old)
    record = table.get("r")
    assert record is not None
    with pytest.raises(InvalidTransition):
        table.move(record, new)
    assert table.state("r") is old and table.get("r") is record and len(table) == 1
    with pytest.raises(InvalidTransition):
        table.enter("r", new)
    assert table.state("r") is old


@pytest.mark.parametrize("state", sorted(set(S) - ENTRY_STATES, key=lambda s: s.value), ids=lambda s: s.name)
def test_a_request_enters_only_in_an_entry_state(state: PoolState) -> None:
    table = PoolRequests()
    with pytest.raises(InvalidTransition):
        table.enter("r", state)
    assert len(table) == 0 and table.get("r") is None


def _scheduler(hit: int = 48, **extra: object) -> KVPoolScheduler:
    return build_scheduler(SPEC, PoolConfig.from_extra(dict(extra)), lambda *args: hit)


def test_sync_load_then_save_then_held_until_sent() -> None:
    sched = _scheduler(hit=32)
    need, is_async = sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    assert (need, is_async) == (32, False) and sched.requests.state("r") is S.WAITING
    sched.update_state_after_alloc("r", [[1, 2, 3, 4]], need)
    assert sched.requests.state("r") is S.LOADING
    meta = sched.build_meta(StepInput(new=[NewRequest("r", PROMPT, [[1, 2, 3, 4]], 32, 18)]))
    assert sched.requests.state("r") is S.RUNNING
    # Loads 0..32 and saves the chunk it computes (32..48): its blocks must be held at the end.
    (req,) = meta.requests
    assert req.load_spec is not None and req.can_save and (req.save_start_token, req.save_end_token) == (32, 48)
    assert sched.request_finished("r") is True
    assert sched.requests.state("r") is S.FINISHED_SAVING and sched.held_req_ids == {"r"}
    assert sched.request_finished("r") is False  # asked twice: nothing changes
    assert sched.held_req_ids == {"r"}
    assert sched.build_meta(StepInput(finished_req_ids=frozenset({"r"}))).delayed_free_req_ids == {"r"}
    sched.mark_sent({"r"})
    assert sched.requests.get("r") is None and sched.held_req_ids == frozenset()


def test_a_request_that_saved_nothing_is_done_at_once() -> None:
    sched = _scheduler(hit=0)
    sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    assert sched.requests.state("r") is S.WAITING
    assert sched.request_finished("r") is False
    assert sched.requests.get("r") is None and len(sched.requests) == 0


def test_async_load_fails_then_the_request_is_recomputed() -> None:
    sched = _scheduler(load_async=True)
    need, is_async = sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    assert (need, is_async) == (48, True)
    sched.update_state_after_alloc("r", [[1, 2, 3, 4]], need)
    assert [m.req_id for m in sched.build_meta(StepInput()).requests] == ["r"]  # the load-only metadata
    assert sched.requests.state("r") is S.LOADING
    assert sched.build_meta(StepInput()).requests == ()  # built once
    sched.mark_load_failed({"r"})
    assert sched.requests.state("r") is S.LOAD_FAILED
    lookups = sched.lookups
    assert sched.get_num_new_matched_tokens("r", PROMPT, 50, 0) == (0, False)  # no retry loop
    assert sched.lookups == lookups and sched.requests.state("r") is S.WAITING
    meta = sched.build_meta(StepInput(new=[NewRequest("r", PROMPT, [[5, 6, 7, 8]], 0, 50)]))
    assert sched.requests.state("r") is S.RUNNING
    assert meta.requests[0].load_spec is None and meta.requests[0].save_start_token == 0


def test_preempted_request_keeps_its_saved_flag_and_is_looked_up_again() -> None:
    sched = _scheduler(hit=0)
    sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    meta = sched.build_meta(StepInput(new=[NewRequest("r", PROMPT, [[1, 2, 3, 4]], 0, 50)]))
    assert meta.requests[0].can_save and sched.requests.state("r") is S.RUNNING
    step = sched.build_meta(StepInput(preempted_req_ids=frozenset({"r"})))
    assert step.preempted_req_ids == {"r"} and sched.requests.state("r") is S.PREEMPTED
    record = sched.requests.get("r")
    assert record is not None and record.tracker is None
    sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    assert sched.requests.state("r") is S.WAITING
    assert sched.request_finished("r") is True  # it saved before the preemption: hold its blocks


def test_scheduling_a_finished_request_raises_and_changes_nothing() -> None:
    sched = _scheduler(hit=0)
    sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    sched.build_meta(StepInput(new=[NewRequest("r", PROMPT, [[1, 2, 3, 4]], 0, 50)]))
    assert sched.request_finished("r") is True
    with pytest.raises(InvalidTransition):
        sched.build_meta(StepInput(new=[NewRequest("r", PROMPT, [[1, 2, 3, 4]], 0, 50)]))
    with pytest.raises(InvalidTransition):
        sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    assert sched.requests.state("r") is S.FINISHED_SAVING and sched.held_req_ids == {"r"}
    record = sched.requests.get("r")
    assert record is not None and record.lookup is None


def test_finished_while_its_async_load_runs_leaves_the_blocks_to_vllms_load_hold() -> None:
    """Saved, preempted, resumed into an async load, then aborted: vLLM already holds the blocks.

    vLLM 0.33's ``finish_requests`` holds a ``WAITING_FOR_REMOTE_KVS`` request's blocks until its
    ``finished_recving``, which frees them and forgets the request; a second hold of ours would be
    reported in ``finished_sending`` and hit ``assert req_id in self.requests`` (or, reported first,
    free the blocks while the load still writes them). So the pool must not hold such a request.
    """
    sched = _scheduler(load_async=True)
    sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    sched.update_state_after_alloc("r", [[1, 2, 3, 4]], 0)  # nothing to load the first time (vLLM's ask)
    meta = sched.build_meta(StepInput(new=[NewRequest("r", PROMPT, [[1, 2, 3, 4]], 0, 50)]))
    assert meta.requests[0].can_save  # it saved: a hold would be asked for at its end
    sched.build_meta(StepInput(preempted_req_ids=frozenset({"r"})))
    need, is_async = sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    assert (need, is_async) == (48, True)  # resumed into an async load
    sched.update_state_after_alloc("r", [[5, 6, 7, 8]], need)
    loads = sched.build_meta(StepInput()).requests
    assert [m.req_id for m in loads] == ["r"] and loads[0].load_spec is not None  # handed to the workers
    assert sched.requests.state("r") is S.LOADING
    assert sched.request_finished("r") is False  # aborted now: vLLM's own hold covers it
    assert sched.requests.get("r") is None and sched.held_req_ids == frozenset()
    assert sched.build_meta(StepInput(finished_req_ids=frozenset({"r"}))).delayed_free_req_ids == frozenset()


def test_finished_while_waiting_after_saving_is_still_held() -> None:
    """Control for the test above: the same request finished before a load was armed is still held."""
    sched = _scheduler(load_async=True)
    sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    sched.update_state_after_alloc("r", [[1, 2, 3, 4]], 0)
    assert sched.build_meta(StepInput(new=[NewRequest("r", PROMPT, [[1, 2, 3, 4]], 0, 50)])).requests[0].can_save
    sched.build_meta(StepInput(preempted_req_ids=frozenset({"r"})))
    sched.get_num_new_matched_tokens("r", PROMPT, 50, 0)
    assert sched.requests.state("r") is S.WAITING
    assert sched.request_finished("r") is True
    assert sched.build_meta(StepInput(finished_req_ids=frozenset({"r"}))).delayed_free_req_ids == {"r"}


def test_no_save_reads_a_failed_block_until_a_step_rewrote_it() -> None:
    """vLLM 0.33's recompute policy keeps a block whose sync load failed in its prefix cache.

    x loads 3 chunks into blocks 1-3 and block 2 fails; y then hits blocks 1-3 in vLLM's cache
    (or x resumes onto them after a preemption) and would save chunk 1 from block 2, which holds
    no chunk. Its saves stop before block 2 until a step writes block 2 whole (x's recompute).
    """
    sched = _scheduler(hit=48)
    sched.get_num_new_matched_tokens("x", PROMPT, 50, 0)
    sched.update_state_after_alloc("x", [[1, 2, 3, 4]], 48)
    sched.build_meta(StepInput(new=[NewRequest("x", PROMPT, [[1, 2, 3, 4]], 48, 2)]))
    sched.mark_blocks_invalid({2})  # vLLM truncates x to 16 computed tokens
    other = [*PROMPT, 1, 2, 3]
    sched.get_num_new_matched_tokens("y", other, 53, 48)  # vLLM's prefix cache: blocks 1-3
    meta = sched.build_meta(StepInput(new=[NewRequest("y", other, [[1, 2, 3, 5]], 48, 5)]))
    (y,) = [m for m in meta.requests if m.req_id == "y"]
    # control: without the rule y saves [0, 48) (it found nothing in the pool); block 2 is chunk 1
    assert (y.can_save, y.save_start_token, y.save_end_token) == (True, 0, 16)
    # x recomputes from block 2 (tokens 16..50): block 2 is written whole before its save is read
    meta = sched.build_meta(
        StepInput(running=[RunningRequest("x", PROMPT[16:50], None, 16), RunningRequest("y", [9], None, 53)])
    )
    saves = {m.req_id: (m.save_start_token, m.save_end_token) for m in meta.requests if m.can_save}
    assert saves == {"x": (16, 48)}  # y decodes now (decode saves are off)
