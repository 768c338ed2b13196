"""Demo/bench scenario ``offload``: KV offload to host memory end to end on the device runtime.

Runs in: the ``ascend-dist demo`` / ``ascend-dist bench`` process (CPU simulation, or hardware).

Demo: a batch of requests' split-K/V blocks stored to host chunks and reloaded into other device
blocks through the transfer worker (the native path's data plane), a store skipped when the host
pool is full, and one preempt / same-step reuse / restore cycle through the recompute connector;
every byte is checked.

Bench (each figure beside a baseline from the same run):
- D->H and H->D of 1,000 scattered 64 KiB blocks through the worker vs one raw contiguous copy
  of the same bytes through the same runtime (target ratio >= 0.8);
- descriptors per block for adjacent blocks (coalesced) vs one per block;
- the sparse memory planner for a 61-layer model vs its 10 ms budget.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ascend_dist.common.device import CopyDirection, CpuSimRuntime, DeviceRuntime, create_runtime, select_backend
from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.kv_offload.block_views import canonical_block_views
from ascend_dist.kv_offload.capacity import HostCapacity
from ascend_dist.kv_offload.host_pool import HostChunkPool
from ascend_dist.kv_offload.offload_worker import OffloadWorker
from ascend_dist.kv_offload.recompute_plan import GroupKind, GroupSpec
from ascend_dist.kv_offload.recompute_scheduler import RecomputeManager
from ascend_dist.kv_offload.recompute_worker import RecomputeWorker
from ascend_dist.kv_offload.sparse_plan import SparseMemoryPlan, plan_sparse_memory

__all__ = ["OffloadScenario", "make_scenario"]

logger = logging.getLogger(__name__)

PAGE = 64 << 10
WAIT_S = 60.0


def _runtime() -> DeviceRuntime:
    choice = select_backend()
    return CpuSimRuntime(wait_timeout_s=WAIT_S) if choice.name == "cpu" else create_runtime(choice.name)


def _random_kv(rt: DeviceRuntime, blocks: int, part: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k, v = rt.empty((blocks, part), torch.int8), rt.empty((blocks, part), torch.int8)
    k.copy_(torch.randint(-128, 127, (blocks, part), dtype=torch.int8, generator=gen))
    v.copy_(torch.randint(-128, 127, (blocks, part), dtype=torch.int8, generator=gen))
    return k, v


class OffloadScenario:
    """The ``offload`` scenario."""

    name = "offload"
    summary = "KV offload to host: store/reload through the worker, preempt/restore, bandwidth vs raw copy"
    modes = frozenset({"demo", "bench"})

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Run the demo checks or the bench figures."""
        report = ScenarioReport(self.name, ctx.mode)
        rt = _runtime()
        try:
            if ctx.mode == "demo":
                self._native_batch(ctx, report, rt)
                self._preempt_restore(ctx, report, rt)
            else:
                self._bandwidth(ctx, report, rt, 100 if ctx.quick else 1000)
                self._descriptors(ctx, report, rt)
                self._sparse_planner(ctx, report)
        finally:
            rt.close()
        return report

    def _native_batch(self, ctx: ScenarioContext, report: ScenarioReport, rt: DeviceRuntime) -> None:
        ctx.progress.step("store 4 requests' KV to host chunks and reload it into other blocks")
        k, v = _random_kv(rt, 64, 4096, seed=1)
        k0, v0 = k.clone(), v.clone()
        worker = OffloadWorker(rt, canonical_block_views([k, v], 64, 8192), num_chunks=16, blocks_per_chunk=2)
        pool = HostChunkPool(16)
        requests = {f"req-{i}": list(range(8 * i, 8 * i + 8)) for i in range(4)}
        chunks: dict[str, list[int]] = {}
        for job, (req, blocks) in enumerate(requests.items()):
            ids = pool.allocate(len(blocks) // 2)
            assert ids is not None
            chunks[req] = ids
            worker.submit_store(job, blocks, ids)
        skipped = pool.allocate(1) is None
        report.check("store skipped when the host pool is full", skipped, f"{pool.num_used}/16 chunks in use")
        worker.wait(range(4), WAIT_S)
        stored = worker.get_finished()
        report.check(
            "4 stores completed in order", [r.job_id for r in stored] == [0, 1, 2, 3] and all(r.success for r in stored)
        )
        k.zero_()
        v.zero_()
        for job, req in enumerate(requests):
            worker.submit_load(10 + job, chunks[req], [32 + b for b in requests[req]])
        worker.wait(range(10, 14), WAIT_S)
        loaded = worker.get_finished()
        same = torch.equal(k[32:64], k0[0:32]) and torch.equal(v[32:64], v0[0:32]) and int(k[:32].abs().sum()) == 0
        report.check(
            "reloaded K/V bytes equal the stored ones", same and all(r.success for r in loaded), "32 blocks x 2 parts"
        )
        worker.shutdown(WAIT_S)

    def _preempt_restore(self, ctx: ScenarioContext, report: ScenarioReport, rt: DeviceRuntime) -> None:
        ctx.progress.step("preempt a request, reuse its blocks in the same step, restore it")
        k, v = _random_kv(rt, 32, 2048, seed=2)
        views = canonical_block_views([k, v], 32, 4096)
        capacity = HostCapacity.from_device(32, 32 * 4096, 16 * 4096)
        manager = RecomputeManager([GroupSpec(GroupKind.FULL, 16)], capacity.num_cpu_blocks, device_pool=_NoPins())
        worker = RecomputeWorker(rt, views, capacity, timeout_s=WAIT_S)
        ids = [3, 4, 5, 6]
        before = (k[ids].clone(), v[ids].clone())
        accepted = manager.update_state_before_preempt("A", [ids], 60)
        meta = manager.build_meta()
        worker.handle_preemptions(meta)  # vLLM's runner order: before the binding
        worker.bind_connector_metadata(meta)
        k[ids] = 7  # request B's forward writes the reused blocks
        v[ids] = 7
        manager.update_connector_output([], worker.build_connector_worker_meta())
        hit = manager.get_num_new_matched_tokens("A", 61, 0)
        manager.update_state_after_alloc("A", 61, [[20, 21, 22, 23]], 60)
        worker.bind_connector_metadata(manager.build_meta())
        worker.start_load_kv()
        worker.transfers.wait(worker.transfers.load.pending(), WAIT_S)
        finished = worker.get_finished() or set()
        manager.update_connector_output(finished, None)
        same = torch.equal(k[20:24], before[0]) and torch.equal(v[20:24], before[1])
        report.check(
            "preempted KV restored byte for byte", accepted and hit == (60, True) and finished == {"A"} and same
        )
        worker.shutdown()

    def _bandwidth(self, ctx: ScenarioContext, report: ScenarioReport, rt: DeviceRuntime, blocks: int) -> None:
        ctx.progress.step(f"D->H and H->D of {blocks:,} scattered 64 KiB blocks vs one raw contiguous copy")
        device = rt.empty((2 * blocks, PAGE), torch.int8)
        device.copy_(torch.randint(-128, 127, device.shape, dtype=torch.int8))
        view = canonical_block_views([device], 2 * blocks, PAGE)
        worker = OffloadWorker(rt, view, num_chunks=blocks)
        rng = np.random.default_rng(3)
        dev_ids = (rng.permutation(blocks) * 2).astype(np.int64)  # never adjacent: one descriptor per block
        host_ids = rng.permutation(blocks).astype(np.int64)
        raw_src, raw_dst = rt.empty((blocks, PAGE), torch.int8), rt.pinned_empty((blocks, PAGE), torch.int8)
        raw_src.zero_()  # touch every page first, as the worker's tensors are
        raw_dst.zero_()
        stream = rt.new_stream()
        for name, direction in (("D->H", "store"), ("H->D", "load")):
            ours = raw = float("inf")
            for rep in range(ctx.repeat):
                start = time.perf_counter()
                if direction == "store":
                    worker.submit_store(rep, dev_ids, host_ids)
                else:
                    worker.submit_load(rep, host_ids, dev_ids)
                worker.wait([rep], WAIT_S)
                ours = min(ours, time.perf_counter() - start)
                worker.get_finished()
                start = time.perf_counter()
                rt.batch_copy(
                    [raw_src.data_ptr()], [raw_dst.data_ptr()], [blocks * PAGE], CopyDirection.D2H, stream=stream
                )
                stream.synchronize(WAIT_S)
                raw = min(raw, time.perf_counter() - start)
            gbps, raw_gbps = blocks * PAGE / ours / 1e9, blocks * PAGE / raw / 1e9
            report.measurements.append(
                Measurement(
                    f"{name} {blocks:,} x 64 KiB via worker",
                    gbps,
                    "GB/s",
                    raw_gbps,
                    "one raw contiguous copy",
                    target_ratio=0.8,
                )
            )
        expected = device[torch.from_numpy(dev_ids)]
        report.check(
            "H->D bytes equal the D->H source",
            torch.equal(worker.mirror.tensors[0][torch.from_numpy(host_ids)], expected),
        )
        worker.shutdown(WAIT_S)

    def _descriptors(self, ctx: ScenarioContext, report: ScenarioReport, rt: DeviceRuntime) -> None:
        ctx.progress.step("descriptors per block: adjacent split-K/V blocks collapse")
        k, v = _random_kv(rt, 1024, 4096, seed=4)
        worker = OffloadWorker(rt, canonical_block_views([k, v], 1024, 8192), num_chunks=1000)
        worker.submit_store(0, range(1000), range(1000))
        worker.wait([0], WAIT_S)
        ok = all(r.success for r in worker.get_finished())
        per_block = worker.store.descriptors_submitted / worker.store.blocks_submitted
        report.check("1,000 adjacent blocks stored", ok and torch.equal(worker.mirror.tensors[0], k[:1000]))
        report.measurements.append(
            Measurement(
                "descriptors per block (adjacent, split K/V)",
                per_block,
                "desc/block",
                2.0,
                "one per block per tensor (Ascend upstream)",
                higher_is_better=False,
            )
        )
        worker.shutdown(WAIT_S)

    def _sparse_planner(self, ctx: ScenarioContext, report: ScenarioReport) -> None:
        ctx.progress.step("sparse memory planner for a 61-layer model")

        def plan_61() -> SparseMemoryPlan:
            return plan_sparse_memory(
                host_page_bytes=61 * 128 * 1152, device_page_bytes=61 * 128 * 256, num_host_layers=61,
                available_device_bytes=20 << 30, dram_bytes=128 << 30, max_blocks_per_request=1024, max_num_seqs=16,
            )  # fmt: skip

        plan = plan_61()
        best = float("inf")
        for _ in range(max(ctx.repeat, 3)):
            start = time.perf_counter()
            plan_61()
            best = min(best, time.perf_counter() - start)
        report.check("61-layer plan matches the worked example", (plan.num_blocks, plan.limit) == (10_743, "npu"))
        report.measurements.append(
            Measurement(
                "sparse planner, 61 layers",
                best * 1e3,
                "ms",
                10.0,
                "10 ms budget",
                higher_is_better=False,
                target_ratio=1.0,
            )
        )


class _NoPins:
    """The demo's device pool: nothing else allocates, so pins need no bookkeeping."""

    def touch(self, block_ids: object) -> None:
        del block_ids

    def free(self, block_ids: object) -> None:
        del block_ids


def make_scenario() -> OffloadScenario:
    """Entry point of ``ascend_dist.scenarios``."""
    return OffloadScenario()
