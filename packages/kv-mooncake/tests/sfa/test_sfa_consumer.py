"""D's read thread over its real ZMQ server, with a fake engine (the `Reader` view of our engine interface).

Covers the completion rules precisely: a request counts as received only on P's `Commit`, from
every contributor (duplicates do not count), never at D's last read; P's verdict fails a request at
once; a failed engine read fails the batch's requests, ranks owning nothing still answer, and
reads past P's budget, unknown or hello-less requests are refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from ascend_dist.common.errors import ConfigError, TransferError
from ascend_dist.common.regions import RegisterRegions
from ascend_dist.common.wire import Codec
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.messages import Refused
from ascend_dist.kv_mooncake.pull.config import Role
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.consumer import ConsumerWorker
from ascend_dist.kv_mooncake.sfa.messages import (
    Commit,
    Committed,
    Hello,
    HelloAck,
    LayerMeta,
    ReadDone,
    ReadFailed,
    ReadReady,
    ReadReq,
    Reply,
    Request,
    TensorSpan,
    reply_codec,
    request_codec,
)
from ascend_dist.kv_mooncake.sfa.plan import DestLayer
from ascend_dist.kv_mooncake.sfa.producer import make_sfa_handshake
from ascend_dist.kv_mooncake.sfa.scheduler import ConsumerMetadata, RecvReq

LAYER = "model.layers.0.self_attn.attn"


class FakeEngine:
    """Our engine interface's `Reader` view: records reads; a nonzero ``rc`` fails each one."""

    def __init__(self) -> None:
        self.rc = 0
        self.delay_s = 0.0
        self.reads: list[tuple[str, list[int], list[int], list[int]]] = []
        self.registered: list[tuple[int, int]] = []

    @property
    def session(self) -> str:
        return "127.0.0.1:1234"

    @property
    def transport_ports(self) -> tuple[int, ...]:
        return ()

    def register(self, regions: RegisterRegions) -> None:
        self.registered.extend(zip(regions.ptrs, regions.lengths, strict=True))

    def unregister(self, regions: RegisterRegions) -> None:
        pass

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        self.reads.append((session, batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist()))
        time.sleep(self.delay_s)
        if self.rc != 0:
            raise TransferError(f"batch_transfer_sync_read returned {self.rc}", peer=session)


def _config(p_tp: int = 2, d_tp: int = 1, model: str = "m") -> SfaConfig:
    extra = {"prefill": {"tp_size": p_tp}, "decode": {"tp_size": d_tp}, "transfer_backend": "mooncake"}
    extra |= {"quarantine_s": 0.0, "dest_wait_s": 0.2, "recv_timeout_s": 30.0}
    return SfaConfig.from_kv_transfer_config(
        engine_id="D", kv_role=Role.CONSUMER.value, kv_port=free_port_range(d_tp), extra=extra, model=model
    )


class Channel:
    def __init__(self, config: SfaConfig, port: int) -> None:
        self.config = config
        self.client = RpcClient(timeout_s=5.0, retries=1)
        self.endpoint = tcp_endpoint("127.0.0.1", port)
        self.requests: Codec[Request] = request_codec(1 << 20)
        self.replies: Codec[Reply] = reply_codec(1 << 20)

    def send(self, msg: Request) -> Reply:
        return self.replies.decode(self.client.request(self.endpoint, self.requests.encode(msg)))

    def hello(self, sender: str, *, model: str = "m", block_bytes: int = 64) -> Reply:
        p_cfg = _config(model=model)
        layer = LayerMeta(layer_idx=0, main=[TensorSpan(1000, block_bytes)], indexer=[TensorSpan(9000, 16)])
        hs = make_sfa_handshake(p_cfg, sender, 1)
        return self.send(Hello(handshake=hs, engine_id="P", sender=sender, session="peer:1", layers={LAYER: layer}))


@pytest.fixture
def d() -> Iterator[tuple[ConsumerWorker, FakeEngine, Channel]]:
    config = _config()
    engine = FakeEngine()
    worker = ConsumerWorker(config, tp_rank=0, backend=engine)
    worker.register({LAYER: DestLayer((50_000,), (64,), (90_000,), (16,))}, [(50_000, 6400), (90_000, 1600)])
    channel = Channel(config, worker.port)
    yield worker, engine, channel
    channel.client.close()
    worker.shutdown()


def _ready(sender: str, member: int, reads: list[ReadReq], done: list[str], **kw: Any) -> ReadReady:
    return ReadReady(
        sender=sender,
        layer_idx=0,
        layer_name=LAYER,
        reads=reads,
        done_ext_ids=done,
        group_member_idx=member,
        tp_ratio=2,
        **kw,
    )


def _commit(sender: str, member: int, ext_ids: list[str], failed: tuple[str, ...] = ()) -> Commit:
    return Commit(sender=sender, ext_ids=ext_ids, failed_ext_ids=list(failed), group_member_idx=member, tp_ratio=2)


