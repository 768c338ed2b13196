"""The synthetic instances' attention caches in each engine's layout, built the way that engine builds them.

Runs in: the synthetic instances (`synthetic`, `layerwise.synthetic`), so the tests, the demo
and the P child processes. torch only (no vLLM): the layouts of vLLM >= 0.32 are rebuilt from
their rule, one flat buffer viewed with ``as_strided`` per layer.

* ``""``: a tuple (K, V) of ``[blocks, tokens, heads, dim]`` per layer (MLA: nope, rope), as
  vllm-ascend hands them;
* ``legacy-NHD`` / ``legacy-HND``: one ``[2, blocks, tokens, heads, dim]`` tensor per layer, stored
  ``[2][B][N][H][D]`` / ``[2][B][H][N][D]`` (MLA: one ``[blocks, tokens, dim]``), as CUDA vLLM
  before 0.32;
* a `NATIVE_LAYOUTS` name: one ``[B, H, N, C]`` view per layer, K and V fused in ``C`` (MLA:
  ``H = 1``, ``C`` both parts), stored in the name's order over ``[L, B, H, N, C]``, as vLLM
  >= 0.32 (``KVCacheLayout``).

`AttentionCaches.rows` gives every tensor as a ``[blocks, tokens, heads, dim]`` view, the order
the pattern code indexes, whatever the storage order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ascend_dist.common.errors import ConfigError

__all__ = ["LAYOUTS", "NATIVE_LAYOUTS", "AttentionCaches", "build_attention_caches", "layout_strides"]

NATIVE_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""vLLM's ``KVCacheLayout`` members: each name is the physical order of the logical ``[L, B, H, N, C]``."""

LAYOUTS = ("", "legacy-NHD", "legacy-HND", *NATIVE_LAYOUTS)


def layout_strides(order: str, sizes: Mapping[str, int]) -> dict[str, int]:
    """Dense strides (elements) of axes stored in ``order`` (outermost first), e.g. ``"LBHNC"``."""
    strides: dict[str, int] = {}
    step = 1
    for axis in reversed(order):
        strides[axis] = step
        step *= sizes[axis]
    return strides


@dataclass(frozen=True)
class AttentionCaches:
    """One rank's attention caches.

    Attributes:
        raw: Layer name -> what the engine hands ``register_kv_caches``.
        rows: Layer name -> each of its tensors as a ``[blocks, tokens, heads, dim]`` view.
    """

    raw: dict[str, torch.Tensor | tuple[torch.Tensor, ...]]
    rows: dict[str, tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class _Shape:
    blocks: int
    tokens: int
    heads: int
    dims: tuple[int, ...]
    mla: bool


def _native(order: str, names: Sequence[str], s: _Shape) -> AttentionCaches:
    sizes = {"L": len(names), "B": s.blocks, "H": s.heads, "N": s.tokens, "C": sum(s.dims)}
    strides = layout_strides(order, sizes)
    buf = torch.zeros(len(names) * s.blocks * s.heads * s.tokens * sum(s.dims), dtype=torch.int16)
    view = torch.as_strided(buf, tuple(sizes[a] for a in "LBHNC"), tuple(strides[a] for a in "LBHNC"))
    raw: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    rows: dict[str, tuple[torch.Tensor, ...]] = {}
    for i, name in enumerate(names):
        raw[name] = view[i]
        rows[name] = (view[i].permute(0, 2, 1, 3),)
    return AttentionCaches(raw, rows)


def _legacy(layout: str, names: Sequence[str], s: _Shape) -> AttentionCaches:
    raw: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    rows: dict[str, tuple[torch.Tensor, ...]] = {}
    for name in names:
        if s.mla:
            t = torch.zeros(s.blocks, s.tokens, sum(s.dims), dtype=torch.int16)
            raw[name], rows[name] = t, (t.unsqueeze(2),)
            continue
        if layout == "legacy-HND":  # inside each K/V block the heads come before the tokens
            t = torch.zeros(2, s.blocks, s.heads, s.tokens, s.dims[0], dtype=torch.int16).permute(0, 1, 3, 2, 4)
        else:
            t = torch.zeros(2, s.blocks, s.tokens, s.heads, s.dims[0], dtype=torch.int16)
        raw[name], rows[name] = t, (t[0], t[1])
    return AttentionCaches(raw, rows)


def build_attention_caches(
    layout: str,
    names: Sequence[str],
    *,
    blocks: int,
    tokens: int,
    heads: int,
    dims: Sequence[int],
    mla: bool = False,
) -> AttentionCaches:
    """The attention caches of ``names`` on one rank.

    Args:
        layout: One of `LAYOUTS`.
        names: The rank's attention layers, in order.
        blocks: Blocks per tensor (kernel blocks when the kernel block is smaller).
        tokens: Tokens per (kernel) block.
        heads: KV heads on this rank (1 for MLA).
        dims: Element width of each part (K and V; MLA nope and rope).
        mla: An MLA cache.

    Raises:
        ConfigError: An unknown layout.
    """
    if layout not in LAYOUTS:
        raise ConfigError("model.layout", layout, f"one of {LAYOUTS}")
    shape = _Shape(blocks, tokens, heads, tuple(dims), mla)
    if layout in NATIVE_LAYOUTS:
        return _native(layout, names, shape)
    if layout:
        return _legacy(layout, names, shape)
    storage = torch.zeros(sum(blocks * tokens * heads * d for d in dims) * len(names), dtype=torch.int16)
    raw: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {}
    rows: dict[str, tuple[torch.Tensor, ...]] = {}
    offset = 0
    for name in names:
        parts = []
        for d in dims:
            n = blocks * tokens * heads * d
            parts.append(storage[offset : offset + n].view(blocks, tokens, heads, d))
            offset += n
        raw[name] = rows[name] = tuple(parts)
    return AttentionCaches(raw, rows)
