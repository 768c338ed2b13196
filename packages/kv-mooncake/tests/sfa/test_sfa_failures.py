"""Failure paths over real processes: dead peers, missing confirmations, bad messages, refused peers.

Each ends in a typed error or reported load errors within a deadline, with every block returned:
D reports every request finished (vLLM frees its blocks) and P's reuse gates all open.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_engines import EngineWrapper

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.wire import Codec
from ascend_dist.common.zmq_rpc import RpcClient, RpcServer
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range, start_on_same_port
from ascend_dist.kv_mooncake._demo.sfa_synthetic import SfaDInstance
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import Reader, get_engine
from ascend_dist.kv_mooncake.sfa.messages import ReadFailed, ReadReady, Reply, reply_codec, request_codec


class LateReader(EngineWrapper):
    """D's engine (our `Reader` interface) whose ``slow_call``-th read starts ``delay_s`` late.

    The bytes are read after the delay: what a read that outlasts P's deadline sees on a real host
    (P has opened its reuse gate and may have overwritten the blocks by then).
    """

    def __init__(self, inner: Reader, *, slow_call: int, delay_s: float) -> None:
        super().__init__(inner)
        self._slow_call = slow_call
        self._delay_s = delay_s
        self.calls = 0

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        self.calls += 1
        if self.calls == self._slow_call:
            time.sleep(self._delay_s)
        self.real.read(session, batch, timeout_s=timeout_s)


class MisdirectedRead(EngineWrapper):
    """D's engine (our `Reader` interface) whose first read goes to a port no engine listens on.

    The real engine fails that read as it fails one of a killed P.
    """

    def __init__(self, inner: Reader, nowhere: str) -> None:
        super().__init__(inner)
        self._nowhere = nowhere
        self.calls = 0

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        self.calls += 1
        self.real.read(self._nowhere if self.calls == 1 else session, batch, timeout_s=timeout_s)


def _all_ids(pair: Any, rid: str) -> set[int]:
    return {b for ids in pair.d.alloc.held[rid] for b in ids}


def _bind_when_released(port: int, timeout_s: float = 5.0) -> RpcServer:
    """Bind a mute server on a port another server just stopped serving.

    ZeroMQ tears a closed socket's listener down on its I/O thread, after ``close`` returns, so the
    port can stay taken for a moment.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return RpcServer("127.0.0.1", port, lambda payload: None, name="mute-d")
        except ConfigError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.timeout(60)
def test_p_killed_before_d_reads_reports_every_block_failed(make_sfa_pair: Callable[..., Any]) -> None:
    """P dispatches its layers, then dies before D's read thread got the destinations."""
    pair = make_sfa_pair(d_extra={"dest_wait_s": 3.0}, own_process=True)
    params = pair.d.decode("x", 40, deliver=False)
    pair.p.prefill([{"rid": "p-x", "prompt_len": 40, "seed": 3, "params": params}])
    deadline = time.monotonic() + 10.0
    while pair.d.workers[0].received < 2:  # hello + the first layer's read request arrived
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pair.p.kill()
    pair.d.step()  # the read thread now reads from a dead P: the engine returns -1
    start = time.monotonic()
    errors = pair.d.wait_recv({"x"}, timeout_s=10.0)
    assert errors == _all_ids(pair, "x")
    assert time.monotonic() - start < 5.0
    assert all(w.pending == 0 for w in pair.d.workers)


@pytest.mark.timeout(60)
def test_p_that_never_sends_is_failed_at_recv_timeout(make_sfa_pair: Callable[..., Any]) -> None:
    pair = make_sfa_pair(d_extra={"recv_timeout_s": 1.0})
    start = time.monotonic()
    pair.d.decode("y", 30)  # the proxy never reaches P
    assert pair.d.wait_recv({"y"}, timeout_s=10.0) == _all_ids(pair, "y")
    assert 0.9 < time.monotonic() - start < 5.0
    assert all(w.pending == 0 for w in pair.d.workers)


