"""Block/port planning for the layer-wise push: which D port and D block each P block goes to.

Runs in: prefill worker processes (once per request per step). Pure: stdlib only.

Order of use for one request on one P rank::

    pair = select_group_pair(p_groups, d_groups, req_idx=..., head_group_rank=p.head_group_rank(tp_rank))
    context_parallel_parameters_check(p, d, num_heads)
    window = transfer_window(...)
    maps = get_local_remote_block_port_mappings(
        window.to_trans_idx, p, d, selected_p_group=pair.p_group, selected_d_group=pair.d_group, ...
    )
    tasks = get_transfer_mappings(
        maps, p, ..., transed_idx=window.transed_idx, to_trans_idx=window.to_trans_idx
    )

Logical block ``l`` is a prompt block index (in block-size units, from token 0). On either side it
lives on CP index ``l mod (pcp * dcp)`` at position ``l // (pcp * dcp)`` of that rank's block list.

The records live in `ascend_dist.kv_mooncake.core.transfer_records` and the D-side placement
(`d_block_location`, `completion_counts`) in `ascend_dist.kv_mooncake.core.transfer_placement`; both are
re-exported here, so this module stays the one import path.

Upstream reference: vllm-ascend ``distributed/kv_transfer/utils/utils.py``
(``get_local_remote_block_port_mappings``, ``get_transfer_mappings``, v0.11). Two deliberate
differences are documented where they occur (both in `transfer_placement`): the D block index
(`d_block_location`) and the completion count with a D prefix hit (`completion_counts`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from types import MappingProxyType

from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.common.log import log_once
from ascend_dist.kv_mooncake.core.mappings import ParallelInfo, get_head_group_mapping, round_robin_count
from ascend_dist.kv_mooncake.core.transfer_placement import completion_counts, d_block_location
from ascend_dist.kv_mooncake.core.transfer_records import (
    BlockPortMappings,
    DBlockLocation,
    Endpoint,
    TransferTask,
    TransferWindow,
)

__all__ = [
    "BlockPortMappings",
    "DBlockLocation",
    "Endpoint",
    "TransferTask",
    "TransferWindow",
    "completion_counts",
    "d_block_location",
    "get_local_remote_block_port_mappings",
    "get_transfer_mappings",
    "transfer_window",
]

logger = logging.getLogger(__name__)


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size", block_size, "an integer >= 1")


def _check_rank(field: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise ConfigError(field, value, f"an integer in [0, {size})")


def _checked_groups(field: str, groups: Collection[int], num_head_groups: int) -> list[int]:
    ordered = sorted(set(groups))
    if ordered and (ordered[0] < 0 or ordered[-1] >= num_head_groups):
        raise ConfigError(field, ordered, f"head-group ranks in [0, {num_head_groups})")
    return ordered


def transfer_window(
    p: ParallelInfo,
    *,
    pcp_rank: int,
    dcp_rank: int,
    computed_tokens: int,
    transed_tokens: int,
    remote_cache_tokens: int,
    prompt_len: int,
    block_size: int,
    chunk_finished: bool,
) -> TransferWindow:
    """Compute the logical-block window a P rank sends in this step.

    ``to_trans_idx`` is ``ceil(computed / bs)`` once the prompt is fully computed, else
    ``floor(computed / bs)`` (a partial block is sent only at the end). ``transed_idx`` is
    ``floor(max(remote_cache_tokens, transed_tokens) / bs)``: D's prefix hit is never sent. The chunk
    also counts as finished once this rank's round-robin share of prompt blocks is covered.

    Args:
        p: P's layout.
        pcp_rank: This P rank's PCP rank.
        dcp_rank: This P rank's DCP rank.
        computed_tokens: Tokens computed so far (this step included).
        transed_tokens: Tokens already sent in earlier steps.
        remote_cache_tokens: D's prefix-hit tokens.
        prompt_len: Prompt length in tokens.
        block_size: Tokens per block.
        chunk_finished: Whether the scheduler marked the prompt as fully computed.

    Returns:
        The window and the (possibly upgraded) finished flag.

    Raises:
        ConfigError: ``block_size < 1`` or a rank is outside P's layout.
    """
    _check_block_size(block_size)
    _check_rank("pcp_rank", pcp_rank, p.pcp_size)
    _check_rank("dcp_rank", dcp_rank, p.dcp_size)
    # A finished chunk sends its partial last block too; an unfinished one only whole blocks.
    to_trans_idx = -(-computed_tokens // block_size) if chunk_finished else computed_tokens // block_size
    cp_index = p.cp_index(pcp_rank, dcp_rank)
    prompt_blocks = math.ceil(prompt_len / block_size)
    own_blocks = round_robin_count(prompt_blocks, p.cp_size, cp_index)
    if own_blocks == round_robin_count(to_trans_idx, p.cp_size, cp_index):
        chunk_finished = True
    transed_idx = max(remote_cache_tokens, transed_tokens) // block_size
    return TransferWindow(transed_idx=transed_idx, to_trans_idx=to_trans_idx, chunk_finished=chunk_finished)


def _head_group_pairs(
    num_heads: int, p: ParallelInfo, d: ParallelInfo, p_group: Collection[int], d_group: Collection[int]
) -> dict[int, tuple[int, ...]]:
    """Selected P head group -> D head groups (of the selected D group) sharing any head."""
    p_heads = get_head_group_mapping(num_heads, p.tp_size, p.num_head_groups, p_group)
    d_heads = get_head_group_mapping(num_heads, d.tp_size, d.num_head_groups, d_group)
    head_to_d: dict[int, set[int]] = {}
    for d_hg, heads in d_heads.items():
        for head in heads:
            head_to_d.setdefault(head, set()).add(d_hg)
    pairs: dict[int, tuple[int, ...]] = {}
    for p_hg, heads in p_heads.items():
        targets: set[int] = set()
        for head in heads:
            if head not in head_to_d:
                log_once(logger, logging.WARNING, "KV head %d of P is held by no selected D head group", head)
            targets |= head_to_d.get(head, set())
        pairs[p_hg] = tuple(sorted(targets))
    return pairs


def get_local_remote_block_port_mappings(
    to_trans_idx: int,
    p: ParallelInfo,
    d: ParallelInfo,
    *,
    d_hosts: Sequence[str],
    d_base_port: int,
    selected_p_group: Collection[int],
    selected_d_group: Collection[int],
    prompt_len: int,
    block_size: int,
    remote_cache_tokens: int,
    num_heads: int,
) -> BlockPortMappings:
    """Place logical blocks ``0 .. to_trans_idx-1`` on P ranks and on D endpoints.

    Args:
        to_trans_idx: Logical blocks computed so far (exclusive upper bound).
        p: P's layout.
        d: D's layout.
        d_hosts: D hosts, splitting D's ``pcp * tp`` ranks evenly in order.
        d_base_port: D's advertised base port (``remote_port``).
        selected_p_group: The P CP group (head-group ranks) from `select_group_pair`.
        selected_d_group: The paired D CP group.
        prompt_len: Prompt length in tokens.
        block_size: Tokens per block.
        remote_cache_tokens: D's prefix-hit tokens (never sent).
        num_heads: Total KV heads (1 for MLA).

    Returns:
        The placement tables; see `BlockPortMappings`.

    Raises:
        ConfigError: Bad sizes, empty hosts, or inconsistent head counts.
    """
    _check_block_size(block_size)
    if to_trans_idx < 0:
        raise BlockIdError("to_trans_idx", to_trans_idx, "an integer >= 0")
    heads = 1 if p.use_mla else num_heads
    p_groups = _checked_groups("selected_p_group", selected_p_group, p.num_head_groups)
    d_groups = _checked_groups("selected_d_group", selected_d_group, d.num_head_groups)
    p_blocks: dict[tuple[int, int, int], list[int]] = {}
    for pcp_rank in range(p.pcp_size):
        for dcp_rank in range(p.dcp_size):
            own = list(range(p.cp_index(pcp_rank, dcp_rank), to_trans_idx, p.cp_size))
            for hg in p_groups:
                p_blocks[(pcp_rank, hg, dcp_rank)] = own
    d_blocks = {
        (logical, hg): d_block_location(logical, hg, d, d_hosts, d_base_port)
        for logical in range(to_trans_idx)
        for hg in d_groups
    }
    counts = completion_counts(
        p,
        d,
        d_hosts,
        d_base_port,
        num_blocks=math.ceil(prompt_len / block_size),
        prefix_blocks=math.ceil(remote_cache_tokens / block_size),
    )
    return BlockPortMappings(
        p_blocks=MappingProxyType({k: tuple(v) for k, v in p_blocks.items()}),
        d_blocks=MappingProxyType(d_blocks),
        head_mapping=MappingProxyType(_head_group_pairs(heads, p, d, p_groups, d_groups)),
        trans_counts=MappingProxyType(counts),
    )


def get_transfer_mappings(
    mappings: BlockPortMappings,
    p: ParallelInfo,
    *,
    tp_rank: int,
    pcp_rank: int,
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    transed_idx: int,
    to_trans_idx: int,
) -> tuple[TransferTask, ...]:
    """Build this P rank's transfer tasks for one request and one KV group.

    For every logical block ``l`` in ``[transed_idx, to_trans_idx)`` that this rank holds (position
    ``i`` in its list) and every D head group paired with its head group: send
    ``local_block_ids[i]`` to ``remote_block_ids[D block index]`` at that D endpoint.

    Args:
        mappings: From `get_local_remote_block_port_mappings`.
        p: P's layout.
        tp_rank: This P rank's TP rank (its DCP rank is ``tp_rank % dcp``).
        pcp_rank: This P rank's PCP rank.
        local_block_ids: This rank's block ids for the group (its CP shard, in order).
        remote_block_ids: D's block ids for the group, as D's scheduler sent them; indexed by
            the D block index of `d_block_location`.
        transed_idx: First logical block not yet sent.
        to_trans_idx: End of the window (exclusive).

    Returns:
        One task per D endpoint, in first-use order; empty when this rank sends nothing.

    Raises:
        BlockIdError: A block position is beyond ``local_block_ids`` or ``remote_block_ids``.
    """
    _check_rank("tp_rank", tp_rank, p.tp_size)
    _check_rank("pcp_rank", pcp_rank, p.pcp_size)
    dcp_rank = p.dcp_rank(tp_rank)
    head_group = p.head_group_rank(tp_rank)
    targets = mappings.head_mapping.get(head_group, ())
    local: dict[Endpoint, list[int]] = {}
    remote: dict[Endpoint, list[int]] = {}
    for position, logical in enumerate(mappings.p_block_list(pcp_rank, head_group, dcp_rank)):
        if not transed_idx <= logical < to_trans_idx:
            continue
        if position >= len(local_block_ids):
            raise BlockIdError("local_block_ids", len(local_block_ids), f"more than {position} entries")
        for d_hg in targets:
            where = mappings.d_blocks[(logical, d_hg)]
            if where.block_idx >= len(remote_block_ids):
                raise BlockIdError("remote_block_ids", len(remote_block_ids), f"more than {where.block_idx} entries")
            local.setdefault(where.endpoint, []).append(local_block_ids[position])
            remote.setdefault(where.endpoint, []).append(remote_block_ids[where.block_idx])
    tasks = tuple(
        TransferTask(
            endpoint=ep,
            local_block_ids=tuple(ids),
            remote_block_ids=tuple(remote[ep]),
            trans_count=mappings.trans_counts[ep],
        )
        for ep, ids in local.items()
    )
    if tasks and logger.isEnabledFor(logging.DEBUG):
        logger.debug("tp_rank=%d pcp_rank=%d transfer tasks: %s", tp_rank, pcp_rank, tasks)
    return tasks
