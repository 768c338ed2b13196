"""Failure paths over real processes: P dies, D never confirms, P unreachable, bad messages, mismatch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_engines import EngineWrapper

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.common.wire import make_handshake
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, get_engine
from ascend_dist.kv_mooncake.core.messages import Ack, Done, GetMeta, MetaReply, Refused
from ascend_dist.kv_mooncake.core.wire import WIRE_VERSION
from ascend_dist.kv_mooncake.pull.messages import CHANNEL, Held, Renew, reply_codec, request_codec


@pytest.mark.timeout(60)
def test_p_dies_d_reports_exactly_the_failed_blocks_and_finishes(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(p_tp=1, d_tp=1, groups=2, pull_timeout_s=5.0, own_process=True)
    assert pair.transfer("ok", 40, seed=1) == set()  # metadata now cached on D
    params = pair.p.prefill("lost", 40, 2)
    pair.p.peer.kill()
    start = time.monotonic()
    pair.d.decode("lost", 40, params)
    errors = pair.d.wait_recv({"lost"}, timeout_s=10.0)  # finished_recving still arrives
    assert time.monotonic() - start < 5.0
    assert errors == {b for ids in pair.d.blocks["lost"] for b in ids}  # every group, logical ids
    assert pair.d.verify("ok", 1) > 0  # the earlier request is untouched
    assert all(r.worker.get_block_ids_with_load_errors() == set() for r in pair.d.ranks)  # reported once


class KillPeerDuringRead(EngineWrapper):
    """Our `TransferBackend` around the real engine: SIGKILLs P shortly after a read has started."""

    def __init__(self, real: MooncakeEngine, delay_s: float) -> None:
        super().__init__(real)
        self.delay_s, self.victim, self.reads = delay_s, None, 0
        self.sessions: list[str] = []

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        self.reads += 1
        self.sessions.append(session)
        killer = None
        if self.victim is not None:
            killer = threading.Timer(self.delay_s, self.victim.kill)
            killer.start()
        try:
            self.real.read(session, batch, timeout_s=timeout_s)
        finally:
            if killer is not None:
                killer.join()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("read_before", [False, True], ids=["first-read", "read-that-sleeps-first"])
def test_p_dies_mid_transfer(make_pair: Callable[..., Any], read_before: bool) -> None:
    """P is SIGKILLed 5 ms into D's read: every block is reported as a load error and the request
    still finishes. With ``read_before`` D has read from this P before, so the read is submitted,
    slept through for most of its expected time and only then waited for (`core.transfer_pace`):
    P dies during the sleep or the wait."""
    real = get_engine("127.0.0.1", "tcp")
    engine = KillPeerDuringRead(real, delay_s=0.005)
    # 64 KiB blocks, 4 layers x K/V, 150 blocks: ~75 MiB in one request, far longer than 5 ms here.
    pair = make_pair(
        p_tp=1, d_tp=1, heads=8, head_dim=128, block_size=32, num_blocks=320, own_process=True, d_engine=engine
    )
    if read_before:
        assert pair.transfer("warm", 150 * 32, 2) == set()  # teaches D this P's rate
        assert pair.d.verify("warm", seed=2) > 0
        assert real.pace.sleep_s(engine.sessions[0], 75 << 20) > 0  # so the next read sleeps first
    params = pair.p.prefill("big", 150 * 32, 1)
    engine.victim = pair.p.peer.proc
    pair.d.decode("big", 150 * 32, params)
    errors = pair.d.wait_recv({"big"}, timeout_s=20.0)
    assert pair.p.peer.proc.poll() is not None and engine.reads == 1 + read_before
    assert errors == set(pair.d.blocks["big"][0])  # reported, and the request still finished


@pytest.mark.timeout(60)
def test_d_never_confirms_and_the_lease_frees_p_blocks(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(p_tp=2, d_tp=1, lease_s=0.5)
    pair.p.prefill("orphan", 40, 1)
    assert pair.p.poll()["blocks_lent"] > 0
    state = pair.wait_p_idle()
    assert state["blocks_lent"] == 0 and state["tracked"] == 0
    assert state["expired"] == 2  # both P ranks force-freed their lent blocks


@pytest.mark.timeout(60)
def test_unreachable_p_fails_fast(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(p_tp=1, d_tp=1)
    dead_port = free_port_range(1)
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "P9",
        "remote_request_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": dead_port,
        "remote_block_ids": [[1, 2, 3]],
        "remote_ptp_size": 1,
    }
    start = time.monotonic()
    pair.d.decode("x", 40, params)
    errors = pair.d.wait_recv({"x"}, timeout_s=10.0)
    assert time.monotonic() - start < 3.0
    assert errors == set(pair.d.blocks["x"][0])


@pytest.mark.timeout(60)
def test_bad_and_oversized_messages_are_dropped_and_the_server_keeps_serving(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(p_tp=1, d_tp=1, max_message_bytes=65536)
    endpoint = tcp_endpoint("127.0.0.1", pair.kv_port)
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)
    with RpcClient(timeout_s=0.5, retries=1) as client:
        # Junk is answered with a refusal naming what was wrong (no traceback, no error frame).
        assert replies.decode(client.request(endpoint, b"\x93garbage")) == Refused(field="message")
        with pytest.raises(DeadlineExceeded):
            client.request(endpoint, b"\x00" * 200_000)  # over max_message_bytes: dropped unanswered
        unknown = client.request(endpoint, requests.encode(Done(request_id="never-seen", d_rank=0, ok=True)))
        pair.p.prefill("leased", 40, 5)  # P now holds its blocks under a lease; D may renew it
        renew = Renew(request_ids=["leased"])
        reply = replies.decode(client.request(endpoint, requests.encode(renew)))
        assert isinstance(reply, Held) and reply.held == [True] and 29.0 < reply.lease_s[0] <= 30.0
        done = Done(request_id="leased", d_rank=0, ok=True)
        # A DONE's answer is the same whether P knew the id: DONEs do not reveal which ids P holds.
        assert client.request(endpoint, requests.encode(done)) == unknown
        assert replies.decode(unknown) == Ack()
    assert pair.wait_p_idle()["blocks_lent"] == 0  # the DONE released them
    assert pair.transfer("after", 40, seed=3) == set()
    assert pair.d.verify("after", 3) > 0


@pytest.mark.timeout(60)
def test_compat_mismatch_is_refused_naming_the_field(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(p_tp=1, d_tp=1, d_extra={"model": "another-model"})
    endpoint = tcp_endpoint("127.0.0.1", pair.kv_port)
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)
    good = pair.d.ranks[0].worker.make_handshake(16)
    bad = make_handshake(CHANNEL.name, WIRE_VERSION, **{**dict(good.compat_fields), "dtype": "bfloat16"})
    with RpcClient(timeout_s=0.5, retries=1) as client:
        reply = replies.decode(client.request(endpoint, requests.encode(GetMeta(handshake=bad, engine_id="D0"))))
        assert isinstance(reply, Refused) and reply.field == "dtype"
        assert reply.local == "" and reply.remote == "bfloat16"  # our own value is never disclosed
        same_id = replies.decode(
            client.request(endpoint, requests.encode(GetMeta(handshake=good, engine_id=pair.extra["engine_id"])))
        )
        assert isinstance(same_id, Refused) and same_id.field == "engine_id"
        newer = make_handshake(CHANNEL.name, WIRE_VERSION + 1, **dict(good.compat_fields))
        reply = replies.decode(client.request(endpoint, requests.encode(GetMeta(handshake=newer, engine_id="D0"))))
        assert isinstance(reply, Refused) and reply.field == "protocol_version"
    # D itself (model "another-model") is refused too: its pull fails, every block reported.
    errors = pair.transfer("m", 40, seed=1)
    assert errors == set(pair.d.blocks["m"][0])
    assert not isinstance(reply, MetaReply)


@pytest.mark.timeout(60)
def test_rejected_d_request_still_releases_p_blocks_without_waiting_for_the_lease(
    make_pair: Callable[..., Any],
) -> None:
    from ascend_dist.kv_mooncake.core.request import SchedRequest

    pair = make_pair(p_tp=2, d_tp=1, lease_s=30.0)
    params = pair.p.prefill("rejected", 40, 1)
    req = SchedRequest("rejected", 40, dict(params))
    pair.d.scheduler.get_num_new_matched_tokens(req, 0)
    assert pair.d.scheduler.request_finished(req, [[]]) == (False, None)  # never allocated (e.g. too long)
    meta = pair.d.scheduler.build_connector_meta()
    assert meta.requests["rejected"].local_block_ids == [[]]
    for r in pair.d.ranks:
        r.worker.start_load_kv(meta)
    state = pair.wait_p_idle()
    assert (state["blocks_lent"], state["expired"], state["tracked"]) == (0, 0, 0)  # freed by DONE, not the lease
    # D reports no receive for it: vLLM no longer holds a request it rejected and asserts on stray ids.
    with pytest.raises(DeadlineExceeded):
        pair.d.wait_recv({"rejected"}, timeout_s=0.5)
