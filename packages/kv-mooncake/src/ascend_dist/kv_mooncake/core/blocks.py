"""Block and layer math of a P -> D pull: tensor block geometry, which block ids, which layers.

Runs in: scheduler and worker processes, on both roles. No I/O, no threads, no torch.

`TensorGeom` describes one registered KV tensor's blocks; `trim_block_ids` is P's list of blocks
to lend, `plan_block_pairs` pairs D's new blocks with P's for a full-attention group;
`pp_layer_ranges` and `layer_index` say which layers each PP stage holds. Which ranks and head
slices are read is `ascend_dist.kv_mooncake.core.ranks`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError, LayoutError

__all__ = ["TensorGeom", "layer_index", "plan_block_pairs", "pp_layer_ranges", "trim_block_ids"]


@dataclass(frozen=True)
class TensorGeom:
    """Geometry of one registered KV tensor: dense blocks of ``tokens x heads`` cells of ``head_bytes``.

    Inside a block the cells are either token-major (``[tokens][heads][content]``, vllm-ascend's
    and FlashAttention's NHD) or head-major (``[heads][tokens][content]``, vLLM's CPU and
    FlashInfer HND layouts); `ascend_dist.kv_mooncake.core.kv_geometry` reads which from the strides.

    Attributes:
        base: Address of block 0.
        block_len: Bytes of one block (``tokens * heads * head_bytes``).
        stride: Bytes between consecutive blocks (>= block_len).
        tokens: Tokens per block.
        heads: KV heads held by this rank (1 for MLA).
        head_bytes: Bytes of one head of one token (vLLM's fused layouts: K and V together).
        head_major: Heads outside tokens inside a block: the layout's order, as the strides show
            it (with one head per rank both orders are the same bytes; planning then goes by the
            other side's order).
    """

    base: int
    block_len: int
    stride: int
    tokens: int
    heads: int
    head_bytes: int
    head_major: bool = False

    def __post_init__(self) -> None:
        if self.block_len != self.tokens * self.heads * self.head_bytes:
            raise LayoutError(
                "block_len", self.block_len, f"tokens*heads*head_bytes = {self.tokens * self.heads * self.head_bytes}"
            )
        if self.stride < self.block_len:
            raise LayoutError("stride", self.stride, f">= block_len ({self.block_len})")


def trim_block_ids(
    block_ids: Sequence[int], prompt_len: int, tokens_per_block: int, window_blocks: int = 0
) -> list[int]:
    """P's block list to send: prompt clip (drops MTP lookahead), then the SWA window, no null block.

    Args:
        block_ids: One group's block ids as allocated.
        prompt_len: Prompt tokens.
        tokens_per_block: Tokens per logical block.
        window_blocks: ``ceil(window / block) + 1`` for a sliding-window group, else 0.

    Returns:
        The trimmed ids.
    """
    if tokens_per_block <= 0:
        raise ConfigError("block_size", tokens_per_block, "a positive int")
    ids = list(block_ids)[: math.ceil(prompt_len / tokens_per_block)]
    if window_blocks > 0:
        ids = [b for b in ids[-window_blocks:] if b != 0]
    return ids


def plan_block_pairs(
    local_ids: Sequence[int], remote_ids: Sequence[int], num_computed_tokens: int, block_size: int
) -> tuple[list[int], list[int]]:
    """Pair D's new blocks with P's: skip P's blocks D already has, truncate to the shorter list.

    Example: remote ``[3, 4, 5]``, local ``[1, 2]``, 16 computed tokens, block 16 -> ``([1, 2], [4, 5])``.
    """
    if num_computed_tokens < 0:
        raise ConfigError("num_computed_tokens", num_computed_tokens, "an int >= 0")
    remote = list(remote_ids)[num_computed_tokens // block_size :]
    n = min(len(local_ids), len(remote))
    return list(local_ids)[:n], remote[:n]


def pp_layer_ranges(num_layers: int, pp_size: int, partition: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Half-open layer ranges of each PP stage (vLLM's default split unless ``partition`` is given).

    Default: equal split; remainder layers go one each to stages counting backward from the
    second-to-last (61 / 4 -> 15, 15, 16, 15).

    Raises:
        ConfigError: ``partition`` has the wrong length or sum.
    """
    if pp_size <= 0 or num_layers < pp_size:
        raise ConfigError("pp_size", pp_size, f"an int in [1, {num_layers}]")
    if partition:
        if len(partition) != pp_size or sum(partition) != num_layers:
            raise ConfigError("pp_layer_partition", list(partition), f"{pp_size} ints summing to {num_layers}")
        sizes = list(partition)
    else:
        sizes = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            sizes[max(0, pp_size - 2 - i)] += 1
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """The transformer layer index in a layer name such as ``model.layers.7.self_attn.attn``.

    Raises:
        ConfigError: The name holds no integer component.
    """
    match = _LAYER_RE.search(name)
    if match is None:
        raise ConfigError("layer_name", name, "a name with a numeric layer component, e.g. 'model.layers.3.attn'")
    return int(match.group(1))
