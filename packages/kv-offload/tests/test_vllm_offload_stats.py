"""The offload connectors' transfer stats read back through vLLM 0.33's own stats objects (nox session vllm).

Recompute: one preempt/restore cycle through the factory-registered `RecomputeCPUOffloadConnector`
(vLLM's real BlockPool, Request, KVCacheBlocks, KVConnectorOutput) on a `FaultyRuntime` over the CPU
simulation; the worker's stats go to vLLM's `KVConnectorLogging` and `KVConnectorProm` (a private
registry) as vLLM's scheduler hands them on. Native: vLLM's own offloading stats
(``vllm:kv_offload_*``) after real stores and loads through vLLM's running ``Scheduler``, and its
failed jobs (ours: ``vllm:ascend_offload_num_failed_transfers``); simple: its bytes each way and
failures (ours) beside vLLM's simple-offload stats. Faults are injected through `FaultyRuntime`, a
fake of our `DeviceRuntime` Protocol over the CPU simulation.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from offload_vllm_loop import NATIVE, SIMPLE, FaultyRuntime, Loop, make_config, write_model_dir  # noqa: E402
from test_vllm_connectors import BLOCK, NUM_BLOCKS, _configs, _kv, _register  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from ascend_dist.common.device import CopyDirection, CpuSimRuntime  # noqa: E402
from ascend_dist.testing import vllm_builders  # noqa: E402
from ascend_dist.testing.vllm_stats import read_back  # noqa: E402

KINDS = ("lease_expired", "peer_unreachable", "timeout", "refused", "other")
PAGE = BLOCK * 1 * 4  # int8 K (or V) bytes of one block: 16 tokens x 1 head x 4


def _payload(connector: Any) -> dict[str, Any] | None:
    stats = connector.get_kv_connector_stats()
    return None if stats is None else stats.to_dict()


def _failed(out: Any, direction: str) -> dict[str, float]:
    found = {
        k: out.sample("vllm:ascend_offload_num_failed_transfers_total", direction=direction, kind=k) for k in KINDS
    }
    return {k: v for k, v in found.items() if v}


def _recompute_cycle(fail_restore: bool) -> tuple[Any, list[dict[str, Any] | None]]:
    """Preempt a request (store 3 blocks), reuse them, restore; the worker's payload after each half."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    _register("RecomputeCPUOffloadConnector", "ascend_dist.kv_offload.vllm_recompute", "RecomputeCPUOffloadConnector")
    vllm_config, kv_config = _configs("RecomputeCPUOffloadConnector", {"cpu_bytes_to_use": "8 KiB"})
    sched = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER, kv_config)
    worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_config)
    runtime = FaultyRuntime(CpuSimRuntime(wait_timeout_s=10.0))
    worker.runtime = runtime
    payloads: list[dict[str, Any] | None] = [_payload(worker)]  # control: registration moved nothing
    try:
        pool = BlockPool(NUM_BLOCKS, enable_caching=False, hash_block_size=BLOCK)
        sched.bind_gpu_block_pool(pool)
        k, v = _kv()
        worker.register_kv_caches({"l0": (k, v)})
        hasher = vllm_builders.block_hasher(vllm_config, kv_config)
        request = Request("A", list(range(40)), SamplingParams(max_tokens=4), None, block_hasher=hasher)
        blocks = pool.get_new_blocks(3)
        ids = [b.block_id for b in blocks]
        saved = (k[ids].clone(), v[ids].clone())
        assert sched.update_state_before_preempt(request, [ids], 40)
        pool.free_blocks(blocks)
        meta = sched.build_connector_meta(None)
        worker.bind_connector_metadata(meta)
        worker.handle_preemptions(meta)  # synchronous store
        k.fill_(1)
        v.fill_(1)
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=worker.build_connector_worker_meta()))
        worker.clear_connector_metadata()
        payloads.append(_payload(worker))
        assert sched.get_num_new_matched_tokens(request, 0) == (40, True)
        new_blocks = pool.get_new_blocks(3)
        sched.update_state_after_alloc(request, KVCacheBlocks((new_blocks,)), 40)
        if fail_restore:
            runtime.fail(CopyDirection.H2D)
        worker.bind_connector_metadata(sched.build_connector_meta(None))
        worker.start_load_kv(None)
        worker.wait_for_layer_load("l0")
        worker.worker.transfers.wait(worker.worker.transfers.load.pending(), 10.0)
        assert worker.get_finished(set()) == (None, {"A"})
        new_ids = [b.block_id for b in new_blocks]
        restored = torch.equal(k[new_ids], saved[0]) and torch.equal(v[new_ids], saved[1])
        assert restored != fail_restore
        assert (worker.get_block_ids_with_load_errors() == set(new_ids)) == fail_restore
        payloads.append(_payload(worker))
        payloads.append(_payload(sched))  # the scheduler side records nothing of its own
        return vllm_config, payloads
    finally:
        worker.shutdown()


