"""A small load-balancing policy for the demo and tests (pure numpy; vLLM brings its own).

Runs in: any process. Greedy: give each redundant slot to the expert with the highest load per
replica, then place replicas heaviest first on the least-loaded rank that has a free slot and does
not hold that expert yet (falling back to any rank with a free slot).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ascend_dist.eplb_ascend.errors import PlacementError
from ascend_dist.eplb_ascend.placement import IntArray

__all__ = ["balance_placement"]


def balance_placement(load: npt.ArrayLike, num_physical: int, num_ranks: int) -> IntArray:
    """``[L, P]`` placement for a ``[L, E]`` load (tokens per logical expert)."""
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    num_logical = arr.shape[1]
    if num_physical < num_logical or num_physical % num_ranks:
        raise PlacementError("num_physical", num_physical, f">= {num_logical} and a multiple of {num_ranks} ranks")
    return np.stack([_balance_layer(row, num_physical, num_ranks) for row in arr])


def _balance_layer(load: npt.NDArray[np.float64], num_physical: int, num_ranks: int) -> IntArray:
    num_logical = load.shape[0]
    replicas = np.ones(num_logical, dtype=np.int64)
    for _ in range(num_physical - num_logical):
        replicas[int(np.argmax(load / replicas))] += 1
    per_rank = num_physical // num_ranks
    items = sorted(
        ((load[e] / replicas[e], e) for e in range(num_logical) for _ in range(replicas[e])),
        key=lambda x: (-x[0], x[1]),
    )
    rank_load = np.zeros(num_ranks)
    rank_experts: list[list[int]] = [[] for _ in range(num_ranks)]
    for weight, expert in items:
        free = [r for r in range(num_ranks) if len(rank_experts[r]) < per_rank]
        fresh = [r for r in free if expert not in rank_experts[r]] or free
        target = min(fresh, key=lambda r: (rank_load[r], r))
        rank_experts[target].append(expert)
        rank_load[target] += weight
    return np.asarray([e for r in range(num_ranks) for e in sorted(rank_experts[r])], dtype=np.int64)
