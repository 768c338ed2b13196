"""Pull faults of issue 22 injected for real: retried DONEs, stopped requests on P, repeated ids,
timed-out pulls, a hung P beside a healthy one, a dead P's later requests.

P runs in a child process (SIGSTOPped or SIGKILLed where the fault needs it), D here; Mooncake TCP
and the ZMQ side channel on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fault_engines import EngineWrapper

from ascend_dist.common.errors import TransferError
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess, free_port_range
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, get_engine
from ascend_dist.kv_mooncake.core.messages import Ack, Done
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.pull.d_plan import ShardKind
from ascend_dist.kv_mooncake.pull.messages import DoneItem, Dones, Held, Renew, reply_codec, request_codec
from ascend_dist.kv_mooncake.pull.threads import done_sender

SPEC = {"layers": 4, "heads": 4, "head_dim": 16, "block_size": 16, "num_blocks": 32}


def _finish_times(d: Any, rids: set[str], timeout_s: float) -> tuple[dict[str, float], set[int]]:
    """Poll D until every request in ``rids`` finished receiving: when each did, and the errors seen."""
    start, seen, errors = time.monotonic(), dict[str, float](), set[int]()
    while set(seen) != rids:
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not received within {timeout_s} s: {sorted(rids - set(seen))}")
        _, recv, errs = d.poll()
        errors |= errs
        for rid in recv & rids:
            seen.setdefault(rid, time.monotonic() - start)
        time.sleep(0.001)
    return seen, errors


@pytest.mark.timeout(60)
def test_a_resent_done_counts_once_and_never_frees_blocks_another_d_rank_reads(make_pair: Callable[..., Any]) -> None:
    """P_tp 1 < D_tp 2: P waits for two DONEs. D rank 0's DONE arriving twice (the RPC client's
    retry after a lost reply) must not free the blocks D rank 1 has yet to read; rank 1's does."""
    pair = make_pair(p_tp=1, d_tp=2)
    params = pair.p.prefill("fan", 40, 1)
    endpoint = tcp_endpoint("127.0.0.1", pair.kv_port)
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)
    whole = done_sender(0, ShardKind.WHOLE)  # what each D rank's WHOLE task sends beside its rank
    rank0 = requests.encode(Dones(d_rank=0, items=[DoneItem(request_id="fan", ok=True, sender=whole)] * 2))
    with RpcClient(timeout_s=5.0, retries=1) as client:
        assert replies.decode(client.request(endpoint, rank0)) == Ack(known=True)
        assert replies.decode(client.request(endpoint, rank0)) == Ack(known=True)  # the same bytes again
        assert pair.p.poll()["blocks_lent"] > 0  # one rank twice is not the fan-in of 2
        reply = replies.decode(client.request(endpoint, requests.encode(Renew(request_ids=["fan"]))))
        assert isinstance(reply, Held) and reply.held == [True]
        # control: D rank 1's DONE completes the fan-in and frees the blocks
        rank1 = requests.encode(Done(request_id="fan", ok=True, d_rank=1, sender=whole))
        assert replies.decode(client.request(endpoint, rank1)) == Ack(known=True)
    state = pair.wait_p_idle()
    assert (state["blocks_lent"], state["expired"]) == (0, 0)
    # The real D ranks now find the request gone: neither reads freed blocks as a success.
    pair.d.decode("fan", 40, params)
    assert pair.d.wait_recv({"fan"}, timeout_s=15.0) == set(pair.d.blocks["fan"][0])
    # and a fan-in-2 request pulled by both real D ranks is freed by their two DONEs
    assert pair.transfer("real", 40, seed=3) == set() and pair.d.verify("real", 3) > 0
    state = pair.wait_p_idle()
    assert (state["blocks_lent"], state["expired"]) == (0, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["stopped", "aborted"])
def test_a_request_ending_stopped_or_aborted_leaves_nothing_on_p(make_pair: Callable[..., Any], end: str) -> None:
    """EOS on the first token (or an abort) frees P's blocks at once: no tracker entry may stay."""
    pair = make_pair(p_tp=2, d_tp=1)
    assert pair.p.prefill("eos", 40, 1, end=end) == {}
    state = pair.p.poll()
    assert (state["tracked"], state["blocks_lent"]) == (0, 0)
    # control: a request that does lend its blocks is tracked until D is done
    params = pair.p.prefill("lent", 40, 2)
    assert pair.p.poll()["tracked"] > 0
    pair.d.decode("lent", 40, params)
    assert pair.d.wait_recv({"lent"}, timeout_s=15.0) == set()
    state = pair.wait_p_idle()
    assert (state["tracked"], state["blocks_lent"], state["expired"]) == (0, 0, 0)


