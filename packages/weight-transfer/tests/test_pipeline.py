"""The trainer's pipeline over a fake `Collective` whose broadcasts complete late (in-flight lifetime)."""

from __future__ import annotations

import torch

from ascend_dist.weight_transfer.broadcast import send_update
from ascend_dist.weight_transfer.demo_procs import synthetic_specs, synthetic_weights
from ascend_dist.weight_transfer.packing import as_bytes, plan_stream
from ascend_dist.weight_transfer.trainer import manifest_of


class LatePending:
    """Reads the broadcast memory only when waited on, like a slow wire: reuse before wait would show."""

    def __init__(self, log: list[bytes], tensor: torch.Tensor) -> None:
        self.log, self.tensor = log, tensor

    def wait(self) -> None:
        self.log.append(self.tensor.numpy().tobytes())


class LateCollective:
    """A single-rank `Collective` (our Protocol) recording what each broadcast carried when it completed."""

    rank, world_size, device = 0, 1, torch.device("cpu")

    def __init__(self) -> None:
        self.log: list[bytes] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> LatePending:
        return LatePending(self.log, tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        pass

    def barrier(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def test_every_buffer_is_sent_intact_even_when_broadcasts_complete_late() -> None:
    specs = synthetic_specs(40, 20_000, dtypes=("bfloat16", "float32", "int8"))
    weights = synthetic_weights(specs, 9)
    for threshold in (0, 700):
        manifest = manifest_of(weights, buffer_size_bytes=512, num_buffers=2, direct_threshold_bytes=threshold)
        comm = LateCollective()
        phases = send_update(comm, manifest, iter(weights), update_id=0, rejection_detail=lambda u, r: "")
        data = b"".join(comm.log[2:])  # after the header and the manifest
        want = b"".join(as_bytes(t).numpy().tobytes() for _, t in weights)
        assert data == want and phases.bytes == len(want)
        assert len(comm.log) == 2 + plan_stream(manifest).num_buffers
