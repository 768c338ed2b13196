"""Pure planning for non-full-attention KV groups: sliding-window tails and state (Mamba/GDN) groups.

Runs in: D worker processes (and tests). No I/O, no threads, no torch.

* `pair_swa_blocks`: P sends only the last ``window_blocks`` non-null blocks of a
  sliding-window group (`ascend_dist.kv_mooncake.core.plan.trim_block_ids`), so skipping P's blocks
  from the *head* by D's prefix hit (the full-attention rule) misaligns them. D clips its own list
  to the prompt and the same window, drops vLLM's null block 0, and pairs the two lists by their
  **tails** (both end at the prompt's final block).
* `state_descriptors`: a state group holds one block per request (conv and ssm
  tensors per layer); with ``ratio = P_tp / D_tp > 1`` D's conv row interleaves the Q, K and V
  sub-projections of ``ratio`` P ranks, and its ssm state stacks them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dist.common.descriptors import Descriptors
from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.kv_mooncake.core.plan import plan_block_pairs, select_sources
from ascend_dist.kv_mooncake.pull.scheduler import ReqMeta

__all__ = [
    "StateGeom",
    "StateLayout",
    "pair_group_blocks",
    "pair_swa_blocks",
    "pull_source_ranks",
    "source_fan_in",
    "state_block_pair",
    "state_descriptors",
    "state_source_ranks",
    "tp_num_need_pulls",
]

NULL_BLOCK = 0
"""vLLM's placeholder block id for positions outside a sliding window."""