@pytest.mark.timeout(60)
def test_a_repeated_live_request_id_fails_that_request_alone(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(p_tp=1, d_tp=1)
    d = pair.d
    params = pair.p.prefill("dup", 40, 1)
    req = SchedRequest("dup", 40, dict(params))
    d.requests["dup"] = req
    count, _ = d.scheduler.get_num_new_matched_tokens(req, 0)
    ids = d._alloc("dup", count)
    d.scheduler.update_state_after_alloc(req, ids, count)
    meta = d.scheduler.build_connector_meta()
    worker = d.ranks[0].worker
    worker.start_load_kv(meta)
    worker.start_load_kv(meta)  # the same live id again: must not raise out of the worker
    errors = d.wait_recv({"dup"}, timeout_s=15.0)
    assert errors == set(ids[0])  # the request failed (vLLM recomputes it), reported once
    assert pair.wait_p_idle()["blocks_lent"] == 0
    assert pair.transfer("after", 40, seed=2) == set()  # the worker goes on
    assert d.verify("after", 2) > 0


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Wait until every thread of ``pid`` is stopped (SIGSTOP takes effect asynchronously)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        states = {
            Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
            for t in os.listdir(f"/proc/{pid}/task")
        }
        if states <= {"T", "t"}:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


class HangingReads(EngineWrapper):
    """Our `TransferBackend` around the real engine: reads wait for ``gate`` (a P that hangs mid-read)."""

    def __init__(self, real: MooncakeEngine) -> None:
        super().__init__(real)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        self.entered.set()
        if not self.gate.wait(15.0):
            raise TransferError("test never released the hung read")
        self.real.read(session, batch, timeout_s=timeout_s)


@pytest.mark.timeout(60)
def test_a_timed_out_pull_releases_p_at_once_and_its_queued_tasks_end(make_pair: Callable[..., Any]) -> None:
    """One read hangs past ``pull_timeout_s`` with the request's second task queued behind it: P
    must free its blocks now (not when its 30 s lease ends), and the request must finish once the
    hung read returns, without waiting for the extra grace."""
    engine = HangingReads(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(
        p_tp=2,
        d_tp=1,
        lease_s=30.0,
        pull_timeout_s=1.0,
        d_engine=engine,
        d_extra={"recv_workers": 1, "quarantine_s": 0.1},
    )
    params = pair.p.prefill("slow", 40, 1)
    pair.d.decode("slow", 40, params)
    assert engine.entered.wait(10.0)
    start = time.monotonic()
    errors: set[int] = set()
    freed_after = None
    while time.monotonic() - start < 5.0:
        _, recv, errs = pair.d.poll()
        errors |= errs
        assert "slow" not in recv  # quarantined while its read runs (released anyway 2 x pull_timeout_s in)
        if pair.p.poll()["blocks_lent"] == 0:
            freed_after = time.monotonic() - start
            break
        time.sleep(0.02)
    assert freed_after is not None and freed_after < 1.6, "P held the blocks of a timed-out pull"
    assert errors == set(pair.d.blocks["slow"][0])
    engine.gate.set()
    released = time.monotonic()
    _finish_times(pair.d, {"slow"}, timeout_s=5.0)
    # The queued task counted down, so the request ends once the hung read returns (+ quarantine_s),
    # not at the deadline plus the grace for a read that never returns.
    assert time.monotonic() - released < 0.6
    assert pair.p.poll()["expired"] == 0  # freed by D's DONE, not the lease
    assert pair.transfer("after", 40, seed=2) == set() and pair.d.verify("after", 2) > 0


@pytest.mark.timeout(90)
def test_a_hung_p_delays_only_its_own_requests(make_pair: Callable[..., Any], p_server: PeerProcess) -> None:
    """P1 is SIGSTOPped (hung, sockets open); D pulls three requests from it, then one from P2:
    P2's must not queue behind P1's (one receive thread per peer here)."""
    pair = make_pair(p_tp=1, d_tp=1, own_process=True, d_extra={"recv_workers": 1})
    p2_extra = {**pair.extra, "engine_id": f"{pair.extra['engine_id']}-2", "kv_port": free_port_range(1)}
    p2 = p_server.create(f"{p2_extra['engine_id']}", p2_extra, SPEC)
    try:
        assert pair.transfer("warm", 40, seed=1) == set()  # P1's metadata cached on D
        hung = {f"h{i}": pair.p.prefill(f"h{i}", 40, 10 + i) for i in range(3)}
        good = p2.prefill("good", 40, 7)
        pid = pair.p.peer.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait_stopped(pid)
            for rid, params in hung.items():
                pair.d.decode(rid, 40, params)
            pair.d.decode("good", 40, good)
            times, errors = _finish_times(pair.d, {"good", *hung}, timeout_s=30.0)
        finally:
            os.kill(pair.p.peer.proc.pid, signal.SIGCONT)
        # Behind the hung requests it would wait >= 3 s (each waits out 2 RPC attempts of 0.5 s).
        assert times["good"] < 2.0, f"P2's request waited {times['good']:.2f} s behind the hung P1"
        assert pair.d.verify("good", 7) > 0 and not errors & set(pair.d.blocks["good"][0])
        assert errors == {b for rid in hung for b in pair.d.blocks[rid][0]}  # every hung request failed
    finally:
        p2.drop()


@pytest.mark.timeout(120)
def test_after_p_dies_later_requests_fail_fast_until_it_answers_again(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(p_tp=1, d_tp=1, own_process=True, d_extra={"peer_retry_s": 0.5})
    assert pair.transfer("warm", 40, seed=1) == set()
    params = {f"r{i}": pair.p.prefill(f"r{i}", 40, 10 + i) for i in range(6)}
    pair.p.peer.kill()
    pair.d.decode("r0", 40, params["r0"])
    first, errors = _finish_times(pair.d, {"r0"}, timeout_s=10.0)
    assert errors == set(pair.d.blocks["r0"][0])
    for i in range(1, 6):
        pair.d.decode(f"r{i}", 40, params[f"r{i}"])
        took, errors = _finish_times(pair.d, {f"r{i}"}, timeout_s=10.0)
        assert took[f"r{i}"] < 0.1, f"request {i} after P died waited {took[f'r{i}']:.3f} s (first: {first['r0']:.2f})"
        assert errors == set(pair.d.blocks[f"r{i}"][0])
    # P comes back on the same ports: after peer_retry_s one request probes it and pulls again.
    time.sleep(0.6)
    with PeerProcess() as again:
        p = again.create("back", pair.extra, SPEC)
        back = p.prefill("back", 40, 5)
        pair.d.decode("back", 40, back)
        assert pair.d.wait_recv({"back"}, timeout_s=15.0) == set()
        assert pair.d.verify("back", 5) > 0
        p.drop()


class OutlastsTheLease(EngineWrapper):
    """Our `TransferBackend` around the real engine: a read that takes longer than P's lease.

    Before the real read it waits past the lease and lets P run its lease check (``on_stall``), so
    P frees (and may reuse) the blocks while D is still reading them.
    """

    def __init__(self, real: MooncakeEngine, stall_s: float) -> None:
        super().__init__(real)
        self.stall_s = stall_s
        self.on_stall: Callable[[], Any] = lambda: None
        self.reads = 0

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        self.reads += 1
        time.sleep(self.stall_s)
        self.on_stall()
        self.real.read(session, batch, timeout_s=timeout_s)


@pytest.mark.timeout(60)
def test_a_read_that_outlasts_the_lease_never_reports_success(make_pair: Callable[..., Any]) -> None:
    engine = OutlastsTheLease(get_engine("127.0.0.1", "tcp"), stall_s=0.8)
    pair = make_pair(p_tp=1, d_tp=1, lease_s=0.4, d_engine=engine)
    freed: list[str] = []
    engine.on_stall = lambda: freed.extend(pair.p.poll()["freed"])  # P's lease check runs mid-read
    params = pair.p.prefill("long", 40, 1)
    pair.d.decode("long", 40, params)
    errors = pair.d.wait_recv({"long"}, timeout_s=15.0)
    assert engine.reads == 1 and freed == ["long"]  # control: P really freed the blocks during the read
    assert errors == set(pair.d.blocks["long"][0])  # so the read must not count as a success
    engine.stall_s = 0.0  # control: a read within the lease succeeds
    assert pair.transfer("short", 40, seed=2) == set() and pair.d.verify("short", 2) > 0
