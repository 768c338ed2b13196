"""Records of the layer-wise push plan: D endpoints, D block locations, placements, tasks, windows.

Runs in: prefill worker processes. Pure: stdlib only. Built by `ascend_dist.kv_mooncake.core.transfer_mappings`
(which re-exports them) and `ascend_dist.kv_mooncake.core.transfer_placement`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "BlockPortMappings",
    "DBlockLocation",
    "Endpoint",
    "TransferTask",
    "TransferWindow",
]


@dataclass(frozen=True, order=True)
class Endpoint:
    """A D worker's side channel: host and absolute port."""

    host: str
    port: int


@dataclass(frozen=True)
class DBlockLocation:
    """Where logical block ``l`` of one D head group lives on D."""

    pcp_rank: int
    dcp_rank: int
    world_rank: int  # pcp_rank * tp + tp_rank; the port offset from D's advertised base
    endpoint: Endpoint
    block_idx: int  # position in that D rank's block list (index into remote_block_ids)


@dataclass(frozen=True)
class BlockPortMappings:
    """Per-request block placement on both sides, for the selected CP-group pair.

    Attributes:
        p_blocks: ``(pcp_rank, head_group, dcp_rank) -> logical blocks`` held by that P rank, for
            the selected P head groups; position ``i`` pairs with the rank's ``local_block_ids[i]``.
        d_blocks: ``(logical block, D head group) -> location`` for the selected D head groups.
        head_mapping: Selected P head group -> sorted D head groups sharing at least one head.
        trans_counts: Completion signals each D endpoint waits for (`completion_counts`).
    """

    p_blocks: Mapping[tuple[int, int, int], tuple[int, ...]]
    d_blocks: Mapping[tuple[int, int], DBlockLocation]
    head_mapping: Mapping[int, tuple[int, ...]]
    trans_counts: Mapping[Endpoint, int]

    def p_block_list(self, pcp_rank: int, head_group: int, dcp_rank: int) -> tuple[int, ...]:
        """Logical blocks a P rank sends (empty when its head group is not selected)."""
        return self.p_blocks.get((pcp_rank, head_group, dcp_rank), ())


@dataclass(frozen=True)
class TransferTask:
    """Everything one P rank writes to one D endpoint for a request in this step."""

    endpoint: Endpoint
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    trans_count: int


@dataclass(frozen=True)
class TransferWindow:
    """Logical blocks ``[transed_idx, to_trans_idx)`` are sent this step."""

    transed_idx: int
    to_trans_idx: int
    chunk_finished: bool
