"""The expert replica routing table, reference implementation (pure numpy).

Runs in: any process; no torch. The device version (`tables.py`) computes the same table with torch
ops on the map's own device and is tested equal to this one.

Entry ``(r, e)`` of the ``[NUM_ROWS, E]`` int32 table is ``l2p[e, (r + ep_rank + e) mod max(count[e], 1)]``:
token row ``i`` routed to logical expert ``e`` uses physical expert ``table[i mod NUM_ROWS, e]``, so a
hot expert's replicas are used round-robin, with a per-rank phase so EP ranks do not all pick replica 0.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ascend_dist.eplb_ascend.errors import PlacementError

__all__ = ["EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS", "build_expert_replica_routing_table", "replica_indices"]

EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS = 1024


def replica_indices(
    count: npt.ArrayLike, ep_rank: int, num_rows: int = EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS
) -> npt.NDArray[np.int64]:
    """``[num_rows, E]``: which replica column row ``r`` uses for expert ``e``."""
    counts = np.maximum(np.asarray(count, dtype=np.int64), 1)
    rows = np.arange(num_rows, dtype=np.int64)[:, None]
    experts = np.arange(counts.shape[0], dtype=np.int64)[None, :]
    return (rows + ep_rank + experts) % counts[None, :]


def build_expert_replica_routing_table(
    logical_to_physical: npt.ArrayLike,
    replica_count: npt.ArrayLike,
    ep_rank: int,
    num_rows: int = EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS,
) -> npt.NDArray[np.int32]:
    """Build one layer's ``[num_rows, E]`` int32 routing table (C-contiguous).

    Args:
        logical_to_physical: ``[E, R]`` physical slots of each logical expert, -1 padded.
        replica_count: ``[E]`` replicas per expert (the non -1 entries of each row).
        ep_rank: this rank's index in the EP group (the phase shift).
        num_rows: the table period (1024 on Ascend).

    Raises:
        PlacementError: wrong ranks or leading dimensions, or a count outside ``[0, R]``.
    """
    l2p = np.asarray(logical_to_physical)
    count = np.asarray(replica_count)
    _check_inputs(l2p.shape, count.shape, ep_rank, num_rows)
    if count.size and (count.min() < 0 or count.max() > l2p.shape[1]):
        raise PlacementError("replica_count", count.tolist(), f"values in [0, {l2p.shape[1]}]")
    idx = replica_indices(count, ep_rank, num_rows)
    table = np.take_along_axis(l2p.T.astype(np.int64), idx, axis=0)
    return np.ascontiguousarray(table, dtype=np.int32)


def _check_inputs(l2p_shape: tuple[int, ...], count_shape: tuple[int, ...], ep_rank: int, num_rows: int) -> None:
    if len(l2p_shape) != 2:
        raise PlacementError("logical_to_physical.shape", l2p_shape, "[num_logical, max_replicas] (2-D)")
    if len(count_shape) != 1:
        raise PlacementError("replica_count.shape", count_shape, "[num_logical] (1-D)")
    if l2p_shape[0] != count_shape[0]:
        raise PlacementError("replica_count.shape", count_shape, f"leading dim {l2p_shape[0]} like logical_to_physical")
    if l2p_shape[1] == 0:
        raise PlacementError("logical_to_physical.shape", l2p_shape, "at least one replica column")
    if ep_rank < 0:
        raise PlacementError("ep_rank", ep_rank, "a non-negative rank")
    if num_rows <= 0:
        raise PlacementError("num_rows", num_rows, "a positive row count")
