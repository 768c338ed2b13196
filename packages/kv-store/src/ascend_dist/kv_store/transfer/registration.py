"""KV-cache buffer registration: tensors -> per-group (base, block_len, stride) entries + regions.

Runs in: worker processes, once at ``register_kv_caches``.

Accepted per-layer cache shapes: a tensor whose dim 0 is ``num_blocks`` (or a multiple: kernel
blocks per logical block), a tuple/list of such tensors (split K/V), or vLLM's stacked
``[2, num_blocks, ...]`` tensor (split into its K and V halves). Layers are ordered by their layer
index, then name, so every rank derives the same entry order (the byte layout of every pool object).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ascend_dist.common.errors import LayoutError
from ascend_dist.kv_store.keys.token_db import GroupBuffers

__all__ = ["Registration", "build_registration", "layer_index"]

_LAYER_RE = re.compile(r"layers\.(\d+)")
_INT_RE = re.compile(r"(\d+)")


def layer_index(name: str) -> int:
    """Physical layer index of a KV layer name (``model.layers.12.self_attn.attn`` -> 12)."""
    m = _LAYER_RE.search(name) or _INT_RE.search(name)
    return int(m.group(1)) if m else 0


@dataclass(frozen=True)
class Registration:
    """Per-group buffers and the merged memory regions to register with the store."""

    groups: tuple[GroupBuffers, ...]
    regions: tuple[tuple[int, int], ...]


def _entries(value: object, num_blocks: int, name: str) -> list[torch.Tensor]:
    tensors = list(value) if isinstance(value, tuple | list) else [value]
    out: list[torch.Tensor] = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise LayoutError(name, type(t).__name__, "a tensor or a tuple of tensors")
        if t.shape[0] == 2 and t.dim() > 1 and t.shape[1] == num_blocks and num_blocks != 2:
            out.extend([t[0], t[1]])
        else:
            out.append(t)
    for t in out:
        if t.shape[0] % num_blocks:
            raise LayoutError(name, tuple(t.shape), f"dim 0 a multiple of num_blocks={num_blocks}")
    return out


def build_registration(
    kv_caches: Mapping[str, object], num_blocks: int, group_layers: Sequence[Sequence[str]] | None = None
) -> Registration:
    """Describe the KV caches for the pool.

    Args:
        kv_caches: Layer name -> cache tensor(s).
        num_blocks: Logical blocks per cache (``kv_cache_config.num_blocks``).
        group_layers: Layer names per KV-cache group; default: every layer in group 0.

    Returns:
        Per-group entries and the regions (one per underlying storage, merged).

    Raises:
        LayoutError: A cache has an unsupported shape or a group names an unknown layer.
    """
    groups = [list(kv_caches)] if group_layers is None else [list(g) for g in group_layers]
    spans: dict[int, list[int]] = {}
    out_groups: list[GroupBuffers] = []
    for names in groups:
        bases: list[int] = []
        lens: list[int] = []
        strides: list[int] = []
        ordered = sorted(names, key=lambda n: (layer_index(n), n))
        offsets: list[int] = []
        for name in ordered:
            offsets.append(len(bases))
            if name not in kv_caches:
                raise LayoutError("group layer", name, f"one of the registered layers ({len(kv_caches)})")
            for t in _entries(kv_caches[name], num_blocks, name):
                scale = t.shape[0] // num_blocks
                block_len = t[0].numel() * t.element_size() * scale
                stride = t.stride(0) * t.element_size() * scale
                bases.append(t.data_ptr())
                lens.append(block_len)
                strides.append(stride)
                storage = t.untyped_storage()
                start, end = t.data_ptr(), t.data_ptr() + (num_blocks - 1) * stride + block_len
                key = storage.data_ptr()
                span = spans.setdefault(key, [start, end])
                span[0], span[1] = min(span[0], start), max(span[1], end)
        offsets.append(len(bases))
        out_groups.append(
            GroupBuffers(tuple(bases), tuple(lens), tuple(strides), num_blocks, tuple(ordered), tuple(offsets))
        )
    regions = tuple(sorted((s, e - s) for s, e in spans.values()))
    return Registration(tuple(out_groups), regions)
