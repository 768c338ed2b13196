"""Layer-wise planning, TP-mismatch planning, KV-event aggregation and the attention gate (worked examples)."""

from __future__ import annotations

import threading

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_store.keys.tp_mismatch import TpMismatchInfo, strided_sub_key_addresses
from ascend_dist.kv_store.transfer.events import BlockStoredEvent, EventAggregator, EventCollector
from ascend_dist.kv_store.transfer.gate import current_gate, reset_gate
from ascend_dist.kv_store.transfer.layerwise_plan import (
    build_layout,
    gva_layer_copies,
    physical_layer_index,
    split_packets,
    stagger_us,
)


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("model.mtp.0.self_attn", 61),
        ("model.layers.12.self_attn.attn", 12),
        ("model.layers.3.self_attn.indexer.k_cache", 3),
        ("model.mtp.layers.1.attn", 62),
        ("lm_head", 0),
    ],
)
def test_physical_layer_index(name: str, index: int) -> None:
    assert physical_layer_index(name, 61) == index


def test_layout_27_layers_6_buffers() -> None:
    layout = build_layout(27, {"layerwise_num_shared_buffers": 6})
    assert layout.storage[0] == (0,)
    assert layout.storage[1:3] == ((1, 7, 13, 19, 25), (2, 8, 14, 20, 26))
    assert layout.storage[3:] == ((3, 9, 15, 21), (4, 10, 16, 22), (5, 11, 17, 23), (6, 12, 18, 24))
    assert layout.prefetch_layer_map[7] == 1 and layout.prefetch_layer_map[26] == 20
    assert len(layout.storage) == 7 and layout.prefetch_layers == 6


def test_layout_default_has_no_reuse_and_validates() -> None:
    layout = build_layout(27)
    assert not layout.has_reuse and len(layout.storage) == 27 and layout.prefetch_layers == 8
    assert build_layout(4, {"layerwise_num_shared_buffers": 1, "layerwise_independent_layers": [-1]}).storage == (
        (3,),
        (0, 1, 2),
    )
    with pytest.raises(ConfigError, match="layerwise_num_shared_buffers"):
        build_layout(4, {"layerwise_num_shared_buffers": True})
    with pytest.raises(ConfigError, match="layerwise_independent_layers"):
        build_layout(4, {"layerwise_independent_layers": [9]})


def test_split_packets_example() -> None:
    got = split_packets([0, 100000], [50000, 200000], [10000, 3000], 4096)
    assert got == [(0, 50000, 4096), (100000, 200000, 3000), (4096, 54096, 4096), (8192, 58192, 1808)]
    assert split_packets([1], [2], [3], 0) == [(1, 2, 3)]


def test_stagger_example() -> None:
    assert [stagger_us(r, 0, 4, 100) for r in range(4)] == [0, 100, 200, 300]
    assert [stagger_us(r, 1, 4, 100) for r in range(4)] == [100, 200, 300, 0]


def test_gva_layer_copies_example() -> None:
    kw = {
        "bases": [1000, 2000, 3000],
        "block_lens": [10, 20, 30],
        "strides": [100, 200, 300],
        "layer_offsets": [0, 2, 3],
        "block_id": 2,
        "block_gva": 500,
    }
    assert gva_layer_copies(layer=0, **kw) == ([1200, 2400], [10, 20], [500, 510])
    assert gva_layer_copies(layer=1, **kw) == ([3600], [30], [530])


def test_tp_mismatch_example() -> None:
    info = TpMismatchInfo.compute(local_tp=2, peer_tp=4, num_kv_heads=8)
    assert (info.enabled, info.effective_tp, info.local_heads_per_rank, info.effective_heads_per_rank) == (
        True,
        4,
        4,
        2,
    )
    assert info.num_sub_keys == 2 and info.sub_key_ranks(1) == [2, 3]
    assert not TpMismatchInfo.compute(local_tp=2, peer_tp=4, num_kv_heads=8, use_mla=True).enabled
    assert not TpMismatchInfo.compute(local_tp=2, peer_tp=None, num_kv_heads=8).enabled
    addrs = strided_sub_key_addresses(
        base=1000, block_id=2, block_stride=128, block_len=64, block_size=4, sub=1, sub_bytes=8, num_tokens=3
    )
    assert addrs == [(1264, 8), (1280, 8), (1296, 8)]


def test_event_aggregation_keeps_events_of_any_worker() -> None:
    e1 = BlockStoredEvent(b"h1", None, (1, 2), 16)
    e2 = BlockStoredEvent(b"h2", b"h1", (3, 4), 16)
    w0, w1 = EventCollector(), EventCollector()
    w0.add([e1, e2])
    w1.add([e1])  # rank 1 of an MLA replica set stored only chunk 1
    agg = EventAggregator()
    agg.add(w0.drain())
    agg.add(w1.drain())
    assert agg.take() == [e1, e2]
    assert agg.take() == [] and w0.drain() == []


def test_attention_gate() -> None:
    gate = reset_gate()
    assert current_gate() is gate and not gate.wait(0.01)
    threading.Timer(0.05, gate.record).start()
    assert gate.wait(5)
    gate.record()  # second record is ignored
    assert reset_gate() is not gate