def _add(worker: ConsumerWorker, ext: str, main: tuple[int, ...], idx: tuple[int, ...]) -> None:
    worker.start_load_kv(ConsumerMetadata((RecvReq(f"{ext}-int", ext, main, idx),)))


def test_done_needs_every_contributor_and_duplicates_do_not_count(d: Any) -> None:
    worker, engine, ch = d
    _add(worker, "r", (10, 11, 12), (20, 21, 22))
    for sender in ("P/tp0", "P/tp1"):
        assert isinstance(ch.hello(sender), HelloAck)
    read = ReadReq("r", [1, 2, 3], [4, 5, 6], 0, 0)
    assert isinstance(ch.send(_ready("P/tp0", 0, [read], ["r"])), ReadDone)
    assert isinstance(ch.send(_ready("P/tp1", 1, [read], ["r"])), ReadDone)
    assert worker.get_finished() == (set(), set())  # every read answered, nothing committed yet
    assert ch.send(_commit("P/tp0", 0, ["r"])) == Committed(failed=[])
    assert ch.send(_commit("P/tp0", 0, ["r"])) == Committed(failed=[])  # a duplicate
    assert worker.get_finished() == (set(), set())
    assert ch.send(_commit("P/tp1", 1, ["r"])) == Committed(failed=[])
    assert worker.get_finished() == (set(), {"r-int"})
    # member 0 read main (3 blocks, one run) + its indexer half; member 1 only its indexer half
    (_, local0, peer0, len0), (_, _, _, len1) = engine.reads
    assert (local0[0], peer0[0], len0[0]) == (50_000 + 10 * 64, 1000 + 64, 3 * 64)
    assert sum(len1) == 16 * 1 and sum(len0) == 3 * 64 + 16 * 2
    assert worker.get_block_ids_with_load_errors() == set()


def test_failed_engine_read_fails_the_batch_and_reports_its_blocks(d: Any) -> None:
    worker, engine, ch = d
    _add(worker, "a", (10,), (20,))
    _add(worker, "b", (11,), (21,))
    ch.hello("P/tp0")
    engine.rc = -1
    reply = ch.send(_ready("P/tp0", 0, [ReadReq("a", [1], [2]), ReadReq("b", [3], [4])], []))
    assert isinstance(reply, ReadFailed) and "returned -1" in reply.error
    assert len(engine.reads) == 2  # read_retries=1: one retry (Mooncake #4209), then the batch fails
    assert worker.get_block_ids_with_load_errors() == {10, 20, 11, 21}
    assert worker.get_finished() == (set(), {"a-int", "b-int"})  # quarantine_s = 0
    engine.rc = 0
    # D forgot the sender it could not read (a dead P's entry must not stay): a live P greets again.
    forgotten = ch.send(_ready("P/tp0", 0, [ReadReq("a", [1], [2])], ["a"]))
    assert isinstance(forgotten, ReadFailed) and "no hello" in forgotten.error
    ch.hello("P/tp0")
    later = ch.send(_ready("P/tp0", 0, [ReadReq("a", [1], [2])], ["a"]))  # a later layer of a failed request
    assert isinstance(later, ReadDone) and later.failed == ["a"]


def test_a_rank_owning_nothing_still_answers(d: Any) -> None:
    worker, engine, ch = d
    _add(worker, "r", (10,), (20,))
    ch.hello("P/tp1")
    reply = ch.send(_ready("P/tp1", 1, [ReadReq("r", [1], [])], []))  # member 1: no main, no indexer blocks
    assert isinstance(reply, ReadDone) and reply.failed == [] and engine.reads == []


def test_refusals(d: Any) -> None:
    worker, engine, ch = d
    _add(worker, "r", (10,), (20,))
    assert isinstance(ch.send(_ready("P/tp9", 0, [ReadReq("r", [1], [2])], [])), ReadFailed)  # no hello
    refused = ch.hello("P/tp0", model="other")
    assert isinstance(refused, Refused) and refused.field == "model"
    refused = ch.hello("P/tp0", block_bytes=32)
    assert isinstance(refused, Refused) and "main block bytes" in refused.field
    ch.hello("P/tp0")
    start = time.monotonic()
    unknown = ch.send(_ready("P/tp0", 0, [ReadReq("nobody", [1], [2])], []))
    assert isinstance(unknown, ReadDone) and unknown.failed == ["nobody"]
    assert 0.15 < time.monotonic() - start < 3.0  # waited dest_wait_s for D's own step, no longer
    assert engine.reads == []


