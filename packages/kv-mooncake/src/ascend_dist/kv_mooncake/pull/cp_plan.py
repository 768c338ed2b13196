"""Pure block-id planning of a pull with context parallelism (PCP/DCP on P and/or D).

Runs in: D worker processes (and tests). No I/O, no threads, no torch.

With CP a prompt's blocks are interleaved over the CP ranks of each side: P global block ``g``
(in P block units) lives on P CP rank ``g mod Rcp`` (``Rcp = P.pcp * P.dcp``) at position
``g div Rcp`` of P's request block list, which every P CP rank shares; the same holds on D with
``Lcp = D.pcp * D.dcp`` and D's block size. `plan_cp_pull` answers, for one D rank, **which P
ranks hold which of its blocks**: one `CpShard` per P CP rank it reads, each with the P world
ranks (one per P head group feeding D's heads) and the paired (D, P) block ids.

Head groups and replicas come from `ascend_dist.kv_mooncake.core.mappings.get_cp_group` (a CP group there is
one replica of all heads, listed as head-group ranks ``tp_rank // dcp``); the layouts are checked
by `context_parallel_parameters_check`. Replica pairing is deterministic (D replica ``i`` reads P
replica ``i mod #P replicas``), not the PRNG of the non-CP path, so P can compute its fan-in.

D block size ``Bd`` may be ``r_blk`` times P's ``Bp``; D's ids are then returned in **P-block
units** ("sub-blocks": D block ``b`` holds sub-blocks ``b*r_blk .. b*r_blk + r_blk - 1``, the
first ``Bp`` tokens, the next ``Bp`` ...), which is contiguous memory in the
``[blocks, tokens, heads, dim]`` layout. ``Bp > Bd`` is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.mappings import ParallelInfo, context_parallel_parameters_check, get_cp_group
from ascend_dist.kv_mooncake.core.ranks import HeadSlice, head_range
from ascend_dist.kv_mooncake.pull.config import PullConfig

__all__ = ["CpShard", "cp_block_counts", "cp_layouts", "cp_p_fan_in", "cp_sources", "plan_cp_pull"]


@dataclass(frozen=True)
class CpShard:
    """What one D rank reads from one P CP rank.

    Attributes:
        p_cp_rank: The P CP rank ``q`` (``pcp_rank * dcp + dcp_rank``).
        p_world_ranks: P ranks (``pcp_rank * P_tp + tp_rank``) read, one per head slice, in
            ``slices`` order; the side-channel port is ``remote_port + world rank`` (PP stage 0).
        slices: Head slices (``p_rank`` = P tp rank), covering D's heads exactly once.
        local_ids: D's ids (sub-block units when ``Bd > Bp``), one per remote id.
        remote_ids: P's block ids (entries of P's shared request list).
        carries_tail: This shard holds the prompt's final block (it is planned last).
    """

    p_cp_rank: int
    p_world_ranks: tuple[int, ...]
    slices: tuple[HeadSlice, ...]
    local_ids: tuple[int, ...]
    remote_ids: tuple[int, ...]
    carries_tail: bool


def cp_layouts(config: PullConfig, use_mla: bool) -> tuple[ParallelInfo, ParallelInfo]:
    """P's and D's layouts from the connector configuration."""
    p, d = config.prefill, config.decode
    return (
        ParallelInfo(p.tp_size, p.pcp_size, p.dcp_size, use_mla=use_mla),
        ParallelInfo(d.tp_size, d.pcp_size, d.dcp_size, use_mla=use_mla),
    )


def _replica_of(groups: Sequence[Sequence[int]], head_group_rank: int) -> int:
    for i, g in enumerate(groups):
        if head_group_rank in g:
            return i
    raise ConfigError("head_group_rank", head_group_rank, f"a member of the CP groups {groups}")


def cp_sources(d_tp_rank: int, p: ParallelInfo, d: ParallelInfo, heads: int) -> list[HeadSlice]:
    """Which P tp ranks (within one P CP rank's dcp slot ``0``) feed D rank ``d_tp_rank``'s heads.

    The returned ``p_rank`` is the P tp rank with DCP rank 0; add the P DCP rank for other CP ranks.

    Raises:
        ConfigError: D holds fewer heads per rank than P (P_tp < D_tp in heads is not supported
            with CP), or the sizes are incompatible.
    """
    h = 1 if p.use_mla else heads
    p_groups = get_cp_group(p.tp_size, h, p.dcp_size)
    d_groups = get_cp_group(d.tp_size, h, d.dcp_size)
    d_first, d_count = head_range(d_tp_rank, d.tp_size, h)
    _, p_count = head_range(0, p.tp_size, h)
    if d_count % p_count:
        raise ConfigError(
            "decode.tp_size", d.tp_size, f"<= prefill tp in heads with CP (D heads/rank {d_count}, P {p_count})"
        )
    p_group = p_groups[_replica_of(d_groups, d.head_group_rank(d_tp_rank)) % len(p_groups)]
    slices = []
    for hg in p_group:
        tp_rank = hg * p.dcp_size
        first, count = head_range(tp_rank, p.tp_size, h)
        if d_first <= first and first + count <= d_first + d_count:
            slices.append(HeadSlice(tp_rank, 0, first - d_first, count))
    return sorted(slices, key=lambda s: s.dst_head)


def cp_block_counts(num_prompt_blocks: int, num_present_blocks: int, rcp: int) -> tuple[list[int], int]:
    """Blocks still to pull per P CP rank, and the CP rank holding the final block.

    Args:
        num_prompt_blocks: Prompt blocks in P units.
        num_present_blocks: Leading prompt blocks D already has (``P0``).
        rcp: P's CP size.
    """
    base, rem = divmod(num_prompt_blocks, rcp)
    counts = [base + (q < rem) for q in range(rcp)]
    skip, extra = divmod(num_present_blocks, rcp)
    counts = [max(0, c - skip - (q < extra)) for q, c in enumerate(counts)]
    return counts, (rem + rcp - 1) % rcp


def _block_ratio(p: ParallelInfo, d: ParallelInfo, p_block: int, d_block: int) -> int:
    if p_block <= 0 or d_block <= 0:
        raise ConfigError("block_size", (p_block, d_block), "positive ints")
    if d_block % p_block:
        raise ConfigError("remote_block_size", p_block, f"a divisor of D's block size {d_block} with CP")
    r_blk = d_block // p_block
    if (p.cp_size // d.cp_size) % r_blk:
        raise ConfigError("remote_block_size", p_block, f"with (P cp / D cp) a multiple of Bd/Bp = {r_blk}")
    return r_blk


def plan_cp_pull(
    *,
    p: ParallelInfo,
    d: ParallelInfo,
    heads: int,
    d_tp_rank: int,
    d_pcp_rank: int = 0,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    prompt_len: int,
    num_external_tokens: int,
    p_block_size: int,
    d_block_size: int,
) -> list[CpShard]:
    """Plan one D rank's pull when either side uses context parallelism.

    Args:
        p: P's layout (``pd_head_ratio`` ignored).
        d: D's layout.
        heads: Total KV heads (ignored for MLA).
        d_tp_rank: This D rank's tp rank (its DCP rank is ``tp_rank % D.dcp``).
        d_pcp_rank: This D rank's PCP rank.
        remote_block_ids: P's request block list (shared by all P CP ranks).
        local_block_ids: D's new blocks on this D CP rank (from D's prefix hit on).
        prompt_len: Prompt tokens.
        num_external_tokens: Tokens to pull (prompt minus D's prefix hit).
        p_block_size: ``Bp``.
        d_block_size: ``Bd`` (a multiple of ``Bp``).

    Returns:
        Shards in pull order; the one carrying the final block, if any, is last. Shards with no
        blocks are kept (the task still sends DONE so P frees).

    Raises:
        ConfigError: An incompatible layout, block size or rank.
    """
    context_parallel_parameters_check(p, d, heads)
    if not 0 <= d_tp_rank < d.tp_size:
        raise ConfigError("tp_rank", d_tp_rank, f"an int in [0, {d.tp_size})")
    if not 0 <= d_pcp_rank < d.pcp_size:
        raise ConfigError("pcp_rank", d_pcp_rank, f"an int in [0, {d.pcp_size})")
    if not 0 <= num_external_tokens <= prompt_len:
        raise ConfigError("num_external_tokens", num_external_tokens, f"an int in [0, {prompt_len}]")
    r_blk = _block_ratio(p, d, p_block_size, d_block_size)
    rcp, lcp = p.cp_size, d.cp_size
    local_cp = d.cp_index(d_pcp_rank, d.dcp_rank(d_tp_rank))
    nb = math.ceil(prompt_len / p_block_size)
    p0 = nb - math.ceil(num_external_tokens / p_block_size)
    counts, last_q = cp_block_counts(nb, p0, rcp)
    mine = [q for q in range(rcp) if (q // r_blk) % lcp == local_cp]
    if last_q in mine:
        mine.remove(last_q)
        mine.append(last_q)
    base_slices = cp_sources(d_tp_rank, p, d, heads)
    first_d = p0 // r_blk + ((local_cp - p0 // r_blk) % lcp)
    shards = []
    for q in mine:
        pcp_q, dcp_q = divmod(q, p.dcp_size)
        slices = tuple(HeadSlice(s.p_rank + dcp_q, s.src_head, s.dst_head, s.n_heads) for s in base_slices)
        remote_first = -((q - p0) // rcp)  # ceil((p0 - q) / rcp)
        n = counts[q]
        local: list[int] = []
        remote: list[int] = []
        for i in range(n):
            if remote_first + i >= len(remote_block_ids):
                break
            g = (remote_first + i) * rcp + q
            idx = (g // r_blk - first_d) // lcp
            if idx >= len(local_block_ids):
                break
            local.append(local_block_ids[idx] * r_blk + g % r_blk)
            remote.append(remote_block_ids[remote_first + i])
        shards.append(
            CpShard(
                p_cp_rank=q,
                p_world_ranks=tuple(pcp_q * p.tp_size + s.p_rank for s in slices),
                slices=slices,
                local_ids=tuple(local),
                remote_ids=tuple(remote),
                carries_tail=q == last_q,
            )
        )
    return shards


def cp_p_fan_in(p_world_rank: int, *, p: ParallelInfo, d: ParallelInfo, heads: int, block_ratio: int = 1) -> int:
    """How many D ranks read from P world rank ``p_world_rank`` (0: P frees at once).

    Independent of the request (the CP pairing has no random choice), so P can count DONEs. Every
    D rank sends one DONE per P rank of each of its shards, also for a shard with no blocks.

    Args:
        p_world_rank: ``pcp_rank * P_tp + tp_rank``.
        p: P's layout.
        d: D's layout.
        heads: Total KV heads (ignored for MLA).
        block_ratio: ``Bd / Bp``.
    """
    pcp_q, tp_rank = divmod(p_world_rank, p.tp_size)
    q = p.cp_index(pcp_q, p.dcp_rank(tp_rank))
    total = 0
    for d_pcp in range(d.pcp_size):
        for d_tp in range(d.tp_size):
            if (q // block_ratio) % d.cp_size != d.cp_index(d_pcp, d.dcp_rank(d_tp)):
                continue
            if any(s.p_rank + p.dcp_rank(tp_rank) == tp_rank for s in cp_sources(d_tp, p, d, heads)):
                total += 1
    return total
