"""SocketPool: bounded per endpoint, least-recently-used endpoints evicted, closed sockets never leak."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.zmq_rpc import SocketPool


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _sockets(ctx: zmq.Context[Any], n: int) -> list[zmq.Socket[Any]]:
    return [ctx.socket(zmq.DEALER) for _ in range(n)]


def test_take_returns_what_was_put(ctx: zmq.Context[Any]) -> None:
    pool = SocketPool()
    (sock,) = _sockets(ctx, 1)
    assert pool.take("tcp://a:1") is None
    pool.put("tcp://a:1", sock)
    assert pool.idle_count("tcp://a:1") == 1
    assert pool.take("tcp://b:1") is None
    assert pool.take("tcp://a:1") is sock
    assert pool.idle_count() == 0
    assert pool.endpoints() == []
    sock.close()


def test_per_endpoint_bound_closes_extra_sockets(ctx: zmq.Context[Any]) -> None:
    pool = SocketPool(max_per_endpoint=2)
    socks = _sockets(ctx, 3)
    for sock in socks:
        pool.put("tcp://a:1", sock)
    assert pool.idle_count("tcp://a:1") == 2
    assert [s.closed for s in socks] == [False, False, True]
    pool.close()
    assert all(s.closed for s in socks)


def test_least_recently_used_endpoint_is_evicted(ctx: zmq.Context[Any]) -> None:
    pool = SocketPool(max_endpoints=2)
    a, b, a2, c = _sockets(ctx, 4)
    pool.put("a", a)
    pool.put("b", b)
    pool.put("a", a2)  # touching "a" makes "b" the least recently used
    pool.put("c", c)
    assert pool.endpoints() == ["a", "c"]
    assert b.closed
    assert not (a.closed or a2.closed or c.closed)
    pool.close()


def test_close_closes_idle_and_later_returned_sockets(ctx: zmq.Context[Any]) -> None:
    pool = SocketPool()
    idle, in_use = _sockets(ctx, 2)
    pool.put("a", idle)
    pool.close()
    pool.close()
    assert pool.closed
    assert idle.closed
    pool.put("a", in_use)  # a request that finished after close
    assert in_use.closed
    assert pool.idle_count() == 0


def test_concurrent_take_never_hands_out_one_socket_twice(ctx: zmq.Context[Any]) -> None:
    pool = SocketPool(max_per_endpoint=8)
    socks = _sockets(ctx, 8)
    for sock in socks:
        pool.put("a", sock)
    taken: list[zmq.Socket[Any]] = []
    lock = threading.Lock()

    def take() -> None:
        sock = pool.take("a")
        if sock is not None:
            with lock:
                taken.append(sock)

    threads = [threading.Thread(target=take) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    assert len(taken) == 8
    assert len({id(s) for s in taken}) == 8
    for sock in taken:
        sock.close()


@pytest.mark.parametrize("field", ["max_per_endpoint", "max_endpoints"])
@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_bounds_are_validated(field: str, bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        SocketPool(**{field: bad})  # type: ignore[arg-type]
    assert info.value.field == field
