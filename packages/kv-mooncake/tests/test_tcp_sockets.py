"""This process's TCP sockets (`core.tcp_sockets`), over real sockets on 127.0.0.1, and its table of peers.

D cuts its connections to a P's transport port so that a receive pending in Mooncake ends at once
and writes nothing more into D's blocks: the cut must end a receive blocked in another thread,
leave every other connection alone and never close a descriptor it does not own.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator

import pytest

from ascend_dist.kv_mooncake.core.messages import AgentMetadata
from ascend_dist.kv_mooncake.core.tcp_sockets import (
    PeerConnections,
    connections_to,
    listening_ports,
    process_incarnation,
    sever_closed_connections,
    sever_connections,
)

LINUX_ONLY = pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux's procfs")


@pytest.fixture
def servers() -> Iterator[list[socket.socket]]:
    made = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    yield made
    for s in made:
        s.close()


def _port(s: socket.socket) -> int:
    return int(s.getsockname()[1])


@LINUX_ONLY
def test_listening_ports_are_this_processes_listeners(servers: list[socket.socket]) -> None:
    ports = listening_ports()
    assert {_port(s) for s in servers} <= ports
    closed = _port(servers[0])
    servers[0].close()
    assert closed not in listening_ports()


@LINUX_ONLY
@pytest.mark.timeout(20)
def test_a_cut_ends_a_blocked_receive_and_spares_other_connections(servers: list[socket.socket]) -> None:
    victim = socket.create_connection(("127.0.0.1", _port(servers[0])))
    other = socket.create_connection(("127.0.0.1", _port(servers[1])))  # control: another port
    accepted = [servers[0].accept()[0], servers[1].accept()[0]]
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(victim.recv(1 << 16)))  # blocks: nothing is sent
    reader.start()
    try:
        assert connections_to("127.0.0.1", [_port(servers[0])]) == 1
        assert sever_connections("127.0.0.1", [_port(servers[0])]) == 1
        reader.join(5.0)
        assert not reader.is_alive() and got == [b""]  # end of stream: the receive is over
        assert victim.fileno() >= 0  # the owner's descriptor is still open (only the socket was shut down)
        accepted[0].sendall(b"late bytes")  # what the peer sends afterwards is never received
        with contextlib.suppress(ConnectionResetError):  # Linux answers bytes arriving after the cut with a reset
            assert victim.recv(16) == b""
        assert connections_to("127.0.0.1", [_port(servers[0])]) == 0
        other.settimeout(5.0)
        accepted[1].sendall(b"still here")
        assert other.recv(16) == b"still here"
        assert connections_to("127.0.0.1", [_port(servers[1])]) == 1
    finally:
        for s in (victim, other, *accepted):
            s.close()


@LINUX_ONLY
def test_nothing_is_cut_without_ports_or_for_another_host(servers: list[socket.socket]) -> None:
    conn = socket.create_connection(("127.0.0.1", _port(servers[0])))
    try:
        assert sever_connections("127.0.0.1", []) == 0
        assert sever_connections("127.0.0.2", [_port(servers[0])]) == 0
        assert connections_to("127.0.0.1", [_port(servers[0])]) == 1
    finally:
        conn.close()


class _Cuts:
    """Records each cut instead of cutting (the table's ``sever`` collaborator)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.calls: list[tuple[str, list[int]]] = []

    def __call__(self, host: str, ports: Iterable[int]) -> int:
        self.calls.append((host, list(ports)))
        return self.count


def _listening(host: str, port: int) -> bool:
    return True  # the peer's transport takes connections (the table's ``accepts`` collaborator)


def test_a_new_session_on_an_old_transport_port_cuts_the_old_ones_connections() -> None:
    cuts = _Cuts(3)
    table = PeerConnections(sever=cuts, sever_closed=_Cuts(0), accepts=_listening)
    assert table.adopt("10.0.0.2", [16001], "10.0.0.2:15001") == 0  # first sight: nothing the peer closed
    assert table.adopt("10.0.0.2", [16001], "10.0.0.2:15001") == 0  # the same P again
    assert cuts.calls == []
    assert table.adopt("10.0.0.2", [16001], "10.0.0.2:15077") == 3  # P restarted on the same port
    assert cuts.calls == [("10.0.0.2", [16001])]
    assert table.adopt("10.0.0.3", [16001], "10.0.0.3:15001") == 0  # another host, same port number


def test_failures_after_a_cut_are_retried_once_per_connection_cut() -> None:
    table = PeerConnections(sever=_Cuts(2), sever_closed=_Cuts(0), accepts=_listening)
    assert not table.take_retry("10.0.0.2", [16001])  # nothing cut: a failure is a failure
    assert table.sever("10.0.0.2", [16001]) == 2
    assert table.take_retry("10.0.0.2", [16001]) and table.take_retry("10.0.0.2", [16001])
    assert not table.take_retry("10.0.0.2", [16001])
    assert not table.take_retry("10.0.0.2", [])  # a P that named no port


def test_a_cut_of_nothing_allows_no_retry() -> None:
    table = PeerConnections(sever=_Cuts(0), sever_closed=_Cuts(0), accepts=_listening)
    assert table.sever("10.0.0.2", [16001]) == 0
    assert not table.take_retry("10.0.0.2", [16001])


def _wait_closed_by_peer(sock: socket.socket, timeout_s: float = 5.0) -> None:
    """Until the kernel has the peer's FIN for ``sock`` (a read would see end of stream)."""
    sock.settimeout(timeout_s)
    assert sock.recv(1, socket.MSG_PEEK) == b""


@LINUX_ONLY
@pytest.mark.timeout(20)
def test_connections_whose_peer_closed_are_cut_and_live_ones_are_not(servers: list[socket.socket]) -> None:
    """A pooled connection left from a peer process that ended (CLOSE_WAIT) is dead: cut it; a live one
    to the same port is not touched."""
    port = _port(servers[0])
    dead, live = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
    gone, kept = servers[0].accept()[0], servers[0].accept()[0]
    try:
        gone.close()  # the peer's end of `dead` (its process ended)
        _wait_closed_by_peer(dead)
        assert sever_closed_connections("127.0.0.1", [port]) == 1
        assert connections_to("127.0.0.1", [port]) == 1  # the live one
        live.settimeout(5.0)
        kept.sendall(b"still here")
        assert live.recv(16) == b"still here"
        assert sever_closed_connections("127.0.0.1", [port]) == 0  # nothing closed by the peer is left
    finally:
        for s in (dead, live, gone, kept):
            s.close()


@LINUX_ONLY
@pytest.mark.timeout(20)
def test_first_sight_of_a_peer_cuts_what_a_process_gone_from_its_port_left_and_allows_a_retry(
    servers: list[socket.socket],
) -> None:
    """The suite's flaky first pull: Mooncake's process-wide pool held a connection to a port whose
    earlier owner (another test's peer) had ended, and the table had never seen a session there, so
    nothing was cut and the first read failed at once without a retry."""
    port = _port(servers[0])
    stale = socket.create_connection(("127.0.0.1", port))
    peer = servers[0].accept()[0]
    try:
        peer.close()
        _wait_closed_by_peer(stale)
        table = PeerConnections()
        assert table.adopt("127.0.0.1", [port], "127.0.0.1:15001") == 1
        assert table.take_retry("127.0.0.1", [port]) and not table.take_retry("127.0.0.1", [port])
        assert table.adopt("127.0.0.1", [port], "127.0.0.1:15001") == 0  # the same session again: nothing
    finally:
        stale.close()


@LINUX_ONLY
@pytest.mark.timeout(20)
def test_a_new_peer_allows_one_retry_for_a_connection_its_old_owner_reset(servers: list[socket.socket]) -> None:
    """The suite's flaky first pull, second shape: the earlier owner of the port reset the pooled
    connection (a killed process with unread bytes sends RST), so the kernel dropped it from its table
    and nothing can be cut, yet Mooncake may still hold it and fail the first read on it at once."""
    port = _port(servers[0])
    reset = socket.create_connection(("127.0.0.1", port))
    peer = servers[0].accept()[0]
    try:
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        peer.close()  # linger 0: RST
        reset.settimeout(5.0)
        with pytest.raises(ConnectionResetError):
            reset.recv(1)
        table = PeerConnections()
        assert table.adopt("127.0.0.1", [port], "127.0.0.1:15001#a1") == 0  # nothing left to cut...
        assert table.take_retry("127.0.0.1", [port])  # ...but one fast failure is read again
        assert not table.take_retry("127.0.0.1", [port])  # once: a dead P is not read twice per request
        assert table.adopt("127.0.0.1", [port], "127.0.0.1:15001#a1") == 0  # the same owner: no new retry
        assert not table.take_retry("127.0.0.1", [port])
    finally:
        reset.close()


def test_a_p_restarted_on_the_same_session_is_a_new_owner_and_its_old_connections_are_cut() -> None:
    """A P restarted on its RPC and transport ports has the same ``te_session``; its metadata's
    incarnation tells D the pooled connections there belong to the dead process."""

    def agent(incarnation: str) -> AgentMetadata:
        return AgentMetadata(
            engine_id="p",
            te_session="10.0.0.2:15001",
            tp_rank=0,
            block_size=16,
            num_blocks=4,
            layers={},
            transport_ports=(16001,),
            incarnation=incarnation,
        )

    first, restarted, old_peer = agent("0f1e"), agent("9a8b"), agent("")
    assert first.owner != restarted.owner and old_peer.owner == "10.0.0.2:15001"
    cuts = _Cuts(2)
    table = PeerConnections(sever=cuts, sever_closed=_Cuts(0), accepts=_listening)
    assert table.adopt("10.0.0.2", first.transport_ports, first.owner) == 0
    assert table.take_retry("10.0.0.2", [16001])  # first sight's one retry, used
    assert table.adopt("10.0.0.2", first.transport_ports, first.owner) == 0 and cuts.calls == []
    assert table.adopt("10.0.0.2", restarted.transport_ports, restarted.owner) == 2
    assert cuts.calls == [("10.0.0.2", [16001])]
    assert table.take_retry("10.0.0.2", [16001]) and table.take_retry("10.0.0.2", [16001])
    assert not table.take_retry("10.0.0.2", [16001])


@pytest.mark.timeout(60)
def test_the_incarnation_is_one_per_process_life() -> None:
    """Every worker of a process shares it (they share Mooncake's engine and ports); another process,
    a restarted P, draws another."""
    code = "from ascend_dist.kv_mooncake.core.tcp_sockets import process_incarnation as i; print(i(), i())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=50)
    theirs = out.stdout.split()
    assert len(theirs) == 2 and theirs[0] == theirs[1]  # stable within that process
    assert process_incarnation() == process_incarnation() != theirs[0]


@LINUX_ONLY
@pytest.mark.timeout(20)
def test_a_peer_that_stopped_listening_is_not_read_again(servers: list[socket.socket]) -> None:
    """A P killed during its first read fails it at once too: with its listener gone, that failure is
    the P's death, not a dead pooled connection, and reading again would only cost another deadline."""
    port = _port(servers[0])
    table = PeerConnections(sever=_Cuts(1), sever_closed=_Cuts(0))
    assert table.adopt("127.0.0.1", [port], "127.0.0.1:15001#a1") == 0
    assert table.sever("127.0.0.1", [port]) == 1  # two retries in hand
    assert table.take_retry("127.0.0.1", [port])  # listening: read again
    servers[0].close()
    assert not table.take_retry("127.0.0.1", [port])  # gone: never
