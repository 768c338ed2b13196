"""Rank lists of every Ascend process group, computed from one parallel layout (pure: numpy only).

Runs in: every worker process, before any group is created. No torch.distributed here, so every
layout can be checked exhaustively in a unit test.

The world is laid out as vLLM lays it out: ``A = arange(W).reshape(external_dp, dp, pp, pcp, tp)``,
i.e. global rank ``((x*dp + d)*pp + p)*pcp*tp + c*tp + t``; the leading axis holds independent engines
sharing one torch world (for example an RL framework colocating several).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ascend_dist.common.errors import ConfigError

__all__ = [
    "ParallelLayout",
    "compute_finegrained_groups",
    "compute_mc2_groups",
    "compute_p_tp_groups",
    "get_global_rank",
]

Groups = list[list[int]]


@dataclass(frozen=True)
class ParallelLayout:
    """World size and the parallel sizes of one engine; validated on construction."""

    world_size: int
    tp: int
    dp: int = 1
    pp: int = 1
    pcp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "dp", "pp", "pcp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, value, "an integer >= 1")
        if self.world_size % self.engine_size:
            raise ConfigError("world_size", self.world_size, f"a multiple of dp*pp*pcp*tp = {self.engine_size}")

    @property
    def engine_size(self) -> int:
        """Ranks in one engine: dp * pp * pcp * tp."""
        return self.dp * self.pp * self.pcp * self.tp

    def grid(self) -> np.ndarray:
        """The rank tensor ``[external_dp, dp, pp, pcp, tp]``."""
        return np.arange(self.world_size).reshape(-1, self.dp, self.pp, self.pcp, self.tp)


def _rows(array: np.ndarray, width: int) -> Groups:
    return array.reshape(-1, width).tolist()


def compute_mc2_groups(layout: ParallelLayout) -> Groups:
    """MC2 (expert-parallel) groups: every rank of one pipeline stage of one engine.

    Same membership as vLLM's EP group: for each (external DP, pp stage) all dp x pcp x tp ranks.
    """
    moved = layout.grid().transpose(0, 2, 1, 3, 4)  # [x, pp, dp, pcp, tp]
    return _rows(moved, layout.dp * layout.pcp * layout.tp)


def compute_p_tp_groups(layout: ParallelLayout, *, pd_tp_ratio: int, num_head_replica: int = 0) -> Groups:
    """Prefill-TP groups that redistribute KV heads to a decode side with a smaller TP.

    Args:
        layout: the prefill engine's layout.
        pd_tp_ratio: prefill TP / decode TP (r); each group holds the r prefill ranks one decode rank reads.
        num_head_replica: how many times each KV head is replicated across TP ranks (h); <= 1 means none.

    Returns:
        With h <= 1, consecutive chunks of r ranks. With h > 1, ranks holding distinct heads are stride-h
        apart, so each group takes r/h ranks of one replica set.

    Raises:
        ConfigError: r or h do not divide TP, or r is not a multiple of h.
    """
    r, h, tp = pd_tp_ratio, num_head_replica, layout.tp
    if not isinstance(r, int) or r < 1 or tp % r:
        raise ConfigError("pd_tp_ratio", r, f"a positive divisor of tp={tp}")
    flat = layout.grid()
    if h <= 1:
        return _rows(flat, r)
    if tp % h or r % h:
        raise ConfigError("num_head_replica", h, f"a divisor of tp={tp} and of pd_tp_ratio={r}")
    by_replica = flat.reshape(-1, tp // h, h).transpose(0, 2, 1)  # [..., h, tp/h]
    return _rows(by_replica, r // h)


def compute_finegrained_groups(layout: ParallelLayout, size: int, *, name: str = "size") -> Groups:
    """Fine-grained TP groups (o_proj, lm_head, embedding, MLP): `size` consecutive DP replicas at one TP index.

    Derived from the real rank layout, so it is right when PP and DP are both above 1 (upstream orders
    the grid (pp, dp, tp) and groups pipeline peers instead), and it covers PCP and external DP.

    Raises:
        ConfigError: `size` does not divide dp (upstream silently drops the remainder ranks).
    """
    if not isinstance(size, int) or size < 1 or layout.dp % size:
        raise ConfigError(name, size, f"a positive divisor of dp={layout.dp}")
    dp_last = layout.grid().transpose(0, 2, 3, 4, 1)  # [x, pp, pcp, tp, dp]
    return _rows(dp_last, size)


def get_global_rank(*, tp: int, pp: int, pcp: int, data_parallel_index: int, rank_in_group: int) -> int:
    """A worker index unique across TP, PP, PCP and DP.

    Valid whether each DP replica is its own torch world (world rank local to the replica) or one world
    spans all of DP: ``dp_index * (tp*pp*pcp) + rank_in_group % (tp*pp*pcp)``. DCP and EP add no ranks.
    """
    for name, value in (("tp", tp), ("pp", pp), ("pcp", pcp)):
        if value < 1:
            raise ConfigError(name, value, "an integer >= 1")
    if data_parallel_index < 0 or rank_in_group < 0:
        raise ConfigError("data_parallel_index/rank_in_group", (data_parallel_index, rank_in_group), ">= 0")
    replica = tp * pp * pcp
    return data_parallel_index * replica + rank_in_group % replica
