"""Loopback ports for tests that start real servers: a free one, a free run of them, and waiting for one."""

from __future__ import annotations

import random
import socket
import time

__all__ = ["free_port", "free_port_base", "wait_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS just handed out (free until someone else takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_base(count: int) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (servers that bind base + rank).

    Raises:
        RuntimeError: 200 random bases all had a taken port.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def wait_port(port: int, timeout_s: float, *, poll_s: float = 0.05) -> bool:
    """Whether something on 127.0.0.1:``port`` accepts a connection within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(poll_s)
    return False
