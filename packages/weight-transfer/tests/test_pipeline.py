"""The trainer's pipeline over a fake `Collective` whose broadcasts complete late (in-flight lifetime)."""

from __future__ import annotations

import torch

from ascend_dist.weight_transfer._demo.procs import synthetic_specs, synthetic_weights
from ascend_dist.weight_transfer.broadcast import receive_update, send_update
from ascend_dist.weight_transfer.packing import as_bytes, plan_stream
from ascend_dist.weight_transfer.pool import BufferPool
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
        plan = plan_stream(manifest)
        assert len(comm.log) == 2 + plan.num_buffers
        assert any(u.direct for u in plan.units) == (threshold > 0)  # the threshold reaches the plan


class ReplayCollective:
    """Worker rank 1 of a fake group (our `Collective` Protocol): each broadcast receives the next
    recorded payload of a trainer's `LateCollective`; every vote comes back all-zero (all agree)."""

    rank, world_size, device = 1, 2, torch.device("cpu")

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = list(payloads)

    def broadcast(self, tensor: torch.Tensor, src: int) -> LatePending:
        data = self.payloads.pop(0)
        assert len(data) == tensor.numel() * tensor.element_size()
        tensor.view(torch.uint8).reshape(-1).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return LatePending([], tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        pass

    def barrier(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class CopySink:
    """A `WeightSink` that copies what it is given, as the contract requires."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded = {name: t.clone() for name, t in weights}


def test_pools_are_reused_across_updates_and_every_update_lands_bit_exact() -> None:
    specs = synthetic_specs(30, 12_000, dtypes=("bfloat16", "float32", "int8"))
    trainer_pool, worker_pool = BufferPool(), BufferPool()
    slot_ptrs, staging_ptrs = set(), set()
    for update, threshold in enumerate((0, 600, 0)):
        weights = synthetic_weights(specs, 100 + update)
        manifest = manifest_of(weights, buffer_size_bytes=700, num_buffers=2, direct_threshold_bytes=threshold)
        wire = LateCollective()
        send_update(
            wire, manifest, iter(weights), update_id=update, rejection_detail=lambda u, r: "", pool=trainer_pool
        )
        slot_ptrs.add(trainer_pool.get("slot0", 700, torch.device("cpu")).data_ptr())
        sink = CopySink()
        uid, phases = receive_update(
            ReplayCollective(wire.log), manifest, sink, reject=lambda u, r: None, pool=worker_pool
        )
        assert uid == update and phases.bytes == sum(len(as_bytes(t)) for _, t in weights)
        for name, want in weights:
            got = sink.loaded[name]
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(as_bytes(got), as_bytes(want))
        staging_ptrs.add(worker_pool.get("staging", phases.bytes, torch.device("cpu")).data_ptr())
    assert len(staging_ptrs) == 1 and len(slot_ptrs) == 1  # allocated once, reused by every update


def test_buffer_pool_reallocates_only_on_a_new_size_and_clear_frees() -> None:
    pool, cpu = BufferPool(), torch.device("cpu")
    a = pool.get("staging", 100, cpu)
    assert pool.get("staging", 100, cpu) is a and a.dtype == torch.uint8
    b = pool.get("staging", 64, cpu)
    assert b is not a and b.numel() == 64 and pool.nbytes == 64
    pool.get("slot0", 8, cpu)
    assert pool.nbytes == 72
    pool.clear()
    assert pool.nbytes == 0
