"""Pure planning of a P -> D pull: which P ranks, which head slices, which blocks, which bytes.

Runs in: scheduler and worker processes, on both roles (P evaluates the same rank selection to
know whether D will pull from it). No I/O, no threads, no torch.

TP heterogeneity is handled in both directions by one head-slice planner (`select_sources`):

* ``P_tp == D_tp``: rank d pulls from rank d, whole blocks (`PullMode.WHOLE`).
* ``P_tp > D_tp``: D rank d pulls ``pulls`` P ranks' whole blocks stacked into its block
  (`PullMode.STACKED`), then reformats ``[pull][token][heads]`` -> ``[token][pull*heads]``
  (head-major blocks ``[heads][token]`` are already in D's order: no reformat).
* ``P_tp < D_tp`` (rejected upstream): D rank d pulls its head sub-slice of every token row of one
  P rank (`PullMode.ROWS`; head-major: one run per block), so nothing needs reformatting.

When P replicates heads (``P_tp > heads``), the replica is chosen by a PRNG seeded from the P
request id: the rule is `PLAN_VERSION` 1 and is part of the handshake compatibility fields, so both
roles always run the same one. `check_coverage` proves every destination head is written exactly once.
"""

from __future__ import annotations

import enum
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.common.hashing import string_to_int64_hash

__all__ = [
    "PLAN_VERSION",
    "HeadSlice",
    "PullMode",
    "TensorGeom",
    "check_coverage",
    "head_range",
    "layer_index",
    "p_rank_fan_in",
    "plan_block_pairs",
    "pp_layer_ranges",
    "pull_mode",
    "select_sources",
    "trim_block_ids",
]

PLAN_VERSION = 1
"""Version of the rank-selection and slicing rules; a change must bump it (it is handshaken)."""


class PullMode(enum.Enum):
    """How a D rank's block is assembled from P."""

    WHOLE = "whole"
    STACKED = "stacked"
    ROWS = "rows"


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[src_head, src_head + n_heads)`` of P tp rank ``p_rank`` land at ``dst_head`` on D."""

    p_rank: int
    src_head: int
    dst_head: int
    n_heads: int


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


def _check_divisible(name: str, a: int, b: int) -> None:
    if a % b:
        raise ConfigError(name, a, f"a multiple of {b}")


def head_range(rank: int, tp: int, heads: int) -> tuple[int, int]:
    """Heads ``(first, count)`` held by tp rank ``rank`` of ``tp`` ranks over ``heads`` KV heads.

    ``tp <= heads``: ``heads / tp`` consecutive heads; ``tp > heads``: one head, replicated
    ``tp / heads`` times (rank r holds head ``r // (tp / heads)``).

    Raises:
        ConfigError: The sizes do not divide one another.
    """
    if not 0 <= rank < tp:
        raise ConfigError("tp_rank", rank, f"an int in [0, {tp})")
    if tp <= heads:
        _check_divisible("num_kv_heads", heads, tp)
        n = heads // tp
        return rank * n, n
    _check_divisible("tp_size", tp, heads)
    return rank // (tp // heads), 1


def request_rng(remote_request_id: str) -> random.Random:
    """The PRNG both roles seed from P's request id (SHA-256, first 8 bytes little-endian)."""
    return random.Random(string_to_int64_hash(remote_request_id))


def select_sources(d_rank: int, p_tp: int, d_tp: int, heads: int, remote_request_id: str) -> list[HeadSlice]:
    """The P tp ranks (within one PP stage) and head slices D rank ``d_rank`` pulls.

    Args:
        d_rank: D's tp rank.
        p_tp: P's tensor-parallel size.
        d_tp: D's tensor-parallel size.
        heads: Total KV heads of the model (1 for MLA).
        remote_request_id: P's request id: the seed of the replica choice.

    Returns:
        Slices sorted by ``dst_head``; together they cover D's heads exactly once.

    Raises:
        ConfigError: The sizes are incompatible.
    """
    first, count = head_range(d_rank, d_tp, heads)
    if p_tp == d_tp:
        return [HeadSlice(d_rank, 0, 0, count)]
    if p_tp <= heads:
        _, p_count = head_range(0, p_tp, heads)
        if p_count >= count:  # one P rank holds all of D's heads (P_tp <= D_tp)
            p = first // p_count
            return [HeadSlice(p, first - p * p_count, 0, count)]
        return [
            HeadSlice(p, 0, p * p_count - first, p_count) for p in range(first // p_count, (first + count) // p_count)
        ]
    replicas = p_tp // heads
    d_replicas = max(1, d_tp // heads)
    chosen = request_rng(remote_request_id).sample(range(replicas), min(replicas, d_replicas))
    column = chosen[(d_rank % d_replicas) % len(chosen)] if d_tp > heads else chosen[0]
    return [HeadSlice(h * replicas + column, 0, h - first, 1) for h in range(first, first + count)]


def p_rank_fan_in(p_rank: int, p_tp: int, d_tp: int, heads: int, remote_request_id: str) -> int:
    """How many D ranks pull from P tp rank ``p_rank`` for this request (0: P frees at once)."""
    return sum(
        any(s.p_rank == p_rank for s in select_sources(d, p_tp, d_tp, heads, remote_request_id)) for d in range(d_tp)
    )


def check_coverage(slices: Sequence[HeadSlice], d_heads: int) -> None:
    """Prove the slices write each of D's ``d_heads`` heads exactly once.

    Raises:
        LayoutError: A head is missed or written twice (silent corruption otherwise).
    """
    hits = np.zeros(d_heads, dtype=np.int64)
    for s in slices:
        if s.dst_head < 0 or s.dst_head + s.n_heads > d_heads:
            raise LayoutError("head slice", s, f"inside D's {d_heads} heads")
        hits[s.dst_head : s.dst_head + s.n_heads] += 1
    if not (hits == 1).all():
        raise LayoutError(
            "head slices", [(s.p_rank, s.dst_head, s.n_heads) for s in slices], "each D head exactly once"
        )


def pull_mode(slices: Sequence[HeadSlice], p_heads: int, d_heads: int) -> PullMode:
    """The assembly mode for these slices, P's heads per rank and D's heads per rank.

    Raises:
        LayoutError: The slices mix modes (never produced by `select_sources`).
    """
    check_coverage(slices, d_heads)
    if len(slices) == 1 and slices[0].n_heads == p_heads == d_heads:
        return PullMode.WHOLE
    if all(s.n_heads == p_heads for s in slices) and all(s.dst_head == i * p_heads for i, s in enumerate(slices)):
        return PullMode.STACKED
    if len(slices) == 1 and slices[0].n_heads < p_heads:
        return PullMode.ROWS
    raise LayoutError("head slices", slices, "whole blocks, stacked whole P blocks, or one sub-slice of P rows")


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