def pair_swa_blocks(
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    *,
    num_computed_tokens: int,
    prompt_len: int,
    block_size: int,
    window_blocks: int,
) -> tuple[list[int], list[int]]:
    """Pair D's and P's blocks of a sliding-window group by their tails.

    Args:
        local_ids: D's new blocks of the group, from its prefix hit on (may hold null blocks and
            lookahead blocks past the prompt).
        remote_ids: P's trimmed list (the last ``window_blocks`` non-null prompt blocks).
        num_computed_tokens: D's prefix hit in tokens.
        prompt_len: Prompt tokens (0: unknown, no prompt clip on D).
        block_size: Tokens per block.
        window_blocks: ``ceil(window / block) + 1``.

    Returns:
        ``(local, remote)`` of equal length; the last entries of both are the prompt's last block.

    Example:
        Prompt 80 tokens (blocks 0..4), block 16, window 3: P sends ``[42, 43, 44]`` (blocks 2..4).
        D has a prefix hit of 32 tokens and new blocks ``[20, 21, 22]`` (blocks 2..4) ->
        ``([20, 21, 22], [42, 43, 44])``; the head-skip rule would pair block 20 with P's 44.
    """
    if block_size <= 0:
        raise ConfigError("block_size", block_size, "a positive int")
    if window_blocks <= 0:
        raise ConfigError("window_blocks", window_blocks, "a positive int for a sliding-window group")
    if num_computed_tokens < 0:
        raise ConfigError("num_computed_tokens", num_computed_tokens, "an int >= 0")
    local = list(local_ids)
    if prompt_len > 0:
        local = local[: max(0, math.ceil(prompt_len / block_size) - num_computed_tokens // block_size)]
    local = [b for b in local[-window_blocks:] if b != NULL_BLOCK]
    remote = [b for b in remote_ids if b != NULL_BLOCK]
    n = min(len(local), len(remote))
    return (local[len(local) - n :], remote[len(remote) - n :]) if n else ([], [])


def pair_group_blocks(meta: ReqMeta, group: int, block_size: int) -> tuple[list[int], list[int]]:
    """D's and P's block ids of one KV group.

    A state group pairs its one state block (`state_block_pair`), a sliding-window group is
    tail-aligned (`pair_swa_blocks`), a full-attention group skips D's prefix hit.
    """
    window = meta.window_blocks[group] if group < len(meta.window_blocks) else 0
    local, remote = meta.local_block_ids[group], meta.remote_block_ids[group]
    if group in meta.state_groups:
        pair = state_block_pair(local, remote, meta.num_speculative_tokens)
        return ([pair[0]], [pair[1]]) if pair else ([], [])
    if window > 0:
        return pair_swa_blocks(
            local,
            remote,
            num_computed_tokens=meta.num_computed_tokens,
            prompt_len=meta.prompt_len,
            block_size=block_size,
            window_blocks=window,
        )
    return plan_block_pairs(local, remote, meta.num_computed_tokens, block_size)


def state_block_pair(
    local_ids: Sequence[int], remote_ids: Sequence[int], num_speculative_tokens: int = 0
) -> tuple[int, int] | None:
    """The one (local, remote) block of a state group, or None if empty.

    Remote index ``len(remote) - num_speculative_tokens - 1``, local ``local_ids[0]`` (D may
    allocate a different number of blocks; never force equal counts). vLLM's null block 0 (the
    padding of a Mamba group's row) is never a destination.
    """
    local_ids = [b for b in local_ids if b != NULL_BLOCK]
    if not local_ids or not remote_ids:
        return None
    idx = len(remote_ids) - num_speculative_tokens - 1
    if idx < 0:
        raise ConfigError("num_speculative_tokens", num_speculative_tokens, f"< {len(remote_ids)} (P's state blocks)")
    return local_ids[0], remote_ids[idx]


@dataclass(frozen=True)
class StateGeom:
    """One side's state tensors of one layer: conv ``[rows, width]`` and ssm, per block.

    Attributes:
        conv_base: Address of the conv tensor's block 0.
        conv_stride: Bytes between blocks of the conv tensor.
        conv_len: Bytes of one block's conv state (``rows * width * elt``).
        ssm_base: Address of the ssm tensor's block 0.
        ssm_stride: Bytes between blocks of the ssm tensor.
        ssm_len: Bytes of one block's ssm state.
    """

    conv_base: int
    conv_stride: int
    conv_len: int
    ssm_base: int
    ssm_stride: int
    ssm_len: int


def state_descriptors(
    local: StateGeom,
    remote: StateGeom,
    local_id: int,
    remote_id: int,
    *,
    ratio: int = 1,
    offset: int = 0,
    conv_rows: int = 0,
    key_size: int = 0,
    value_size: int = 0,
    elt: int = 0,
    segments: Sequence[int] = (),
) -> Descriptors:
    """Descriptors pulling one layer's state block from one P rank.

    Args:
        local: D's tensors.
        remote: P's tensors.
        local_id: D's state block.
        remote_id: P's state block.
        ratio: ``P_tp / D_tp`` (pulls per D rank).
        offset: This P rank's index among the ``ratio`` (``remote_tp_offset``).
        conv_rows: Rows of the conv state (ratio > 1 only).
        key_size: ``sK = (nk / P_tp) * dk`` elements (ratio > 1 only).
        value_size: ``sV = (nv / P_tp) * dv`` elements (ratio > 1 only).
        elt: Bytes per element (ratio > 1 only).
        segments: The conv row's sub-projection sizes per P rank (default GDN's
            ``(key_size, key_size, value_size)``).

    Raises:
        LayoutError: The sizes do not match the tensors.
        ConfigError: ``ratio`` or ``offset`` out of range.
    """
    if ratio < 1:
        raise ConfigError("ratio", ratio, "an int >= 1 (P_tp a multiple of D_tp)")
    if not 0 <= offset < ratio:
        raise ConfigError("remote_tp_offset", offset, f"an int in [0, {ratio})")
    lc = local.conv_base + local_id * local.conv_stride
    rc = remote.conv_base + remote_id * remote.conv_stride
    ls = local.ssm_base + local_id * local.ssm_stride
    rs = remote.ssm_base + remote_id * remote.ssm_stride
    if ratio == 1:
        if (local.conv_len, local.ssm_len) != (remote.conv_len, remote.ssm_len):
            raise LayoutError("state lengths", (remote.conv_len, remote.ssm_len), f"{(local.conv_len, local.ssm_len)}")
        return Descriptors(np.array([lc, ls]), np.array([rc, rs]), np.array([local.conv_len, local.ssm_len]))
    seg = list(segments) or [key_size, key_size, value_size]
    if min(conv_rows, elt, *seg) <= 0:
        raise ConfigError("conv_rows/segments/elt", (conv_rows, seg, elt), "positive ints")
    w_p = sum(seg)
    if remote.conv_len != conv_rows * w_p * elt or local.conv_len != ratio * remote.conv_len:
        raise LayoutError(
            "conv_len", (local.conv_len, remote.conv_len), f"D = {ratio} x P = {ratio} x rows x W_p x elt"
        )
    if local.ssm_len != ratio * remote.ssm_len:
        raise LayoutError("ssm_len", (local.ssm_len, remote.ssm_len), f"D = {ratio} x P")
    sizes = np.array(seg, dtype=np.int64)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = np.arange(conv_rows, dtype=np.int64)[:, None]
    p_elem = rows * w_p + offs[None, :]
    d_elem = p_elem * ratio + offset * sizes[None, :]
    loc = np.concatenate([(lc + d_elem * elt).reshape(-1), [ls + offset * (local.ssm_len // ratio)]])
    rem = np.concatenate([(rc + p_elem * elt).reshape(-1), [rs]])
    lens = np.concatenate([np.broadcast_to(sizes * elt, (conv_rows, len(seg))).reshape(-1), [remote.ssm_len]])
    return Descriptors(loc, rem, lens)


@dataclass(frozen=True)
class StateLayout:
    """Per-P-rank sizes of the conv row's sub-projections, needed when ``P_tp > D_tp``.

    One P rank's conv row is its TP shard of each sub-projection, back to back: for GDN
    ``[Q (sK) | K (sK) | V (sV)]`` (`gdn`), for Mamba2 ``[x | B | C]``. D's row holds ``ratio``
    P shards inside each sub-projection.

    Attributes:
        segments: Elements of each sub-projection in one P rank's row, in order.
        elt: Bytes per conv element.
    """

    segments: tuple[int, ...]
    elt: int

    def __post_init__(self) -> None:
        if not self.segments or min(*self.segments, self.elt) <= 0:
            raise ConfigError("state_layout", (self.segments, self.elt), "positive segment sizes and element size")

    @classmethod
    def gdn(cls, key_size: int, value_size: int, elt: int) -> StateLayout:
        """GDN's ``[Q | K | V]`` with ``sK = (nk / P_tp) * dk`` and ``sV = (nv / P_tp) * dv`` elements."""
        return cls((key_size, key_size, value_size), elt)

    def conv_rows(self, p_conv_len: int) -> int:
        """Rows of P's conv block of ``p_conv_len`` bytes.

        Raises:
            LayoutError: The length is not a whole number of rows.
        """
        row = sum(self.segments) * self.elt
        if p_conv_len % row:
            raise LayoutError("conv block_len", p_conv_len, f"a multiple of the conv row ({row} bytes)")
        return p_conv_len // row


def state_source_ranks(d_rank: int, p_tp: int, d_tp: int) -> list[int]:
    """P tp ranks whose state shards D rank ``d_rank`` assembles (``d*k + j``, ``k = P_tp / D_tp``).

    Raises:
        ConfigError: ``P_tp`` is not a multiple of ``D_tp`` (a state shard cannot be split further).
    """
    if p_tp < d_tp or p_tp % d_tp:
        raise ConfigError("prefill.tp_size", p_tp, f"a multiple of decode.tp_size={d_tp} with state (Mamba) groups")
    k = p_tp // d_tp
    return [d_rank * k + j for j in range(k)]


def pull_source_ranks(
    d_rank: int,
    p_tp: int,
    d_tp: int,
    heads: int,
    remote_request_id: str,
    *,
    attention: bool = True,
    state: bool = False,
) -> list[int]:
    """Every P tp rank (within one PP stage) D rank ``d_rank`` reads for a request, sorted.

    The union of the attention groups' head sources (`select_sources`) and, for a hybrid model,
    the state groups' sources (`state_source_ranks`). P evaluates the same function to count DONEs.
    """
    ranks: set[int] = set()
    if attention:
        ranks.update(s.p_rank for s in select_sources(d_rank, p_tp, d_tp, heads, remote_request_id))
    if state:
        ranks.update(state_source_ranks(d_rank, p_tp, d_tp))
    return sorted(ranks)


def source_fan_in(
    p_rank: int,
    p_tp: int,
    d_tp: int,
    heads: int,
    remote_request_id: str,
    *,
    attention: bool = True,
    state: bool = False,
) -> int:
    """How many D ranks read P tp rank ``p_rank`` for this request (each sends one DONE per PP stage rank)."""
    return sum(
        p_rank in pull_source_ranks(d, p_tp, d_tp, heads, remote_request_id, attention=attention, state=state)
        for d in range(d_tp)
    )


def tp_num_need_pulls(heads: int, p_tp: int, d_tp: int, *, use_mla: bool = False) -> int:
    """P ranks one D rank reads per PP stage for an attention group.

    ``max(1, H // D_tp) // max(1, H // P_tp)``; 1 for MLA. `select_sources` yields exactly this
    many P ranks for ``P_tp >= D_tp`` (one P rank for ``P_tp < D_tp``, which upstream refuses).

    Example: H=8, P8, D2 -> 4; H=4, P8, D2 -> 2; H=4, P16, D8 -> 1; H=32, P8, D4 -> 2.
    """
    if use_mla:
        return 1
    return max(1, max(1, heads // d_tp) // max(1, heads // p_tp))