@pytest.mark.timeout(60)
def test_dead_d_fails_requests_on_p_and_opens_every_gate(make_sfa_pair: Callable[..., Any]) -> None:
    pair = make_sfa_pair(p_extra={"read_timeout_s": 1.0, "hello_timeout_s": 0.5, "endpoint_retry_s": 30.0})
    params = pair.d.decode("z", 40)
    pair.d.shutdown()  # D's read threads are gone: nobody answers
    start = time.monotonic()
    pair.p.prefill([{"rid": "p-z", "prompt_len": 40, "seed": 4, "params": params}])
    pair.p.prefill([{"rid": "p-z2", "prompt_len": 40, "seed": 5, "params": {**params, "request_id": "z2"}}])
    drained = pair.p.drain()
    assert set(drained["failed"]) == {"z", "z2"}
    assert "DeadlineExceeded" in drained["failed"]["z"]
    # One missed hello, then the endpoint is skipped: not one timeout per layer.
    assert time.monotonic() - start < 4.0


@pytest.mark.timeout(60)
def test_missing_confirmation_times_out_and_releases_the_gate(make_sfa_pair: Callable[..., Any]) -> None:
    """A D endpoint that accepts messages but never answers (a hung read thread)."""
    pair = make_sfa_pair(p_extra={"read_timeout_s": 1.0, "hello_timeout_s": 0.5})
    params = pair.d.decode("m", 24)
    pair.d.shutdown()
    with _bind_when_released(pair.extra["kv_port"]):
        start = time.monotonic()
        pair.p.prefill([{"rid": "p-m", "prompt_len": 24, "seed": 6, "params": params}])
        drained = pair.p.drain()
        assert "m" in drained["failed"]
        assert time.monotonic() - start < 5.0


@pytest.mark.timeout(60)
def test_malformed_and_out_of_order_messages_are_answered_and_d_keeps_serving(
    make_sfa_pair: Callable[..., Any],
) -> None:
    pair = make_sfa_pair()
    replies: Codec[Reply] = reply_codec(1 << 20)
    endpoint = tcp_endpoint("127.0.0.1", pair.extra["kv_port"])
    with RpcClient(timeout_s=2.0, retries=1) as client:
        bad = replies.decode(client.request(endpoint, b"\x93garbage"))
        assert isinstance(bad, ReadFailed) and "malformed" in bad.error
        early = ReadReady(sender="stranger/tp0", layer_idx=0, layer_name="model.layers.0.self_attn.attn", reads=[])
        reply = replies.decode(client.request(endpoint, request_codec(1 << 20).encode(early)))
        assert isinstance(reply, ReadFailed) and "no hello" in reply.error
    pair.run("ok", 33, seed=7)
    assert pair.d.wait_recv({"ok"}) == set()
    assert pair.d.verify("ok", 7) > 0


@pytest.mark.timeout(60)
def test_incompatible_p_is_refused_with_the_field_named(make_sfa_pair: Callable[..., Any]) -> None:
    pair = make_sfa_pair(p_extra={"model": "another-model"}, d_extra={"recv_timeout_s": 1.5})
    pair.run("c", 24, seed=8)
    drained = pair.p.drain()
    assert "model differs" in drained["failed"]["c"]
    assert pair.d.wait_recv({"c"}, timeout_s=10.0) == _all_ids(pair, "c")


@pytest.mark.timeout(60)
def test_layout_mismatch_is_refused(make_sfa_pair: Callable[..., Any]) -> None:
    """D's host pool blocks differ from P's main blocks: refused at hello, never silently corrupted."""
    pair = make_sfa_pair(d_model={"main_dims": (32, 16)}, d_extra={"recv_timeout_s": 1.5})
    pair.run("l", 24, seed=9)
    drained = pair.p.drain()
    assert "main block bytes" in drained["failed"]["l"]
    assert pair.d.wait_recv({"l"}, timeout_s=10.0) == _all_ids(pair, "l")


