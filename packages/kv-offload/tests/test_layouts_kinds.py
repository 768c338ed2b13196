"""Layout kinds: classification, parts and page sizes, each layout end to end."""

from __future__ import annotations

import pytest
import torch

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.kv_offload.layouts import (
    KV_LAYOUTS,
    KVLayoutKind,
    attention_page_bytes,
    attention_part_bytes,
    canonical_block_views,
    classify_kv_layer,
    layer_parts,
    logical_block_bytes,
    mamba_page_bytes,
    mla_page_bytes,
    mla_part_bytes,
    stacked_segment_parts,
)


def test_every_kind_is_described() -> None:
    assert set(KV_LAYOUTS) == set(KVLayoutKind)
    assert all(d.kind is kind for kind, d in KV_LAYOUTS.items())


def test_page_bytes_helpers() -> None:
    # bf16, 128 tokens, 4 heads, dim 128 -> 131 072 bytes per part.
    assert attention_part_bytes(128, 4, 128, 2) == 131_072
    assert attention_page_bytes(128, 4, 128, 2) == 262_144
    assert attention_page_bytes(128, 4, 128, 2, num_parts=1) == 131_072
    assert mla_part_bytes(128, 512, 64, 2) == (131_072, 16_384)
    assert mla_page_bytes(128, 512, 64, 2) == 147_456
    assert mamba_page_bytes([(3, 4096), (32, 128, 128)], [2, 4]) == 3 * 4096 * 2 + 32 * 128 * 128 * 4
    with pytest.raises(ConfigError, match="head_dim"):
        attention_part_bytes(128, 4, 0, 2)
    with pytest.raises(ConfigError, match="element_sizes"):
        mamba_page_bytes([(3, 4)], [2, 2])
    with pytest.raises(ConfigError, match=r"state_shapes\[0\]"):
        mamba_page_bytes([(3, -4)], [2])


def test_split_kv() -> None:
    k, v = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16), torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)
    assert classify_kv_layer((k, v), layer_name="model.layers.0.self_attn.attn") is KVLayoutKind.SPLIT_KV
    page = attention_page_bytes(16, 2, 8, 2)
    views = canonical_block_views(layer_parts((k, v)), 4, page)
    assert [x.base_ptr for x in views] == [k.data_ptr(), v.data_ptr()]  # V is never dropped


def test_mla() -> None:
    nope, rope = (
        torch.zeros(4, 16, 1, 512, dtype=torch.bfloat16),
        torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16),
    )
    assert classify_kv_layer((nope, rope)) is KVLayoutKind.MLA
    views = canonical_block_views([nope, rope], 4, mla_page_bytes(16, 512, 64, 2))
    assert [x.copy_bytes for x in views] == list(mla_part_bytes(16, 512, 64, 2))


def test_quant_with_scale() -> None:
    data = torch.zeros(4, 16, 8, dtype=torch.int8)
    scale = torch.zeros(4, 16, 1, dtype=torch.float32)
    assert classify_kv_layer((data, scale)) is KVLayoutKind.QUANT_WITH_SCALE
    full = torch.zeros(4, 8, dtype=torch.int8)
    assert classify_kv_layer((full[:, :4], full[:, 4:], full)) is KVLayoutKind.QUANT_WITH_SCALE
    views = canonical_block_views([data, scale], 4, logical_block_bytes(data) + logical_block_bytes(scale))
    assert [x.copy_bytes for x in views] == [128, 64]


def test_sparse_indexer_by_name() -> None:
    k = torch.zeros(4, 16, 128, dtype=torch.bfloat16)
    assert classify_kv_layer(k, layer_name="model.layers.3.attn.indexer.k_cache") is KVLayoutKind.SPARSE_INDEXER


def test_mamba_states_in_one_raw_allocation() -> None:
    raw = torch.zeros(4 + 4 * (6 + 10), dtype=torch.int8)
    conv = raw[4 : 4 + 24].view(4, 3, 2)
    ssm = raw[28:68].view(4, 10)
    assert classify_kv_layer([conv, ssm]) is KVLayoutKind.MAMBA
    views = canonical_block_views(layer_parts([conv, ssm]), 4, mamba_page_bytes([(3, 2), (10,)], [1, 1]))
    assert [x.base_ptr for x in views] == [conv.data_ptr(), ssm.data_ptr()]


def test_single_tensor_and_stacked_segments() -> None:
    single = torch.zeros(4, 16, dtype=torch.int8)
    assert classify_kv_layer(single) is KVLayoutKind.SINGLE_TENSOR
    assert classify_kv_layer((single,)) is KVLayoutKind.SINGLE_TENSOR
    stacked = torch.zeros(3, 4, 16, dtype=torch.int8)
    assert classify_kv_layer(stacked, stacked=True) is KVLayoutKind.STACKED_SEGMENTS
    segments = layer_parts(stacked, stacked=True)
    assert [s.data_ptr() for s in segments] == [stacked[i].data_ptr() for i in range(3)]
    views = [canonical_block_views([s], 4, 16)[0] for s in segments]
    assert [x.base_ptr for x in views] == [stacked.data_ptr() + i * 64 for i in range(3)]


def test_bad_layer_objects() -> None:
    with pytest.raises(LayoutError, match="kv_cache"):
        classify_kv_layer(())
    with pytest.raises(LayoutError, match=r"kv_cache\[1\]"):
        layer_parts((torch.zeros(1, 1), "v"))
    with pytest.raises(LayoutError, match="tensor"):
        stacked_segment_parts(torch.zeros(3))
