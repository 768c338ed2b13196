"""Shared layer buffers applied to vLLM 0.33's own KV-cache tensor descriptors."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402

from ascend_dist.common.errors import LayoutError  # noqa: E402
from ascend_dist.kv_store.config.config import PoolConfig  # noqa: E402
from ascend_dist.kv_store.vllm_buffers import share_layer_buffers  # noqa: E402

PAGE = 4096
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
SHARED = PoolConfig.from_extra({"use_layerwise": True, "backend": "memcache", "layerwise_num_shared_buffers": 2})


def _config(names: list[str], sizes: list[int] | None = None) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    tensors = [
        KVCacheTensor(size=size, layers=[name], layer_stride=size, block_stride=PAGE)
        for name, size in zip(names, sizes or [8 * PAGE] * len(names), strict=True)
    ]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def test_slots_alias_one_tensor_each() -> None:
    out = share_layer_buffers(_config(NAMES), SHARED, base_layers=6)
    assert [t.layers for t in out.kv_cache_tensors] == [
        [NAMES[0]], [NAMES[1], NAMES[3], NAMES[5]], [NAMES[2], NAMES[4]]
    ]  # fmt: skip
    assert all(t.layer_stride == 0 and t.size == 8 * PAGE for t in out.kv_cache_tensors[1:])
    assert sum(t.size for t in out.kv_cache_tensors) == 3 * 8 * PAGE  # half the memory of six layers


def test_without_sharing_or_outside_memcache_the_config_is_unchanged() -> None:
    cfg = _config(NAMES)
    assert share_layer_buffers(cfg, PoolConfig.from_extra({"use_layerwise": True, "backend": "memcache"}), 6) is cfg
    assert share_layer_buffers(cfg, PoolConfig.from_extra({"use_layerwise": True}), 6) is cfg
    assert share_layer_buffers(_config(NAMES[:4]), SHARED, base_layers=6).kv_cache_tensors[0].layers == [NAMES[0]]


def test_descriptors_that_cannot_alias_are_refused() -> None:
    with pytest.raises(LayoutError, match="equal sizes"):
        share_layer_buffers(_config(NAMES, [8 * PAGE] * 5 + [4 * PAGE]), SHARED, base_layers=6)
    two = _config(NAMES)
    two.kv_cache_tensors[0] = KVCacheTensor(size=PAGE, layers=NAMES[:2], layer_stride=PAGE, block_stride=PAGE)
    with pytest.raises(LayoutError, match="one layer per tensor"):
        share_layer_buffers(two, SHARED, base_layers=6)
