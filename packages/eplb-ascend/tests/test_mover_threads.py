"""The mover's all-or-nothing application, property-tested over an in-process fabric of our Protocol.

`ThreadFabric` gives each rank a `P2PTransport` whose sends land in a shared mailbox and whose
all-gather meets at a barrier; every rank runs `EplbRankState.rearrange` in its own thread (joined
with a deadline). Multi-process gloo runs are in test_gloo_rebalance.py; this file explores many
placements quickly.
"""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from placement_strategies import random_placement

from ascend_dist.common.errors import TransferError, TransferTimeout
from ascend_dist.eplb_ascend.controller import EplbRankState
from ascend_dist.eplb_ascend.mover import ExpertWeightMover


class ThreadFabric:
    def __init__(self, world, drop_to=None):
        self.world, self.drop_to = world, drop_to
        self.cond = threading.Condition()
        self.mail = {}
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world

    def transport(self, rank):
        return ThreadTransport(self, rank)


class ThreadTransport:
    def __init__(self, fabric, rank):
        self.fabric, self.rank, self.world_size = fabric, rank, fabric.world

    def batch_send_recv(self, ops, timeout_s):
        f = self.fabric
        with f.cond:
            for op in ops:
                if op.kind == "send" and op.peer != f.drop_to:
                    f.mail[(self.rank, op.peer, op.tag)] = op.tensor.clone()
            f.cond.notify_all()
        for op in ops:
            if op.kind == "recv":
                key = (op.peer, self.rank, op.tag)
                with f.cond:
                    if not f.cond.wait_for(lambda k=key: k in f.mail, timeout=timeout_s):
                        raise TransferTimeout(f"rank {self.rank}: nothing from {op.peer}")
                    op.tensor.copy_(f.mail.pop(key))

    def all_gather_int64(self, values, timeout_s):
        f = self.fabric
        f.slots[self.rank] = values.clone()
        try:
            f.barrier.wait(timeout=timeout_s)
            out = torch.stack(list(f.slots))
            f.barrier.wait(timeout=timeout_s)
        except threading.BrokenBarrierError as exc:  # like gloo's timeout, typed
            raise TransferTimeout(f"rank {self.rank}: all-gather timed out") from exc
        return out


def fill(layer, expert, k):
    return float(layer * 1000 + expert * 10 + k)


def make_states(fabric, old, num_logical, timeout_s=5.0):
    per = old.shape[1] // fabric.world
    states = []
    for r in range(fabric.world):
        mine = old[:, r * per : (r + 1) * per]
        weights = [
            [[torch.full((3,), fill(layer, int(e), k)) for k in range(2)] for e in mine[layer]]
            for layer in range(old.shape[0])
        ]
        mover = ExpertWeightMover(fabric.transport(r), timeout_s=timeout_s)
        states.append(EplbRankState(old, num_logical=num_logical, weights=weights, mover=mover))
    return states


def run_all(states, new):
    results = [None] * len(states)

    def one(i):
        try:
            results[i] = states[i].rearrange(new)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(states))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results


def holds(state, placement):
    per = placement.shape[1] // state.num_ranks
    r = state.ep_rank
    return all(
        bool((t == fill(layer, int(e), k)).all())
        for layer in range(placement.shape[0])
        for s, e in enumerate(placement[layer, r * per:(r + 1) * per])
        for k, t in enumerate(state.weights[layer][s])
    )  # fmt: skip


@st.composite
def cases(draw):
    world = draw(st.integers(1, 4))
    per = draw(st.integers(1, 3))
    slots = world * per
    num_logical = draw(st.integers(1, slots))
    layers = draw(st.integers(1, 2))

    return (
        world,
        num_logical,
        random_placement(draw, layers, slots, num_logical),
        random_placement(draw, layers, slots, num_logical),
    )


@settings(max_examples=40, deadline=None)
@given(cases())
def test_every_rank_ends_holding_the_new_placement_and_tables_stay_put(case):
    world, num_logical, old, new = case
    states = make_states(ThreadFabric(world), old, num_logical)
    ptrs = [s.tables.table.data_ptr() for s in states]
    results = run_all(states, new)
    assert not [r for r in results if isinstance(r, Exception)], results
    for state, ptr in zip(states, ptrs, strict=True):
        assert holds(state, new) and state.tables.table.data_ptr() == ptr
        assert (state.placement == new).all()


def test_a_lost_message_aborts_on_every_rank_and_nothing_changes():
    old = np.array([[0, 1, 2, 3]])
    new = np.array([[3, 2, 1, 0]])  # both ranks fetch from each other
    states = make_states(ThreadFabric(2, drop_to=1), old, 4, timeout_s=0.5)
    results = run_all(states, new)
    assert isinstance(results[1], TransferTimeout)  # rank 1 never got its experts
    assert isinstance(results[0], TransferError)  # rank 0 received fine but the vote says no
    for state in states:
        assert holds(state, old) and (state.placement == old).all()


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        ExpertWeightMover(ThreadFabric(1).transport(0), timeout_s=0)
