"""Pure planning of the SFA remote-D2H connector: ports, ranks, block ranges, read descriptors.

Runs in: P and D workers. No I/O, no threads, no torch (numpy only). The rules:

* P rank p feeds D rank ``p // ratio`` as contributor ``p mod ratio`` (``ratio = P_tp / D_tp``).
* A chunk covers the request's blocks ``[start, end)``: ``start = max(D's cached tokens,
  transferred tokens) // block``, ``end = ceil(computed / block)`` when the chunk finishes the
  prompt, else ``floor`` (the partial last block is sent with the next chunk).
* The main MLA cache is replicated on every P rank and lands in D's host pool, shared by D's TP
  ranks: only contributor 0 reads it, and the D ranks split the chunk's blocks into disjoint
  ranges with `tp_block_range` (rotated by the chunk's first block so small chunks spread).
* The indexer cache lives in each D rank's device memory: each D rank reads the whole chunk; its
  ``ratio`` contributors split it with the same function.
* Descriptors adjacent on both sides are merged (`coalesce`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ascend_dist.common.errors import BlockIdError, ConfigError, LayoutError
from ascend_dist.kv_mooncake.core.descriptors import Descriptors

__all__ = [
    "DestLayer",
    "GroupIds",
    "ReadPlan",
    "chunk_block_range",
    "coalesce",
    "contributor_of",
    "d_endpoint_port",
    "infer_groups",
    "layer_index",
    "plan_request_reads",
    "tp_block_range",
]

_LAYER_RE = re.compile(r"layers\.(\d+)")
_I64 = npt.NDArray[np.int64]


def layer_index(name: str) -> int:
    """Transformer layer index of a vLLM layer name (``...layers.<i>...``).

    Raises:
        ConfigError: The name holds no ``layers.<i>`` part.
    """
    match = _LAYER_RE.search(name)
    if match is None:
        raise ConfigError("kv_caches layer name", name, "a name containing 'layers.<index>'")
    return int(match.group(1))


@dataclass(frozen=True)
class GroupIds:
    """Which vLLM KV-cache group holds the main cache and which the indexer cache."""

    main: int
    indexer: int


def infer_groups(groups: Sequence[Sequence[str]]) -> GroupIds:
    """Main group = first group with a layer name without "indexer"; indexer group = first with one.

    The indexer group falls back to the main group when no name contains "indexer" (uniform layouts).

    Raises:
        ConfigError: No group holds a main layer.
    """
    main = next((g for g, names in enumerate(groups) if any("indexer" not in n for n in names)), None)
    if main is None:
        raise ConfigError("kv_cache_groups", [list(g) for g in groups], "a group with a non-indexer layer")
    indexer = next((g for g, names in enumerate(groups) if any("indexer" in n for n in names)), main)
    return GroupIds(main, indexer)


def contributor_of(p_tp_rank: int, p_tp: int, d_tp: int) -> tuple[int, int, int]:
    """``(d_rank, group_member_idx, ratio)`` of P rank ``p_tp_rank``.

    Raises:
        ConfigError: ``P_tp < D_tp``, not divisible, or the rank is out of range.
    """
    if d_tp < 1 or p_tp < d_tp or p_tp % d_tp:
        raise ConfigError("prefill.tp_size", p_tp, f"a multiple of decode.tp_size={d_tp}")
    if not 0 <= p_tp_rank < p_tp:
        raise ConfigError("tp_rank", p_tp_rank, f"an int in [0, {p_tp})")
    ratio = p_tp // d_tp
    return p_tp_rank // ratio, p_tp_rank % ratio, ratio


def d_endpoint_port(remote_port: int, d_rank: int) -> int:
    """Port of D rank ``d_rank`` given D's advertised base; validated to ``[1, 65535]``.

    Raises:
        ConfigError: The port is out of range.
    """
    port = remote_port + d_rank
    if not 0 < port <= 65535:
        raise ConfigError("kv_transfer_params.remote_port", remote_port, f"a base with base + {d_rank} in [1, 65535]")
    return port


def tp_block_range(n: int, rank: int, size: int, start_block: int) -> tuple[int, int]:
    """``(first, count)`` of the ``n`` chunk blocks owned by ``rank`` of ``size``.

    The ranks' ranges are disjoint, contiguous and cover ``[0, n)``; the rotation by
    ``start_block`` lets consecutive small chunks land on different ranks.
    Example: ``n=5, size=2, start_block=3`` -> rank 0 ``(3, 2)``, rank 1 ``(0, 3)``.
    """
    if size < 1 or not 0 <= rank < size or n < 0:
        raise ConfigError("tp_block_range", (n, rank, size), "n >= 0 and 0 <= rank < size")
    logical = (rank - start_block % size) % size
    per, rem = divmod(n, size)
    return logical * per + min(logical, rem), per + (1 if logical < rem else 0)


def chunk_block_range(
    *,
    cached_tokens: int,
    transferred_tokens: int,
    computed_tokens: int,
    block_size: int,
    finished: bool,
    allocated: int,
) -> tuple[int, int]:
    """Blocks ``[start, end)`` of a request that this prefill chunk makes readable.

    Raises:
        BlockIdError: ``end`` lies beyond the ``allocated`` blocks.
    """
    start = max(cached_tokens, transferred_tokens) // block_size
    end = -(-computed_tokens // block_size) if finished else computed_tokens // block_size
    if end > allocated:
        raise BlockIdError("computed_tokens", computed_tokens, f"at most {allocated} blocks of {block_size} tokens")
    return start, max(start, end)


def coalesce(local: _I64, peer: _I64, lengths: _I64) -> Descriptors:
    """Merge descriptor i+1 into i while both sides continue exactly where i ends."""
    if local.size == 0:
        return Descriptors(local, peer, lengths)
    cont = (local[1:] == local[:-1] + lengths[:-1]) & (peer[1:] == peer[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return Descriptors(local[starts], peer[starts], np.add.reduceat(lengths, starts))


@dataclass(frozen=True)
class DestLayer:
    """D's destinations for one layer.

    Attributes:
        main_bases: Host-pool base address of each main tensor (valid on every D rank).
        main_block_bytes: Bytes per logical block of each main tensor (pool stride).
        indexer_bases: This D rank's indexer tensors (device memory), maybe empty.
        indexer_block_bytes: Bytes per logical block of each indexer tensor.
    """

    main_bases: tuple[int, ...]
    main_block_bytes: tuple[int, ...]
    indexer_bases: tuple[int, ...] = ()
    indexer_block_bytes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReadPlan:
    """What one D rank reads for one request of one layer."""

    main_blocks: int
    indexer_blocks: int
    descriptors: Descriptors


def _pairs(
    bases_p: Sequence[int], bases_d: Sequence[int], sizes: Sequence[int], p_ids: _I64, d_ids: _I64
) -> tuple[_I64, _I64, _I64]:
    """Tensor-major (local, peer, length) of every block pair for every tensor."""
    bp = np.asarray(bases_p, dtype=np.int64)[:, None]
    bd = np.asarray(bases_d, dtype=np.int64)[:, None]
    sz = np.asarray(sizes, dtype=np.int64)[:, None]
    local = (bd + d_ids[None, :] * sz).reshape(-1)
    peer = (bp + p_ids[None, :] * sz).reshape(-1)
    return local, peer, np.broadcast_to(sz, (len(sizes), p_ids.size)).reshape(-1).copy()


def _slice_ids(dest: Sequence[int], start: int, first: int, count: int, what: str) -> _I64:
    lo, hi = start + first, start + first + count
    if hi > len(dest):
        raise BlockIdError(
            f"{what} destination blocks", len(dest), f"at least {hi} (chunk block {start}+{first + count})"
        )
    return np.asarray(dest[lo:hi], dtype=np.int64)


def plan_request_reads(
    *,
    p_main: Sequence[tuple[int, int]],
    p_indexer: Sequence[tuple[int, int]],
    dest: DestLayer,
    p_main_ids: Sequence[int],
    p_indexer_ids: Sequence[int],
    main_start: int,
    indexer_start: int,
    d_main_ids: Sequence[int],
    d_indexer_ids: Sequence[int],
    d_tp_rank: int,
    d_tp: int,
    member: int,
    ratio: int,
) -> ReadPlan:
    """Descriptors (local = D, peer = P) one D rank reads for one request's chunk of one layer.

    Args:
        p_main: P's main tensors ``(base, block_bytes)``.
        p_indexer: P's indexer tensors ``(base, block_bytes)``.
        dest: D's destinations for the layer.
        p_main_ids: P's main block ids of the chunk (request blocks ``main_start ...``).
        p_indexer_ids: P's indexer block ids of the chunk (request blocks ``indexer_start ...``).
        main_start: Request block number of ``p_main_ids[0]``.
        indexer_start: Request block number of ``p_indexer_ids[0]``.
        d_main_ids: D's main block ids of the whole request (host-pool blocks).
        d_indexer_ids: D's indexer block ids of the whole request.
        d_tp_rank: This D rank.
        d_tp: D's TP size.
        member: Contributor index of the sending P rank (0 reads main).
        ratio: Contributors per D rank (``P_tp / D_tp``).

    Raises:
        LayoutError: Block sizes or indexer presence differ between P and D.
        BlockIdError: D holds fewer destination blocks than the chunk needs.
    """
    p_main_bytes = tuple(b for _, b in p_main)
    if p_main_bytes != dest.main_block_bytes:
        raise LayoutError("main block bytes", p_main_bytes, f"D's host-pool block bytes {dest.main_block_bytes}")
    if bool(p_indexer) != bool(dest.indexer_bases):
        raise LayoutError("indexer", len(p_indexer), f"{len(dest.indexer_bases)} indexer tensors, as on D")
    p_idx_bytes = tuple(b for _, b in p_indexer)
    if p_idx_bytes != dest.indexer_block_bytes:
        raise LayoutError("indexer block bytes", p_idx_bytes, f"D's {dest.indexer_block_bytes}")
    parts: list[tuple[_I64, _I64, _I64]] = []
    main_count = idx_count = 0
    if member == 0 and p_main_ids:
        first, main_count = tp_block_range(len(p_main_ids), d_tp_rank, d_tp, main_start)
        p_ids = np.asarray(p_main_ids[first : first + main_count], dtype=np.int64)
        d_ids = _slice_ids(d_main_ids, main_start, first, main_count, "main")
        parts.append(_pairs([b for b, _ in p_main], dest.main_bases, p_main_bytes, p_ids, d_ids))
    if p_indexer and p_indexer_ids:
        n = len(p_indexer_ids)
        first, idx_count = tp_block_range(n, member, ratio, indexer_start) if ratio > 1 else (0, n)
        p_ids = np.asarray(p_indexer_ids[first : first + idx_count], dtype=np.int64)
        d_ids = _slice_ids(d_indexer_ids, indexer_start, first, idx_count, "indexer")
        parts.append(_pairs([b for b, _ in p_indexer], dest.indexer_bases, p_idx_bytes, p_ids, d_ids))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return ReadPlan(0, 0, Descriptors(empty, empty, empty))
    local, peer, lengths = (np.concatenate(col) for col in zip(*parts, strict=True))
    return ReadPlan(main_count, idx_count, coalesce(local, peer, lengths))