def test_recompute_store_and_restore_report_their_bytes_each_way() -> None:
    config, (before, stored, restored, scheduler) = _recompute_cycle(fail_restore=False)
    assert before is None and scheduler is None
    out = read_back(config, stored)
    assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="save") == 3 * 2 * PAGE  # device -> host
    assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="load") is None
    assert out.sample("vllm:ascend_offload_num_descriptors_sum", direction="save") >= 1
    assert out.sample("vllm:ascend_offload_xfer_time_seconds_count", direction="save") == 1
    assert f"offload save: MB transferred={round(3 * 2 * PAGE / 2**20, 3)}" in out.lines[0]
    out = read_back(config, restored)
    assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="load") == 3 * 2 * PAGE  # host -> device
    assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="save") is None
    assert _failed(out, "load") == {} and _failed(out, "save") == {}


def test_a_failed_restore_is_a_failure_and_moves_no_bytes() -> None:
    config, (_, stored, restored, _) = _recompute_cycle(fail_restore=True)
    assert read_back(config, stored).sample("vllm:ascend_offload_bytes_transferred_sum", direction="save") == 384
    out = read_back(config, restored)
    assert _failed(out, "load") == {"other": 1}  # a device copy error
    assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="load") is None
    assert "offload load: Num failed transfers (other)=1" in out.lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


class StatsScheduler(Scheduler):
    """vLLM's Scheduler keeping each step's connector stats payload (what it puts in ``SchedulerStats``)."""

    payloads: list[dict[str, Any]]

    def make_stats(self, spec_decoding_stats: Any = None, kv_connector_stats: Any = None, *args: Any, **kw: Any) -> Any:
        if kv_connector_stats is not None:
            self.__dict__.setdefault("payloads", []).append(kv_connector_stats.to_dict())
        return super().make_stats(spec_decoding_stats, kv_connector_stats, *args, **kw)

    def take(self) -> list[dict[str, Any]]:
        out, self.payloads = self.__dict__.get("payloads", []), []
        return out


def test_native_offload_reports_bytes_each_way_under_vllms_own_names(model_dir: Path) -> None:
    """`AscendOffloadingConnector` keeps vLLM's OffloadingConnector stats: ``vllm:kv_offload_*`` (vLLM's names)."""
    extra = {"spec_name": "NPUOffloadingSpec", "spec_module_path": NATIVE, "cpu_bytes_to_use": 1 << 20}
    config = make_config(model_dir, "AscendOffloadingConnector", NATIVE, extra, 32)
    loop = Loop(config, 32, scheduler_cls=StatsScheduler)
    try:
        loop.add("a", 100, 48)  # three full blocks: stored to host once computed
        list(loop.run())
        stored = read_back(config, *loop.sched.take())
        again = loop.add("a2", 100, 48)
        list(loop.run())
        assert again.is_finished() and loop.verified == {"a2": 48}  # loaded from host, every byte checked
        loaded = read_back(config, *loop.sched.take())
        page = 2 * BLOCK * 1 * 4  # K and V of one block
        assert stored.sample("vllm:kv_offload_store_bytes_total") == 3 * page  # device -> host
        assert stored.sample("vllm:kv_offload_load_bytes_total") is None  # control: nothing loaded yet
        assert loaded.sample("vllm:kv_offload_load_bytes_total") == 3 * page  # host -> device
        assert loaded.sample("vllm:kv_offload_store_bytes_total") is None  # a2's blocks were already on host
        assert loaded.sample("vllm:kv_offload_load_time_total") > 0
    finally:
        loop.close()


