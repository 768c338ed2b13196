"""Teardown always completes: the worker destroys its communicator even when its heartbeat will not stop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.weight_transfer.collective import TransferGroup
from ascend_dist.weight_transfer.session import ModuleSink
from ascend_dist.weight_transfer.worker import BroadcastWorker

from .conftest import free_port


class StuckHeartbeat:
    """A heartbeat whose thread is stuck in the store (what `Heartbeat.stop` reports then)."""

    def __init__(self, store: Any, rank: int, interval_s: float) -> None:
        self.rank = rank

    def stop(self, timeout_s: float = 5.0) -> None:
        raise DeadlineExceeded(f"heartbeat thread wt/hb/{self.rank} did not stop within {timeout_s} s")


class RecordingCollective:
    """A `Collective` that records its destruction (no update runs in this test)."""

    def __init__(self, group: TransferGroup, device: torch.device) -> None:
        self.rank, self.world_size, self.device = group.rank, group.world_size, device
        self.destroyed = 0

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any:
        raise AssertionError("not used")

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        raise AssertionError("not used")

    def barrier(self) -> None:
        raise AssertionError("not used")

    def destroy(self) -> None:
        self.destroyed += 1


def test_shutdown_destroys_the_communicator_when_the_heartbeat_stop_raises() -> None:
    """Issue 25 item 4: the heartbeat's DeadlineExceeded skipped `destroy`, leaking the communicator."""
    port = free_port()
    host: list[TransferGroup] = []
    trainer = threading.Thread(target=lambda: host.append(TransferGroup.join("127.0.0.1", port, 0, 2, timeout_s=10)))
    trainer.start()
    made: list[RecordingCollective] = []

    def factory(group: TransferGroup, device: torch.device) -> RecordingCollective:
        made.append(RecordingCollective(group, device))
        return made[-1]

    worker = BroadcastWorker(
        ModuleSink(torch.nn.Linear(2, 2)), collective_factory=factory, heartbeat_factory=StuckHeartbeat
    )
    worker.init(master_address="127.0.0.1", master_port=port, rank=1, world_size=2, op_timeout_s=10)
    trainer.join(20)
    assert host and made
    with pytest.raises(DeadlineExceeded, match="heartbeat"):
        worker.shutdown()
    assert made[0].destroyed == 1
    assert worker.collective is None
