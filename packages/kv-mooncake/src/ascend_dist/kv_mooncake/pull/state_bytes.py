"""The bytes of a state (Mamba/GDN) group's block: tensor geometry, conv row layout, descriptors.

Runs in: D worker processes (and tests). No I/O, no threads, no torch.

A state group holds one block per request (a conv and an ssm tensor per layer). With
``ratio = P_tp / D_tp > 1`` D's conv row interleaves the sub-projections (GDN's Q, K and V) of
``ratio`` P ranks and its ssm state stacks theirs; `state_descriptors` builds the pieces of one P
rank's share. Which P ranks those are is `ascend_dist.kv_mooncake.pull.sources`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.kv_mooncake.core.descriptors import Descriptors

__all__ = ["StateGeom", "StateLayout", "state_descriptors"]


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
