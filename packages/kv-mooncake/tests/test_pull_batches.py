"""D's batched receive path (`pull/threads.py`, `pull/lanes.py`): one lease check per P per batch, a read per request.

Real P workers (child processes), real Mooncake TCP, D here with our own `Reader` wrapped around the
real engine (`GatedReads`): its first read waits on a gate, so the requests decoded meanwhile queue on
the lane (one reader here: ``recv_workers`` 1) and the reader takes them as one batch
(``recv_batch_requests``, default 4), asks P once whether it holds them all, then reads them one
request per engine call, reporting each as its read ends. Every success is checked byte for byte.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_engines import EngineWrapper

from ascend_dist.common.errors import TransferError
from ascend_dist.common.zmq_rpc import RpcClient, tcp_endpoint
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, get_engine
from ascend_dist.kv_mooncake.core.messages import Ack
from ascend_dist.kv_mooncake.pull.d_plan import ShardKind
from ascend_dist.kv_mooncake.pull.messages import DoneItem, Dones, reply_codec, request_codec
from ascend_dist.kv_mooncake.pull.threads import done_sender

SPEC = {"layers": 4, "heads": 4, "head_dim": 16, "block_size": 16, "num_blocks": 32}


class GatedReads(EngineWrapper):
    """Records each read (session, pieces); the first waits for ``gate``; ``before(n)`` runs before read n."""

    def __init__(self, real: MooncakeEngine) -> None:
        super().__init__(real)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[str, int]] = []
        self.before: Callable[[int], None] = lambda n: None
        self.failing: set[str] = set()

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        n = len(self.calls)
        self.calls.append((session, len(batch)))
        if n == 0:
            self.entered.set()
            if not self.gate.wait(15.0):
                raise TransferError("the test never opened the gate")
        self.before(n)
        if session in self.failing:
            raise TransferError(f"injected: read from {session} failed")
        self.real.read(session, batch, timeout_s=timeout_s)


def _queue_behind_a_gated_read(pair: Any, engine: GatedReads, rids: dict[str, int]) -> None:
    """Pull ``warm`` (its read waits on the gate), then decode ``rids`` so they queue behind it."""
    params = {rid: pair.p.prefill(rid, 40, seed) for rid, seed in rids.items()}
    pair.d.decode("warm", 40, pair.p.prefill("warm", 40, 1))
    assert engine.entered.wait(10.0)
    for rid, p in params.items():
        pair.d.decode(rid, 40, p)


@pytest.mark.timeout(60)
def test_a_batch_is_read_one_request_at_a_time_and_each_reported_when_its_read_ends(
    make_pair: Callable[..., Any],
) -> None:
    """Four requests queued behind a gated read form one batch of the one reader: one engine call per
    request, in turn, each 0.3 s long here, and the first is reported before the last one's read starts
    (reading the batch in one call reported all four after its last byte)."""
    engine = GatedReads(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(p_tp=1, d_tp=1, d_engine=engine, d_extra={"recv_workers": 1})  # one reader: it waits
    rids = {f"r{i}": 10 + i for i in range(4)}
    read_started: dict[int, float] = {}

    def slow(n: int) -> None:
        read_started[n] = time.monotonic()
        if n > 0:
            time.sleep(0.3)

    engine.before = slow
    _queue_behind_a_gated_read(pair, engine, rids)
    engine.gate.set()
    reported: dict[str, float] = {}
    deadline = time.monotonic() + 15.0
    while len(reported) < 1 + len(rids):
        assert time.monotonic() < deadline, reported
        _, recv, errors = pair.d.poll()
        assert not errors
        reported.update({rid: time.monotonic() for rid in recv})
        time.sleep(0.005)
    for rid, seed in {"warm": 1, **rids}.items():
        assert pair.d.verify(rid, seed) > 0
    # The gated read, then one read per request of the batch (each the size of the first).
    assert len(engine.calls) == 5 and {pieces for _, pieces in engine.calls} == {engine.calls[0][1]}, engine.calls
    assert reported["r0"] < read_started[4], (reported, read_started)  # r0 did not wait for r3's read
    assert reported["r0"] < reported["r1"] < reported["r2"] < reported["r3"]
    state = pair.wait_p_idle()  # the batched DONEs freed every block
    assert (state["blocks_lent"], state["expired"]) == (0, 0)


@pytest.mark.timeout(90)
def test_a_failed_batch_fails_only_its_own_requests(make_pair: Callable[..., Any], p_server: Any) -> None:
    """P1's reads fail (its whole batch); P2's requests, pulled meanwhile by its own lane, succeed."""
    engine = GatedReads(get_engine("127.0.0.1", "tcp"))
    engine.gate.set()
    pair = make_pair(p_tp=1, d_tp=1, own_process=True, d_engine=engine, d_extra={"quarantine_s": 0.1})
    p2_extra = {**pair.extra, "engine_id": f"{pair.extra['engine_id']}-2", "kv_port": free_port_range(1)}
    p2 = p_server.create(f"{p2_extra['engine_id']}", p2_extra, SPEC)
    try:
        assert pair.transfer("warm", 40, seed=1) == set()
        bad_session = engine.calls[0][0]
        engine.failing.add(bad_session)
        bad = {f"b{i}": pair.p.prefill(f"b{i}", 40, 10 + i) for i in range(3)}
        good = {f"g{i}": p2.prefill(f"g{i}", 40, 20 + i) for i in range(3)}
        for rid, params in [*bad.items(), *good.items()]:
            pair.d.decode(rid, 40, params)
        errors = pair.d.wait_recv({*bad, *good}, timeout_s=15.0)
        assert errors == {b for rid in bad for b in pair.d.blocks[rid][0]}  # every request of P1, no other
        for i, rid in enumerate(good):
            assert pair.d.verify(rid, 20 + i) > 0
        assert any(s != bad_session for s, _ in engine.calls)  # control: P2 was read through its own session
    finally:
        p2.drop()


def _send_done(pair: Any, rid: str, reader: str) -> None:
    """A DONE for P's ``rid`` from D rank 0's WHOLE task slot, naming ``reader``."""
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)
    item = DoneItem(request_id=rid, ok=True, sender=done_sender(0, ShardKind.WHOLE), reader=reader)
    with RpcClient(timeout_s=2.0, retries=1) as client:
        done = requests.encode(Dones(d_rank=0, items=[item]))
        assert replies.decode(client.request(tcp_endpoint("127.0.0.1", pair.kv_port), done)) == Ack()


@pytest.mark.timeout(60)
def test_the_after_read_check_failing_for_one_request_fails_only_that_request(
    make_pair: Callable[..., Any],
) -> None:
    """Two requests of one batch (one lease check), each read ending past half the 1 s lease, so D asks
    P again after each; P freed one of them during its read (its pull's own DONE, sent from
    elsewhere), so the check says "not held" for it alone."""
    engine = GatedReads(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(p_tp=1, d_tp=1, d_engine=engine, d_extra={"recv_workers": 1}, lease_s=1.0)
    receiver = pair.d.ranks[0].worker.receiver
    freed: list[str] = []

    def free_a(n: int) -> None:
        if n != 1:
            return
        time.sleep(0.6)  # past LEASE_TRUST (0.5) of the 1 s lease: the check after the read runs
        _send_done(pair, "a", receiver.reader_of("a"))
        freed.extend(pair.p.poll()["freed"])

    engine.before = free_a
    _queue_behind_a_gated_read(pair, engine, {"a": 5, "b": 6})
    engine.gate.set()
    errors = pair.d.wait_recv({"warm", "a", "b"}, timeout_s=15.0)
    assert len(engine.calls) == 3 and "a" in freed  # control: a read each, P really freed a during a's
    assert errors == set(pair.d.blocks["a"][0])  # a fails, b does not
    assert pair.d.verify("b", 6) > 0 and pair.d.verify("warm", 1) > 0
    state = pair.wait_p_idle()
    assert (state["blocks_lent"], state["expired"]) == (0, 0)


@pytest.mark.timeout(60)
def test_a_done_from_another_reader_frees_nothing_a_pull_still_reads(make_pair: Callable[..., Any]) -> None:
    """A DONE for a request D is reading, from any other reader (a replayed pull's, or one naming no
    reader), is not counted: the read ends well inside the lease, is not checked again, and its
    bytes are P's."""
    engine = GatedReads(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(p_tp=1, d_tp=1, d_engine=engine, d_extra={"recv_workers": 1})
    freed: list[str] = []

    def foreign_done(n: int) -> None:
        if n == 1:
            _send_done(pair, "a", "")
            _send_done(pair, "a", "another reader's token")
            freed.extend(pair.p.poll()["freed"])

    engine.before = foreign_done
    _queue_behind_a_gated_read(pair, engine, {"a": 5, "b": 6})
    engine.gate.set()
    assert pair.d.wait_recv({"warm", "a", "b"}, timeout_s=15.0) == set()
    assert len(engine.calls) == 3 and "a" not in freed  # a read each; neither foreign DONE freed a
    assert pair.d.verify("a", 5) > 0 and pair.d.verify("b", 6) > 0
    state = pair.wait_p_idle()
    assert (state["blocks_lent"], state["expired"], state["refused_readers"]) == (0, 0, 2)


@pytest.mark.timeout(60)
def test_params_replayed_to_a_second_d_request_are_refused_before_it_reads(make_pair: Callable[..., Any]) -> None:
    """A client hands D the same P params for two requests: the first pull's reader holds P's blocks,
    the copy is told "not held" before reading (load errors, vLLM recomputes it) and its DONE frees
    nothing, so the first still reads P's bytes."""
    engine = GatedReads(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(p_tp=1, d_tp=1, d_engine=engine, d_extra={"recv_workers": 1})
    params = pair.p.prefill("a", 40, 5)
    pair.d.decode("warm", 40, pair.p.prefill("warm", 40, 1))
    assert engine.entered.wait(10.0)
    pair.d.decode("a", 40, params)
    pair.d.decode("copy", 40, params)
    engine.gate.set()
    errors = pair.d.wait_recv({"warm", "a", "copy"}, timeout_s=15.0)
    assert errors == set(pair.d.blocks["copy"][0])  # the copy fails alone
    assert pair.d.verify("a", 5) > 0 and pair.d.verify("warm", 1) > 0
    state = pair.wait_p_idle()
    assert (state["blocks_lent"], state["expired"]) == (0, 0) and state["refused_readers"] >= 1
