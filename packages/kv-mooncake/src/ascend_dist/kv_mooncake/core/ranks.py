"""Which P ranks and which head slices a D rank pulls: rank selection, fan-in and coverage.

Runs in: scheduler and worker processes, on both roles (P evaluates the same rank selection to
know whether D will pull from it). No I/O, no threads, no torch.

One head-slice planner (`select_sources`) covers TP heterogeneity in both directions:

* ``P_tp == D_tp``: D rank d reads P rank d, whole blocks (`PullMode.WHOLE`).
* ``P_tp > D_tp``: D rank d stacks ``pulls`` P ranks' whole blocks into its own block
  (`PullMode.STACKED`) and reorders ``[pull][token][heads]`` into ``[token][pull*heads]``
  afterwards (a head-major block ``[heads][token]`` is already in D's order).
* ``P_tp < D_tp`` (refused upstream): D rank d reads its heads out of every token row of one P
  rank (`PullMode.ROWS`; head-major: one run per block), so nothing is reordered.

With replicated heads on P (``P_tp > heads``) a PRNG seeded from P's request id picks the
replica; that rule is `PLAN_VERSION` 1, a handshake compatibility field, so both roles agree.
`check_coverage` proves each destination head is written exactly once. Block ids, layer ranges
and tensor geometry are `ascend_dist.kv_mooncake.core.blocks`'s.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.common.hashing import string_to_int64_hash

__all__ = [
    "PLAN_VERSION",
    "HeadSlice",
    "PullMode",
    "check_coverage",
    "head_range",
    "p_rank_fan_in",
    "pull_mode",
    "select_sources",
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
