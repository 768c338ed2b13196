"""The engine's KV tensors as the workers register them: split, labelled, measured.

Runs in: worker processes (all three connectors) and the synthetic instances. torch only; the
vLLM adapters (`ascend_dist.kv_mooncake.core.vllm_glue`) say whether the tensors are vLLM's native
per-layer views and which layout vLLM resolved, and `label_kv_caches` does the rest, so the same
code runs without vLLM (tests, the P child processes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ascend_dist.common.errors import LayoutError
from ascend_dist.kv_mooncake.core.blocks import TensorGeom
from ascend_dist.kv_mooncake.core.kv_geometry import CacheLayout, block_geometry

__all__ = ["label_kv_caches", "layer_axes", "state_geometry", "tensor_geometry", "token_rows"]


def label_kv_caches(
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]], *, native: bool = False, layout_name: str = ""
) -> tuple[dict[str, list[torch.Tensor]], CacheLayout]:
    """Split the engine's layer -> cache dict into tensors per layer and label their axes.

    * a ``[2, B, N, H, D]`` tensor (legacy CUDA vLLM, any stride order) -> its K and V halves, ``BNHD``;
    * with ``native`` (vLLM >= 0.32) a single 4-D tensor -> vLLM's ``[B, H, N, C]`` view, ``BHNC``;
    * a tuple or list (vllm-ascend's K/V or nope/rope, Mamba's states) -> as it is, labelled by rank.

    Args:
        kv_caches: Layer name -> tensor or sequence of tensors.
        native: The tensors come from vLLM >= 0.32's generic allocation (``vllm.v1.kv_cache_layout``).
        layout_name: vLLM's resolved ``kv_cache_layout`` (kept only when some layer is a native view).

    Returns:
        The tensors per layer and their `CacheLayout`.
    """
    parts: dict[str, list[torch.Tensor]] = {}
    axes: dict[str, str] = {}
    for name, value in kv_caches.items():
        if isinstance(value, torch.Tensor) and value.dim() == 5 and value.shape[0] == 2:
            parts[name], axes[name] = [value[0], value[1]], "BNHD"
        elif isinstance(value, torch.Tensor):
            parts[name] = [value]
            if native and value.dim() == 4:
                axes[name] = "BHNC"
        else:
            parts[name] = list(value)
    named = any(a == "BHNC" for a in axes.values())
    return parts, CacheLayout(name=layout_name if named else "", axes=axes)


def tensor_geometry(name: str, t: torch.Tensor, num_blocks: int, layout: CacheLayout | None = None) -> TensorGeom:
    """Geometry of one attention tensor, from its strides (see `kv_geometry.block_geometry`).

    Raises:
        LayoutError: The tensor is not one the connector can serve; the error names the layout.
    """
    lay = layout or CacheLayout()
    axes = lay.axes_of(name, t.dim())
    return block_geometry(
        name,
        axes=axes,
        shape=tuple(t.shape),
        strides=tuple(t.stride()),
        element_size=t.element_size(),
        base=t.data_ptr(),
        num_blocks=num_blocks,
        layout=lay.name,
    )


def state_geometry(name: str, t: torch.Tensor, num_blocks: int) -> TensorGeom:
    """Geometry of a state (Mamba conv or ssm) tensor ``[blocks, ...]``: one opaque block of bytes.

    Raises:
        LayoutError: Wrong block count, or a block that is not contiguous.
    """
    if t.dim() < 2 or t.shape[0] != num_blocks:
        raise LayoutError(f"{name}.shape", tuple(t.shape), f"[num_blocks={num_blocks}, ...] (a state tensor)")
    if not t[0].is_contiguous():
        raise LayoutError(f"{name}.stride", t.stride(), "each state block contiguous")
    block_len = t[0].numel() * t.element_size()
    return TensorGeom(t.data_ptr(), block_len, t.stride(0) * t.element_size(), 1, 1, block_len)


def token_rows(t: torch.Tensor, axes: str) -> torch.Tensor:
    """A ``[blocks, tokens, heads, content]`` view of ``t`` (no copy): the order pattern code indexes.

    ``BHNC`` (vLLM's view) is permuted, ``BND`` gets a head axis, ``BNHD`` is ``t`` itself. For a
    token-major tensor the view's element order inside a block is the physical order.
    """
    if axes == "BHNC":
        return t.permute(0, 2, 1, 3)
    if axes == "BND" or t.dim() == 3:
        return t.unsqueeze(2)
    return t


def layer_axes(layout: CacheLayout | None, name: str, tensors: Sequence[torch.Tensor]) -> list[str]:
    """The logical axes of each tensor of a layer."""
    lay = layout or CacheLayout()
    return [lay.axes_of(name, t.dim()) for t in tensors]
