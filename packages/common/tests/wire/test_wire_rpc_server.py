"""RpcServer: binding rules, lifecycle (threads joined), endpoint construction, requests answered inline."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, InvalidTransition, ProtocolError
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.zmq_rpc import RpcClient, RpcServer, tcp_endpoint
from ascend_dist.common.zmq_server import KIND_REQUEST, frame_limit, pack_header


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    # term() would block on a leaked socket; the timeout below turns that into a failure.
    context.term()


def _echo(payload: bytes) -> bytes:
    return payload


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("127.0.0.1", 5555, "tcp://127.0.0.1:5555"),
        ("10.0.0.7", 0, "tcp://10.0.0.7:0"),
        ("::1", 80, "tcp://[::1]:80"),
        ("[fe80::1]", 80, "tcp://[fe80::1]:80"),
        ("node-3.cluster", 65535, "tcp://node-3.cluster:65535"),
    ],
)
def test_tcp_endpoint(host: str, port: int, expected: str) -> None:
    assert tcp_endpoint(host, port) == expected


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", "", "[::]"])
def test_tcp_endpoint_refuses_wildcards_by_default(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        tcp_endpoint(host, 5555)
    assert info.value.field == "host"
    assert "allow_wildcard" in str(info.value)
    assert tcp_endpoint(host, 5555, allow_wildcard=True).startswith("tcp://")


@pytest.mark.parametrize(("host", "port", "field"), [("h", -1, "port"), ("h", 65536, "port"), ("h", True, "port")])
def test_tcp_endpoint_validates_port(host: str, port: int, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        tcp_endpoint(host, port)
    assert info.value.field == field


@pytest.mark.parametrize("host", ["a b", 127])
def test_tcp_endpoint_validates_host(host: object) -> None:
    with pytest.raises(ConfigError, match="host"):
        tcp_endpoint(host, 1)  # type: ignore[arg-type]


def test_server_binds_only_the_given_host(ctx: zmq.Context[Any]) -> None:
    with RpcServer("127.0.0.1", 0, _echo, ctx=ctx, poll_interval_s=0.02) as server:
        assert server.port > 0
        assert server.endpoint == f"tcp://127.0.0.1:{server.port}"  # read back from ZMQ_LAST_ENDPOINT


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", ""])
def test_server_refuses_wildcard_hosts(ctx: zmq.Context[Any], host: str) -> None:
    with pytest.raises(ConfigError) as info:
        RpcServer(host, 0, _echo, ctx=ctx)
    assert info.value.field == "host"


def test_server_on_a_given_port_and_port_in_use(ctx: zmq.Context[Any]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with RpcServer("127.0.0.1", port, _echo, ctx=ctx) as server:
        assert server.port == port
        with pytest.raises(ConfigError) as info:
            RpcServer("127.0.0.1", port, _echo, ctx=ctx)
        assert info.value.field == "port"


def test_server_on_a_foreign_address_is_a_config_error(ctx: zmq.Context[Any]) -> None:
    with pytest.raises(ConfigError) as info:
        RpcServer("192.0.2.1", 0, _echo, ctx=ctx)  # TEST-NET-1: never a local interface
    assert info.value.field == "host"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"handler": None}, "handler"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"poll_interval_s": 0}, "poll_interval_s"),
    ],
)
def test_server_arguments_are_validated(ctx: zmq.Context[Any], kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"handler": _echo, **kwargs}
    with pytest.raises(ConfigError) as info:
        RpcServer("127.0.0.1", 0, ctx=ctx, **args)
    assert info.value.field == field


def test_stop_joins_the_thread_and_is_idempotent(ctx: zmq.Context[Any]) -> None:
    baseline = set(threading.enumerate())
    server = RpcServer("127.0.0.1", 0, _echo, ctx=ctx, poll_interval_s=0.02, name="meta")
    assert not server.running
    server.start()
    assert server.running
    started = set(threading.enumerate()) - baseline
    assert sorted(t.name for t in started) == [f"meta-handler:{server.port}", f"meta-server:{server.port}"]
    with pytest.raises(InvalidTransition):
        server.start()
    server.stop()
    assert set(threading.enumerate()) == baseline
    assert not server.running
    server.stop()
    with pytest.raises(InvalidTransition):
        server.start()


def test_stop_without_start_closes_the_socket(ctx: zmq.Context[Any]) -> None:
    server = RpcServer("127.0.0.1", 0, _echo, ctx=ctx)
    server.stop()
    server.stop()
    assert not server.running
    # The ctx fixture's term() returns only because the never-served socket was closed.


def test_stop_times_out_on_a_stuck_handler_then_succeeds(ctx: zmq.Context[Any]) -> None:
    entered = threading.Event()
    release = threading.Event()

    def handler(payload: bytes) -> bytes:
        entered.set()
        release.wait(5.0)
        return payload

    server = RpcServer("127.0.0.1", 0, handler, ctx=ctx, poll_interval_s=0.02)
    server.start()
    with RpcClient(ctx, timeout_s=0.2, retries=1) as rpc:
        with pytest.raises(DeadlineExceeded):
            rpc.request(server.endpoint, b"x")
        assert entered.wait(2.0)
        with pytest.raises(DeadlineExceeded, match="did not stop"):
            server.stop(timeout_s=0.05)
        release.set()
        server.stop(timeout_s=5.0)
    assert not server.running


def test_grossly_oversized_frame_drops_only_that_connection(ctx: zmq.Context[Any]) -> None:
    with RpcServer("127.0.0.1", 0, _echo, ctx=ctx, max_bytes=1024, poll_interval_s=0.02) as server:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        try:
            raw.connect(server.endpoint)
            raw.send_multipart([b"", pack_header(KIND_REQUEST, 1), b"\x00" * (frame_limit(1024) + 1)])
            assert not raw.poll(100, zmq.POLLIN)
        finally:
            raw.close(linger=0)
        with RpcClient(ctx, timeout_s=2.0, retries=1) as rpc:
            assert rpc.request(server.endpoint, b"still here") == b"still here"


def test_ipv6_loopback_round_trip(ctx: zmq.Context[Any]) -> None:
    try:
        server = RpcServer("::1", 0, _echo, ctx=ctx, poll_interval_s=0.02)
    except ConfigError:
        pytest.skip("no IPv6 loopback on this machine")
    with server, RpcClient(ctx, timeout_s=2.0, retries=1) as rpc:
        assert server.endpoint == f"tcp://[::1]:{server.port}"
        assert rpc.request(tcp_endpoint("::1", server.port), b"v6") == b"v6"


def _thread_echo(payload: bytes) -> bytes:
    """Answers with the payload and the name of the thread that ran the handler."""
    if payload == b"fail":
        raise ValueError("handler refused")
    return payload + b"@" + threading.current_thread().name.encode()


@pytest.mark.parametrize("secret", [None, DeploymentSecret(b"s" * 32)])
def test_inline_requests_are_answered_on_the_socket_thread(ctx: zmq.Context[Any], secret: Any) -> None:
    def inline(payload: bytes) -> bool:
        if payload == b"odd":
            raise ValueError("cannot tell")  # the predicate failing: the handler thread answers
        return payload.startswith(b"fast") or payload == b"fail"

    with (
        RpcServer("127.0.0.1", 0, _thread_echo, ctx=ctx, poll_interval_s=0.02, secret=secret, inline=inline) as srv,
        RpcClient(ctx, timeout_s=2.0, retries=1, secret=secret) as rpc,
    ):
        assert rpc.request(srv.endpoint, b"fast").startswith(b"fast@rpc-server:")  # the MAC'ed reply verified
        assert rpc.request(srv.endpoint, b"slow").startswith(b"slow@rpc-handler:")
        assert rpc.request(srv.endpoint, b"odd").startswith(b"odd@rpc-handler:")
        with pytest.raises(ProtocolError, match="ValueError: handler refused"):
            rpc.request(srv.endpoint, b"fail")  # an inline handler's error is an error frame, the server lives
        assert rpc.request(srv.endpoint, b"fast again").startswith(b"fast again@rpc-server:")


@pytest.mark.parametrize("inline", [True, False])
def test_an_inline_request_is_not_queued_behind_a_slow_one(ctx: zmq.Context[Any], inline: bool) -> None:
    """The point of `inline`: a lease renewal answered while the handler thread is busy.

    The control, without `inline`: it waits behind the slow request and times out."""
    entered, release = threading.Event(), threading.Event()

    def handler(payload: bytes) -> bytes:
        if payload == b"slow":
            entered.set()
            release.wait(5.0)
        return payload

    server = RpcServer("127.0.0.1", 0, handler, ctx=ctx, poll_interval_s=0.02,
                       inline=(lambda p: p == b"renew") if inline else None)  # fmt: skip
    with server, RpcClient(ctx, timeout_s=0.5, retries=1) as rpc:
        slow = threading.Thread(target=lambda: rpc.request(server.endpoint, b"slow", timeout_s=5.0))
        slow.start()
        try:
            assert entered.wait(2.0)
            if inline:
                assert rpc.request(server.endpoint, b"renew") == b"renew"
            else:
                with pytest.raises(DeadlineExceeded):
                    rpc.request(server.endpoint, b"renew")
        finally:
            release.set()
            slow.join(10.0)
