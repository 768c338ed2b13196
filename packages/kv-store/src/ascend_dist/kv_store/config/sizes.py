"""Derived block sizes, transfer granularity, cache families and PP layer partitions.

Runs in: scheduler and worker processes (both must compute the same numbers). Pure planning.

The chunk span of group g is its block size times the context-parallel
scale; the transfer granularity is the LCM of every group's chunk span, so a lookup or save of a
40,000-token prompt over DSV4-like groups ``[128, 512, 16384]`` covers ``floor_to(40000, 16384)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError

__all__ = ["DerivedSizes", "cache_family", "cdiv", "floor_to", "pp_layer_partition"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def floor_to(x: int, g: int) -> int:
    """``x`` rounded down to a multiple of ``g``."""
    return x // g * g


@dataclass(frozen=True)
class DerivedSizes:
    """Block sizes both roles derive from the KV-cache groups."""

    original_block_sizes: tuple[int, ...]
    grouped_block_sizes: tuple[int, ...]
    hash_block_size: int
    lcm_block_size: int

    @property
    def granularity(self) -> int:
        """Tokens per transfer unit: lookups and saves cover multiples of it."""
        return self.lcm_block_size

    @classmethod
    def compute(
        cls,
        block_sizes: Sequence[int],
        *,
        pcp_size: int = 1,
        dcp_size: int = 1,
        prefix_match_unit: int | None = None,
    ) -> DerivedSizes:
        """Derive the sizes.

        Args:
            block_sizes: Each KV-cache group's block size in raw tokens (at least one).
            pcp_size: Prefill context-parallel size.
            dcp_size: Decode context-parallel size.
            prefix_match_unit: vLLM's hash block size; defaults to the smallest group block.

        Returns:
            The derived sizes.

        Raises:
            ConfigError: A size is not a positive int, or a group block is not a multiple of the
                hash block size.
        """
        if not block_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block_sizes):
            raise ConfigError("block_sizes", list(block_sizes), "a non-empty list of positive ints")
        if pcp_size < 1 or dcp_size < 1:
            raise ConfigError("pcp_size/dcp_size", (pcp_size, dcp_size), "positive ints")
        scale = pcp_size * dcp_size
        grouped = tuple(b * scale for b in block_sizes)
        base = prefix_match_unit if isinstance(prefix_match_unit, int) and prefix_match_unit > 0 else min(block_sizes)
        hash_block = base * scale
        bad = [g for g in grouped if g % hash_block]
        if bad:
            raise ConfigError("prefix_match_unit", base, f"a divisor of every group block size {list(block_sizes)}")
        return cls(tuple(block_sizes), grouped, hash_block, math.lcm(*grouped))


def cache_family(compress_ratios: Sequence[float | int | None]) -> str:
    """The cache family of a group from its layers' compress ratios.

    Returns:
        ``"default"`` for no ratio, ``"c1"`` for ratio <= 1, ``"c{r}"`` for one ratio r, ``"mixed"``
        for several distinct ratios.
    """
    distinct = set(compress_ratios)
    if not distinct:
        return "default"
    if len(distinct) > 1:
        return "mixed"
    ratio = distinct.pop()
    if ratio is None:
        return "default"
    return "c1" if ratio <= 1 else f"c{int(ratio)}"


def pp_layer_partition(num_layers: int, pp_size: int, explicit: str | None = None) -> list[int]:
    """Layers per prefill PP stage.

    The remainder of ``num_layers // pp_size`` goes +1 to stages from the second-to-last backwards:
    61 layers, P=4 -> ``[15, 15, 16, 15]``; 62 -> ``[15, 16, 16, 15]``; 61, P=2 -> ``[31, 30]``.

    Raises:
        ConfigError: ``explicit`` does not have ``pp_size`` entries summing to ``num_layers``.
    """
    if pp_size < 1 or num_layers < pp_size:
        raise ConfigError("prefill_pp_size", pp_size, f"an integer in [1, {num_layers}]")
    if explicit is not None:
        try:
            parts = [int(x) for x in explicit.split(",")]
        except ValueError as exc:
            raise ConfigError("prefill_pp_layer_partition", explicit, "comma-separated ints") from exc
        if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
            raise ConfigError(
                "prefill_pp_layer_partition", explicit, f"{pp_size} positive ints summing to {num_layers}"
            )
        return parts
    parts = [num_layers // pp_size] * pp_size
    rest = num_layers % pp_size
    idx = pp_size - 2 if pp_size > 1 else 0
    while rest:
        parts[idx] += 1
        rest -= 1
        idx = idx - 1 if idx > 0 else pp_size - 1
    return parts
