"""Planning of the layer-wise push: which D endpoint and D blocks each P block of a request goes to.

Runs in: P worker processes (once per request per step, in ``start_load_kv``) and the send thread
(descriptors per layer). Pure: numpy and `ascend_dist.common` only.

The block/port mapping is common's (`ascend_dist.kv_mooncake.core.transfer_mappings`): CP groups
(`get_cp_group`), the P/D group pair of a request (`select_group_pair`), the window of logical blocks
computed since the last step (`transfer_window`), their D endpoint and D block
(`get_local_remote_block_port_mappings`) and this rank's tasks (`get_transfer_mappings`). This module
adds the per-request wrapper and the two descriptor layouts:

* plain (``pd_head_ratio == 1``): whole blocks, consecutive runs merged;
* resharded (``pd_head_ratio = r > 1``): after the all-to-all each P rank holds all heads of a
  ``1/r`` token slice of every block, contiguous in its staging buffer; it writes it at byte offset
  ``j · P_block_len`` of D's block, ``j`` its index in the all-to-all group. Head-major blocks
  (``[heads][tokens]``) need no exchange: P's own block is D's heads ``j·h ..``, the same offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dist.common.errors import BlockIdError, ConfigError, LayoutError
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.mappings import ParallelInfo, get_cp_group, select_group_pair
from ascend_dist.kv_mooncake.core.messages import TensorMeta
from ascend_dist.kv_mooncake.core.transfer_mappings import (
    Endpoint,
    get_local_remote_block_port_mappings,
    get_transfer_mappings,
    transfer_window,
)

__all__ = [
    "PushTask",
    "RequestPlan",
    "Pieces",
    "a2a_groups",
    "a2a_member_index",
    "as_descriptors",
    "block_runs",
    "plain_pieces",
    "plan_request",
    "rearranged_positions",
    "resharded_pieces",
]


@dataclass(frozen=True)
class PushTask:
    """What this P rank writes to one D endpoint for one request and one KV group in this step."""

    transfer_id: str
    group: int
    endpoint: Endpoint
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    trans_count: int


@dataclass(frozen=True)
class RequestPlan:
    """One request's tasks in this step, whether its prompt is fully sent after it, and who waits.

    ``done_to`` lists each D endpoint expecting this rank's `Done` with its ``trans_count``.
    """

    transfer_id: str
    tasks: tuple[PushTask, ...]
    chunk_finished: bool
    done_to: tuple[tuple[Endpoint, int], ...]


def plan_request(
    *,
    transfer_id: str,
    req_idx: int,
    p: ParallelInfo,
    d: ParallelInfo,
    tp_rank: int,
    pcp_rank: int,
    num_heads: int,
    block_size: int,
    local_block_ids: Sequence[Sequence[int]],
    remote_block_ids: Sequence[Sequence[int]],
    d_host: str,
    d_base_port: int,
    prompt_len: int,
    computed_tokens: int,
    transed_tokens: int,
    remote_cached_tokens: int,
    chunk_finished: bool,
) -> RequestPlan:
    """Plan one request's writes for this step on one P rank.

    Args:
        transfer_id: The request id both sides use on the wire.
        req_idx: The request's index in this step's metadata (same on every P rank).
        p: P's layout (with ``pd_head_ratio``).
        d: D's layout.
        tp_rank: This P rank's TP rank.
        pcp_rank: This P rank's PCP rank.
        num_heads: Total KV heads (1 for MLA).
        block_size: Tokens per block (equal on P and D).
        local_block_ids: P's block ids per KV group.
        remote_block_ids: D's block ids per KV group (prefix-hit blocks included).
        d_host: D's host.
        d_base_port: D's advertised base port.
        prompt_len: Prompt tokens.
        computed_tokens: Tokens computed after this step.
        transed_tokens: Tokens already sent in earlier steps.
        remote_cached_tokens: D's prefix hit (never sent).
        chunk_finished: Whether this step computes the prompt's end.

    Returns:
        The tasks of every group (possibly none), the finished flag and the request's endpoints.

    Raises:
        ConfigError: Group counts differ.
        BlockIdError: A block list is shorter than the mapping needs.
    """
    if len(local_block_ids) != len(remote_block_ids):
        raise ConfigError("remote_block_ids", len(remote_block_ids), f"{len(local_block_ids)} groups (as on P)")
    heads = 1 if p.use_mla else num_heads
    pair = select_group_pair(
        get_cp_group(p.tp_size, heads, p.dcp_size),
        get_cp_group(d.tp_size, heads, d.dcp_size),
        req_idx=req_idx,
        head_group_rank=p.head_group_rank(tp_rank),
    )
    window = transfer_window(
        p,
        pcp_rank=pcp_rank,
        dcp_rank=p.dcp_rank(tp_rank),
        computed_tokens=computed_tokens,
        transed_tokens=transed_tokens,
        remote_cache_tokens=remote_cached_tokens,
        prompt_len=prompt_len,
        block_size=block_size,
        chunk_finished=chunk_finished,
    )
    if pair is None:
        return RequestPlan(transfer_id, (), window.chunk_finished, ())
    maps = get_local_remote_block_port_mappings(
        window.to_trans_idx,
        p,
        d,
        d_hosts=[d_host],
        d_base_port=d_base_port,
        selected_p_group=pair.p_group,
        selected_d_group=pair.d_group,
        prompt_len=prompt_len,
        block_size=block_size,
        remote_cache_tokens=remote_cached_tokens,
        num_heads=heads,
    )
    tasks: list[PushTask] = []
    for group, (local, remote) in enumerate(zip(local_block_ids, remote_block_ids, strict=True)):
        for t in get_transfer_mappings(
            maps,
            p,
            tp_rank=tp_rank,
            pcp_rank=pcp_rank,
            local_block_ids=local,
            remote_block_ids=remote,
            transed_idx=window.transed_idx,
            to_trans_idx=window.to_trans_idx,
        ):
            tasks.append(PushTask(transfer_id, group, t.endpoint, t.local_block_ids, t.remote_block_ids, t.trans_count))
    # Every endpoint that waits for this rank's Done, also in a step with no new blocks for it.
    mine = set(maps.head_mapping.get(p.head_group_rank(tp_rank), ()))
    targets = sorted({where.endpoint for (_, hg), where in maps.d_blocks.items() if hg in mine})
    done_to = tuple((ep, maps.trans_counts[ep]) for ep in targets)
    return RequestPlan(transfer_id, tuple(tasks), window.chunk_finished, done_to)


def a2a_member_index(tp_rank: int, p: ParallelInfo, num_heads: int) -> int:
    """This P rank's index ``j`` in its all-to-all group: ``(tp_rank // num_head_replica) mod ratio``."""
    replica = p.tp_size // num_heads if p.tp_size >= num_heads else 1
    return (tp_rank // replica) % p.pd_head_ratio


def a2a_groups(p_tp: int, num_heads: int, ratio: int) -> list[list[int]]:
    """P's all-to-all groups (TP ranks, each in member order), in the order every rank creates them.

    A group is the ``ratio`` ranks of one head replica whose heads together fill one D rank: with
    ``P_tp > H`` each head lives on ``P_tp / H`` consecutive ranks, so the members are strided by
    that count (``P_tp = 8, H = 4, ratio 2``: ``[0, 2], [1, 3], [4, 6], [5, 7]``); otherwise they are
    consecutive. Members of a group serve the same requests (the same replica window), so every one
    of them enters each exchange. Member ``j`` of a group has `a2a_member_index` ``j``.

    Raises:
        ConfigError: ``ratio`` does not divide the ranks of one replica.
    """
    replica = p_tp // num_heads if p_tp >= num_heads else 1
    per_replica = p_tp // replica
    if ratio < 1 or per_replica % ratio:
        raise ConfigError("pd_head_ratio", ratio, f"a divisor of P's {per_replica} ranks per head replica")
    return [
        [(g * ratio + j) * replica + i for j in range(ratio)]
        for g in range(per_replica // ratio)
        for i in range(replica)
    ]


def _check_same_len(local: TensorMeta, remote: TensorMeta, expected: int, name: str) -> None:
    if remote.block_len != expected:
        raise LayoutError(f"{name}.block_len", remote.block_len, f"{expected} bytes (D's block for P's slices)")
    if local.block_len > local.stride or remote.block_len > remote.stride:
        raise LayoutError(f"{name}.stride", (local.stride, remote.stride), "at least the block length")


Pieces = tuple[list[int], list[int], list[int]]
"""Parallel lists of one batch's pieces: local addresses, peer addresses, lengths (what the engine takes)."""


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(local start, remote start, count)`` of the runs where both id lists advance by exactly one.

    Example: local ``[1, 2, 5]``, remote ``[7, 8, 3]`` -> ``[(1, 7, 2), (5, 3, 1)]``.

    Raises:
        BlockIdError: The lists differ in length.
    """
    if len(local_ids) != len(remote_ids):
        raise BlockIdError("remote_ids", len(remote_ids), f"{len(local_ids)} ids (one per local id)")
    runs: list[tuple[int, int, int]] = []
    for lid, rid in zip(local_ids, remote_ids, strict=True):
        if runs and lid == runs[-1][0] + runs[-1][2] and rid == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lid, rid, 1))
    return runs


def plain_pieces(
    local: Sequence[TensorMeta], remote: Sequence[TensorMeta], runs: Sequence[tuple[int, int, int]]
) -> Pieces:
    """Whole-block writes of one layer (every tensor), each run one piece when both strides equal the block.

    This is the send thread's per-layer hot path: plain Python over precomputed `block_runs`.

    Raises:
        LayoutError: The layer has another tensor count or block length on D.
    """
    if len(local) != len(remote):
        raise LayoutError("layer tensors", len(remote), f"{len(local)} tensors on D (as on P)")
    lo: list[int] = []
    ro: list[int] = []
    ln: list[int] = []
    for i, (lt, rt) in enumerate(zip(local, remote, strict=True)):
        _check_same_len(lt, rt, lt.block_len, f"tensor[{i}]")
        merge = lt.stride == lt.block_len and rt.stride == rt.block_len
        for l0, r0, count in runs:
            if merge:
                lo.append(lt.base + l0 * lt.stride)
                ro.append(rt.base + r0 * rt.stride)
                ln.append(count * lt.block_len)
                continue
            for k in range(count):
                lo.append(lt.base + (l0 + k) * lt.stride)
                ro.append(rt.base + (r0 + k) * rt.stride)
                ln.append(lt.block_len)
    return lo, ro, ln


def resharded_pieces(
    staging: Sequence[int],
    local: Sequence[TensorMeta],
    remote: Sequence[TensorMeta],
    positions: Sequence[int],
    remote_ids: Sequence[int],
    *,
    member: int,
    ratio: int,
) -> Pieces:
    """Writes of one layer after the all-to-all (resharded path): one piece per block and tensor.

    Args:
        staging: Base address of each tensor's staging buffer (block ``i`` of the rearranged list
            at ``i · P_block_len``); empty: head-major blocks written from P's cache itself.
        local: P's tensors of the layer (for ``block_len``; with no staging also base and stride).
        remote: D's tensors of the layer.
        positions: Each block's index in the rearranged list (with no staging: P's block ids).
        remote_ids: D's block id for each position.
        member: This rank's index in its all-to-all group (``0 <= member < ratio``).
        ratio: ``pd_head_ratio``.

    Raises:
        LayoutError: D's block is not ``ratio`` times P's, or the tensor counts differ.
        ConfigError: ``member`` is outside ``[0, ratio)``.
    """
    if len(local) != len(remote) or (staging and len(staging) != len(local)):
        raise LayoutError("layer tensors", len(remote), f"{len(local)} tensors on D and staging buffers")
    if not 0 <= member < ratio:
        raise ConfigError("member", member, f"an index in [0, {ratio})")
    lo: list[int] = []
    ro: list[int] = []
    ln: list[int] = []
    for i, (lt, rt) in enumerate(zip(local, remote, strict=True)):
        _check_same_len(lt, rt, lt.block_len * ratio, f"tensor[{i}]")
        size = lt.block_len
        base, step = (staging[i], size) if staging else (lt.base, lt.stride)
        for pos, rid in zip(positions, remote_ids, strict=True):
            lo.append(base + pos * step)
            ro.append(rt.base + rid * rt.stride + member * size)
            ln.append(size)
    return lo, ro, ln


def as_descriptors(pieces: Pieces) -> Descriptors:
    """The pieces as validated `Descriptors` (tests, the bench's raw baseline)."""
    lo, ro, ln = pieces
    return Descriptors(np.asarray(lo, dtype=np.int64), np.asarray(ro, dtype=np.int64), np.asarray(ln, dtype=np.int64))


def rearranged_positions(union: Sequence[int], ids: Sequence[int]) -> list[int]:
    """Index of each id in the sorted union list (the staging order)."""
    arr = np.asarray(union, dtype=np.int64)
    pos = np.searchsorted(arr, np.asarray(ids, dtype=np.int64))
    return [int(x) for x in pos]