@pytest.mark.timeout(60)
def test_read_that_outlasts_p_deadline_is_never_reported_loaded(make_sfa_pair: Callable[..., Any]) -> None:
    """D's read of the last layer finishes after P gave up on it (and opened its reuse gate).

    P's clock decides: P marks the request failed, so D must report load errors for it (vLLM
    recomputes), never the request as received. Control: the same pair with a read in time loads.
    """
    readers: list[LateReader] = []

    def late(inner: Reader) -> Reader:
        readers.append(LateReader(inner, slow_call=3, delay_s=2.0))  # 3 layers: the last one's read
        return readers[-1]

    pair = make_sfa_pair(
        p_extra={"read_timeout_s": 1.0, "hello_timeout_s": 1.0, "endpoint_retry_s": 0.0},
        d_extra={"recv_timeout_s": 6.0},
        d_reader=late,
    )
    params = pair.d.decode("late", 40)
    pair.p.prefill([{"rid": "p-late", "prompt_len": 40, "seed": 11, "params": params}])
    drained = pair.p.drain()
    assert "late" in drained["failed"], "P did not time out: the fault was not injected"
    start = time.monotonic()
    errors = pair.d.wait_recv({"late"}, timeout_s=15.0)
    failed_after = time.monotonic() - start
    assert readers[0].calls >= 3
    assert failed_after < 4.0, "D waited out recv_timeout_s: P's verdict did not reach it"
    assert errors == _all_ids(pair, "late"), "D reported a read P had given up on as loaded"
    # Control: a later request through the same pair (every read in time) loads and verifies.
    pair.run("ok", 40, seed=12)
    assert pair.d.wait_recv({"ok"}) == set()
    assert pair.d.verify("ok", 12) > 0


@pytest.mark.timeout(60)
def test_a_sender_d_could_not_read_is_forgotten_and_greets_again(make_sfa_pair: Callable[..., Any]) -> None:
    """D drops the peer entry of a P whose memory the engine failed to read (a killed P's must not
    stay: `test_sfa_leaks`); a P that is alive greets again after the `ReadFailed`, so its next
    request loads instead of being answered "no hello" for good.
    """
    readers: list[MisdirectedRead] = []

    def misdirect(inner: Reader) -> Reader:
        readers.append(MisdirectedRead(inner, f"127.0.0.1:{free_port_range(1)}"))
        return readers[-1]

    pair = make_sfa_pair(d_extra={"read_retries": 0}, d_reader=misdirect)
    pair.run("bad", 24, seed=21)
    assert "bad" in pair.p.drain()["failed"]
    assert pair.d.wait_recv({"bad"}, timeout_s=10.0) == _all_ids(pair, "bad")
    assert readers[0].calls == 1, "the fault was not injected: D read more than the failed layer"
    pair.run("ok", 24, seed=22)  # P greets again: without it D answers "no hello" to every read
    assert pair.d.wait_recv({"ok"}, timeout_s=10.0) == set()
    assert pair.d.verify("ok", 22) > 0


@pytest.mark.timeout(90)
def test_a_d_restarted_on_its_ports_with_a_new_engine_id_is_read_into_again(make_sfa_pair: Callable[..., Any]) -> None:
    """vLLM draws a new engine id at each start. P's link to D's endpoint remembered the engine id
    D greeted it with; before the fix every later request to the restarted D named another one and
    P refused it (without telling D, which failed it at ``recv_timeout_s``), for good."""
    pair = make_sfa_pair(d_extra={"recv_timeout_s": 5.0})
    pair.run("before", 24, seed=31)
    assert pair.d.wait_recv({"before"}) == set()
    assert pair.d.verify("before", 31) > 0
    pair.d.finish("before")
    pair.d.shutdown()
    config = dataclasses.replace(pair.d.config, engine_id=f"{pair.d.config.engine_id}-restarted")
    pair.d = start_on_same_port(lambda: SfaDInstance(config, pair.d.model, get_engine("127.0.0.1")))
    for i in range(2):
        rid = f"after{i}"
        pair.run(rid, 24, seed=40 + i)
        assert pair.d.wait_recv({rid}, timeout_s=15.0) == set(), pair.p.drain()["failed"]
        assert pair.d.verify(rid, 40 + i) > 0
