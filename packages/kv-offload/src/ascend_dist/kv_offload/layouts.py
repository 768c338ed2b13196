"""The Ascend KV-cache layouts a connector meets at registration, as data.

Runs in: worker processes, at `register_kv_caches`. torch is only needed by the functions that
inspect tensors and is imported lazily there.

vllm-ascend does not hand a connector one ``[2, num_blocks, ...]`` tensor per layer as CUDA vLLM
does: split attention gives a tuple (K, V) of separate allocations, MLA a tuple (nope, rope) of
different widths, quantised caches data and scale views (sometimes with a "full" view over both),
Mamba a list of state tensors inside one raw allocation, `cache_only_layers` one stacked tensor of
N segments. `KV_LAYOUTS` describes each; `classify_kv_layer` tells them apart; the page-size
helpers give the unpadded bytes per logical block that `canonical_block_views` (re-exported here
from `block_views`) checks the tensors against.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.kv_offload.block_views import (
    BlockView,
    canonical_block_views,
    dedup_views,
    generic_block_view,
    logical_block_bytes,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "KV_LAYOUTS",
    "BlockView",
    "KVLayoutKind",
    "LayoutDescription",
    "attention_page_bytes",
    "attention_part_bytes",
    "canonical_block_views",
    "classify_kv_layer",
    "dedup_views",
    "generic_block_view",
    "layer_parts",
    "logical_block_bytes",
    "mamba_page_bytes",
    "mla_page_bytes",
    "mla_part_bytes",
    "stacked_segment_parts",
]


class KVLayoutKind(enum.Enum):
    """How one layer's KV cache is laid out."""

    SPLIT_KV = "split_kv"
    MLA = "mla"
    QUANT_WITH_SCALE = "quant_with_scale"
    SPARSE_INDEXER = "sparse_indexer"
    MAMBA = "mamba"
    SINGLE_TENSOR = "single_tensor"
    STACKED_SEGMENTS = "stacked_segments"


@dataclass(frozen=True)
class LayoutDescription:
    """What a layout looks like and what breaks naive code.

    Attributes:
        kind: the layout.
        container: how the layer's object is structured (``tuple``, ``list`` or ``tensor``).
        structure: shapes per part.
        notes: the trap this layout sets.
    """

    kind: KVLayoutKind
    container: str
    structure: str
    notes: str


KV_LAYOUTS: Mapping[KVLayoutKind, LayoutDescription] = MappingProxyType(
    {
        d.kind: d
        for d in (
            LayoutDescription(
                KVLayoutKind.SPLIT_KV,
                "tuple",
                "(K, V), each its own allocation [num_blocks*f, block_size, kv_heads, head_dim]",
                "not one [2, num_blocks, ...] tensor as on CUDA; taking element 0 silently drops V",
            ),
            LayoutDescription(
                KVLayoutKind.MLA,
                "tuple",
                "(k_nope [..., kv_lora_rank], k_pe [..., rope_dim]), separately allocated",
                "different bytes per part (e.g. 512 vs 64 elements)",
            ),
            LayoutDescription(
                KVLayoutKind.QUANT_WITH_SCALE,
                "tuple",
                "data and scale views, possibly with a 'full' view overlapping both",
                "use the full view alone only when it provably covers every part",
            ),
            LayoutDescription(
                KVLayoutKind.SPARSE_INDEXER,
                "tensor or tuple",
                "separate layers whose name contains 'indexer'",
                "sparse offload keeps them on the device",
            ),
            LayoutDescription(
                KVLayoutKind.MAMBA,
                "list",
                "state tensors [num_blocks, ...] laid out one after another in one raw allocation",
                "not block-interleaved; the allocation may start at a non-zero storage offset",
            ),
            LayoutDescription(
                KVLayoutKind.SINGLE_TENSOR,
                "tensor",
                "[num_blocks, ...], possibly packed (block stride > page)",
                "handled by the generic single-tensor path",
            ),
            LayoutDescription(
                KVLayoutKind.STACKED_SEGMENTS,
                "tensor",
                "[N, num_blocks, ...] (cache_only_layers)",
                "split into N segment views before anything else",
            ),
        )
    }
)


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(name, value, "a positive integer")
    return value


