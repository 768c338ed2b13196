"""Recompute connector, scheduler side: worked examples and bookkeeping rules."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
import pytest

from ascend_dist.common.errors import ConfigError, IncompatiblePeer
from ascend_dist.kv_offload.capacity import HostCapacity
from ascend_dist.kv_offload.messages import (
    RecomputeMetadata,
    RecomputeWorkerMeta,
    decode_metadata,
    decode_worker_meta,
    encode_message,
)
from ascend_dist.kv_offload.recompute_plan import (
    GroupKind,
    GroupSpec,
    align_group_block_ids,
    attention_load_pairs,
    mamba_state_index,
)
from ascend_dist.kv_offload.recompute_scheduler import RecomputeManager

FULL = GroupSpec(GroupKind.FULL, 16)
SWA = GroupSpec(GroupKind.SLIDING_WINDOW, 16)
MAMBA = GroupSpec(GroupKind.MAMBA, 16)


class FakeDevicePool:
    """Counts references like vLLM's BlockPool.touch/free_blocks."""

    def __init__(self) -> None:
        self.refs: Counter[int] = Counter()

    def touch(self, block_ids: Sequence[int]) -> None:
        self.refs.update(block_ids)

    def free(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            assert self.refs[b] > 0, f"free of unreferenced block {b}"
            self.refs[b] -= 1


@pytest.mark.parametrize(
    ("ids", "sliding", "expected"),
    [([7, 8], True, [0, 0, 7, 8]), ([5, 6, 7, 8, 9], True, [5, 6, 7, 8]), ([7, 8], False, [7, 8])],
)
def test_alignment_examples(ids: list[int], sliding: bool, expected: list[int]) -> None:
    assert align_group_block_ids(ids, 64, 16, sliding_window=sliding) == expected
    assert align_group_block_ids(ids, 0, 16, sliding_window=sliding) == []


def test_load_pair_examples() -> None:
    assert attention_load_pairs([0, 0, 4, 5], [30, 31], 0, 64, 16, sliding_window=True) == [(4, 30), (5, 31)]
    assert attention_load_pairs([1, 2, 3, 4], [10, 11, 12], 0, 64, 16, sliding_window=False) == [
        (1, 10), (2, 11), (3, 12),
    ]  # fmt: skip


def test_mamba_state_choice() -> None:
    assert mamba_state_index(1, 63, 64) == 1  # usual case: newest of 2 states
    assert mamba_state_index(1, 64, 64) == 0
    with pytest.raises(ConfigError, match="mamba_state_index"):
        mamba_state_index(0, 70, 64)


def test_recompute_capacity_example() -> None:
    cap = HostCapacity.from_device(2000, 40_000 << 20, 16 << 30)
    assert cap.num_cpu_blocks == 819


def _manager(groups: Sequence[GroupSpec], blocks: int = 16, **kw: object) -> tuple[RecomputeManager, FakeDevicePool]:
    pool = FakeDevicePool()
    return RecomputeManager(groups, blocks, device_pool=pool, **kw), pool  # type: ignore[arg-type]


def test_swa_preempt_example_then_restore_round_trip() -> None:
    mgr, pool = _manager([SWA], world_size=2)
    assert mgr.update_state_before_preempt("r", [[20, 21]], 64)
    meta = mgr.build_meta()
    assert meta.need_flush and meta.store_gpu_blocks == (20, 21) and len(meta.store_cpu_blocks) == 2
    assert mgr.get_num_new_matched_tokens("r", 65, 0) == (None, False)  # not acknowledged yet
    mgr.update_connector_output([], RecomputeWorkerMeta(completed_stores={meta.store_event: 1}))
    assert mgr.get_num_new_matched_tokens("r", 65, 0) == (None, False)  # one of two workers
    mgr.update_connector_output([], RecomputeWorkerMeta(completed_stores={meta.store_event: 1}))
    assert mgr.get_num_new_matched_tokens("r", 65, 0) == (64, True)
    mgr.update_state_after_alloc("r", 65, [[30, 31]], 64)
    load = mgr.build_meta()
    assert not load.need_flush
    assert list(zip(load.load_cpu_blocks, load.load_gpu_blocks, strict=True)) == list(
        zip(meta.store_cpu_blocks, (30, 31), strict=True)
    )
    assert load.load_event_to_reqs == {load.load_event: ("r",)}
    assert pool.refs[30] == 1 and pool.refs[31] == 1  # pinned during the async load
    assert mgr.has_pending_transfers() and not mgr.reset_cache()
    mgr.update_connector_output(["r"], None)
    assert pool.refs[30] == 0 and not mgr.has_preempted_request("r") and mgr.host.num_free == 16
    assert mgr.reset_cache()


def test_host_pool_exhaustion_falls_back_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    mgr, _ = _manager([FULL], blocks=2)
    assert not mgr.update_state_before_preempt("big", [[1, 2, 3]], 48)
    assert "fall back" in caplog.text and mgr.host.num_free == 2
    assert mgr.update_state_before_preempt("small", [[4, 5]], 20)
    assert not mgr.update_state_before_preempt("none", [[0]], 0)


def test_mtp_clipping_and_mamba_restore() -> None:
    mgr, _ = _manager([FULL, MAMBA], num_spec_tokens=1)
    assert mgr.update_state_before_preempt("r", [[1, 2, 3, 4], [7, 8, 9]], 63)
    meta = mgr.build_meta()
    assert meta.store_gpu_blocks == (1, 2, 3, 4, 8, 9)  # Mamba: last 1 + num_spec_tokens states
    host = dict(zip(meta.store_gpu_blocks, meta.store_cpu_blocks, strict=True))
    mgr.update_connector_output([], RecomputeWorkerMeta(completed_stores={meta.store_event: 1}))
    assert mgr.get_num_new_matched_tokens("r", 64, 0) == (63, True)
    mgr.update_state_after_alloc("r", 64, [[10, 11, 12], [20]], 63)  # one device block fewer: clipped
    load = mgr.build_meta()
    pairs = set(zip(load.load_cpu_blocks, load.load_gpu_blocks, strict=True))
    assert pairs == {(host[1], 10), (host[2], 11), (host[3], 12), (host[9], 20)}


def test_prefix_hashes_are_shared_within_one_step() -> None:
    mgr, _ = _manager([FULL], enable_prefix_caching=True)
    hashes = [b"h0", b"h1"]
    assert mgr.update_state_before_preempt("a", [[1, 2, 3]], 40, hashes)  # 2 full + 1 partial
    assert mgr.update_state_before_preempt("b", [[4, 5, 6]], 40, hashes)
    meta = mgr.build_meta()
    assert meta.store_gpu_blocks == (1, 2, 3, 6)  # b shares a's two full blocks, keeps its partial one
    assert mgr.host.num_free == 16 - 4
    mgr.update_connector_output([], RecomputeWorkerMeta(completed_stores={meta.store_event: 1}))
    assert mgr.update_state_before_preempt("c", [[7, 8]], 32, hashes)  # both cached now
    assert mgr.build_meta().store_gpu_blocks == ()
    with pytest.raises(ConfigError, match="enable_offload_prefix_caching"):
        RecomputeManager([FULL], 4, enable_prefix_caching="yes")  # type: ignore[arg-type]


def test_finish_during_store_frees_on_ack_and_failed_store_falls_back() -> None:
    mgr, _ = _manager([FULL])
    mgr.update_state_before_preempt("r", [[1, 2]], 32)
    meta = mgr.build_meta()
    assert mgr.request_finished("r") == (False, None)
    assert mgr.has_preempted_request("r") and mgr.host.num_free == 14  # still in flight: no reuse
    mgr.update_connector_output([], RecomputeWorkerMeta(completed_stores={meta.store_event: 1}))
    assert not mgr.has_preempted_request("r") and mgr.host.num_free == 16
    mgr.update_state_before_preempt("s", [[1]], 10)
    meta = mgr.build_meta()
    mgr.update_connector_output([], RecomputeWorkerMeta(failed_stores=(meta.store_event,)))
    assert mgr.get_num_new_matched_tokens("s", 11, 0) == (0, False) and mgr.host.num_free == 16


def test_messages_round_trip_aggregate_and_version_check() -> None:
    meta = RecomputeMetadata(need_flush=True, store_event=3, store_gpu_blocks=(1,), store_cpu_blocks=(2,))
    assert decode_metadata(encode_message(meta)) == meta
    a = RecomputeWorkerMeta(completed_stores={1: 1, 2: 1})
    b = RecomputeWorkerMeta(completed_stores={1: 1}, failed_stores=(5,))
    agg = a.aggregate(b)
    assert agg.completed_stores == {1: 2, 2: 1} and agg.failed_stores == (5,)
    assert decode_worker_meta(encode_message(agg)) == agg
    with pytest.raises(IncompatiblePeer, match="version"):
        decode_metadata(encode_message(RecomputeMetadata(version=99)))


def test_native_failed_stores_message_round_trip_and_version_check() -> None:
    from ascend_dist.common.errors import ProtocolError
    from ascend_dist.kv_offload.messages import NativeFailedStores, decode_failed_stores, encode_failed_stores

    assert encode_failed_stores([]) == b"" and decode_failed_stores(b"") == frozenset()
    assert decode_failed_stores(encode_failed_stores([7, 3, 7])) == {3, 7}
    with pytest.raises(IncompatiblePeer, match="version"):
        decode_failed_stores(msgspec.msgpack.encode(NativeFailedStores(version=99, job_ids=(1,))))
    with pytest.raises(ProtocolError):
        decode_failed_stores(b"\xc1 not msgpack")
