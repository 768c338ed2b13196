"""This process's TCP sockets, read from Linux's procfs: the ports it listens on; cutting connections.

The connections cut are this process's to one peer address and port.

Runs in: worker processes (P records its transport listener; D cuts its connections to a P).

Why: Mooncake's TCP transport can write into D's memory after it reported a read failed, or
while a read hangs on a dead link, once the link returns (Mooncake #4247): the socket's pending
receive still targets D's blocks. Its Python binding has no call to close a peer's connections, so
before D hands such blocks back to vLLM it shuts down its own sockets to that P's transport port.
``shutdown(SHUT_RDWR)`` acts on the socket, not on the descriptor, so a duplicate of Mooncake's
descriptor ends Mooncake's pending receive at once (end of stream): nothing more is read into D's
memory from that connection. Mooncake keeps the cut connection pooled until a transfer fails on it
(`PeerConnections` counts them, so a reader knows such a failure and reads again).

Only sockets this process owns are touched (``/proc/self/fd`` names their inodes), and only those
whose peer is exactly the given address and port. Elsewhere than Linux nothing is found.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

__all__ = [
    "PEER_CONNECTIONS",
    "PeerConnections",
    "TcpSocket",
    "accepts_connections",
    "connections_to",
    "listening_ports",
    "ports_in_use",
    "process_incarnation",
    "sever_closed_connections",
    "sever_connections",
]

logger = logging.getLogger(__name__)

_incarnations: dict[int, str] = {}  # pid -> token: a forked child draws its own


def process_incarnation() -> str:
    """A random token of this process's life: what tells peers a restart on the same ports apart.

    Every worker in one process shares it (they share Mooncake's engine and its ports).
    """
    pid = os.getpid()
    if pid not in _incarnations:  # drawn once per process, not on every call
        _incarnations[pid] = secrets.token_hex(8)
    return _incarnations[pid]


_LISTEN = 0x0A
_CLOSE = 0x07
_CLOSE_WAIT = 0x08  # the peer closed its end (its process ended): the connection is dead
_OPEN = frozenset({0x01, 0x02, 0x03})  # ESTABLISHED, SYN_SENT, SYN_RECV
_TABLES = ("/proc/self/net/tcp", "/proc/self/net/tcp6")


@dataclass(frozen=True)
class TcpSocket:
    """One row of the kernel's TCP table."""

    local: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]
    remote: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]
    state: int
    inode: int