def attention_part_bytes(block_size: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of one logical block of ONE attention part (K or V).

    Args:
        block_size: tokens per logical block.
        num_kv_heads: KV heads on this rank.
        head_dim: elements per head.
        element_size: bytes per element (bf16: 2).

    Returns:
        ``block_size * num_kv_heads * head_dim * element_size``.

    Raises:
        ConfigError: an argument is not a positive integer.
    """
    dims = {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    dims["element_size"] = element_size
    return math.prod(_positive_int(name, value) for name, value in dims.items())


def attention_page_bytes(
    block_size: int, num_kv_heads: int, head_dim: int, element_size: int, *, num_parts: int = 2
) -> int:
    """Bytes of one logical block over all attention parts (split K/V: 2 parts).

    Returns:
        `attention_part_bytes` times `num_parts`.

    Raises:
        ConfigError: an argument is not a positive integer.
    """
    part = attention_part_bytes(block_size, num_kv_heads, head_dim, element_size)
    return part * _positive_int("num_parts", num_parts)


def mla_part_bytes(block_size: int, kv_lora_rank: int, rope_dim: int, element_size: int) -> tuple[int, int]:
    """Bytes of one logical block of MLA's two parts.

    Args:
        block_size: tokens per logical block.
        kv_lora_rank: elements of the nope (latent) part per token.
        rope_dim: elements of the rope part per token.
        element_size: bytes per element.

    Returns:
        ``(nope_bytes, rope_bytes)``.

    Raises:
        ConfigError: an argument is not a positive integer.
    """
    per_token = _positive_int("block_size", block_size) * _positive_int("element_size", element_size)
    nope = per_token * _positive_int("kv_lora_rank", kv_lora_rank)
    return nope, per_token * _positive_int("rope_dim", rope_dim)


def mla_page_bytes(block_size: int, kv_lora_rank: int, rope_dim: int, element_size: int) -> int:
    """Bytes of one logical MLA block, both parts together.

    Raises:
        ConfigError: an argument is not a positive integer.
    """
    return sum(mla_part_bytes(block_size, kv_lora_rank, rope_dim, element_size))


def mamba_page_bytes(state_shapes: Sequence[Sequence[int]], element_sizes: Sequence[int]) -> int:
    """Unpadded bytes of one Mamba block: the sum of every state's bytes.

    Args:
        state_shapes: per state, its shape WITHOUT the block dimension (e.g. conv ``(3, 4096)``).
        element_sizes: per state, bytes per element.

    Returns:
        ``sum(prod(shape) * element_size)``.

    Raises:
        ConfigError: the sequences differ in length or are empty, or a size is not positive.
    """
    if not state_shapes or len(state_shapes) != len(element_sizes):
        expected = f"one element size per state shape ({len(state_shapes)}), at least one"
        raise ConfigError("element_sizes", list(element_sizes), expected)
    total = 0
    for index, (shape, elt) in enumerate(zip(state_shapes, element_sizes, strict=True)):
        dims = [_positive_int(f"state_shapes[{index}]", int(d)) for d in shape]
        total += math.prod(dims) * _positive_int(f"element_sizes[{index}]", elt)
    return total


def stacked_segment_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Split a stacked ``[N, num_blocks, ...]`` tensor into its N segment views (no copy).

    Raises:
        LayoutError: the tensor has fewer than 2 dimensions.
    """
    if tensor.dim() < 2:
        raise LayoutError("tensor", tuple(tensor.shape), "a stacked [N, num_blocks, ...] tensor")
    return list(tensor.unbind(0))


def layer_parts(obj: object, *, stacked: bool = False) -> list[torch.Tensor]:
    """The parts of one layer's registered object, in tuple/list order.

    Args:
        obj: a tensor, or a tuple/list of tensors.
        stacked: the tensor is a ``cache_only_layers`` stack to split into segments.

    Returns:
        The tensors to hand to `canonical_block_views`.

    Raises:
        LayoutError: `obj` is empty or holds something other than tensors.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        return stacked_segment_parts(obj) if stacked else [obj]
    if isinstance(obj, tuple | list) and obj:
        for index, part in enumerate(obj):
            if not isinstance(part, torch.Tensor):
                raise LayoutError(f"kv_cache[{index}]", type(part).__name__, "a tensor")
        return list(obj)
    raise LayoutError("kv_cache", type(obj).__name__, "a tensor or a non-empty tuple/list of tensors")


def _classify_tuple(parts: Sequence[torch.Tensor]) -> KVLayoutKind:
    """Tell split K/V, MLA and quantised data+scale tuples apart (see `classify_kv_layer`)."""
    if len(parts) == 1:
        return KVLayoutKind.SINGLE_TENSOR
    if len({p.dtype for p in parts}) > 1 or len(parts) > 2:
        return KVLayoutKind.QUANT_WITH_SCALE
    first, second = parts
    if first.shape == second.shape:
        return KVLayoutKind.SPLIT_KV
    if first.dim() == second.dim() and first.shape[:-1] == second.shape[:-1]:
        return KVLayoutKind.MLA
    return KVLayoutKind.QUANT_WITH_SCALE


def classify_kv_layer(obj: object, *, layer_name: str = "", stacked: bool = False) -> KVLayoutKind:
    """Classify the object a layer registered.

    Rules, in order: a name containing ``indexer`` is `SPARSE_INDEXER`; a list is `MAMBA`; a tensor
    is `STACKED_SEGMENTS` when `stacked` (the caller knows its ``cache_only_layers``) else
    `SINGLE_TENSOR`; a tuple of one is `SINGLE_TENSOR`; a tuple with mixed dtypes or more than two
    parts is `QUANT_WITH_SCALE`; two parts of one shape are `SPLIT_KV`; two parts differing only in
    the last dimension are `MLA`; any other pair is `QUANT_WITH_SCALE`. The classification is
    informational: `canonical_block_views` handles every layout from the parts alone.

    Args:
        obj: the layer's KV cache (tensor, tuple or list of tensors).
        layer_name: the vLLM layer name.
        stacked: the tensor stacks N segments on dim 0.

    Returns:
        The layout kind.

    Raises:
        LayoutError: `obj` is empty or holds something other than tensors.
    """
    parts = layer_parts(obj)
    if "indexer" in layer_name:
        return KVLayoutKind.SPARSE_INDEXER
    if isinstance(obj, list):
        return KVLayoutKind.MAMBA
    if isinstance(obj, tuple):
        return _classify_tuple(parts)
    return KVLayoutKind.STACKED_SEGMENTS if stacked else KVLayoutKind.SINGLE_TENSOR
