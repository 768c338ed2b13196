"""RpcServer under hostile load (real sockets on 127.0.0.1): memory bounded in bytes, small requests
not starved by large ones, repeated errors logged once per interval, codec refusals answered."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from ascend_dist.common.errors import ProtocolError
from ascend_dist.common.frame_queue import ITEM_OVERHEAD, FrameQueue
from ascend_dist.common.log import IntervalLog
from ascend_dist.common.wire import Codec
from ascend_dist.common.zmq_rpc import RpcClient, RpcServer
from ascend_dist.common.zmq_server import KIND_REPLY, KIND_REQUEST, pack_header, unpack_header


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


class Nested(msgspec.Struct, frozen=True, tag="n", tag_field="kind"):
    value: Any = None


def test_deep_nesting_is_a_protocol_error_not_a_recursion_error() -> None:
    codec = Codec(Nested)
    frame = b"\x82\xa4kind\xa1n\xa5value" + b"\x91" * 200_000 + b"\xc0"
    with pytest.raises(ProtocolError, match="RecursionError"):
        codec.decode(frame)


def test_refuse_hook_answer_rides_on_the_error() -> None:
    seen: list[bytes] = []

    def refuse(exc: ProtocolError, buf: bytes) -> bytes:
        seen.append(buf)
        return b"refused"

    codec = Codec(Nested, max_bytes=64, refuse=refuse)
    with pytest.raises(ProtocolError) as junk:
        codec.decode(b"\xc1junk")
    assert junk.value.reply == b"refused" and seen == [b"\xc1junk"]
    with pytest.raises(ProtocolError) as big:
        codec.decode(b"\x00" * 65)
    assert big.value.reply == b"refused" and seen[-1] == b""  # an oversized frame is never handed over
    assert Codec(Nested).decode(Codec(Nested).encode(Nested(1))) == Nested(1)  # control: valid frames decode


def test_a_raising_refuse_hook_still_raises_the_protocol_error() -> None:
    def refuse(exc: ProtocolError, buf: bytes) -> bytes:
        raise RecursionError

    with pytest.raises(ProtocolError) as junk:
        Codec(Nested, refuse=refuse).decode(b"\xc1")
    assert junk.value.reply is None


def test_interval_log_counts_what_it_suppresses(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limiter = IntervalLog(10.0, clock=lambda: now[0])
    log = logging.getLogger("ascend_dist.test.interval")
    with caplog.at_level(logging.WARNING, logger=log.name):
        emitted = [limiter.log(log, logging.WARNING, "junk", "junk frame %d", i) for i in range(100)]
        now[0] = 10.5
        limiter.log(log, logging.WARNING, "junk", "junk frame %d", 100)
        limiter.log(log, logging.WARNING, "other", "another kind")
    assert emitted.count(True) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["junk frame 0", "junk frame 100 [99 more like this in the last 10 s]", "another kind"]


def test_repeated_handler_errors_are_logged_once_per_interval_with_a_count(
    ctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    codec = Codec(Nested)

    def handler(payload: bytes) -> bytes:
        return codec.encode(codec.decode(payload))

    client = RpcClient(ctx, timeout_s=2.0, retries=1)
    with RpcServer("127.0.0.1", 0, handler, ctx=ctx, poll_interval_s=0.02) as server:
        with caplog.at_level(logging.WARNING, logger="ascend_dist.common.zmq_server"):
            for i in range(50):
                with pytest.raises(ProtocolError):
                    client.request(server.endpoint, b"\xc1junk%d" % i)
        assert client.request(server.endpoint, codec.encode(Nested(2))) == codec.encode(Nested(2))
    client.close()
    lines = [r for r in caplog.records if "refused a request" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None  # no traceback for hostile input


def test_a_protocol_error_with_a_reply_is_answered_with_it(ctx: zmq.Context[Any]) -> None:
    codec = Codec(Nested, refuse=lambda exc, buf: b"no: " + str(len(buf)).encode())

    def handler(payload: bytes) -> bytes:
        return codec.encode(codec.decode(payload))

    client = RpcClient(ctx, timeout_s=2.0, retries=1)
    with RpcServer("127.0.0.1", 0, handler, ctx=ctx, poll_interval_s=0.02) as server:
        assert client.request(server.endpoint, b"\xc1junk") == b"no: 5"
    client.close()


def test_frame_queue_is_bounded_in_bytes_per_lane() -> None:
    queue: FrameQueue[int] = FrameQueue(small_budget=2 * (100 + ITEM_OVERHEAD), bulk_budget=4096, small_bytes=100)
    assert queue.put(1, 3000) and not queue.put(2, 3000)  # bulk lane full
    assert queue.put(3, 100) and queue.put(4, 100) and not queue.put(5, 100)  # small lane full
    assert queue.refused == 2
    assert [queue.get(0.1) for _ in range(3)] == [3, 4, 1]  # small first
    assert queue.get(0.01) is None and queue.queued_bytes == 0


def test_a_flood_of_large_frames_is_bounded_and_does_not_delay_small_requests(ctx: zmq.Context[Any]) -> None:
    def handler(payload: bytes) -> bytes:
        if len(payload) > 1024:
            time.sleep(0.3)  # large requests are slow to handle
        return b"ok"

    mib = 1 << 20
    with RpcServer(
        "127.0.0.1", 0, handler, ctx=ctx, max_bytes=mib, queue_bytes=2 * mib, poll_interval_s=0.02
    ) as server:
        floods = []
        for i in range(8):  # eight senders, 4 x 512 KiB each: 16 MiB offered, 2 MiB may wait
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(server.endpoint)
            for j in range(4):
                sock.send_multipart([b"", pack_header(KIND_REQUEST, i * 10 + j), b"\x00" * (mib // 2)])
            floods.append(sock)
        deadline = time.monotonic() + 5.0
        while server.dropped_for_space < 8 * 4 - 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.queued_bytes <= 2 * mib + 4 * ITEM_OVERHEAD
        assert server.dropped_for_space >= 8 * 4 - 8  # at most a few in the handler, four waiting
        client = RpcClient(ctx, timeout_s=1.0, retries=1)
        start = time.monotonic()
        assert client.request(server.endpoint, b"small") == b"ok"
        # Served after at most the one large request in the handler, not after the four queued.
        assert time.monotonic() - start < 0.9
        client.close()
        for sock in floods:
            sock.close(linger=0)


def test_small_requests_go_first_while_large_ones_wait(ctx: zmq.Context[Any]) -> None:
    gate = threading.Event()
    order: list[str] = []

    def handler(payload: bytes) -> bytes:
        if payload == b"first":
            gate.wait(5.0)
        order.append("small" if len(payload) < 1024 else "large")
        return b"ok"

    with RpcServer("127.0.0.1", 0, handler, ctx=ctx, poll_interval_s=0.02) as server:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        sock.send_multipart([b"", pack_header(KIND_REQUEST, 0), b"first"])
        time.sleep(0.1)  # the handler holds "first"
        for i in range(3):
            sock.send_multipart([b"", pack_header(KIND_REQUEST, 1 + i), b"\x00" * 200_000])
        sock.send_multipart([b"", pack_header(KIND_REQUEST, 9), b"late small"])
        time.sleep(0.2)
        gate.set()
        ids = []
        for _ in range(5):
            assert sock.poll(3000, zmq.POLLIN)
            frames = sock.recv_multipart()
            header = unpack_header(frames[1])
            assert header is not None and header[0] == KIND_REPLY
            ids.append(header[1])
        sock.close(linger=0)
    assert ids[:2] == [0, 9] and order[:2] == ["small", "small"]
