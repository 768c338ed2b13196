"""The all-to-all "head -> token" rearrangement of P_tp > D_tp.

Runs in: P worker processes, on the forward thread inside ``save_kv_layer`` (a collective: every
member of the group calls it for the same layer in the same order, which the shared scheduler
output guarantees).

Each of the ``r`` P ranks feeding one D rank holds every token of a block but only ``h`` of D's
``r·h`` heads. After the exchange each holds **all heads of a 1/r token slice** of every block,
one contiguous byte range of D's block, so it writes one piece per block instead of ``b`` tiny
strided ones:

1. gathered ``[n·b, h, dim]`` -> view ``[n, r, b/r, h, dim]`` -> swap the first two axes (`chunk_major`);
2. all-to-all over the group: part ``j`` goes to member ``j``;
3. received ``[r, n·b/r, h·dim]`` -> swap the first two axes -> ``[n·b, h, dim]`` (`rearrange_output`).

On the CPU the exchange runs over a gloo group. gloo's ``all_to_all_single`` rejects int16 and
bfloat16 tensors ("Invalid scalar type", measured with torch 2.14), so `GlooAllToAll` exchanges a
uint8 view of the same bytes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ascend_dist.common.errors import ConfigError

__all__ = ["AllToAll", "GlooAllToAll", "chunk_major", "rearrange_output"]


class AllToAll(Protocol):
    """An equal-split all-to-all over the P ranks that feed one D rank."""

    @property
    def size(self) -> int:
        """Group size (``pd_head_ratio``)."""
        ...

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """Send the ``j``-th ``1/size`` of ``send`` (dim 0) to member ``j``; return what arrived, source-major."""
        ...


def chunk_major(x: torch.Tensor, ratio: int, block_size: int) -> torch.Tensor:
    """Step 1: ``[n·b, h, dim]`` -> token-slice-major ``[n·b, h, dim]`` (slice j of every block together).

    Raises:
        ConfigError: ``block_size`` is not a multiple of ``ratio`` or ``x`` is not whole blocks.
    """
    if ratio < 1 or block_size % ratio:
        raise ConfigError("block_size", block_size, f"a multiple of pd_head_ratio={ratio}")
    if x.dim() != 3 or x.shape[0] % block_size:
        raise ConfigError("x.shape", tuple(x.shape), f"[blocks*{block_size}, heads, dim]")
    n = x.shape[0] // block_size
    view = x.reshape(n, ratio, block_size // ratio, x.shape[1], x.shape[2])
    return view.transpose(0, 1).contiguous().reshape(x.shape)


def rearrange_output(out: torch.Tensor, ratio: int, heads: int) -> torch.Tensor:
    """Step 3: received ``[r·m, h, dim]`` (source-major) -> ``[m, r·h, dim]`` = D's head order.

    Raises:
        ConfigError: ``out.shape[0]`` is not divisible by ``ratio``.
    """
    if out.shape[0] % ratio:
        raise ConfigError("out.shape[0]", out.shape[0], f"a multiple of pd_head_ratio={ratio}")
    m = out.shape[0] // ratio
    return out.reshape(ratio, m, -1).transpose(0, 1).contiguous().reshape(m, ratio * heads, -1)


class GlooAllToAll:
    """`AllToAll` over a torch.distributed (gloo) group, exchanging raw bytes."""

    def __init__(self, group: Any = None) -> None:
        """Wrap a process group (None: the default group)."""
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._size = dist.get_world_size(group)

    @property
    def size(self) -> int:
        """Group size."""
        return self._size

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """All-to-all of equal parts along dim 0 (bytes, so any dtype works on gloo)."""
        src = send.contiguous()
        flat = src.view(torch.uint8).reshape(-1) if src.element_size() > 1 else src.reshape(-1).view(torch.uint8)
        out = torch.empty_like(flat)
        self._dist.all_to_all_single(out, flat, group=self._group)
        return out.view(src.dtype).reshape(src.shape)