def _address(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """``"0100007F:1F90"`` -> (127.0.0.1, 8080): the kernel prints each 32-bit word in host order."""
    hex_ip, hex_port = field.split(":")
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian hosts (x86, arm)
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(hex_port, 16)


def _rows() -> Iterator[TcpSocket]:
    for path in _TABLES:
        try:
            with open(path, encoding="ascii") as table:
                next(table, None)
                for line in table:
                    cols = line.split()
                    if len(cols) > 9:
                        yield TcpSocket(_address(cols[1]), _address(cols[2]), int(cols[3], 16), int(cols[9]))
        except OSError:
            continue


def _own_sockets() -> dict[int, int]:
    """Socket inode -> one of this process's descriptors for it."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            out.setdefault(int(target[8:-1]), int(name))
    return out


def listening_ports() -> set[int]:
    """The TCP ports this process listens on (every address)."""
    own = _own_sockets()
    return {row.local[1] for row in _rows() if row.state == _LISTEN and row.inode in own}


def ports_in_use(ports: Iterable[int]) -> bool:
    """Whether any socket of this network namespace (TIME_WAIT included) has one of ``ports`` as its own."""
    wanted = set(ports)
    return any(row.local[1] in wanted for row in _rows())


def _peer_ips(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    return {ipaddress.ip_address(info[4][0]) for info in infos}


def _shutdown(fd: int, inode: int) -> bool:
    """Shut down the socket behind ``fd`` if it is still socket ``inode``; True when done."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False  # closed meanwhile
    try:
        if os.fstat(dup).st_ino != inode:  # the descriptor was closed and reused meanwhile
            return False
        with socket.socket(fileno=dup) as sock:  # owns the duplicate: closing it leaves Mooncake's open
            dup = -1
            sock.shutdown(socket.SHUT_RDWR)
            return True
    except OSError as exc:
        logger.debug("shutdown of socket %d: %s", inode, exc)
        return False
    finally:
        if dup >= 0:
            os.close(dup)


def _to_peer(host: str, ports: Iterable[int]) -> Iterator[tuple[TcpSocket, int]]:
    """This process's sockets connected (or connecting, or closing) to ``host`` on ``ports``, each with a descriptor."""
    wanted = set(ports)
    if not wanted:
        return
    ips = _peer_ips(host)
    own = _own_sockets()
    for row in _rows():
        if row.state in (_LISTEN, _CLOSE) or row.remote[1] not in wanted or row.remote[0] not in ips:
            continue
        fd = own.get(row.inode)
        if fd is not None:
            yield row, fd


def connections_to(host: str, ports: Iterable[int]) -> int:
    """How many TCP connections this process has open (or opening) to ``host`` on ``ports``."""
    return sum(1 for row, _ in _to_peer(host, ports) if row.state in _OPEN)


def sever_connections(host: str, ports: Iterable[int]) -> int:
    """Shut down every TCP connection of this process whose peer is ``host`` on one of ``ports``.

    Returns how many were shut down. A socket closed meanwhile is skipped.
    """
    return sum(1 for row, fd in list(_to_peer(host, ports)) if _shutdown(fd, row.inode))


def sever_closed_connections(host: str, ports: Iterable[int]) -> int:
    """Shut down this process's connections to ``host`` on ``ports`` that the peer has closed.

    A pooled connection whose peer process ended sits in CLOSE_WAIT until its owner uses it; the
    next transfer on it fails at once. Live connections are left alone. Returns how many were shut.
    """
    return sum(1 for row, fd in list(_to_peer(host, ports)) if row.state == _CLOSE_WAIT and _shutdown(fd, row.inode))


ACCEPT_PROBE_S = 0.25
"""How long `accepts_connections` waits for a peer's listener (a loopback or LAN answer takes far less)."""


def accepts_connections(host: str, port: int, timeout_s: float = ACCEPT_PROBE_S) -> bool:
    """Whether ``host`` takes a TCP connection on ``port`` now (opened and closed at once, nothing sent)."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


class PeerConnections:
    """What this process knows of its connections to peers' transport ports (one per process).

    Mooncake pools its TCP connections per peer address and drops one only when a transfer fails
    on it, so a connection that is dead (cut by D, or left from a P that died and whose port a new
    P now uses) fails the next transfer at once. This table says when that is the likely cause of
    a failure, so the reader may try again: once per connection cut and not yet seen failing, and
    once for a peer process not seen before.
    """

    def __init__(
        self,
        sever: Callable[[str, Iterable[int]], int] = sever_connections,
        sever_closed: Callable[[str, Iterable[int]], int] = sever_closed_connections,
        accepts: Callable[[str, int], bool] = accepts_connections,
    ) -> None:
        """An empty table.

        ``sever(host, ports)`` cuts this process's connections, ``sever_closed`` only those the
        peer closed; each returns how many. ``accepts(host, port)``: whether the peer's transport
        listens now (a dead peer is never read again).
        """
        self._sever = sever
        self._sever_closed = sever_closed
        self._accepts = accepts
        self._lock = threading.Lock()
        self._sessions: dict[tuple[str, int], str] = {}  # transport endpoint -> its owner last seen
        self._dead: dict[tuple[str, int], int] = {}  # transport endpoint -> cut connections not yet failed

    def adopt(self, host: str, ports: Iterable[int], owner: str) -> int:
        """``owner`` now serves ``host``'s ``ports``: cut what is left from an earlier one (returns how many).

        ``owner`` names the peer process (`AgentMetadata.owner`: its session and the life of that
        process, so a restart on the same ports reads as a new owner). On the first sight of an
        endpoint the earlier owner is unknown (another user of Mooncake's process-wide pool, a push
        or a test, reached a process that had that port before): only connections whose peer
        closed them are cut then, never a live one. A new owner, first seen or not, also allows one
        read that fails at once to be tried again: a connection the old owner reset is gone from
        the kernel's table (nothing to cut) yet may still be pooled.
        """
        ports = list(ports)
        stale: list[int] = []
        first: list[int] = []
        with self._lock:
            for port in ports:
                before = self._sessions.get((host, port))
                if before is None:
                    first.append(port)
                elif before != owner:
                    stale.append(port)
                self._sessions[(host, port)] = owner
        cut = 0
        if first:
            cut += self._sever_closed(host, first)
        if stale:
            severed = self._sever(host, stale)
            logger.warning(
                "a new peer %s at %s:%s: cut %d connection(s) left from the old one", owner, host, stale, severed
            )
            cut += severed
        if first or stale:
            self._count_dead(host, ports, max(1, cut))
        return cut

    def sever(self, host: str, ports: Iterable[int]) -> int:
        """Cut this process's connections to ``host`` on ``ports``; remember them as pooled but dead."""
        ports = list(ports)
        return self._count_dead(host, ports, self._sever(host, ports))

    def _count_dead(self, host: str, ports: list[int], cut: int) -> int:
        """Remember ``cut`` connections to ``host``'s ``ports`` as pooled but dead; returns ``cut``."""
        if cut and ports:
            with self._lock:
                key = (host, ports[0])  # one count per peer: its transport ports share one pool
                self._dead[key] = self._dead.get(key, 0) + cut
        return cut

    def take_retry(self, host: str, ports: Iterable[int]) -> bool:
        """A transfer to ``host`` failed at once: whether to try it again (each True uses one retry).

        True when a cut connection (or a new peer's one retry) may explain the failure and the
        peer's transport still takes connections: a peer that died is not read twice.
        """
        ports = list(ports)
        if not ports:
            return False
        with self._lock:
            key = (host, ports[0])
            left = self._dead.get(key, 0)
            if left <= 0:
                return False
            if left == 1:
                del self._dead[key]
            else:
                self._dead[key] = left - 1
        return self._accepts(host, ports[0])


PEER_CONNECTIONS = PeerConnections()
"""This process's table (every receiver in the process shares Mooncake's one connection pool)."""
