"""Expert placements: validation and the logical maps derived from them (pure numpy).

Runs in: any process; no torch, no vLLM. A *placement* is vLLM's ``physical_to_logical_map`` for
one or more MoE layers: ``placement[layer, slot]`` is the logical expert held by physical slot
``slot``; slots ``[r * S, (r + 1) * S)`` live on EP rank ``r`` (``S`` local slots per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ascend_dist.eplb_ascend.errors import PlacementError

__all__ = [
    "IntArray",
    "PlacementDiff",
    "initial_placement",
    "logical_maps",
    "placement_diff",
    "validate_placement",
]

IntArray = npt.NDArray[np.int64]


def initial_placement(num_logical: int, num_physical: int, num_layers: int = 1) -> IntArray:
    """VLLM's initial arrangement: experts ``0..E-1`` then redundant slots ``i mod E``, for every layer."""
    if num_logical <= 0:
        raise PlacementError("num_logical", num_logical, "a positive expert count")
    if num_physical < num_logical:
        raise PlacementError("num_physical", num_physical, f">= num_logical ({num_logical})")
    row = np.arange(num_physical, dtype=np.int64) % num_logical
    return np.tile(row, (num_layers, 1))


def validate_placement(
    placement: npt.ArrayLike,
    *,
    num_logical: int,
    num_ranks: int,
    max_replicas: int | None = None,
    field: str = "placement",
) -> IntArray:
    """Check a ``[layers, slots]`` (or ``[slots]``) placement and return it as int64 ``[layers, slots]``.

    Every logical expert must appear at least once per layer and at most ``max_replicas`` times
    (default: ``slots - num_logical + 1``, i.e. all redundant slots on one expert); slots must split
    evenly over ranks.

    Raises:
        PlacementError: naming the field, the layer/expert and what was allowed.
    """
    arr = np.asarray(placement)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise PlacementError(f"{field}.shape", arr.shape, "[layers, physical_slots] with at least one slot")
    if not np.issubdtype(arr.dtype, np.integer):
        raise PlacementError(f"{field}.dtype", arr.dtype, "an integer dtype")
    arr = arr.astype(np.int64, copy=False)
    slots = arr.shape[1]
    if num_ranks <= 0 or slots % num_ranks:
        raise PlacementError("num_ranks", num_ranks, f"a positive divisor of the slot count {slots}")
    limit = slots - num_logical + 1 if max_replicas is None else max_replicas
    bad = (arr < 0) | (arr >= num_logical)
    if bad.any():
        layer, slot = (int(x) for x in np.argwhere(bad)[0])
        raise PlacementError(
            f"{field}[{layer}, {slot}]", int(arr[layer, slot]), f"a logical expert id in [0, {num_logical})"
        )
    counts = _replica_counts(arr, num_logical)
    missing = np.argwhere(counts == 0)
    if missing.size:
        layer, expert = (int(x) for x in missing[0])
        raise PlacementError(f"{field}[{layer}] expert {expert}", 0, "at least one replica of every expert")
    over = np.argwhere(counts > limit)
    if over.size:
        layer, expert = (int(x) for x in over[0])
        raise PlacementError(
            f"{field}[{layer}] expert {expert} replicas", int(counts[layer, expert]), f"at most {limit}"
        )
    return arr


def _replica_counts(arr: IntArray, num_logical: int) -> IntArray:
    offsets = (np.arange(arr.shape[0], dtype=np.int64) * num_logical)[:, None]
    flat = np.bincount((arr + offsets).ravel(), minlength=arr.shape[0] * num_logical)
    return flat.reshape(arr.shape[0], num_logical)


def logical_maps(placement: IntArray, num_logical: int, max_replicas: int | None = None) -> tuple[IntArray, IntArray]:
    """``logical_to_physical [L, E, R]`` (-1 padded, slots ascending) and ``replica_count [L, E]``.

    The same contents as vLLM's ``compute_logical_maps``; ``R`` is ``max_replicas`` or the largest count.
    """
    arr = np.asarray(placement, dtype=np.int64)
    if arr.ndim == 1:
        arr = arr[None, :]
    valid = arr >= 0
    counts = np.zeros((arr.shape[0], num_logical), dtype=np.int64)
    layers, slots = np.nonzero(valid)
    experts = arr[layers, slots]
    np.add.at(counts, (layers, experts), 1)
    width = int(counts.max(initial=1)) if max_replicas is None else max_replicas
    if counts.max(initial=0) > width:
        raise PlacementError("max_replicas", width, f">= the largest replica count {int(counts.max())}")
    out = np.full((arr.shape[0], num_logical, width), -1, dtype=np.int64)
    # Stable sort by (layer, expert) keeps slots ascending inside each expert.
    order = np.lexsort((slots, experts, layers))
    layers, slots, experts = layers[order], slots[order], experts[order]
    key = layers * num_logical + experts
    first = np.r_[0, np.flatnonzero(np.diff(key)) + 1]
    starts = np.repeat(first, np.diff(np.r_[first, key.size]))
    replica = np.arange(key.size) - starts
    out[layers, experts, replica] = slots
    return out, counts


@dataclass(frozen=True)
class PlacementDiff:
    """What changes between two placements of the same shape.

    Attributes:
        changed_slots: ``[n, 2]`` (layer, slot) pairs whose expert differs.
        fetches: ``[m, 3]`` (layer, rank, expert) triples a rank must obtain from another rank: it holds
            the expert in the new placement but in no slot of the old one. This is the minimum remote
            traffic any rearrangement needs (in experts).
    """

    changed_slots: IntArray
    fetches: IntArray

    @property
    def num_remote_fetches(self) -> int:
        """How many (layer, rank, expert) copies must cross ranks."""
        return int(self.fetches.shape[0])


def placement_diff(old: IntArray, new: IntArray, num_ranks: int, num_logical: int) -> PlacementDiff:
    """Compare two validated ``[L, P]`` placements of the same shape."""
    if old.shape != new.shape:
        raise PlacementError("new_placement.shape", new.shape, f"the old placement's shape {old.shape}")
    slots = old.shape[1]
    per_rank = slots // num_ranks
    changed = np.argwhere(old != new).astype(np.int64)
    held_old = _holdings(old, num_ranks, per_rank, num_logical)
    held_new = _holdings(new, num_ranks, per_rank, num_logical)
    fetches = np.argwhere(held_new & ~held_old).astype(np.int64)
    return PlacementDiff(changed_slots=changed, fetches=fetches)


def _holdings(arr: IntArray, num_ranks: int, per_rank: int, num_logical: int) -> npt.NDArray[np.bool_]:
    """``held[layer, rank, expert]``: whether any slot of `rank` holds `expert`."""
    held = np.zeros((arr.shape[0], num_ranks, num_logical), dtype=bool)
    layers, slots = np.nonzero(arr >= 0)
    held[layers, slots // per_rank, arr[layers, slots]] = True
    return held
