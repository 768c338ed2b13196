"""The transfer plan: which expert goes from which rank (and slot) to which (pure Python + numpy).

Runs in: every EP rank, identically: each rank computes the same plan from the same old and new
placements, so sends and receives pair up by their position in `TransferPlan.moves` (used as the
message tag on gloo and as the per-pair FIFO order on HCCL).

A rank receives each expert it newly needs exactly once (the minimum traffic the change requires);
further slots with the same expert are filled by local copies. Senders are spread: each fetch picks
the holder that has sent the least so far in this layer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ascend_dist.eplb_ascend.errors import PlacementError
from ascend_dist.eplb_ascend.placement import IntArray

__all__ = ["ExpertMove", "LocalCopy", "TransferPlan", "plan_transfers"]


@dataclass(frozen=True)
class ExpertMove:
    """One expert copied across ranks. Slots are global physical slot indices."""

    layer: int
    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


@dataclass(frozen=True)
class LocalCopy:
    """One slot filled on its own rank.

    `from_old` True: the source is the old content of `src_slot` (staged before anything changes);
    False: the source is the new content of `src_slot` (a slot filled by a receive in this plan).
    """

    layer: int
    rank: int
    expert: int
    src_slot: int
    dst_slot: int
    from_old: bool


@dataclass(frozen=True)
class TransferPlan:
    """The whole rearrangement for every layer and rank."""

    num_ranks: int
    slots_per_rank: int
    moves: tuple[ExpertMove, ...]
    copies: tuple[LocalCopy, ...]

    def sends_for(self, rank: int) -> list[tuple[int, ExpertMove]]:
        """(tag, move) pairs this rank sends, in plan order."""
        return [(i, m) for i, m in enumerate(self.moves) if m.src_rank == rank]

    def recvs_for(self, rank: int) -> list[tuple[int, ExpertMove]]:
        """(tag, move) pairs this rank receives, in plan order."""
        return [(i, m) for i, m in enumerate(self.moves) if m.dst_rank == rank]

    def copies_for(self, rank: int) -> list[LocalCopy]:
        """Local copies on this rank, in plan order."""
        return [c for c in self.copies if c.rank == rank]

    def local_slot(self, slot: int) -> int:
        """Row of a global slot on its own rank."""
        return slot % self.slots_per_rank

    @property
    def is_empty(self) -> bool:
        """True when nothing changes anywhere."""
        return not self.moves and not self.copies


def plan_transfers(old: IntArray, new: IntArray, num_ranks: int) -> TransferPlan:
    """Plan the rearrangement from `old` to `new` (validated ``[L, P]`` placements of one shape).

    Raises:
        PlacementError: shapes differ, or a needed expert has no holder in the old placement.
    """
    if old.shape != new.shape or old.ndim != 2:
        raise PlacementError("new_placement.shape", new.shape, f"the old placement's 2-D shape {old.shape}")
    slots = old.shape[1]
    if num_ranks <= 0 or slots % num_ranks:
        raise PlacementError("num_ranks", num_ranks, f"a positive divisor of the slot count {slots}")
    per_rank = slots // num_ranks
    moves: list[ExpertMove] = []
    copies: list[LocalCopy] = []
    for layer in range(old.shape[0]):
        _plan_layer(
            layer, old=old[layer], new=new[layer], num_ranks=num_ranks, per_rank=per_rank, moves=moves, copies=copies
        )
    return TransferPlan(num_ranks, per_rank, tuple(moves), tuple(copies))


def _first_slots(row: IntArray, rank: int, per_rank: int) -> dict[int, int]:
    """Expert -> its first global slot on `rank`."""
    base = rank * per_rank
    first: dict[int, int] = {}
    for offset, expert in enumerate(row[base : base + per_rank].tolist()):
        if expert >= 0:
            first.setdefault(expert, base + offset)
    return first


def _plan_layer(
    layer: int,
    *,
    old: IntArray,
    new: IntArray,
    num_ranks: int,
    per_rank: int,
    moves: list[ExpertMove],
    copies: list[LocalCopy],
) -> None:
    old_first = [_first_slots(old, r, per_rank) for r in range(num_ranks)]
    holders: dict[int, list[int]] = defaultdict(list)
    for rank, held in enumerate(old_first):
        for expert in held:
            holders[expert].append(rank)
    sent = np.zeros(num_ranks, dtype=np.int64)
    for rank in range(num_ranks):
        primary: dict[int, int] = {}
        for slot in np.flatnonzero(old != new).tolist():
            if slot // per_rank != rank or new[slot] < 0:
                continue
            expert = int(new[slot])
            if expert in old_first[rank]:
                copies.append(LocalCopy(layer, rank, expert, old_first[rank][expert], slot, from_old=True))
            elif expert in primary:
                copies.append(LocalCopy(layer, rank, expert, primary[expert], slot, from_old=False))
            else:
                if not holders.get(expert):
                    raise PlacementError(f"old_placement[{layer}] expert {expert}", 0, "a holder to fetch it from")
                src = min(holders[expert], key=lambda r: (int(sent[r]), (r - rank) % num_ranks))
                sent[src] += 1
                primary[expert] = slot
                moves.append(ExpertMove(layer, expert, src, old_first[src][expert], rank, slot))
