"""Transfer worker on the threaded CPU simulation: bytes, coalescing, failures, pool exhaustion."""

from __future__ import annotations

import pytest
import torch

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.common.errors import BlockIdError, ConfigError, DeviceError
from ascend_dist.kv_offload.block_views import canonical_block_views
from ascend_dist.kv_offload.host_pool import HostChunkPool
from ascend_dist.kv_offload.offload_worker import GroupRef, OffloadWorker


def split_kv(num_blocks: int = 32, part_bytes: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(-128, 127, (num_blocks, part_bytes), dtype=torch.int8, generator=gen)
    v = torch.randint(-128, 127, (num_blocks, part_bytes), dtype=torch.int8, generator=gen)
    return k, v


def worker_for(rt: CpuSimRuntime, k: torch.Tensor, v: torch.Tensor, **kw: int) -> OffloadWorker:
    views = canonical_block_views([k, v], int(k.shape[0]), int(k.shape[1] + v.shape[1]))
    return OffloadWorker(rt, views, num_chunks=kw.pop("num_chunks", 16), **kw)  # type: ignore[arg-type]


def drain(worker: OffloadWorker, ids: list[int]) -> dict[int, object]:
    worker.wait(ids, timeout=10.0)
    return {r.job_id: r for r in worker.get_finished()}


def test_store_then_load_round_trips_bytes(rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    k0, v0 = k.clone(), v.clone()
    worker = worker_for(rt, k, v)
    worker.submit_store(1, [4, 5, 6, 20], [0, 1, 2, 3])
    results = drain(worker, [1])
    assert results[1].success  # type: ignore[attr-defined]
    k.zero_()
    v.zero_()
    worker.submit_load(2, [0, 1, 2, 3], [10, 11, 12, 13])
    assert drain(worker, [2])[2].success  # type: ignore[attr-defined]
    assert torch.equal(k[10:14], k0[[4, 5, 6, 20]]) and torch.equal(v[10:14], v0[[4, 5, 6, 20]])
    assert int(k[:10].abs().sum()) == 0  # nothing else touched
    worker.shutdown()


def test_adjacent_blocks_collapse_into_one_descriptor_per_tensor(rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    worker = worker_for(rt, k, v)
    worker.submit_store(1, list(range(8)), list(range(8)))
    drain(worker, [1])
    assert worker.store.descriptors_submitted == 2  # K run + V run
    assert worker.store.blocks_submitted == 8
    worker.shutdown()


def test_blocks_per_chunk_packs_sub_blocks_into_host_rows(rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    worker = worker_for(rt, k, v, blocks_per_chunk=4, num_chunks=4)
    worker.submit_store(1, [11, 12, 13, 14, 15, 16], [1, 3], block_indices=[5])  # skip 1 sub-block
    assert drain(worker, [1])[1].success  # type: ignore[attr-defined]
    host_k = worker.mirror.tensors[0].view(4, 4, 64)
    assert torch.equal(host_k[1, 1:4], k[11:14]) and torch.equal(host_k[3, 0:3], k[14:17])
    assert int(host_k[1, 0].abs().sum()) == 0
    worker.shutdown()


def test_copy_failure_at_descriptor_k_fails_exactly_that_job(rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    k0 = k.clone()
    worker = worker_for(rt, k, v, coalesce=False)
    rt.inject_copy_fault(3)
    worker.submit_store(1, [1, 2, 3], [0, 1, 2])  # descriptors: K1 K2 K3 V1 V2 V3 -> fails at V1
    results = drain(worker, [1])
    bad = results[1]
    assert not bad.success and bad.failed_block_ids == (1, 2, 3) and bad.failed_descriptor == 3  # type: ignore[attr-defined]
    worker.submit_store(2, [7], [5])  # after the failed job was reported: unaffected
    assert drain(worker, [2])[2].success  # type: ignore[attr-defined]
    assert torch.equal(worker.mirror.tensors[0][5], k0[7])
    # the sticky error was consumed: a later, separate failure is reported afresh
    rt.inject_copy_fault(0)
    worker.submit_load(3, [5], [9])
    third = drain(worker, [3])[3]
    assert not third.success and third.failed_block_ids == (9,) and third.failed_descriptor == 0  # type: ignore[attr-defined]
    worker.submit_load(4, [5], [9])
    assert drain(worker, [4])[4].success  # type: ignore[attr-defined]
    assert torch.equal(k[9], k0[7])
    worker.shutdown()


def test_duplicate_job_id_and_closed_worker_are_refused(rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    worker = worker_for(rt, k, v)
    worker.submit_store(1, [0], [0])
    with pytest.raises(ConfigError, match="job_id"):
        worker.submit_store(1, [1], [1])
    worker.shutdown()
    with pytest.raises(ConfigError, match="handler"):
        worker.submit_store(2, [1], [1])


def test_bad_geometry_is_a_typed_error(rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    views = canonical_block_views([k, v], 32, 128)
    with pytest.raises(ConfigError, match="num_chunks"):
        OffloadWorker(rt, views, num_chunks=0)
    with pytest.raises(ConfigError, match="view_index"):
        OffloadWorker(rt, views, [[GroupRef(5, 64)]], num_chunks=2)
    with pytest.raises(ConfigError, match="copy_bytes"):
        OffloadWorker(rt, views, [[GroupRef(0, 65)]], num_chunks=2)
    worker = OffloadWorker(rt, views, num_chunks=2)
    with pytest.raises(BlockIdError):
        worker.submit_store(1, [0, 1], [0])  # one host chunk short
    worker.shutdown()


def test_host_pool_exhaustion_returns_none_and_takes_nothing() -> None:
    pool = HostChunkPool(3)
    first = pool.allocate(2)
    assert first == [0, 1]
    assert pool.allocate(2) is None and pool.num_free == 1
    pool.free([0])
    assert pool.allocate(2) == [0, 2]
    with pytest.raises(BlockIdError):
        pool.free([0, 0])
    with pytest.raises(ConfigError, match="num_chunks"):
        HostChunkPool(0)


@pytest.mark.parametrize("direction", ["load", "store"])
def test_host_chunk_id_past_the_host_allocation_is_refused_and_nothing_moves(rt: CpuSimRuntime, direction: str) -> None:
    """Issue 21 item 10: a host id at or past ``num_chunks`` addresses memory outside the mirror."""
    k, v = split_kv()
    k0, v0 = k.clone(), v.clone()
    worker = worker_for(rt, k, v, num_chunks=16)
    host_before = [t.clone() for t in worker.mirror.tensors]
    submit = worker.submit_load if direction == "load" else worker.submit_store
    with pytest.raises(BlockIdError, match=r"host_chunk_ids\[1\]"):
        if direction == "load":
            submit(1, [3, 16], [4, 5])  # host chunk 16 of 0..15
        else:
            submit(1, [4, 5], [3, 16])
    assert worker.load.pending() == [] and worker.store.pending() == []
    assert worker.get_finished() == []
    assert torch.equal(k, k0) and torch.equal(v, v0)
    assert all(torch.equal(a, b) for a, b in zip(worker.mirror.tensors, host_before, strict=True))
    # control: the last valid chunk is accepted and moves bytes
    worker.submit_store(2, [4], [15])
    assert drain(worker, [2])[2].success  # type: ignore[attr-defined]
    assert torch.equal(worker.mirror.tensors[0][15], k0[4])
    worker.shutdown()


def test_device_block_id_past_the_device_cache_is_refused(rt: CpuSimRuntime) -> None:
    k, v = split_kv(num_blocks=32)
    worker = worker_for(rt, k, v, num_chunks=16)
    with pytest.raises(BlockIdError, match=r"device_block_ids\[0\]"):
        worker.submit_load(1, [0], [32])
    assert worker.load.pending() == []
    worker.shutdown()


class _RefusingRuntime(CpuSimRuntime):
    """The CPU simulation whose next ``refuse`` batched copies raise at the call (a driver refusing it)."""

    refuse = 0

    def batch_copy(self, *args: object, **kwargs: object) -> None:
        if self.refuse:
            self.refuse -= 1
            raise DeviceError("injected: copy call refused")
        super().batch_copy(*args, **kwargs)  # type: ignore[arg-type]


def test_a_refused_copy_call_fails_its_job_in_turn_instead_of_raising() -> None:
    with _RefusingRuntime(wait_timeout_s=10.0) as rt:
        k, v = split_kv()
        k0 = k.clone()
        worker = worker_for(rt, k, v)
        rt.refuse = 1
        assert worker.submit_store(1, [1, 2], [0, 1])  # refused: reported below, not raised
        worker.submit_store(2, [3], [2])
        results = drain(worker, [1, 2])
        bad, good = results[1], results[2]
        assert not bad.success and bad.failed_block_ids == (1, 2) and "refused" in (bad.error or "")  # type: ignore[attr-defined]
        assert good.success and torch.equal(worker.mirror.tensors[0][2], k0[3])  # type: ignore[attr-defined]
        assert worker.store.pending() == []
        worker.shutdown()


def test_a_second_failure_while_the_stream_holds_the_first_is_never_reported_as_success(rt: CpuSimRuntime) -> None:
    """Found by the soak: the stream keeps only its first sticky error, so a later job's own failure is hidden."""
    k, v = split_kv()
    worker = worker_for(rt, k, v)
    host0 = worker.mirror.tensors[0][6].clone()
    rt.inject_copy_fault(0)
    worker.submit_store(1, [1], [5])
    rt.inject_copy_fault(0)
    worker.submit_store(2, [2], [6])  # fails too; its copy never ran
    results = drain(worker, [1, 2])
    assert not results[1].success  # type: ignore[attr-defined]
    assert torch.equal(worker.mirror.tensors[0][6], host0)  # nothing stored for job 2 ...
    assert not results[2].success  # type: ignore[attr-defined]  # ... so it must not report success
    # once the stream's error is consumed (queue drained), jobs succeed again
    worker.submit_store(3, [3], [7])
    assert drain(worker, [3])[3].success  # type: ignore[attr-defined]
    worker.shutdown()
