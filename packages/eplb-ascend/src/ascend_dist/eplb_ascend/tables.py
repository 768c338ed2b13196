"""Routing tables on the device, refreshed in place (torch; no vLLM).

Runs in: the worker. Captured graphs (ACL graphs on Ascend, CUDA graphs elsewhere) keep the address
of the routing table they were captured with, so a refresh must write into the SAME storage: the
table tensor is created once and every refresh copies new values into it. The values are computed
with torch ops on the maps' own device (a gather; no host sync), equal to `routing.py`'s reference.
"""

from __future__ import annotations

import torch

from ascend_dist.eplb_ascend.errors import PlacementError
from ascend_dist.eplb_ascend.routing import EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS, _check_inputs

__all__ = [
    "ModelRoutingTables",
    "compute_routing_table",
    "refresh_expert_replica_routing_table",
]


def compute_routing_table(
    logical_to_physical: torch.Tensor,
    replica_count: torch.Tensor,
    ep_rank: int,
    num_rows: int = EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS,
) -> torch.Tensor:
    """A fresh ``[num_rows, E]`` int32 table for one layer (or ``[L, num_rows, E]`` for ``[L, E, R]`` maps)."""
    if logical_to_physical.dim() == 3:
        if replica_count.dim() != 2 or replica_count.shape[0] != logical_to_physical.shape[0]:
            raise PlacementError(
                "replica_count.shape", tuple(replica_count.shape), f"[{logical_to_physical.shape[0]}, num_logical]"
            )
        return torch.stack(
            [
                compute_routing_table(m, c, ep_rank, num_rows)
                for m, c in zip(logical_to_physical, replica_count, strict=True)
            ]
        )
    _check_inputs(tuple(logical_to_physical.shape), tuple(replica_count.shape), ep_rank, num_rows)
    device = logical_to_physical.device
    counts = replica_count.to(torch.long).clamp(min=1)
    rows = torch.arange(num_rows, device=device, dtype=torch.long)[:, None]
    experts = torch.arange(counts.shape[0], device=device, dtype=torch.long)[None, :]
    index = (rows + ep_rank + experts) % counts[None, :]
    return torch.gather(logical_to_physical.t().to(torch.long), 0, index).to(torch.int32).contiguous()


def refresh_expert_replica_routing_table(
    table: torch.Tensor,
    logical_to_physical: torch.Tensor,
    replica_count: torch.Tensor,
    ep_rank: int,
    layer: int | None = None,
) -> torch.Tensor:
    """Rewrite `table` in place from the maps; returns `table` itself (same storage, same address).

    Args:
        table: ``[L, rows, E]`` (whole model) or ``[rows, E]`` (one layer) int32 table to update.
        logical_to_physical: ``[L, E, R]`` or ``[E, R]`` maps matching `table`'s rank.
        replica_count: ``[L, E]`` or ``[E]``.
        ep_rank: this rank in the EP group.
        layer: with a model-level table, refresh only this layer (after a per-layer async commit).

    Raises:
        PlacementError: shapes that do not match the table's (the table is left untouched).
    """
    if layer is not None:
        if table.dim() != 3 or not 0 <= layer < table.shape[0]:
            raise PlacementError("layer", layer, f"a layer index in [0, {table.shape[0] if table.dim() == 3 else 0})")
        refresh_expert_replica_routing_table(table[layer], logical_to_physical[layer], replica_count[layer], ep_rank)
        return table
    fresh = compute_routing_table(logical_to_physical, replica_count, ep_rank, table.shape[-2])
    if fresh.shape != table.shape:
        raise PlacementError("routing_table.shape", tuple(table.shape), f"the maps' table shape {tuple(fresh.shape)}")
    table.copy_(fresh, non_blocking=True)
    return table


class ModelRoutingTables:
    """The ``[L, rows, E]`` routing table of one model, allocated once and refreshed in place.

    `layer_view(i)` is a view into the one storage: handing it to layer `i` keeps it valid forever.
    """

    def __init__(
        self,
        logical_to_physical: torch.Tensor,
        replica_count: torch.Tensor,
        ep_rank: int,
        num_rows: int = EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS,
    ) -> None:
        """Build the table from ``[L, E, R]`` maps and ``[L, E]`` counts (kept by reference)."""
        if logical_to_physical.dim() != 3:
            raise PlacementError("logical_to_physical.shape", tuple(logical_to_physical.shape), "[layers, E, R]")
        self.logical_to_physical = logical_to_physical
        self.replica_count = replica_count
        self.ep_rank = ep_rank
        self.table = compute_routing_table(logical_to_physical, replica_count, ep_rank, num_rows)

    def layer_view(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s ``[rows, E]`` table (a view of the model table)."""
        return self.table[layer]

    def refresh(self, layer: int | None = None) -> torch.Tensor:
        """Recompute from the (in-place updated) maps: every layer, or one."""
        return refresh_expert_replica_routing_table(
            self.table, self.logical_to_physical, self.replica_count, self.ep_rank, layer
        )


def refresh_or_build(
    existing: torch.Tensor | None,
    logical_to_physical: torch.Tensor,
    replica_count: torch.Tensor,
    ep_rank: int,
) -> torch.Tensor:
    """Refresh `existing` in place when its shape still fits; otherwise build a new table.

    The layer-state rule: captured graphs keep pointing at `existing`, so its identity and storage
    are kept whenever the shape allows.
    """
    fresh = compute_routing_table(logical_to_physical, replica_count, ep_rank)
    if existing is not None and existing.shape == fresh.shape and existing.device == fresh.device:
        existing.copy_(fresh, non_blocking=True)
        return existing
    return fresh
