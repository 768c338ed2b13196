"""State (Mamba/GDN) layers of the synthetic model: TP-sharded conv and ssm tensors with known contents.

Runs in: the ``pd`` scenario, the tests and the P child process (with `synthetic`). A state layer
holds, per block, a conv state ``[rows, W]`` and an ssm state ``[value_heads, value_dim,
key_dim]``. The conv row of the full model is ``[Q (nk*dk) | K (nk*dk) | V (nv*dv)]``; tp rank
``r`` of ``tp`` holds the ``r``-th slice of each part, back to back (``W = (2*nk*dk + nv*dv) / tp``),
and value heads ``[r*nv/tp, (r+1)*nv/tp)`` of the ssm state, as vLLM shards GDN layers. Contents
are a function of (seed, layer, part, row, *global* column or head), so D verifies the
assembly of ``P_tp / D_tp`` P shards into its own shard byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.pull.state_bytes import StateLayout

__all__ = ["StateShape"]


@dataclass(frozen=True)
class StateShape:
    """Sizes of a state layer of the whole model (before TP sharding).

    Attributes:
        conv_rows: Rows of the conv state (kernel - 1).
        key_heads: ``nk``.
        key_dim: ``dk``.
        value_heads: ``nv``.
        value_dim: ``dv``.
    """

    conv_rows: int = 3
    key_heads: int = 4
    key_dim: int = 4
    value_heads: int = 4
    value_dim: int = 8

    def check(self, tp: int) -> None:
        """Raise `ConfigError` unless both head counts divide over ``tp`` ranks."""
        if self.key_heads % tp or self.value_heads % tp:
            raise ConfigError("state heads", (self.key_heads, self.value_heads), f"multiples of tp_size={tp}")

    def key_size(self, tp: int) -> int:
        """Q (and K) elements per conv row on one rank."""
        return self.key_heads // tp * self.key_dim

    def value_size(self, tp: int) -> int:
        """V elements per conv row on one rank."""
        return self.value_heads // tp * self.value_dim

    def conv_width(self, tp: int) -> int:
        """Elements of one rank's conv row."""
        return 2 * self.key_size(tp) + self.value_size(tp)

    def layout(self, p_tp: int, elt: int = 2) -> StateLayout:
        """The `StateLayout` D needs to assemble its shard from ``p_tp`` P ranks."""
        return StateLayout.gdn(self.key_size(p_tp), self.value_size(p_tp), elt)

    def empty(self, num_blocks: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed int16 ``(conv, ssm)`` tensors of one rank."""
        self.check(tp)
        conv = torch.zeros(num_blocks, self.conv_rows, self.conv_width(tp), dtype=torch.int16)
        ssm = torch.zeros(num_blocks, self.value_heads // tp, self.value_dim, self.key_dim, dtype=torch.int16)
        return conv, ssm

    def _global_columns(self, rank: int, tp: int) -> torch.Tensor:
        sk, sv, kt = self.key_size(tp), self.value_size(tp), self.key_heads * self.key_dim
        q = rank * sk + torch.arange(sk)
        return torch.cat([q, kt + q, 2 * kt + rank * sv + torch.arange(sv)])

    def contents(self, seed: int, layer: int, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expected ``(conv [rows, W], ssm [nv/tp, dv, dk])`` of one rank for a request's state."""
        cols = self._global_columns(rank, tp)
        rows = torch.arange(self.conv_rows)
        conv = seed * 1_000_003 + layer * 7_919 + rows[:, None] * 15_485_863 + cols[None, :] * 1_299_709
        nvr = self.value_heads // tp
        heads = rank * nvr + torch.arange(nvr)
        inner = torch.arange(self.value_dim * self.key_dim).reshape(self.value_dim, self.key_dim)
        ssm = seed * 1_000_003 + layer * 7_919 + 104_729 + heads[:, None, None] * 1_299_709 + inner[None]
        return (conv % 32_749).to(torch.int16), (ssm % 32_749).to(torch.int16)
