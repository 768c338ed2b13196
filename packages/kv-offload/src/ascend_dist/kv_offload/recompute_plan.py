"""Pure block math of the recompute (preempt) connector.

Runs in: the scheduler process. No torch, no I/O: alignment of a group's block ids to logical
positions, the Mamba state choice, and the host->device pairs of a restore.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from ascend_dist.common.errors import ConfigError, format_allowed

__all__ = [
    "SAVE_TABLE",
    "GroupKind",
    "SavePhase",
    "GroupSpec",
    "align_group_block_ids",
    "attention_load_pairs",
    "mamba_state_index",
]


class GroupKind(enum.Enum):
    """How a KV-cache group holds its blocks."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group: its kind and tokens per block.

    Raises:
        ConfigError: a non-positive block size or a kind that is not a `GroupKind`.
    """

    kind: GroupKind
    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            raise ConfigError("kind", self.kind, format_allowed([k.value for k in GroupKind]))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError("block_size", self.block_size, "a positive number of tokens")


class SavePhase(enum.Enum):
    """Where a preempted request's saved KV stands."""

    SAVING = enum.auto()
    READY = enum.auto()
    LOADING = enum.auto()


SAVE_TABLE: Final[Mapping[SavePhase, frozenset[SavePhase]]] = {
    SavePhase.SAVING: frozenset({SavePhase.READY}),
    SavePhase.READY: frozenset({SavePhase.LOADING}),
    SavePhase.LOADING: frozenset(),
}


def align_group_block_ids(
    block_ids: Sequence[int], num_computed_tokens: int, block_size: int, *, sliding_window: bool
) -> list[int]:
    """Place a group's device blocks at their logical positions.

    The logical count is ``ceil(num_computed_tokens / block_size)``. A sliding-window list covers
    only the window, so it is left-padded with 0 (the null block) up to that count; every list is
    then cut to the count. Examples: SWA ``[7, 8]`` with 4 logical -> ``[0, 0, 7, 8]``; SWA
    ``[5..9]`` -> ``[5, 6, 7, 8]``; full ``[7, 8]`` -> ``[7, 8]``; 0 logical -> ``[]``.
    """
    logical = math.ceil(max(num_computed_tokens, 0) / block_size)
    ids = list(block_ids)
    if sliding_window and len(ids) < logical:
        ids = [0] * (logical - len(ids)) + ids
    return ids[:logical]


def mamba_state_index(num_spec_tokens: int, saved_computed_tokens: int, num_tokens: int) -> int:
    """Which of the ``1 + num_spec_tokens`` saved Mamba states matches the last accepted token.

    ``num_spec_tokens - (saved_computed_tokens - num_tokens + 1)``; with the usual
    ``saved_computed_tokens = num_tokens - 1`` it is the newest state.

    Raises:
        ConfigError: the index falls outside the saved states.
    """
    index = num_spec_tokens - (saved_computed_tokens - num_tokens + 1)
    if not 0 <= index <= num_spec_tokens:
        raise ConfigError("mamba_state_index", index, f"0..{num_spec_tokens} (one of the saved states)")
    return index


def attention_load_pairs(
    host_ids: Sequence[int],
    device_ids: Sequence[int],
    start_token: int,
    end_token: int,
    block_size: int,
    *,
    sliding_window: bool,
) -> list[tuple[int, int]]:
    """Host -> device pairs restoring tokens ``[start_token, end_token)`` of one attention group.

    The range is clipped to the device blocks actually allocated (MTP/lookahead can make the lists
    differ in length); positions whose host or device id is 0 (null) are skipped. Examples (block
    16, 64 tokens): SWA host ``[0, 0, 4, 5]``, device ``[30, 31]`` -> ``[(4, 30), (5, 31)]``; full
    host ``[1, 2, 3, 4]``, device ``[10, 11, 12]`` -> ``[(1, 10), (2, 11), (3, 12)]``.

    Raises:
        ConfigError: the clipped end lies before the start block.
    """
    start_block = start_token // block_size
    wanted = math.ceil(end_token / block_size)
    logical = max(wanted, len(device_ids)) * block_size
    aligned = align_group_block_ids(device_ids, logical, block_size, sliding_window=sliding_window)
    end_block = min(len(host_ids), len(aligned), wanted)
    if end_block < start_block:
        raise ConfigError("end_block", end_block, f"at least the start block {start_block}")
    return [(host_ids[i], aligned[i]) for i in range(start_block, end_block) if host_ids[i] > 0 and aligned[i] > 0]