def _native_loop(model_dir: Path) -> tuple[Any, Loop]:
    extra = {"spec_name": "NPUOffloadingSpec", "spec_module_path": NATIVE, "cpu_bytes_to_use": 1 << 20}
    config = make_config(model_dir, "AscendOffloadingConnector", NATIVE, extra, 32)
    return config, Loop(config, 32, scheduler_cls=StatsScheduler)


def test_native_failed_jobs_are_failures_by_kind_and_move_no_bytes(model_dir: Path) -> None:
    """A failed store and a failed load: one ``other`` failure each way; vLLM's bytes count only the good jobs."""
    config, loop = _native_loop(model_dir)
    page = 2 * BLOCK * 1 * 4
    try:
        runtime = loop.shards[0].runtime
        runtime.fail(CopyDirection.D2H)  # a's store
        loop.add("a", 100, 48)
        list(loop.run())
        failed_store = read_back(config, *loop.sched.take())
        assert _failed(failed_store, "save") == {"other": 1} and _failed(failed_store, "load") == {}
        assert failed_store.sample("vllm:kv_offload_store_bytes_total") is None  # nothing stored
        assert "offload save: Num failed transfers (other)=1" in failed_store.lines[0]
        loop.add("b", 300, 48)
        list(loop.run())
        stored = read_back(config, *loop.sched.take())
        assert stored.sample("vllm:kv_offload_store_bytes_total") == 3 * page  # control: a good store
        assert _failed(stored, "save") == {}  # control: a failure is counted once, in its own poll
        runtime.fail(CopyDirection.H2D)  # b2's first load
        again = loop.add("b2", 300, 48)
        list(loop.run())
        assert again.is_finished() and loop.verified == {"b2": 48}  # vLLM retried: the host copy was intact
        loaded = read_back(config, *loop.sched.take())
        assert _failed(loaded, "load") == {"other": 1} and _failed(loaded, "save") == {}
        assert loaded.sample("vllm:kv_offload_load_bytes_total") == 3 * page  # the retry only
    finally:
        loop.close()


def _simple_loop(model_dir: Path) -> tuple[Any, Loop]:
    config = make_config(
        model_dir, "AscendSimpleCPUOffloadConnector", SIMPLE, {"cpu_bytes_to_use": 1 << 20}, 40, prefix_caching=True
    )
    return config, Loop(config, 40, scheduler_cls=StatsScheduler)


def test_simple_reports_its_bytes_each_way_beside_vllms_stats(model_dir: Path) -> None:
    config, loop = _simple_loop(model_dir)
    try:
        loop.add("a", 100, 48)  # three full blocks: stored to host once computed
        list(loop.run())
        stored = read_back(config, *loop.sched.take())
        assert stored.sample("vllm:ascend_offload_bytes_transferred_sum", direction="save") == 3 * 2 * PAGE
        assert stored.sample("vllm:ascend_offload_bytes_transferred_sum", direction="load") is None  # control
        assert stored.sample("vllm:ascend_offload_num_descriptors_sum", direction="save") >= 1
        assert _failed(stored, "save") == {} and _failed(stored, "load") == {}
        assert loop.sched.reset_prefix_cache()  # the repeat can only hit the host copy
        loop.add("a2", 100, 48)
        list(loop.run())
        loaded = read_back(config, *loop.sched.take())
        blocks = loop.verified["a2"] // BLOCK  # loaded and checked byte for byte (vLLM computes the last block)
        assert blocks >= 2
        assert loaded.sample("vllm:ascend_offload_bytes_transferred_sum", direction="load") == blocks * 2 * PAGE
        assert loaded.sample("vllm:ascend_offload_bytes_transferred_sum", direction="save") is None
        assert loaded.sample("vllm:simple_kv_offload_load_blocks_total") == blocks  # vLLM's own half, unchanged
        assert any("offload load: MB transferred" in line for line in loaded.lines)
    finally:
        loop.close()


