"""Descriptors of a P -> D pull: the bytes of each head slice, for token-major and head-major blocks.

Runs in: D worker processes (the receiver's pool threads) and the ``pd`` bench. Pure numpy: no
I/O, no threads, no torch. The rank and head-slice choice is `ascend_dist.kv_mooncake.core.ranks`'s;
this module turns one P rank's slices into ``(local, remote, length)`` pieces over every tensor of
a task, per `PullMode`:

* WHOLE: whole blocks (runs merge), either block order;
* STACKED: P's block at ``pull * P_block_len`` of D's. Token-major (``[tokens][heads][c]``) the
  worker then reformats ``[pull][token][h]``; head-major (``[heads][tokens][c]``) that offset is
  ``dst_head * tokens * c``, already D's order;
* ROWS: token-major one piece per token row (``n_heads`` heads at ``src_head``); head-major one
  piece per block at ``src_head * tokens * c``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ascend_dist.common.errors import LayoutError
from ascend_dist.kv_mooncake.core.blocks import TensorGeom
from ascend_dist.kv_mooncake.core.descriptors import Descriptors, build_layer_descriptors
from ascend_dist.kv_mooncake.core.ranks import HeadSlice, PullMode, pull_mode

__all__ = ["build_pull_descriptors"]


def _arr(values: Sequence[int]) -> npt.NDArray[np.int64]:
    return np.asarray(values, dtype=np.int64)


def _check_pair(local: Sequence[TensorGeom], remote: Sequence[TensorGeom]) -> None:
    if len(local) != len(remote):
        raise LayoutError("tensors", len(remote), f"{len(local)} tensors per layer as on D")
    for i, (lg, rg) in enumerate(zip(local, remote, strict=True)):
        if lg.tokens != rg.tokens or lg.head_bytes != rg.head_bytes:
            raise LayoutError(
                f"tensor {i} geometry",
                (rg.tokens, rg.head_bytes),
                f"block tokens and head bytes as on D {(lg.tokens, lg.head_bytes)}",
            )
        if lg.head_major != rg.head_major and lg.heads > 1 and rg.heads > 1:  # one head: either order
            order = {True: "head-major", False: "token-major"}
            raise LayoutError(f"tensor {i} block order", order[rg.head_major], f"{order[lg.head_major]} as on D")


def build_pull_descriptors(
    local: Sequence[TensorGeom],
    remote: Sequence[TensorGeom],
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    *,
    slices: Sequence[HeadSlice],
    p_rank: int,
) -> Descriptors:
    """Descriptors pulling the blocks of one P rank into D's blocks, for many tensors at once.

    Args:
        local: D's tensors (all layers and parts pulled from this P rank).
        remote: The same tensors on P, in the same order.
        local_ids: D's block ids.
        remote_ids: P's block ids, one per local id.
        slices: The request's head slices for this D rank (all P ranks).
        p_rank: The P tp rank these descriptors read from.

    Returns:
        The batch (contiguous block runs merge into one descriptor in `PullMode.WHOLE`).

    Raises:
        LayoutError: The two sides' tensors do not match.
    """
    _check_pair(local, remote)
    if not local:
        return Descriptors.empty()
    mode = pull_mode(slices, remote[0].heads, local[0].heads)
    mine = [s for s in slices if s.p_rank == p_rank]
    if not mine:
        return Descriptors.empty()
    lstride, rstride = _arr([g.stride for g in local]), _arr([g.stride for g in remote])
    lbase, rbase = _arr([g.base for g in local]), _arr([g.base for g in remote])
    if mode is PullMode.WHOLE:
        return build_layer_descriptors(
            lbase,
            rbase,
            local_ids,
            remote_ids,
            block_len=_arr([g.block_len for g in local]),
            local_stride=lstride,
            remote_stride=rstride,
        )
    if mode is PullMode.STACKED:
        # P's whole block lands at its first head's offset: ``[pull][token][h]`` (token-major, the
        # worker reformats it afterwards) or, head-major, ``dst_head * tokens * head_bytes``, which
        # is already D's order.
        parts = []
        for s in mine:
            inner = _arr([g.block_len for g in remote])
            parts.append(
                build_layer_descriptors(
                    lbase,
                    rbase,
                    local_ids,
                    remote_ids,
                    block_len=inner,
                    local_stride=lstride,
                    remote_stride=rstride,
                    local_offset=inner * (s.dst_head // s.n_heads),
                )
            )
        return Descriptors.concat(parts)
    return _rows_descriptors(local, remote, local_ids, remote_ids, mine[0])


def _rows_descriptors(
    local: Sequence[TensorGeom],
    remote: Sequence[TensorGeom],
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    s: HeadSlice,
) -> Descriptors:
    """`PullMode.ROWS`: D's heads are a sub-slice of one P rank's.

    Token-major blocks give one piece per token row (``n_heads`` heads at ``src_head``); in a
    head-major block those heads of every token are one run, so one piece per block.
    """
    parts = []
    # P holds more heads than D here: its order decides (D's one head is the same bytes either way).
    head_major = [i for i, g in enumerate(remote) if g.head_major]
    token_major = [i for i, g in enumerate(remote) if not g.head_major]
    if head_major:
        lg = [local[i] for i in head_major]
        rg = [remote[i] for i in head_major]
        run = _arr([g.tokens * g.head_bytes for g in lg])  # one head, every token of the block
        parts.append(
            build_layer_descriptors(
                _arr([g.base for g in lg]),
                _arr([g.base for g in rg]) + s.src_head * run,
                local_ids,
                remote_ids,
                block_len=s.n_heads * run,
                local_stride=_arr([g.stride for g in lg]),
                remote_stride=_arr([g.stride for g in rg]),
            )
        )
    if token_major:
        lg = [local[i] for i in token_major]
        rg = [remote[i] for i in token_major]
        tokens = lg[0].tokens
        t = np.arange(tokens, dtype=np.int64)
        hb = _arr([g.head_bytes for g in lg])
        l_row = _arr([g.heads for g in lg]) * hb
        r_row = _arr([g.heads for g in rg]) * hb
        lbase, rbase = _arr([g.base for g in lg]), _arr([g.base for g in rg])
        lb = (lbase[:, None] + t[None, :] * l_row[:, None]).reshape(-1)
        rb = (rbase[:, None] + t[None, :] * r_row[:, None] + s.src_head * hb[:, None]).reshape(-1)
        parts.append(
            build_layer_descriptors(
                lb,
                rb,
                local_ids,
                remote_ids,
                block_len=np.repeat(s.n_heads * hb, tokens),
                local_stride=np.repeat(_arr([g.stride for g in lg]), tokens),
                remote_stride=np.repeat(_arr([g.stride for g in rg]), tokens),
            )
        )
    return Descriptors.concat(parts)
