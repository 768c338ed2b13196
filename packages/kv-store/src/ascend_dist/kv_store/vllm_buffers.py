"""vLLM adapter, model-runner side: shared layer buffers applied to vLLM's KV-cache tensors.

Runs in: the worker process, where the model runner allocates the KV cache from
``KVCacheConfig.kv_cache_tensors``. With memcache layer-wise mode and
``layerwise_num_shared_buffers`` (`shared_buffer_layout`), the layers of one buffer slot must alias the same
bytes; a model runner that supports it (vllm-ascend's does) passes its config through
`share_layer_buffers` before allocating. In vLLM 0.33 a `KVCacheTensor` lists its ``layers`` with a
``layer_stride``; a stride of 0 makes them alias, which is how the slots are expressed here.
Imports vllm (an adapter module).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from ascend_dist.common.errors import LayoutError
from ascend_dist.kv_store.config.config import PoolConfig
from ascend_dist.kv_store.transfer.layerwise_plan import physical_layer_index, shared_buffer_layout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

__all__ = ["share_layer_buffers"]

logger = logging.getLogger(__name__)

_INDEXER = ".indexer.k_cache"  # DSA indexer caches share slots among themselves, never with main KV


def share_layer_buffers(kv_cache_config: KVCacheConfig, config: PoolConfig, base_layers: int) -> KVCacheConfig:
    """``kv_cache_config`` with the layers of each shared buffer slot aliasing one tensor.

    Example: 6 layers, 2 shared buffers, layer 0 independent -> tensors for ``[L0]``,
    ``[L1, L3, L5]`` and ``[L2, L4]``.

    Args:
        kv_cache_config: vLLM's config, one tensor per layer (as vLLM builds it).
        config: The pool settings (only memcache layer-wise with shared buffers changes anything).
        base_layers: The model's ``num_hidden_layers`` (MTP layers are numbered after them).

    Returns:
        The config unchanged when no layers share a buffer, else a copy with merged tensors.

    Raises:
        LayoutError: A tensor holds several layers or starts at an offset, or the layers of one slot
            differ in size.
    """
    if not (config.use_layerwise and config.backend == "memcache" and config.layerwise_num_shared_buffers):
        return kv_cache_config
    tensors = list(kv_cache_config.kv_cache_tensors)
    if len(tensors) < 2:
        return kv_cache_config
    for tensor in tensors:
        if len(tensor.layers) != 1 or tensor.offset:
            raise LayoutError(
                "kv_cache_tensors", [t.layers for t in tensors], "one layer per tensor at offset 0 to share buffers"
            )
    by_layer: dict[int, list[KVCacheTensor]] = {}
    for tensor in tensors:
        by_layer.setdefault(physical_layer_index(tensor.layers[0], base_layers), []).append(tensor)
    physical = sorted(by_layer)
    if len(physical) < base_layers:
        logger.warning(
            "KV caches cover %d layers, fewer than the model's %d: layer buffers are not shared",
            len(physical),
            base_layers,
        )
        return kv_cache_config
    layout = shared_buffer_layout(
        len(physical),
        num_shared_buffers=config.layerwise_num_shared_buffers,
        independent_layers=config.layerwise_independent_layers,
    )
    if not layout.has_reuse:
        return kv_cache_config
    merged: list[KVCacheTensor] = []
    for slot in layout.storage:
        members = [t for index in slot for t in by_layer[physical[index]]]
        for kind in (False, True):  # main KV, then indexer caches: each kind aliases only its own
            same = [t for t in members if t.layers[0].endswith(_INDEXER) == kind]
            if same:
                merged.append(_alias(same))
    return dataclasses.replace(kv_cache_config, kv_cache_tensors=merged)


def _alias(tensors: list[KVCacheTensor]) -> KVCacheTensor:
    first = tensors[0]
    if any(t.size != first.size or t.block_stride != first.block_stride for t in tensors):
        raise LayoutError(
            "kv_cache_tensors", [t.layers[0] for t in tensors], "layers of one shared buffer with equal sizes"
        )
    layers = [t.layers[0] for t in tensors]
    return dataclasses.replace(first, layers=layers, layer_stride=0)
