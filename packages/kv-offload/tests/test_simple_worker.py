"""Simple CPU offload worker: views of every sub-tensor, copy thread, store-after-compute."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.common.transfer_stats import FailureKind, TransferStats
from ascend_dist.kv_offload.capacity import HostCapacity, check_worker_capacity, per_rank_capacity
from ascend_dist.kv_offload.simple_worker import SimpleOffloadWorker, simple_block_views


@dataclass
class Plan:
    load_event: int = -1
    load_gpu_blocks: list[int] = field(default_factory=list)
    load_cpu_blocks: list[int] = field(default_factory=list)
    load_event_to_reqs: dict[int, list[str]] = field(default_factory=dict)
    store_event: int = -1
    store_gpu_blocks: list[int] = field(default_factory=list)
    store_cpu_blocks: list[int] = field(default_factory=list)
    need_flush: bool = False


def test_views_keep_sibling_tensors_of_one_allocation_and_split_stacks() -> None:
    raw = torch.zeros(1 + 8 * 2 + 8 * 3, dtype=torch.int8)
    state0 = raw[1:17].view(8, 2)
    state1 = raw[17:41].view(8, 3)
    stacked = torch.zeros(2, 8, 4, dtype=torch.int8)
    views = simple_block_views({"mamba": [state0, state1], "kv": stacked, "alias": [state0]}, 8)
    assert [v.base_ptr for v in views] == [
        state0.data_ptr(),
        state1.data_ptr(),
        stacked[0].data_ptr(),
        stacked[1].data_ptr(),
    ]
    assert [v.copy_bytes for v in views] == [2, 3, 4, 4]
    with pytest.raises(LayoutError, match="blocks dim"):
        simple_block_views({"bad": torch.zeros(2, 3, dtype=torch.int8)}, 8)


def test_capacity_is_one_formula_and_worker_refuses_less() -> None:
    per_rank = per_rank_capacity({"cpu_bytes_to_use": "4 KiB"}, world_size=2)
    cap = HostCapacity.from_device(num_gpu_blocks=8, total_device_kv_bytes=8 * 128, capacity_per_rank=per_rank)
    assert cap.num_cpu_blocks == 16
    with pytest.raises(ConfigError, match="num_cpu_blocks"):
        check_worker_capacity(15, cap)
    with pytest.raises(ConfigError, match="cpu_bytes_to_use_per_rank"):
        per_rank_capacity({"cpu_bytes_to_use_per_rank": "3 parsecs"}, world_size=1)


def test_store_waits_for_compute_and_load_reports_request(rt: CpuSimRuntime) -> None:
    k = torch.zeros(8, 64, dtype=torch.int8)
    v = torch.zeros(8, 64, dtype=torch.int8)
    worker = SimpleOffloadWorker(rt, HostCapacity.from_device(8, 8 * 128, 4 * 128), timeout_s=5.0)
    worker.register_kv_caches({"layer0": (k, v)}, 8)
    gate = threading.Event()

    def model_writes_block_1() -> None:
        assert gate.wait(5.0)
        k[1].fill_(9)
        v[1].fill_(8)

    rt.launch_host_func(rt.compute_stream(), model_writes_block_1)
    worker.bind_connector_metadata(Plan(store_event=0, store_gpu_blocks=[1], store_cpu_blocks=[2]))
    worker.wait_for_save()
    assert worker.get_finished(set()) == (None, None) and worker.build_connector_worker_meta() is None
    gate.set()
    worker.handle_preemptions(Plan(need_flush=True))
    worker.get_finished(set())
    assert worker.build_connector_worker_meta() == {0: 1}
    assert worker.transfers is not None
    assert (
        int(worker.transfers.mirror.tensors[0][2].min()) == 9 and int(worker.transfers.mirror.tensors[1][2].max()) == 8
    )
    worker.clear_connector_metadata()
    worker.bind_connector_metadata(
        Plan(load_event=0, load_gpu_blocks=[6], load_cpu_blocks=[2], load_event_to_reqs={0: ["req-1"]})
    )
    worker.start_load_kv()
    worker.handle_preemptions(Plan(need_flush=True))
    assert worker.get_finished(set()) == (None, {"req-1"})
    assert torch.equal(k[6], k[1]) and torch.equal(v[6], v[1])
    worker.shutdown()


def test_a_worker_without_a_runtime_copies_on_its_ranks_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25 item 2: the runtime taken at registration was device 0's on every rank."""
    from ascend_dist.common.device import DEVICE_ENV, close_runtime, get_runtime, set_current_device

    monkeypatch.setenv(DEVICE_ENV, "cpu")
    close_runtime()
    try:
        set_current_device(2)  # vLLM's worker for local rank 2 (CPU tensors carry no device index)
        worker = SimpleOffloadWorker(None, HostCapacity.from_device(8, 8 * 128, 4 * 128), timeout_s=5.0)
        worker.register_kv_caches({"layer0": (torch.zeros(8, 64, dtype=torch.int8),)}, 8)
        assert worker.runtime is get_runtime(2) and worker.runtime.device_index == 2
        worker.shutdown()
    finally:
        close_runtime()


def test_each_ended_job_is_in_the_stats_a_refused_one_as_a_failure(rt: CpuSimRuntime) -> None:
    """Bytes, descriptors and time of a good store and load; a store the copy thread could not submit is a failure."""
    k = torch.zeros(8, 64, dtype=torch.int8)
    v = torch.zeros(8, 64, dtype=torch.int8)
    stats = TransferStats("offload")
    worker = SimpleOffloadWorker(rt, HostCapacity.from_device(8, 8 * 128, 4 * 128), timeout_s=5.0, stats=stats)
    try:
        worker.register_kv_caches({"layer0": (k, v)}, 8)
        assert stats.take() is None  # control: registration moved nothing
        worker.bind_connector_metadata(Plan(store_event=0, store_gpu_blocks=[1, 2], store_cpu_blocks=[0, 1]))
        worker.wait_for_save()
        worker.handle_preemptions(Plan(need_flush=True))
        worker.get_finished(set())
        worker.clear_connector_metadata()
        worker.bind_connector_metadata(
            Plan(load_event=0, load_gpu_blocks=[5], load_cpu_blocks=[1], load_event_to_reqs={0: ["r"]})
        )
        worker.start_load_kv()
        worker.handle_preemptions(Plan(need_flush=True))
        assert worker.get_finished(set()) == (None, {"r"})
        worker.clear_connector_metadata()
        data = stats.take()
        assert data is not None and data.failures == []
        assert [(t.direction, t.nbytes) for t in data.transfers] == [("save", 2 * 128), ("load", 128)]
        assert all(t.descriptors >= 1 and t.duration_s >= 0 for t in data.transfers)
        worker.bind_connector_metadata(Plan(store_event=1, store_gpu_blocks=[3], store_cpu_blocks=[99]))  # no host 99
        worker.wait_for_save()
        worker.handle_preemptions(Plan(need_flush=True))
        worker.get_finished(set())
        assert worker.take_failed_stores() == {1: 1}
        data = stats.take()
        assert data is not None and data.transfers == []
        assert [(f.direction, f.kind, f.count) for f in data.failures] == [("save", FailureKind.OTHER, 1)]
    finally:
        worker.shutdown()