@pytest.mark.parametrize("how", ["copy-fault", "submit-raises"])
def test_simple_failed_jobs_are_failures_by_kind_and_move_no_bytes(model_dir: Path, how: str) -> None:
    config, loop = _simple_loop(model_dir)
    try:
        runtime = loop.shards[0].runtime
        arm = runtime.fail if how == "copy-fault" else runtime.raise_on_submit
        arm(CopyDirection.D2H)
        loop.add("a", 100, 48)
        list(loop.run())
        out = read_back(config, *loop.sched.take())
        assert _failed(out, "save") == {"other": 1} and _failed(out, "load") == {}
        assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="save") is None
        loop.add("b", 300, 48)
        list(loop.run())
        out = read_back(config, *loop.sched.take())
        assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="save") == 3 * 2 * PAGE  # control
        assert _failed(out, "save") == {}
        assert loop.sched.reset_prefix_cache()
        arm(CopyDirection.H2D)
        again = loop.add("b2", 300, 48)
        list(loop.run())
        assert again.is_finished() and loop.load_errors  # reported; vLLM then retried from the intact host copy
        assert loop.verified == {"b2": 32}
        out = read_back(config, *loop.sched.take())
        assert _failed(out, "load") == {"other": 1} and _failed(out, "save") == {}
        # the retry only: the failed job moved nothing
        assert out.sample("vllm:ascend_offload_bytes_transferred_sum", direction="load") == 2 * 2 * PAGE
        assert out.sample("vllm:ascend_offload_xfer_time_seconds_count", direction="load") == 1
    finally:
        loop.close()


def test_a_malformed_paired_payload_is_dropped_whole(model_dir: Path) -> None:
    """A payload from outside: a wrong marker, a bad half of ours or of vLLM's is logged and counts nothing."""
    from ascend_dist.common.vllm_stats import AscendTransferStats
    from ascend_dist.kv_offload.vllm_native import AscendOffloadingConnector, NativeOffloadStats

    extra = {"spec_name": "NPUOffloadingSpec", "spec_module_path": NATIVE, "cpu_bytes_to_use": 1 << 20}
    config = make_config(model_dir, "AscendOffloadingConnector", NATIVE, extra, 32)
    ours = {"ascend_dist_stats": 1, "failures": [["offload", "save", "other", 1]]}
    negative = {"ascend_dist_stats": 1, "failures": [["offload", "save", "other", -1]]}
    bad = [
        ours,  # ours without the pair's marker
        {"ascend_dist_paired_stats": 2, "vllm": None, "ascend": ours},
        {"ascend_dist_paired_stats": 1, "vllm": None, "ascend": negative},
        {"ascend_dist_paired_stats": 1, "vllm": [1], "ascend": ours},
    ]
    for payload in bad:
        stats = AscendOffloadingConnector.build_kv_connector_stats(payload)
        assert stats is not None and stats.is_empty()
    out = read_back(config, *bad, {"ascend_dist_paired_stats": 1, "vllm": None, "ascend": ours})
    assert _failed(out, "save") == {"other": 1}  # the well-formed payload only (control: it is counted)
    with pytest.raises(TypeError, match="cannot aggregate"):  # one connector's stats only, as vLLM's own
        NativeOffloadStats().aggregate(AscendTransferStats(data=ours))