def test_reads_for_unknown_requests_cannot_keep_the_read_thread_parked(d: Any) -> None:
    worker, engine, ch = d
    ch.hello("P/tp0")
    start = time.monotonic()
    first = ch.send(_ready("P/tp0", 0, [ReadReq("nobody", [1], [2])], []))
    assert isinstance(first, ReadDone) and first.failed == ["nobody"]
    assert time.monotonic() - start > 0.15  # control: the first one waited dest_wait_s (0.2 s)
    for i in range(10):  # a repeat, then other unknown ids: answered without waiting
        start = time.monotonic()
        again = ch.send(_ready("P/tp0", 0, [ReadReq("nobody" if i == 0 else f"ghost{i}", [1], [2])], []))
        assert isinstance(again, ReadDone) and len(again.failed) == 1
        assert time.monotonic() - start < 0.15
    # A request whose destination D knows is still read during the back-off.
    _add(worker, "r", (10,), (20,))
    served = ch.send(_ready("P/tp0", 0, [ReadReq("r", [1], [2])], []))
    assert isinstance(served, ReadDone) and served.failed == [] and engine.reads


def test_p_verdict_fails_a_request_at_once_and_a_failed_one_is_never_committed(d: Any) -> None:
    worker, _, ch = d
    _add(worker, "a", (10,), (20,))
    _add(worker, "b", (11,), (21,))
    ch.hello("P/tp0")
    ch.hello("P/tp1")
    reads = [ReadReq("a", [1], [2]), ReadReq("b", [3], [4])]
    assert isinstance(ch.send(_ready("P/tp0", 0, reads, ["a", "b"])), ReadDone)
    # P gave up on a (its deadline passed before D's answer reached it): a fails now, b counts.
    assert ch.send(_commit("P/tp0", 0, ["b"], failed=("a",))) == Committed(failed=[])
    assert ch.send(_commit("P/tp1", 1, ["a", "b"])) == Committed(failed=["a"])  # the other member cannot revive it
    assert worker.get_block_ids_with_load_errors() == {10, 20}
    assert worker.get_finished() == (set(), {"a-int", "b-int"})  # quarantine_s = 0
    assert worker.take_failed_recving() == {"a-int"}
    # A commit from a sender D never greeted counts nothing.
    _add(worker, "c", (12,), (22,))
    assert ch.send(_commit("P/tp7", 0, ["c"])) == Committed(failed=["c"])
    assert worker.get_finished() == (set(), set())


def test_no_read_attempt_starts_after_p_budget(d: Any) -> None:
    """The first attempt fails after 100 ms; P's budget (50 ms) has passed, so D does not retry."""
    worker, engine, ch = d
    _add(worker, "r", (10,), (20,))
    ch.hello("P/tp0")
    engine.rc, engine.delay_s = -1, 0.1
    reply = ch.send(_ready("P/tp0", 0, [ReadReq("r", [1], [2])], [], read_budget_ms=50))
    assert isinstance(reply, ReadFailed) and "returned -1" in reply.error
    assert len(engine.reads) == 1  # control: without a budget read_retries=1 reads twice (test above)
    assert worker.get_block_ids_with_load_errors() == {10, 20}


def test_greeted_senders_are_bounded_and_the_latest_still_served(d: Any) -> None:
    """Every P restart greets under a new sender name; D kept each one forever."""
    from ascend_dist.kv_mooncake.sfa.consumer import _PEER_MEMORY

    worker, engine, ch = d
    for i in range(_PEER_MEMORY + 20):
        assert isinstance(ch.hello(f"P{i}/tp0"), HelloAck)
    assert len(worker._peers) == _PEER_MEMORY
    _add(worker, "r", (10,), (20,))
    assert isinstance(ch.send(_ready("P0/tp0", 0, [ReadReq("r", [1], [2])], [])), ReadFailed)  # evicted: greet again
    latest = ch.send(_ready(f"P{_PEER_MEMORY + 19}/tp0", 0, [ReadReq("r", [1], [2])], []))
    assert isinstance(latest, ReadDone) and latest.failed == [] and engine.reads


def test_a_start_whose_port_is_taken_leaves_nothing_registered() -> None:
    class Registrations(FakeEngine):
        def unregister(self, regions: RegisterRegions) -> None:
            for region in zip(regions.ptrs, regions.lengths, strict=True):
                self.registered.remove(region)

    config = _config()
    engine = Registrations()
    first = ConsumerWorker(config, tp_rank=0, backend=engine)
    dest = {LAYER: DestLayer((4096,), (64,), (), ())}
    first.register(dest, [(4096, 64 * 8)])
    try:
        second = ConsumerWorker(config, tp_rank=0, backend=engine)  # the same port
        with pytest.raises(ConfigError, match="port"):
            second.register(dest, [(8192, 64 * 8)])
        assert engine.registered == [(4096, 64 * 8)]  # only the running worker's
        second.shutdown()  # idempotent after a failed start
        assert engine.registered == [(4096, 64 * 8)]
    finally:
        first.shutdown()
    assert engine.registered == []
