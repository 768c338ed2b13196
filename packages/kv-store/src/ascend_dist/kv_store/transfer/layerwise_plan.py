"""Layer-wise planning: shared layer buffers, copy packets, H2D staggering, GVA addresses.

Runs in: worker processes (and the model runner for the buffer plan). Pure planning, tested against
worked examples (the package's test_layerwise_plan.py). They serve the memcache
GVA layer-wise path (`ascend_dist.kv_store.transfer.gva_layerwise`) and the model runner's shared buffers
(`ascend_dist.kv_store.vllm_buffers`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError

__all__ = [
    "LayerLayout",
    "build_layout",
    "gva_layer_copies",
    "physical_layer_index",
    "shared_buffer_layout",
    "split_packets",
    "stagger_us",
]

_MTP_RE = re.compile(r"mtp\.(?:layers\.)?(\d+)")
_LAYER_RE = re.compile(r"layers\.(\d+)")
_INT_RE = re.compile(r"(\d+)")


def physical_layer_index(name: str, base_layers: int) -> int:
    """Physical layer of a KV layer name: MTP layers follow the ``base_layers`` main layers.

    Examples (base 61): ``model.mtp.0.self_attn`` -> 61; ``model.layers.12.self_attn.attn`` -> 12.
    """
    if m := _MTP_RE.search(name):
        return base_layers + int(m.group(1))
    if m := _LAYER_RE.search(name) or _INT_RE.search(name):
        return int(m.group(1))
    return 0


@dataclass(frozen=True)
class LayerLayout:
    """Which logical layers share a physical buffer, and the save-before-load ordering."""

    num_shared_buffers: int
    prefetch_layers: int
    independent: tuple[int, ...]
    storage: tuple[tuple[int, ...], ...]
    prefetch_layer_map: dict[int, int]

    @property
    def has_reuse(self) -> bool:
        """Whether any slot holds more than one layer."""
        return bool(self.prefetch_layer_map)


def _independent(value: object, n: int) -> tuple[int, ...]:
    if value == "all":
        return tuple(range(n))
    if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        out = []
        for v in value:
            idx = v + n if v < 0 else v
            if not 0 <= idx < n:
                raise ConfigError("layerwise_independent_layers", v, f"layer indices in [-{n}, {n})")
            out.append(idx)
        return tuple(sorted(set(out)))
    raise ConfigError("layerwise_independent_layers", value, "a list of ints or 'all'")


def build_layout(num_layers: int, extra: dict[str, object] | None = None) -> LayerLayout:
    """Plan shared layer buffers.

    Example: 27 layers, 6 shared buffers -> slots ``[1,7,13,19,25]``, ``[2,8,14,20,26]``, ...; layer
    7 waits for layer 1's save before loading; 1 + 6 = 7 physical buffers.

    Raises:
        ConfigError: A bad ``layerwise_num_shared_buffers`` / ``layerwise_prefetch_layers`` /
            ``layerwise_independent_layers``.
    """
    extra = extra or {}
    shared = extra.get("layerwise_num_shared_buffers", num_layers)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
        raise ConfigError("layerwise_num_shared_buffers", shared, "an int >= 1")
    prefetch = extra.get("layerwise_prefetch_layers", min(shared, 8))
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ConfigError("layerwise_prefetch_layers", prefetch, "an int >= 1")
    independent = _independent(extra.get("layerwise_independent_layers", [0]), num_layers)
    reused = [i for i in range(num_layers) if i not in independent]
    if len(reused) <= shared:
        storage = tuple((i,) for i in range(num_layers))
        return LayerLayout(shared, prefetch, independent, storage, {})
    slots = tuple(tuple(reused[s::shared]) for s in range(shared))
    prefetch_map = {reused[j]: reused[j - shared] for j in range(shared, len(reused))}
    return LayerLayout(shared, prefetch, independent, tuple((i,) for i in independent) + slots, prefetch_map)


def shared_buffer_layout(
    num_layers: int, *, num_shared_buffers: int, independent_layers: Sequence[int] | str
) -> LayerLayout:
    """`build_layout` from the two settings (``num_shared_buffers`` 0 = a buffer per layer)."""
    extra: dict[str, object] = {"layerwise_independent_layers": independent_layers}
    if num_shared_buffers:
        extra["layerwise_num_shared_buffers"] = num_shared_buffers
    return build_layout(num_layers, extra)


def split_packets(
    gvas: Sequence[int], addrs: Sequence[int], sizes: Sequence[int], limit: int
) -> list[tuple[int, int, int]]:
    """Split copies larger than ``limit`` bytes, packet-index-major.

    Example, limit 4096, sizes ``[10000, 3000]``: (e0,+0,4096), (e1,+0,3000), (e0,+4096,4096),
    (e0,+8192,1808). ``limit <= 0`` keeps the copies whole.
    """
    if limit <= 0:
        return list(zip(gvas, addrs, sizes, strict=True))
    out: list[tuple[int, int, int]] = []
    k = 0
    while True:
        emitted = False
        for g, a, s in zip(gvas, addrs, sizes, strict=True):
            off = k * limit
            if off < s:
                out.append((g + off, a + off, min(limit, s - off)))
                emitted = True
        if not emitted:
            return out
        k += 1


def stagger_us(tp_rank: int, layer: int, tp_size: int, step_us: int) -> int:
    """Busy-wait before a layer's H2D copy so TP ranks do not all start at once."""
    return ((tp_rank + layer) % tp_size) * step_us


def gva_layer_copies(
    *,
    bases: Sequence[int],
    block_lens: Sequence[int],
    strides: Sequence[int],
    layer_offsets: Sequence[int],
    layer: int,
    block_id: int,
    block_gva: int,
) -> tuple[list[int], list[int], list[int]]:
    """Device addresses, sizes and global addresses of one layer of one block.

    Layers are packed back to back in the block's object. Example: lens ``[10,20,30]``, strides
    ``[100,200,300]``, bases ``[1000,2000,3000]``, offsets ``[0,2,3]``, block 2, gva 500: layer 0 ->
    ``([1200, 2400], [10, 20], [500, 510])``; layer 1 -> ``([3600], [30], [530])``.
    """
    start, end = layer_offsets[layer], layer_offsets[layer + 1]
    before = sum(block_lens[:start])
    addrs, sizes, gvas = [], [], []
    for e in range(start, end):
        addrs.append(bases[e] + block_id * strides[e])
        sizes.append(block_lens[e])
        gvas.append(block_gva + before + sum(block_lens[start:e]))
    return addrs, sizes, gvas
