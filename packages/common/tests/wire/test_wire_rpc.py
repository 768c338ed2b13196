"""RpcClient against RpcServer over real sockets on 127.0.0.1 (OS-assigned ports)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from ascend_dist.common.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidTransition,
    MessageTooLarge,
    ProtocolError,
)
from ascend_dist.common.zmq_rpc import RpcClient, RpcServer
from ascend_dist.common.zmq_server import KIND_REPLY, KIND_REQUEST, pack_header, unpack_header
from ascend_dist.testing.ports import free_port


class CountingContext(zmq.Context[Any]):
    """A real ZMQ context that remembers every socket it created, to check closing and reuse."""

    created: list[zmq.Socket[Any]]

    def __init__(self) -> None:
        super().__init__()
        self.created = []

    def socket(self, socket_type: int, **kwargs: Any) -> zmq.Socket[Any]:  # type: ignore[override]
        sock = super().socket(socket_type, **kwargs)
        self.created.append(sock)
        return sock


@pytest.fixture
def ctx() -> Iterator[CountingContext]:
    """A private context; at teardown every socket it made must be closed (no leaks)."""
    context = CountingContext()
    yield context
    leaked = [s for s in context.created if not s.closed]
    context.destroy(linger=0)
    assert not leaked, f"{len(leaked)} socket(s) left open"


ServerFactory = Callable[..., RpcServer]


@pytest.fixture
def make_server(ctx: CountingContext) -> Iterator[ServerFactory]:
    """Start RpcServers on 127.0.0.1 with OS-assigned ports; all are stopped at teardown."""
    servers: list[RpcServer] = []
    baseline = set(threading.enumerate())

    def factory(handler: Callable[[bytes], Any], **kwargs: Any) -> RpcServer:
        kwargs.setdefault("ctx", ctx)
        kwargs.setdefault("poll_interval_s", 0.02)
        server = RpcServer("127.0.0.1", 0, handler, **kwargs)
        servers.append(server)
        server.start()
        return server

    yield factory
    for server in servers:
        server.stop(timeout_s=5.0)
    assert set(threading.enumerate()) <= baseline


def _echo(payload: bytes) -> bytes:
    return b"echo:" + payload


@pytest.fixture
def client(ctx: CountingContext) -> Iterator[RpcClient]:
    rpc = RpcClient(ctx, timeout_s=1.0, retries=3, retry_delay_s=0.02)
    yield rpc
    rpc.close()


def _dealer_sockets(ctx: CountingContext) -> list[zmq.Socket]:
    return [s for s in ctx.created if s.closed or s.socket_type == zmq.DEALER]


def test_request_reply_and_socket_reuse(make_server: ServerFactory, client: RpcClient) -> None:
    server = make_server(_echo)
    assert client.request(server.endpoint, b"a") == b"echo:a"
    assert client.pool.idle_count(server.endpoint) == 1
    assert client.request(server.endpoint, b"b") == b"echo:b"
    assert client.pool.idle_count(server.endpoint) == 1  # the same socket went out and came back


def test_handler_exception_becomes_protocol_error_and_server_keeps_serving(
    make_server: ServerFactory, client: RpcClient, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[bytes] = []

    def handler(payload: bytes) -> bytes:
        calls.append(payload)
        if payload == b"boom":
            raise KeyError("no such request")
        return b"ok"

    server = make_server(handler)
    with (
        caplog.at_level(logging.ERROR, logger="ascend_dist.common.zmq_server"),
        pytest.raises(ProtocolError, match="KeyError"),
    ):
        client.request(server.endpoint, b"boom")
    assert calls == [b"boom"]  # an error reply is final: not retried
    assert any("KeyError" in r.getMessage() and r.exc_info for r in caplog.records)
    assert client.request(server.endpoint, b"next") == b"ok"


def test_handler_returning_non_bytes_is_reported(make_server: ServerFactory, client: RpcClient) -> None:
    server = make_server(lambda payload: "text, not bytes")
    with pytest.raises(ProtocolError, match="str"):
        client.request(server.endpoint, b"x")


def test_handler_returning_none_sends_no_reply(make_server: ServerFactory, ctx: CountingContext) -> None:
    seen = threading.Event()

    def handler(payload: bytes) -> None:
        seen.set()

    server = make_server(handler)
    with RpcClient(ctx, timeout_s=0.1, retries=1) as rpc, pytest.raises(DeadlineExceeded):
        rpc.request(server.endpoint, b"notify")
    assert seen.is_set()


def test_malformed_frames_are_dropped_and_server_keeps_serving(
    make_server: ServerFactory, ctx: CountingContext, client: RpcClient, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(_echo, max_bytes=1024)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(server.endpoint)
        with caplog.at_level(logging.WARNING, logger="ascend_dist.common.zmq_server"):
            raw.send_multipart([b"", b"only-one-frame"])  # wrong frame count
            raw.send_multipart([b"x", pack_header(KIND_REQUEST, 1), b"p"])  # non-empty delimiter
            raw.send_multipart([b"", b"\x09" + pack_header(KIND_REQUEST, 2)[1:], b"p"])  # unknown version
            raw.send_multipart([b"", pack_header(KIND_REPLY, 3), b"p"])  # a reply sent as a request
            raw.send_multipart([b"", pack_header(KIND_REQUEST, 4), b"\x00" * 1025])  # over max_bytes
            raw.send_multipart([b"", pack_header(KIND_REQUEST, 5), b"fine"])
            # Same connection, so the reply to id 5 proves the five bad ones were handled first.
            assert raw.poll(2000, zmq.POLLIN)
            frames = raw.recv_multipart()
        assert frames[0] == b""
        assert unpack_header(frames[1]) == (KIND_REPLY, 5)
        assert frames[2] == b"echo:fine"
        assert not raw.poll(50, zmq.POLLIN)  # nothing was answered for the bad ones
        # Three kinds of bad framing (frame count, header, size): each logged once per interval.
        dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
        assert len(dropped) == 3
        assert client.request(server.endpoint, b"after") == b"echo:after"
    finally:
        raw.close(linger=0)


def test_no_server_raises_deadline_exceeded_with_fresh_socket_per_attempt(ctx: CountingContext) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    rpc = RpcClient(ctx, timeout_s=0.15, retries=3, retry_delay_s=0.05)
    try:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            rpc.request(endpoint, b"anyone?")
        elapsed = time.monotonic() - start
        assert 0.15 * 3 <= elapsed < 0.15 * 3 + 0.05 * 2 + 1.0
        assert endpoint in str(info.value)
        assert "3 attempt" in str(info.value)
        assert isinstance(info.value, TimeoutError)
        dealers = _dealer_sockets(ctx)
        assert len(dealers) == 3  # one fresh socket per attempt
        assert all(s.closed for s in dealers)  # none kept
        assert rpc.pool.idle_count() == 0
    finally:
        rpc.close()


def test_per_request_timeout_overrides_the_default(ctx: CountingContext) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with RpcClient(ctx, timeout_s=5.0, retries=1) as rpc:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            rpc.request(endpoint, b"x", timeout_s=0.1)
        assert time.monotonic() - start < 1.0


def test_late_reply_never_answers_the_next_request(make_server: ServerFactory, ctx: CountingContext) -> None:
    release = threading.Event()

    def handler(payload: bytes) -> bytes:
        if payload == b"slow":
            release.wait(2.0)
            return b"reply-to-slow"
        return b"reply-to-" + payload

    server = make_server(handler)
    with RpcClient(ctx, timeout_s=0.1, retries=1) as rpc:
        with pytest.raises(DeadlineExceeded):
            rpc.request(server.endpoint, b"slow")
        assert rpc.pool.idle_count() == 0  # the socket that missed its reply is gone
        release.set()  # the server now answers the abandoned request
        assert rpc.request(server.endpoint, b"fast", timeout_s=2.0) == b"reply-to-fast"
        assert rpc.request(server.endpoint, b"again", timeout_s=2.0) == b"reply-to-again"


def test_reply_with_another_request_id_is_ignored(ctx: CountingContext) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)

    def fake_server() -> None:
        # Answers once with a stale id, a malformed reply, then the right one.
        if not router.poll(2000, zmq.POLLIN):
            return
        identity, _, header, _payload = router.recv_multipart()
        parsed = unpack_header(header)
        assert parsed is not None
        request_id = parsed[1]
        router.send_multipart([identity, b"", pack_header(KIND_REPLY, request_id + 1000), b"stale"])
        router.send_multipart([identity, b"junk"])
        router.send_multipart([identity, b"", pack_header(KIND_REPLY, request_id), b"fresh"])

    thread = threading.Thread(target=fake_server)
    thread.start()
    try:
        with RpcClient(ctx, timeout_s=2.0, retries=1) as rpc:
            assert rpc.request(endpoint, b"q") == b"fresh"
    finally:
        thread.join(5.0)
        router.close(linger=0)
    assert not thread.is_alive()


def test_oversized_reply_is_refused(make_server: ServerFactory, ctx: CountingContext) -> None:
    server = make_server(lambda payload: b"x" * 20)
    with RpcClient(ctx, max_reply_bytes=10, retries=1) as rpc, pytest.raises(MessageTooLarge):
        rpc.request(server.endpoint, b"q")


def test_many_threads_share_one_client(make_server: ServerFactory, ctx: CountingContext) -> None:
    server = make_server(_echo)
    errors: list[BaseException] = []
    rpc = RpcClient(ctx, timeout_s=2.0, retries=1, pool_size=4)

    def worker(n: int) -> None:
        try:
            for i in range(25):
                payload = f"{n}-{i}".encode()
                assert rpc.request(server.endpoint, payload) == b"echo:" + payload
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10.0)
        assert not errors
        assert 1 <= rpc.pool.idle_count(server.endpoint) <= 4
    finally:
        rpc.close()


def test_closed_client_refuses_requests_and_close_is_idempotent(ctx: CountingContext) -> None:
    rpc = RpcClient(ctx)
    rpc.close()
    rpc.close()
    with pytest.raises(InvalidTransition):
        rpc.request("tcp://127.0.0.1:1", b"x")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"retries": 0}, "retries"),
        ({"retry_delay_s": -1}, "retry_delay_s"),
        ({"pool_size": 0}, "max_per_endpoint"),
    ],
)
def test_client_arguments_are_validated(ctx: CountingContext, kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        RpcClient(ctx, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_bad_payload_and_endpoint_are_config_errors(ctx: CountingContext, client: RpcClient) -> None:
    with pytest.raises(ConfigError, match="payload"):
        client.request("tcp://127.0.0.1:1", "text")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="endpoint"):
        client.request("not-an-endpoint", b"x")
