"""This process's TCP sockets, read from Linux's procfs: the ports it listens on; cutting connections.

The connections cut are this process's to one peer address and port.

Runs in: worker processes (P records its transport listener; D cuts its connections to a P).

Why: Mooncake's TCP transport can write into D's memory after it reported a read failed, or
while a read hangs on a dead link, once the link returns (Mooncake #4247): the socket's pending
receive still targets D's blocks. Its Python binding has no call to close a peer's connections, so
before D hands such blocks back to vLLM it shuts down its own sockets to that P's transport port.
``shutdown(SHUT_RDWR)`` acts on the socket, not on the descriptor, so a duplicate of Mooncake's
descriptor ends Mooncake's pending receive at once (end of stream): nothing more is read into D's
memory from that connection, and Mooncake opens a new one for its next transfer.

Only sockets this process owns are touched (``/proc/self/fd`` names their inodes), and only those
whose peer is exactly the given address and port. Elsewhere than Linux nothing is found.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["TcpSocket", "connections_to", "listening_ports", "sever_connections"]

logger = logging.getLogger(__name__)

_LISTEN = 0x0A
_CLOSE = 0x07
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
