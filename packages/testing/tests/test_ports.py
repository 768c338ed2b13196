"""The port helpers against real sockets on 127.0.0.1."""

from __future__ import annotations

import socket

from ascend_dist.testing.ports import free_port, free_port_base, wait_port


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_base_gives_a_bindable_run() -> None:
    base = free_port_base(3)
    socks = [socket.socket() for _ in range(3)]
    try:
        for offset, s in enumerate(socks):
            s.bind(("127.0.0.1", base + offset))
    finally:
        for s in socks:
            s.close()


def test_wait_port_sees_a_listener_and_times_out_without_one() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert wait_port(server.getsockname()[1], 2.0)
    # Nothing listens on a port the OS just handed out and nobody took.
    assert not wait_port(free_port(), 0.3, poll_s=0.05)
