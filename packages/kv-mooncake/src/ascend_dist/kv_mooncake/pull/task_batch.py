"""Descriptors of one pull task: every KV group's blocks a D rank reads from one P rank.

Runs in: D worker processes (the receiver's pool threads). Pure: no I/O, no threads, no torch.

A task reads from one P worker (one tp rank of one PP stage, or one P CP rank with CP). Per
KV-cache group of D's cache:

* **attention** groups (full or sliding window): the head slices of `ascend_dist.kv_mooncake.core.ranks`
  for the paired blocks (`block_pairs.pair_group_blocks`, or the CP shard's ids);
* **state** groups (Mamba/GDN/linear attention): one state block per layer, read
  from the P ranks of `sources.state_source_ranks`; whole tensors when ``P_tp == D_tp``, the
  conv Q/K/V interleave and the stacked ssm slice (`state_bytes.state_descriptors`) when
  ``P_tp > D_tp``.

Only the layers P's metadata lists are read (a PP stage serves its own layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dist.common.errors import ConfigError, LayoutError, ProtocolError
from ascend_dist.kv_mooncake.core.blocks import TensorGeom
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.messages import AgentMetadata, TensorMeta
from ascend_dist.kv_mooncake.core.ranks import HeadSlice
from ascend_dist.kv_mooncake.pull.block_pairs import pair_group_blocks
from ascend_dist.kv_mooncake.pull.cp_plan import CpShard
from ascend_dist.kv_mooncake.pull.slice_bytes import build_pull_descriptors
from ascend_dist.kv_mooncake.pull.sources import state_source_ranks
from ascend_dist.kv_mooncake.pull.state_bytes import StateGeom, StateLayout, state_descriptors
from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta

__all__ = ["LocalCache", "TaskBatch", "check_peer_rank", "group_pairs", "task_batch"]


@dataclass(frozen=True)
class LocalCache:
    """D's registered cache as the receiver needs it.

    Attributes:
        layers: Layer name -> its tensors' geometry (a state tensor: one "token" of one "head"
            of ``block_len`` bytes).
        groups: Per KV-cache group, its layer names.
        block_size: Tokens per logical block (of the attention groups).
        heads: Total KV heads of the model (1 for MLA).
        state_groups: Indices of the state (Mamba) groups.
        state_layout: Conv sub-projection sizes per P rank (needed only when ``P_tp > D_tp``).
    """

    layers: dict[str, list[TensorGeom]]
    groups: list[list[str]]
    block_size: int
    heads: int
    state_groups: frozenset[int] = frozenset()
    state_layout: StateLayout | None = None

    @property
    def attention_groups(self) -> list[int]:
        """Indices of the attention (non-state) groups."""
        return [g for g in range(len(self.groups)) if g not in self.state_groups]

    def kernel_tokens(self, group: int) -> int:
        """Tokens of one kernel block of an attention group (``block_size`` without kernel scaling)."""
        for name in self.groups[group]:
            geoms = self.layers.get(name)
            if geoms:
                return geoms[0].tokens
        return self.block_size

    @property
    def has_state(self) -> bool:
        """Whether the model has a state group (a hybrid or pure-state model)."""
        return bool(self.state_groups)


@dataclass(frozen=True)
class TaskBatch:
    """What one task reads: its descriptors and the layers they cover."""

    descriptors: Descriptors
    layers: list[str]


def check_peer_rank(agent: AgentMetadata, *, port: int, pp_rank: int, tp_rank: int) -> None:
    """PP-aware handshake: the P worker answering at ``port`` must be the (pp, tp) rank D planned for.

    A P whose ports or PP partition differ from what D derived would otherwise serve the wrong
    layers or heads.

    Raises:
        ProtocolError: The worker reports another rank.
    """
    if (agent.pp_rank, agent.tp_rank) != (pp_rank, tp_rank):
        raise ProtocolError(
            f"P worker at port {port} is pp_rank={agent.pp_rank} tp_rank={agent.tp_rank}; "
            f"D expected pp_rank={pp_rank} tp_rank={tp_rank} (prefill tp/pp sizes or kv_port differ)"
        )


def _geom(t: TensorMeta) -> TensorGeom:
    return TensorGeom(t.base, t.block_len, t.stride, t.tokens, t.heads, t.head_bytes, t.head_major)


def _check_ids(remote_ids: Sequence[int], agent: AgentMetadata, scale: int = 1) -> None:
    if remote_ids and max(remote_ids) >= agent.num_blocks * scale:
        raise ProtocolError(f"remote block id {max(remote_ids)} >= P's {agent.num_blocks * scale} blocks")


def _sub_blocks(geom: TensorGeom, r: int) -> TensorGeom:
    """D's block as ``r`` sub-blocks of P's size (CP with ``Bd = r * Bp``).

    Sub-block ``x`` is tokens ``(x % r) * Bp ..`` of block ``x // r``: linear in ``x`` only for
    dense token-major blocks (in a head-major block of several heads a token range is one run per
    head).

    Raises:
        LayoutError: D's blocks are head-major with several heads, not dense (stride != block
            length) or not divisible by ``r``.
    """
    if geom.head_major and geom.heads > 1:
        raise LayoutError(
            "D block order", "head-major", f"token-major to read D's blocks as {r} P-sized sub-blocks (CP)"
        )
    if geom.stride != geom.block_len or geom.tokens % r:
        raise LayoutError("D block stride", geom.stride, f"= block_len ({geom.block_len}) to split blocks by {r}")
    sub = geom.block_len // r
    return TensorGeom(geom.base, sub, sub, geom.tokens // r, geom.heads, geom.head_bytes)


def _expand(ids: Sequence[int], scale: int) -> list[int]:
    return [b * scale + j for b in ids for j in range(scale)]


def _scales(cache: LocalCache, meta: ReqMeta, group: int) -> tuple[int, int, int]:
    kernel = cache.kernel_tokens(group)
    remote_bs = meta.remote_block_size or cache.block_size
    if remote_bs % kernel:
        raise ConfigError("remote_block_size", remote_bs, f"a multiple of D's kernel block ({kernel} tokens)")
    return kernel, cache.block_size // kernel, remote_bs // kernel


def group_pairs(cache: LocalCache, meta: ReqMeta, group: int) -> tuple[list[int], list[int]]:
    """D's and P's ids of one group in **kernel-block** units (rows of the registered tensors).

    Without kernel scaling and with equal block sizes these are the logical ids of
    `block_pairs.pair_group_blocks`. Otherwise a full-attention group expands logical block
    ``b`` into kernels ``b*s .. b*s+s-1`` on each side (its own ``s``), skips the
    ``num_computed_tokens // kernel`` kernels D already has and truncates to the shorter list; a
    sliding-window group (equal block sizes) pairs logical tails, then expands. A state group
    keeps its one logical block.

    Example: block 16, kernel 8 (scale 2), local ``[1, 2]``, remote ``[3, 4]``, 8 computed tokens ->
    local ``[2, 3, 4]``, remote ``[7, 8, 9]``.

    Raises:
        ConfigError: P's block size is not a multiple of D's kernel block.
    """
    if group in cache.state_groups:
        return pair_group_blocks(meta, group, cache.block_size)
    kernel, local_scale, remote_scale = _scales(cache, meta, group)
    if local_scale == remote_scale == 1:
        return pair_group_blocks(meta, group, cache.block_size)
    if group < len(meta.window_blocks) and meta.window_blocks[group]:
        local, remote = pair_group_blocks(meta, group, cache.block_size)
        return _expand(local, local_scale), _expand(remote, remote_scale)
    local = _expand(meta.local_block_ids[group], local_scale)
    remote = _expand(meta.remote_block_ids[group], remote_scale)[meta.num_computed_tokens // kernel :]
    n = min(len(local), len(remote))
    return local[:n], remote[:n]


def _state_layer(
    local: Sequence[TensorGeom],
    remote: Sequence[TensorMeta],
    local_id: int,
    remote_id: int,
    *,
    ratio: int,
    offset: int,
    layout: StateLayout | None,
) -> Descriptors:
    if len(local) != len(remote):
        raise LayoutError("state tensors", len(remote), f"{len(local)} tensors per state layer as on D")
    if ratio == 1:
        for i, (lg, rg) in enumerate(zip(local, remote, strict=True)):
            if lg.block_len != rg.block_len:
                raise LayoutError(f"state tensor {i} block_len", rg.block_len, f"{lg.block_len} as on D")
        return Descriptors(
            np.array([g.base + local_id * g.stride for g in local], dtype=np.int64),
            np.array([t.base + remote_id * t.stride for t in remote], dtype=np.int64),
            np.array([g.block_len for g in local], dtype=np.int64),
        )
    if len(local) != 2:
        raise LayoutError("state tensors", len(local), "2 (conv, ssm) to split a state over P_tp > D_tp")
    if layout is None:
        raise ConfigError(
            "state_layout", None, "the conv sub-projection sizes per P rank when prefill.tp_size > decode.tp_size"
        )
    (lc, ls), (rc, rs) = local, remote
    return state_descriptors(
        StateGeom(lc.base, lc.stride, lc.block_len, ls.base, ls.stride, ls.block_len),
        StateGeom(rc.base, rc.stride, rc.block_len, rs.base, rs.stride, rs.block_len),
        local_id,
        remote_id,
        ratio=ratio,
        offset=offset,
        conv_rows=layout.conv_rows(rc.block_len),
        elt=layout.elt,
        segments=layout.segments,
    )


def task_batch(
    cache: LocalCache,
    agent: AgentMetadata,
    meta: ReqMeta,
    *,
    p_rank: int,
    d_rank: int,
    d_tp: int,
    slices: Sequence[HeadSlice],
    shards: Sequence[CpShard | None] | None = None,
    state_only: bool = False,
) -> TaskBatch:
    """Descriptors reading every group's blocks of ``meta`` from P tp rank ``p_rank``.

    Args:
        cache: D's cache.
        agent: The P worker's metadata.
        meta: The request.
        p_rank: The P tp rank read (within its PP stage or CP rank).
        d_rank: This D rank's tp rank.
        d_tp: D's tp size.
        slices: The request's attention head slices of this D rank.
        shards: With CP: this task's shard of each attention group (indexed by group; None for a
            state group), else None. A CP shard task reads no state group.
        state_only: Read only the state groups (the CP path's state tasks).

    Raises:
        ProtocolError: P's block ids exceed its cache.
        LayoutError: The two sides' tensors do not match.
        ConfigError: A state split needs `StateLayout` and none was given.
    """
    p_tp = meta.remote_ptp_size
    state_ranks = state_source_ranks(d_rank, p_tp, d_tp) if cache.has_state else []
    batches: list[Descriptors] = []
    layers: list[str] = []
    for g, names in enumerate(cache.groups):
        here = [n for n in names if n in agent.layers]
        if g in cache.state_groups:
            if p_rank not in state_ranks or shards is not None:
                continue
            local_ids, remote_ids = pair_group_blocks(meta, g, cache.block_size)
            if not local_ids:
                continue
            _check_ids(remote_ids, agent)
            for n in here:
                batches.append(
                    _state_layer(
                        cache.layers[n],
                        agent.layers[n],
                        local_ids[0],
                        remote_ids[0],
                        ratio=p_tp // d_tp,
                        offset=state_ranks.index(p_rank),
                        layout=cache.state_layout,
                    )
                )
            layers.extend(here)
            continue
        if state_only:
            continue
        if shards is None:
            local_ids, remote_ids = group_pairs(cache, meta, g)
            group_slices = list(slices)
            scale = _scales(cache, meta, g)[2]
        else:
            shard = shards[g]
            if shard is None:
                continue
            local_ids, remote_ids, group_slices = list(shard.local_ids), list(shard.remote_ids), list(shard.slices)
            scale = 1
        _check_ids(remote_ids, agent, scale)
        local = [geom for n in here for geom in cache.layers[n]]
        if shards is not None and meta.remote_block_size and meta.remote_block_size < cache.block_size:
            local = [_sub_blocks(geom, cache.block_size // meta.remote_block_size) for geom in local]
        remote = [_geom(t) for n in here for t in agent.layers[n]]
        batches.append(build_pull_descriptors(local, remote, local_ids, remote_ids, slices=group_slices, p_rank=p_rank))
        layers.extend(here)
    return TaskBatch(Descriptors.concat(batches) if batches else Descriptors.empty(), layers)
