"""One rank's expert placement, maps and routing tables, rearranged all or nothing (no vLLM).

Runs in: the worker (and the `eplb` demo's processes). `EplbRankState` is the vLLM-free core of
`AscendEplbState`: it validates a new placement, plans the transfers, moves the weights through an
`ExpertWeightMover`, and only then commits the maps in place and refreshes the routing tables in
place. Any failure before the commit leaves placement, maps, tables and weights exactly as they were.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from ascend_dist.eplb_ascend.errors import PlacementError
from ascend_dist.eplb_ascend.mover import ExpertWeightMover, ExpertWeights, MoveStats
from ascend_dist.eplb_ascend.placement import IntArray, logical_maps, validate_placement
from ascend_dist.eplb_ascend.tables import ModelRoutingTables
from ascend_dist.eplb_ascend.transfer_plan import TransferPlan, plan_transfers

__all__ = ["EplbRankState"]


class EplbRankState:
    """Placement ``[L, P]``, maps ``[L, E, R]``/``[L, E]`` and routing tables ``[L, rows, E]`` of one rank.

    The map and table tensors are allocated once; every rearrangement writes into them, so views
    handed to layers (and captured graphs) stay valid.
    """

    def __init__(
        self,
        placement: npt.ArrayLike,
        *,
        num_logical: int,
        weights: ExpertWeights,
        mover: ExpertWeightMover,
        max_replicas: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """Adopt the current placement (validated) and this rank's expert tensors."""
        self.num_ranks = mover.transport.world_size
        self.ep_rank = mover.transport.rank
        self.num_logical = num_logical
        self.placement = validate_placement(
            placement, num_logical=num_logical, num_ranks=self.num_ranks, max_replicas=max_replicas
        )
        self.max_replicas = max_replicas or self.placement.shape[1] - num_logical + 1
        self.weights = weights
        self.mover = mover
        l2p, count = logical_maps(self.placement, num_logical, self.max_replicas)
        self.logical_to_physical = torch.from_numpy(l2p).to(device)
        self.replica_count = torch.from_numpy(count).to(device)
        self.tables = ModelRoutingTables(self.logical_to_physical, self.replica_count, self.ep_rank)
        self.last_plan: TransferPlan | None = None

    def rearrange(self, new_placement: npt.ArrayLike) -> MoveStats:
        """Collective: move to `new_placement` on every rank; commit maps and tables only on success.

        Raises:
            PlacementError: the new placement is malformed (nothing moved).
            IncompatiblePeer: ranks disagree on shapes or placements (nothing moved).
            TransferError / TransferTimeout: a transfer failed or a peer did not answer in time
                (nothing committed; the old placement stays in use).
        """
        new = validate_placement(
            new_placement, num_logical=self.num_logical, num_ranks=self.num_ranks, max_replicas=self.max_replicas,
            field="new_placement",
        )  # fmt: skip
        if new.shape != self.placement.shape:
            raise PlacementError("new_placement.shape", new.shape, f"the current shape {self.placement.shape}")
        plan = plan_transfers(self.placement, new, self.num_ranks)
        stats = self.mover.apply(plan, self.placement, new, self.weights)
        self._commit(new)
        self.last_plan = plan
        return stats

    def _commit(self, new: IntArray) -> None:
        l2p, count = logical_maps(new, self.num_logical, self.max_replicas)
        self.logical_to_physical.copy_(torch.from_numpy(l2p))
        self.replica_count.copy_(torch.from_numpy(count))
        self.placement = new
        self.tables.refresh()

    def local_experts(self) -> npt.NDArray[np.int64]:
        """``[L, S]``: the logical expert in each of this rank's slots."""
        per_rank = self.placement.shape[1] // self.num_ranks
        return self.placement[:, self.ep_rank * per_rank : (self.ep_rank + 1) * per_rank]
