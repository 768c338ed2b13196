"""Streamed (bounded, pipelined) broadcast updates: layout, pipelining, memory bound, failures.

In-process parts use fakes of our own `Collective` Protocol; the end-to-end parts run a trainer
(this process) and 2 worker processes over gloo, and measure staging memory with the simulated
device's allocation counters (`CpuSimRuntime.peak_allocated_bytes`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import pytest
import torch

from ascend_dist.common.device import close_runtime
from ascend_dist.common.device.cpu_sim import CpuSimRuntime
from ascend_dist.common.errors import ConfigError
from ascend_dist.weight_transfer._demo.procs import (
    Spec,
    WorkerProcess,
    device_meter,
    param_digests,
    synthetic_specs,
    synthetic_weights,
)
from ascend_dist.weight_transfer.broadcast import receive_update, send_update
from ascend_dist.weight_transfer.collective import gloo_collective, hccl_collective
from ascend_dist.weight_transfer.errors import LoadFailed, ManifestMismatch, WorkerLost
from ascend_dist.weight_transfer.messages import check_manifests
from ascend_dist.weight_transfer.packing import (
    BUCKET_ALIGN,
    as_bytes,
    pack_images,
    plan_buckets,
    pull_bucket,
    spec_nbytes,
)
from ascend_dist.weight_transfer.pool import BufferPool
from ascend_dist.weight_transfer.trainer import BroadcastTrainer, manifest_of

from .conftest import free_port
from .test_pipeline import LateCollective, LatePending, ReplayCollective

BUFFER = 16 * 1024
NUM_BUFFERS = 2
BOUND = BUFFER * NUM_BUFFERS
# over 8x the bound, tensors of up to ~5 KiB (bf16/fp8 odd sizes, 0-dim scalars), none larger than a buffer
SPECS = synthetic_specs(120, 400 * 1024, dtypes=("float32", "bfloat16", "float16", "int8", "float8_e4m3fn"))
TIMEOUT_S = 20.0


def test_buckets_hold_whole_aligned_tensors_in_order_and_never_exceed_a_buffer() -> None:
    weights = synthetic_weights(SPECS, 1)
    manifest = manifest_of(weights, buffer_size_bytes=BUFFER, num_buffers=NUM_BUFFERS, streamed=True)
    buckets = plan_buckets(manifest)
    covered = [b.first + i for b in buckets for i in range(len(b.offsets))]
    assert covered == list(range(len(SPECS)))  # every tensor once, in send order
    assert len(buckets) >= 10 and all(0 < b.length <= BUFFER for b in buckets)
    for bucket in buckets:
        end = 0
        for i, offset in enumerate(bucket.offsets):
            size = spec_nbytes(manifest.tensors[bucket.first + i])
            assert offset % BUCKET_ALIGN == 0 and (offset >= end or size == 0)
            end = max(end, offset + size)
        assert end == bucket.length
    assert manifest.direct_threshold_bytes == 0  # streamed: no direct sends (they would bypass the bound)


def test_a_tensor_larger_than_a_buffer_is_refused_naming_it() -> None:
    big = [("small", torch.zeros(4)), ("embed.weight", torch.zeros(64, 128))]  # 32 KiB > 16 KiB
    with pytest.raises(ConfigError, match=r"embed\.weight.*32768.*buffer_size_bytes=16384"):
        manifest_of(big, buffer_size_bytes=BUFFER, streamed=True)
    manifest_of(big, buffer_size_bytes=BUFFER)  # the staged mode splits it across buffers


def test_a_staged_worker_names_the_streamed_trainer_as_the_difference() -> None:
    weights = synthetic_weights(SPECS[:3], 1)
    with pytest.raises(ManifestMismatch, match="streamed: worker has False, trainer has True"):
        check_manifests(
            manifest_of(weights, buffer_size_bytes=BUFFER),
            manifest_of(weights, buffer_size_bytes=BUFFER, streamed=True),
            local_role="worker",
            remote_role="trainer",
        )


class CountingAllocator:
    """Allocates uint8 buffers and tracks live/peak bytes (a fake allocator, injected)."""

    def __init__(self) -> None:
        self.runtime = CpuSimRuntime(manual=True)

    def __call__(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.runtime.empty((nbytes,), torch.uint8)


class EventLog:
    """A worker-side replay collective that records when each broadcast is posted and waited on."""

    def __init__(self, payloads: list[bytes], events: list[str]) -> None:
        self.inner = ReplayCollective(payloads)
        self.rank, self.world_size, self.device = 1, 2, torch.device("cpu")
        self.events = events
        self.posted = 0

    def broadcast(self, tensor: torch.Tensor, src: int) -> LatePending:
        self.events.append(f"post{self.posted}")
        self.posted += 1
        return self.inner.broadcast(tensor, src)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        pass

    def barrier(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class BucketSink:
    """Records each ``load_weights`` call (one per bucket) and copies what it is given."""

    def __init__(self, events: list[str], fail_at: int | None = None) -> None:
        self.events, self.fail_at = events, fail_at
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.events.append(f"load{self.calls}")
        self.calls += 1
        if self.fail_at is not None and self.calls - 1 == self.fail_at:
            raise KeyError("the loader has no such parameter")
        self.loaded.update({name: t.clone() for name, t in weights})


def _streamed_wire(seed: int) -> tuple[list[tuple[str, torch.Tensor]], object, list[bytes]]:
    weights = synthetic_weights(SPECS, seed)
    manifest = manifest_of(weights, buffer_size_bytes=BUFFER, num_buffers=NUM_BUFFERS, streamed=True)
    wire = LateCollective()
    send_update(wire, manifest, iter(weights), update_id=0, rejection_detail=lambda u, r: "")
    return weights, manifest, wire.log


def test_each_bucket_is_loaded_as_it_lands_while_the_next_is_posted_within_the_bound() -> None:
    weights, manifest, log = _streamed_wire(5)
    events: list[str] = []
    sink, alloc = BucketSink(events), CountingAllocator()
    receive_update(EventLog(log, events), manifest, sink, reject=lambda u, r: None, allocate=alloc)
    buckets = plan_buckets(manifest)  # type: ignore[arg-type]
    assert sink.calls == len(buckets)  # one load per bucket, not one at the end
    for name, want in weights:
        got = sink.loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(as_bytes(got), as_bytes(want))
    # post0/post1 are the header and manifest; bucket k is post(k + 2). Bucket k+1 is on the wire
    # before bucket k is loaded (double buffering), and bucket k+2 is posted only after that load.
    data = [e for e in events if e.startswith("load") or int(e[4:]) >= 2]
    for k in range(len(buckets) - 1):
        assert data.index(f"post{k + 3}") < data.index(f"load{k}")
        if k + 2 < len(buckets):
            assert data.index(f"load{k}") < data.index(f"post{k + 4}")
    assert 0 < alloc.runtime.peak_allocated_bytes <= BOUND
    assert alloc.runtime.allocated_bytes == 0  # released after the update


class PtrCollective(LateCollective):
    """A `LateCollective` that also records the address of each broadcast tensor (which memory was sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.ptrs: list[int] = []

    def broadcast(self, tensor: torch.Tensor, src: int) -> LatePending:
        self.ptrs.append(tensor.data_ptr())
        return super().broadcast(tensor, src)


def _u8(numel: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_bucket_that_is_one_contiguous_tensor_is_broadcast_from_it_bytes_exact() -> None:
    kib = 1024
    big = _u8(12 * kib, 1).view(torch.bfloat16).reshape(96, 64)  # alone in its bucket (8 + 12 KiB > 16)
    strided = _u8(12 * kib, 2).view(torch.float16).reshape(96, 64).t()  # alone too, but not contiguous
    tail = _u8(5 * kib, 5).view(torch.int8)  # alone in the last bucket (12 + 5 KiB > 16)
    weights = [
        ("a1", _u8(4 * kib, 3).view(torch.float32)),
        ("a2", _u8(4 * kib, 4)),
        ("big", big),
        ("empty", torch.empty(0, 4)),  # zero bytes: in big's bucket, takes no room
        ("b1", _u8(5 * kib, 6)),
        ("b2", _u8(3 * kib, 7)),
        ("strided", strided),
        ("tail", tail),
    ]
    manifest = manifest_of(weights, buffer_size_bytes=BUFFER, num_buffers=NUM_BUFFERS, streamed=True)
    buckets = plan_buckets(manifest)
    assert [b.first for b in buckets] == [0, 2, 4, 6, 7]
    wire = PtrCollective()
    phases = send_update(wire, manifest, iter(weights), update_id=0, rejection_detail=lambda u, r: "")
    payloads, ptrs = wire.log[2:], wire.ptrs[2:]  # after the header and the manifest
    # the one-tensor buckets were sent from the tensors themselves; the others (the strided one
    # too: its image is a copy) from the trainer's buffers
    assert (ptrs[1], ptrs[4]) == (big.data_ptr(), tail.data_ptr()) and phases.extra["direct_buckets"] == 2
    assert not {ptrs[0], ptrs[2], ptrs[3]} & {t.data_ptr() for _, t in weights}
    # bytes exact: each payload is what packing the bucket would give (the receiver cannot tell)
    source = iter(weights)
    for bucket, payload in zip(buckets, payloads, strict=True):
        packed = torch.zeros(bucket.length, dtype=torch.uint8)
        pack_images(packed, bucket, pull_bucket(bucket, source, manifest))  # type: ignore[arg-type]
        assert payload == packed.numpy().tobytes()
    sink = BucketSink([])
    receive_update(ReplayCollective(wire.log), manifest, sink, reject=lambda u, r: None)
    for name, want in weights:
        got = sink.loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(as_bytes(got), as_bytes(want))


class CountingPoolAllocator(CountingAllocator):
    """`CountingAllocator` that also counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self.calls += 1
        return super().__call__(nbytes, device)


def test_an_engine_pool_keeps_the_buckets_between_updates_within_the_bound() -> None:
    trainer_alloc, worker_alloc = CountingPoolAllocator(), CountingPoolAllocator()
    trainer_pool, worker_pool = BufferPool(trainer_alloc), BufferPool(worker_alloc)
    for seed in (11, 12, 13):
        weights = synthetic_weights(SPECS, seed)
        manifest = manifest_of(weights, buffer_size_bytes=BUFFER, num_buffers=NUM_BUFFERS, streamed=True)
        wire = LateCollective()
        send_update(wire, manifest, iter(weights), update_id=seed, rejection_detail=lambda u, r: "", pool=trainer_pool)
        sink = BucketSink([])
        receive_update(ReplayCollective(wire.log), manifest, sink, reject=lambda u, r: None, pool=worker_pool)
        for name, want in weights:  # every update lands, though the buffers are the previous update's
            assert torch.equal(as_bytes(sink.loaded[name]), as_bytes(want))
    for alloc, pool in ((trainer_alloc, trainer_pool), (worker_alloc, worker_pool)):
        assert alloc.calls == NUM_BUFFERS  # allocated by the first update only
        assert 0 < alloc.runtime.peak_allocated_bytes <= BOUND
        assert alloc.runtime.allocated_bytes == pool.nbytes <= BOUND  # held between updates, within the bound
        pool.clear()  # what shutdown does
        assert alloc.runtime.allocated_bytes == 0


def test_a_loader_failure_mid_stream_is_load_failed_and_later_buckets_are_not_loaded() -> None:
    _, manifest, log = _streamed_wire(6)
    events: list[str] = []
    sink = BucketSink(events, fail_at=2)
    collective = EventLog(log, events)
    with pytest.raises(LoadFailed, match=r"loader failed on a bucket.*mixed weights") as info:
        receive_update(collective, manifest, sink, reject=lambda u, r: None)
    assert isinstance(info.value.__cause__, KeyError)
    assert sink.calls == 3  # buckets after the failure are received (the group stays in step), not loaded
    assert collective.inner.payloads == []  # every bucket was still received


# -- across processes over gloo ---------------------------------------------------------------------


def _connect(
    workers: list[WorkerProcess], *, streamed: bool, die_after: int | None = None, op_timeout_s: float = TIMEOUT_S,
    collective: str = "gloo",
) -> BroadcastTrainer:  # fmt: skip
    port = free_port()
    for i, proc in enumerate(workers):
        proc.send(
            "init", master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=len(workers) + 1,
            dp_index=i, replica_size=1, rank_in_replica=0, packed=True, buffer_size_bytes=BUFFER,
            num_buffers=NUM_BUFFERS, op_timeout_s=op_timeout_s, direct_threshold_bytes=0, streamed=streamed,
            die_after_buffers=die_after if i == 1 else None, collective=collective,
        )  # fmt: skip
    trainer = BroadcastTrainer.connect(
        "127.0.0.1", port, len(workers) + 1, buffer_size_bytes=BUFFER, num_buffers=NUM_BUFFERS,
        op_timeout_s=op_timeout_s, direct_threshold_bytes=0, streamed=streamed,
        collective_factory=hccl_collective if collective == "hccl" else gloo_collective,
    )  # fmt: skip
    expected = "CommunicatorCollective" if collective == "hccl" else "GlooCollective"
    for i, proc in enumerate(workers):
        reply = proc.reply(TIMEOUT_S)
        assert reply["ok"] and reply["collective"] == ("_DieAfter" if die_after and i == 1 else expected), reply
    assert type(trainer.collective).__name__ == expected
    return trainer


def _start(workers: list[WorkerProcess], specs: list[Spec]) -> None:
    for proc in workers:
        assert proc.call("start")["ok"]
        proc.send("update", names=[s[0] for s in specs], dtype_names=[s[1] for s in specs],
                  shapes=[list(s[2]) for s in specs])  # fmt: skip


def _bases(workers: list[WorkerProcess]) -> list[int]:
    """Simulated-device bytes allocated now in this process and each worker (before any update's buffers)."""
    gc.collect()  # buffers of earlier tests in this process that are garbage already would leave the base later
    return [device_meter().allocated_bytes] + [proc.call("memory")["allocated"] for proc in workers]


def _update_measured(
    trainer: BroadcastTrainer, workers: list[WorkerProcess], seed: int, bases: list[int]
) -> tuple[dict[str, str], int]:
    """One update; returns the trainer's digests and the largest staging peak of any process.

    The peak is counted from ``bases`` (taken before the connection's first update), so buffers an
    engine keeps from an earlier update count in full.
    """
    meter = device_meter()
    meter.reset_peak_allocated()
    for proc in workers:
        proc.call("memory", reset_peak=True)
    weights = synthetic_weights(SPECS, seed)
    _start(workers, SPECS)
    trainer.send(weights)
    peaks = [meter.peak_allocated_bytes - bases[0]]
    for proc, worker_base in zip(workers, bases[1:], strict=True):
        reply = proc.reply(TIMEOUT_S)
        assert reply["ok"], reply
        assert proc.call("finish")["ok"]
        peaks.append(proc.call("memory")["peak"] - worker_base)
    return param_digests(weights), max(peaks)


def _released(trainer: BroadcastTrainer, workers: list[WorkerProcess], bases: list[int]) -> bool:
    """Shut the trainer down and make the workers leave; whether every process is back at its base."""
    trainer.shutdown()
    for proc in workers:
        assert proc.call("leave")["ok"]
    return _settles(lambda: device_meter().allocated_bytes, bases[0]) and all(
        _settles(lambda proc=proc: proc.call("memory")["allocated"], base)
        for proc, base in zip(workers, bases[1:], strict=True)
    )


def _settles(read: Callable[[], int], want: int, deadline_s: float = 3.0) -> bool:
    """Whether ``read()`` reaches ``want`` within the deadline.

    gloo's background thread drops its reference to a completed broadcast's tensor a moment after
    ``wait`` returned, so the last bucket's memory is freed shortly after the update, not at once.
    """
    end = time.monotonic() + deadline_s
    while read() != want:
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_a_model_eight_times_the_bound_updates_bit_exact_within_the_bound_over_gloo(
    spawn_workers: Callable[..., list[WorkerProcess]],
) -> None:
    total = sum(spec_nbytes(s) for s in manifest_of(synthetic_weights(SPECS, 0)).tensors)
    assert total >= 8 * BOUND
    workers = spawn_workers(2, SPECS)
    bases = _bases(workers)
    trainer = _connect(workers, streamed=True)
    try:
        previous: dict[str, str] | None = None
        for seed in (1, 2, 3):  # the engines keep their buckets between updates: still within the bound
            expected, peak = _update_measured(trainer, workers, seed, bases)
            assert 0 < peak <= BOUND, (peak, BOUND)
            for proc in workers:
                got = proc.call("digest")["digests"]
                assert got == expected
                if previous is not None:  # control: every tensor changed, so a stale one would show
                    assert all(got[name] != previous[name] for name in got)
            previous = expected
        assert _released(trainer, workers, bases)  # shutdown frees the kept buckets everywhere
    finally:
        trainer.shutdown()
    # control: the staged (all or nothing) mode on the same model holds the whole update: over the bound
    trainer = _connect(workers, streamed=False)
    try:
        expected, peak = _update_measured(trainer, workers, 4, bases)
        assert peak >= total > BOUND
        for proc in workers:
            assert proc.call("digest")["digests"] == expected
    finally:
        trainer.shutdown()


def test_one_tensor_buckets_go_direct_over_gloo_bit_exact(spawn_workers: Callable[..., list[WorkerProcess]]) -> None:
    """Buckets sent from the trainer's tensors land bit-exactly through a real gloo group."""
    specs: list[Spec] = [
        ("a", "bfloat16", (40, 128)),  # 10240 B: b does not fit after it, so a is alone (direct)
        ("b", "float32", (3000,)),  # 12000 B: alone too (direct)
        ("c", "int8", (9000,)),  # c and d share a bucket (packed)
        ("d", "float16", (10, 7)),
    ]
    workers = spawn_workers(2, specs)
    trainer = _connect(workers, streamed=True)
    try:
        previous: dict[str, str] | None = None
        for seed in (21, 22):
            weights = synthetic_weights(specs, seed)
            _start(workers, specs)
            phases = trainer.send(weights)
            for proc in workers:
                assert proc.reply(TIMEOUT_S)["ok"] and proc.call("finish")["ok"]
            assert phases.extra["direct_buckets"] == 2
            expected = param_digests(weights)
            for proc in workers:
                got = proc.call("digest")["digests"]
                assert got == expected
                if previous is not None:  # control: every tensor changed, so a stale one would show
                    assert all(got[name] != previous[name] for name in got)
            previous = expected
    finally:
        trainer.shutdown()


def test_streamed_updates_over_the_hccl_communicator_path(spawn_workers: Callable[..., list[WorkerProcess]]) -> None:
    """The same over `hccl_collective` (the real `PyHcclCommunicator` on its gloo engine, simulated streams)."""
    workers = spawn_workers(2, SPECS)
    bases = _bases(workers)
    trainer = _connect(workers, streamed=True, collective="hccl")
    try:
        for seed in (1, 2):
            expected, peak = _update_measured(trainer, workers, seed, bases)
            assert 0 < peak <= BOUND
            assert all(proc.call("digest")["digests"] == expected for proc in workers)
    finally:
        trainer.shutdown()
        close_runtime()  # the trainer's communicator ran on this process's runtime: stop its threads


def test_a_worker_dying_mid_stream_is_worker_lost_and_the_survivor_reports_mixed_weights(
    spawn_workers: Callable[..., list[WorkerProcess]],
) -> None:
    workers = spawn_workers(2, SPECS)
    trainer = _connect(workers, streamed=True, die_after=3, op_timeout_s=5.0)
    survivor = workers[0]
    try:
        before = survivor.call("digest")["digests"]
        weights = synthetic_weights(SPECS, 7)
        _start(workers, SPECS)
        with pytest.raises(WorkerLost, match="mixed weights") as info:
            trainer.send(weights)
        assert info.value.ranks == (2,)
        reply = survivor.reply(TIMEOUT_S)
        assert not reply["ok"] and reply["error"] == "PartialUpdate", reply
        assert "some new weights" in reply["message"]
        # the error tells the truth: the survivor holds some new and some old tensors
        now, new = survivor.call("digest")["digests"], param_digests(weights)
        assert any(now[n] == new[n] for n in now) and any(now[n] == before[n] != new[n] for n in now)
    finally:
        trainer.shutdown()


def test_the_packed_ipc_trainer_pulls_each_tensor_only_when_its_chunk_is_packed() -> None:
    from ascend_dist.weight_transfer.ipc import SharedExporter, packed_chunks

    weights = synthetic_weights(SPECS, 3)
    manifest = manifest_of(weights, buffer_size_bytes=BUFFER)
    pulled: list[int] = []

    def source():
        for i, item in enumerate(weights):
            pulled.append(i)
            yield item

    with CpuSimRuntime(manual=True) as runtime:
        chunks = packed_chunks(SharedExporter(runtime, "cpu-0"), manifest, source())
        next(chunks)
        # chunk 0 holds the first BUFFER bytes (~1/25 of the model): only its tensors were pulled
        assert 0 < len(pulled) < len(SPECS) // 4, len(pulled)
        count = 1 + sum(1 for _ in chunks)
    assert pulled == list(range(len(SPECS))) and count > 8


@pytest.mark.parametrize(
    "specs",
    [
        [("a", "float32", (0,)), ("b", "bfloat16", (3,)), ("c", "int8", (0, 5)), ("d", "float32", (2,))],
        [("a", "float32", (0,)), ("b", "bfloat16", (2, 0))],  # no bytes at all
        [("a", "bfloat16", (4000,)), ("b", "float32", ()), ("c", "int8", (0,)), ("d", "float16", (1,))],
    ],
)
def test_zero_byte_tensors_and_byte_less_updates_round_trip(specs: list[Spec]) -> None:
    weights = synthetic_weights(specs, 4)
    manifest = manifest_of(weights, buffer_size_bytes=8000, num_buffers=2, streamed=True)
    wire = LateCollective()
    send_update(wire, manifest, iter(weights), update_id=0, rejection_detail=lambda u, r: "")
    sink = BucketSink([])
    receive_update(ReplayCollective(wire.log), manifest, sink, reject=lambda u, r: None)
    assert sink.calls == len(plan_buckets(manifest))
    for name, want in weights:
        got = sink.loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(as_bytes(got), as_bytes(want))
