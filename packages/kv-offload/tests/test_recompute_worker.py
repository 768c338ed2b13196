"""Recompute connector end to end on the CPU simulation: preempt, reuse in the same step, restore."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.kv_offload.block_views import canonical_block_views
from ascend_dist.kv_offload.capacity import HostCapacity
from ascend_dist.kv_offload.messages import decode_metadata, encode_message
from ascend_dist.kv_offload.recompute_plan import GroupKind, GroupSpec
from ascend_dist.kv_offload.recompute_scheduler import RecomputeManager
from ascend_dist.kv_offload.recompute_worker import RecomputeWorker

BLOCKS = 16
PART = 64


class FakeDevicePool:
    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()

    def touch(self, block_ids: Sequence[int]) -> None:
        self.refs.update(block_ids)

    def free(self, block_ids: Sequence[int]) -> None:
        self.refs.subtract(block_ids)


def _setup(rt: CpuSimRuntime) -> tuple[torch.Tensor, torch.Tensor, RecomputeManager, RecomputeWorker, FakeDevicePool]:
    gen = torch.Generator().manual_seed(3)
    k = torch.randint(-128, 127, (BLOCKS, PART), dtype=torch.int8, generator=gen)
    v = torch.randint(-128, 127, (BLOCKS, PART), dtype=torch.int8, generator=gen)
    views = canonical_block_views([k, v], BLOCKS, 2 * PART)
    capacity = HostCapacity.from_device(BLOCKS, BLOCKS * 2 * PART, 8 * 2 * PART)  # 8 host blocks
    pool = FakeDevicePool()
    mgr = RecomputeManager([GroupSpec(GroupKind.FULL, 16)], capacity.num_cpu_blocks, device_pool=pool)
    return k, v, mgr, RecomputeWorker(rt, views, capacity, timeout_s=10.0), pool


def test_preempted_blocks_reused_in_the_same_step_restore_the_original_bytes(rt: CpuSimRuntime) -> None:
    k, v, mgr, worker, pool = _setup(rt)
    original = (k[[2, 3]].clone(), v[[2, 3]].clone())
    assert mgr.update_state_before_preempt("A", [[2, 3]], 30)
    meta = decode_metadata(encode_message(mgr.build_meta()))  # crosses the process boundary as bytes
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions(meta)  # synchronous store, before the model runs this step
    # the scheduler handed blocks 2 and 3 to request B, whose forward overwrites them this step
    rt.launch_host_func(rt.compute_stream(), lambda: (k[2:4].fill_(5), v[2:4].fill_(5)))
    rt.compute_stream().synchronize(5.0)
    ack = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    mgr.update_connector_output([], ack)
    assert mgr.get_num_new_matched_tokens("A", 31, 0) == (30, True)
    mgr.update_state_after_alloc("A", 31, [[9, 10]], 30)
    worker.bind_connector_metadata(mgr.build_meta())
    worker.start_load_kv()
    worker.start_load_kv()  # repeated calls submit once
    worker.wait_for_layer_load()
    rt.compute_stream().synchronize(5.0)
    worker.transfers.wait(worker.transfers.load.pending(), 5.0)
    finished = worker.get_finished()
    assert finished == {"A"} and worker.get_block_ids_with_load_errors() == set()
    assert torch.equal(k[[9, 10]], original[0]) and torch.equal(v[[9, 10]], original[1])
    mgr.update_connector_output(finished, worker.build_connector_worker_meta())
    assert not mgr.has_preempted_request("A") and all(n == 0 for n in pool.refs.values())
    worker.shutdown()


def test_failed_store_makes_the_request_recompute(rt: CpuSimRuntime) -> None:
    _, _, mgr, worker, _ = _setup(rt)
    assert mgr.update_state_before_preempt("A", [[4]], 10)
    meta = mgr.build_meta()
    rt.inject_copy_fault(1)
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions()
    ack = worker.build_connector_worker_meta()
    assert ack is not None and ack.failed_stores == (meta.store_event,)
    mgr.update_connector_output([], ack)
    assert mgr.get_num_new_matched_tokens("A", 11, 0) == (0, False)
    worker.shutdown()


def test_failed_restore_reports_its_device_blocks(rt: CpuSimRuntime) -> None:
    _, _, mgr, worker, _ = _setup(rt)
    mgr.update_state_before_preempt("A", [[4, 5]], 20)
    meta = mgr.build_meta()
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions()
    mgr.update_connector_output([], worker.build_connector_worker_meta())
    assert mgr.get_num_new_matched_tokens("A", 21, 0) == (20, True)
    mgr.update_state_after_alloc("A", 21, [[11, 12]], 20)
    worker.bind_connector_metadata(mgr.build_meta())
    rt.inject_copy_fault(0)
    worker.start_load_kv()
    worker.transfers.wait(worker.transfers.load.pending(), 5.0)
    assert worker.get_finished() == {"A"}
    assert worker.get_block_ids_with_load_errors() == {11, 12}
    worker.shutdown()
