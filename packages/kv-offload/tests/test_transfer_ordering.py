"""Ordering rules of the transfer worker, proven by stepping the simulated streams by hand."""

from __future__ import annotations

import torch

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.kv_offload.block_views import canonical_block_views
from ascend_dist.kv_offload.offload_worker import OffloadWorker


def _worker(rt: CpuSimRuntime, k: torch.Tensor, v: torch.Tensor, chunks: int = 8) -> OffloadWorker:
    views = canonical_block_views([k, v], int(k.shape[0]), int(k.shape[1] + v.shape[1]))
    return OffloadWorker(rt, views, num_chunks=chunks)


def split_kv(num_blocks: int = 16, part_bytes: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_blocks)
    k = torch.randint(-128, 127, (num_blocks, part_bytes), dtype=torch.int8, generator=gen)
    v = torch.randint(-128, 127, (num_blocks, part_bytes), dtype=torch.int8, generator=gen)
    return k, v


def test_store_never_reads_a_block_before_compute_wrote_it(manual_rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    worker = _worker(manual_rt, k, v)
    compute = manual_rt.compute_stream()
    manual_rt.launch_host_func(compute, lambda: k[3].fill_(7))  # the model writes block 3
    worker.submit_store(1, [3], [0])
    assert worker.store.stream.step(100) == 0  # blocked behind the compute stream
    assert worker.get_finished() == []
    assert int(worker.mirror.tensors[0][0].abs().sum()) == 0
    compute.step(100)
    worker.store.stream.step(100)
    (result,) = worker.get_finished()
    assert result.success and result.job_id == 1
    assert torch.equal(worker.mirror.tensors[0][0], torch.full((64,), 7, dtype=torch.int8))
    assert torch.equal(worker.mirror.tensors[1][0], v[3])


def test_a_block_is_not_reused_before_its_store_finished(manual_rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    before = k[5].clone()
    worker = _worker(manual_rt, k, v)
    compute = manual_rt.compute_stream()
    worker.submit_store(7, [5], [2])
    compute.step(100)  # the marker the store waits on
    assert worker.store.fence([7]) == 1  # the reuse below waits for store 7
    manual_rt.launch_host_func(compute, lambda: k[5].fill_(-1))  # another request reuses block 5
    assert compute.step(100) == 0  # the overwrite cannot run yet
    worker.store.stream.step(100)
    compute.step(100)
    assert torch.equal(k[5], torch.full((64,), -1, dtype=torch.int8))
    assert torch.equal(worker.mirror.tensors[0][2], before)  # the host holds the pre-reuse bytes
    assert [r.job_id for r in worker.get_finished()] == [7]


def test_stores_and_loads_complete_in_submission_order(manual_rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    worker = _worker(manual_rt, k, v)
    manual_rt.compute_stream().step(100)
    for job in range(3):
        worker.submit_load(10 + job, [job], [job])
    stream = worker.load.stream
    done: list[int] = []
    while stream.step(1):
        done += [r.job_id for r in worker.get_finished()]
        assert done == sorted(done)
    assert done == [10, 11, 12]
    assert worker.load.pending() == []


def test_later_job_is_not_reported_before_an_earlier_one(manual_rt: CpuSimRuntime) -> None:
    k, v = split_kv()
    worker = _worker(manual_rt, k, v)
    worker.submit_store(1, [0, 1], [0, 1])
    worker.submit_store(2, [2], [2])
    manual_rt.compute_stream().step(100)
    stream = worker.store.stream
    stream.step(2)  # wait + start of job 1
    assert worker.get_finished() == []
    manual_rt.run_until_idle()
    assert [r.job_id for r in worker.get_finished()] == [1, 2]


def test_a_job_over_4096_descriptors_is_split_into_native_calls(manual_rt: CpuSimRuntime) -> None:
    k, v = split_kv(num_blocks=5000, part_bytes=8)
    worker = _worker(manual_rt, k, v, chunks=2500)
    ids = list(range(0, 5000, 2))  # never adjacent: 2 x 2500 = 5000 descriptors
    worker.submit_store(1, ids, list(reversed(range(2500))))
    assert worker.store.descriptors_submitted == 5000
    assert worker.store.stream.pending() == 5  # wait on compute, start, 4096 + 904 copies, end
    manual_rt.run_until_idle()
    (result,) = worker.get_finished()
    assert result.success and torch.equal(worker.mirror.tensors[1][2499], v[0])
