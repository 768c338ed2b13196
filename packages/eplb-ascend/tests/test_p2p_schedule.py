"""The rendezvous issue order: every pair meets once; strict rendezvous never deadlocks (hypothesis)."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError
from ascend_dist.eplb_ascend._demo.launch import run_ranks
from ascend_dist.eplb_ascend.p2p_schedule import partner_rounds, rendezvous_order
from ascend_dist.eplb_ascend.transport import GlooTransport, P2POperation, RendezvousTransport


@pytest.mark.parametrize("world", range(1, 10))
def test_every_pair_meets_exactly_once_and_symmetrically(world):
    rounds = [partner_rounds(r, world) for r in range(world)]
    assert len({len(x) for x in rounds}) == 1
    for r in range(world):
        met = [p for p in rounds[r] if p is not None]
        assert sorted(met) == [p for p in range(world) if p != r]
        for k, p in enumerate(rounds[r]):
            assert p is None or rounds[p][k] == r


def per_rank_ops(world, messages):
    ops = [[] for _ in range(world)]
    for mid, (src, dst) in enumerate(messages):
        ops[src].append(("send", dst, mid))
        ops[dst].append(("recv", src, mid))
    return ops


def simulate(world, sequences):
    """Strict rendezvous: a head send completes only with the peer's head recv of the same message."""
    heads = [0] * world
    matched = []
    while True:
        progressed = False
        for r in range(world):
            if heads[r] >= len(sequences[r]):
                continue
            kind, peer, mid = sequences[r][heads[r]]
            if kind != "send" or heads[peer] >= len(sequences[peer]):
                continue
            pkind, ppeer, pmid = sequences[peer][heads[peer]]
            if pkind == "recv" and ppeer == r:
                matched.append((mid, pmid))
                heads[r] += 1
                heads[peer] += 1
                progressed = True
        if all(h == len(s) for h, s in zip(heads, sequences, strict=True)):
            return matched
        if not progressed:
            return None  # deadlock


messages = st.integers(2, 6).flatmap(
    lambda world: st.tuples(
        st.just(world),
        st.lists(st.tuples(st.integers(0, world - 1), st.integers(0, world - 1)).filter(lambda m: m[0] != m[1]),
                 max_size=30),
    )
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(messages)
def test_rendezvous_order_never_deadlocks_and_pairs_messages_fifo(case):
    world, msgs = case
    ops = per_rank_ops(world, msgs)
    ordered = []
    for r in range(world):
        order = rendezvous_order([(k, p) for k, p, _ in ops[r]], r, world)
        assert sorted(order) == list(range(len(ops[r])))
        ordered.append([ops[r][i] for i in order])
    matched = simulate(world, ordered)
    assert matched is not None and all(a == b for a, b in matched) and len(matched) == len(msgs)


def test_the_naive_order_can_deadlock():
    ops = per_rank_ops(2, [(0, 1), (1, 0)])  # both ranks send first
    assert simulate(2, [[*ops[0]], [ops[1][1], ops[1][0]]]) is None


def test_bad_peers_are_refused():
    with pytest.raises(ConfigError, match="peer"):
        rendezvous_order([("send", 0)], 0, 2)
    with pytest.raises(ConfigError, match="peer"):
        rendezvous_order([("recv", 2)], 0, 2)
    with pytest.raises(ConfigError, match="kind"):
        rendezvous_order([("put", 1)], 0, 2)


class GlooBlockingSendRecv:
    """A `SendRecvCommunicator` of blocking gloo send/recv (world group)."""

    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def send(self, tensor, dst, stream=None):
        dist.send(tensor, dst)

    def recv(self, tensor, src, stream=None):
        dist.recv(tensor, src)


def _all_to_all_rank(cfg):
    rank, world = cfg["rank"], cfg["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))  # fmt: skip
    try:
        transport = RendezvousTransport(GlooBlockingSendRecv(), GlooTransport(), lambda timeout_s: None)
        ops, inbox = [], {}
        for peer in range(world):
            if peer != rank:
                for k in range(2):  # two messages per pair: FIFO pairing matters
                    ops.append(P2POperation("send", torch.full((4,), float(100 * rank + 10 * peer + k)), peer))
                    inbox[(peer, k)] = torch.empty(4)
                    ops.append(P2POperation("recv", inbox[(peer, k)], peer))
        transport.batch_send_recv(ops, 20)
        ok = all(bool((t == 100 * peer + 10 * rank + k).all()) for (peer, k), t in inbox.items())
        return {"rank": rank, "ok": ok}
    finally:
        dist.destroy_process_group()


def test_rendezvous_transport_all_to_all_over_blocking_gloo():
    assert all(s["ok"] for s in run_ranks(_all_to_all_rank, {}, world=4, timeout_s=60))
