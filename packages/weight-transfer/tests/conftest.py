"""Fixtures of the weight-transfer tests: free loopback ports and worker processes that are always reaped."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from ascend_dist.weight_transfer._demo.procs import Spec, WorkerProcess


def free_port() -> int:
    """An OS-assigned free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def port() -> int:
    """A free loopback port."""
    return free_port()


@pytest.fixture
def spawn_workers() -> Iterator[Callable[[int, list[Spec]], list[WorkerProcess]]]:
    """Spawn worker processes; every one is shut down (or killed) after the test, pass or fail."""
    started: list[WorkerProcess] = []

    def spawn(count: int, specs: list[Spec]) -> list[WorkerProcess]:
        procs = [WorkerProcess(specs) for _ in range(count)]
        started.extend(procs)
        return procs

    yield spawn
    for proc in started:
        proc.close()
