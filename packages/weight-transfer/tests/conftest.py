"""Fixtures of the weight-transfer tests: free loopback ports, worker processes that are always reaped, thread ranks."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

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


class ThreadReplica:
    """`ReplicaExchange` for ranks that are threads of this process (vLLM's engines use its CPU groups)."""

    def __init__(self, rank: int, world_size: int, barrier: threading.Barrier, shared: dict[str, Any]) -> None:
        self.rank, self.world_size = rank, world_size
        self._barrier, self._shared = barrier, shared

    @classmethod
    def group(cls, world_size: int) -> list[ThreadReplica]:
        barrier, shared = threading.Barrier(world_size), {}
        return [cls(r, world_size, barrier, shared) for r in range(world_size)]

    def broadcast_from_first(self, payload: bytes) -> bytes:
        if self.rank == 0:
            self._shared["payload"] = payload
        self._barrier.wait(30)
        got = self._shared["payload"]
        self._barrier.wait(30)
        return got

    def all_true(self, flag: bool) -> bool:
        self._shared.setdefault("flags", {})[self.rank] = flag
        self._barrier.wait(30)
        result = all(self._shared["flags"].values())
        self._barrier.wait(30)
        return result
