"""Canonical block views of KV-cache tensors.

Runs in: worker processes, at `register_kv_caches`. Handles tensors; torch is imported lazily.

Whatever the layout (split K/V, MLA, quantised data+scale, Mamba states, ...), every part a layer
registered becomes an int8 view ``(num_blocks, row_bytes)`` whose row b holds logical block b's
bytes of that part. Copies then need only ``base_ptr + b * row_stride`` and ``copy_bytes``.

The views are built over the raw byte storage from each tensor's own storage offset, strides and
shape, never from the storage's size: allocations are over-allocated by 2 MiB and sliced, so the
storage is larger than the blocks and the tensor may start at a non-zero offset. The views alias
the original memory (writing through a view changes the tensor); nothing is copied.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.common.regions import tensor_storage_key

if TYPE_CHECKING:
    import torch

__all__ = ["BlockView", "canonical_block_views", "dedup_views", "generic_block_view", "logical_block_bytes"]


@dataclass(frozen=True, eq=False)
class BlockView:
    """One canonical view: row b of `tensor` is logical block b of one cache part.

    Attributes:
        tensor: int8 view of shape ``(num_blocks, row_bytes)`` aliasing the cache memory.
        copy_bytes: bytes to copy per block (the unpadded page share of this part).
        row_stride: bytes between consecutive rows.
        base_ptr: address of row 0.
    """

    tensor: torch.Tensor
    copy_bytes: int
    row_stride: int
    base_ptr: int

    @property
    def row_bytes(self) -> int:
        """Width of one row in bytes (``>= copy_bytes``)."""
        return int(self.tensor.shape[1])

    @property
    def dedup_key(self) -> tuple[int, int, int]:
        """``(base_ptr, row_stride, row_bytes)``: equal for views of the same bytes."""
        return self.base_ptr, self.row_stride, self.row_bytes


def logical_block_bytes(tensor: torch.Tensor) -> int:
    """``prod(shape[1:]) * element_size``: the bytes of one dim-0 row of `tensor`."""
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _check_args(parts: Sequence[torch.Tensor], num_blocks: int, page_bytes: int) -> list[int]:
    """Validate the inputs; return each part's logical block bytes."""
    import torch

    for name, value in (("num_blocks", num_blocks), ("unpadded_page_bytes", page_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(name, value, "a positive integer")
    if not parts:
        raise LayoutError("parts", [], "at least one cache tensor")
    sizes = []
    for index, part in enumerate(parts):
        if not isinstance(part, torch.Tensor) or part.dim() == 0:
            raise LayoutError(f"parts[{index}]", type(part).__name__, "a tensor with a block dimension")
        size = logical_block_bytes(part)
        if size <= 0:
            raise LayoutError(f"parts[{index}]", tuple(part.shape), "non-empty blocks (block bytes > 0)")
        sizes.append(size)
    return sizes


def _full_view_index(parts: Sequence[torch.Tensor], sizes: list[int], num_blocks: int, page: int) -> int | None:
    """The first part (by decreasing block bytes) that provably covers every other part, if any.

    Shape alone is not enough: a K tensor with extra physical rows can look as long as a K+V view,
    so the other parts must live in the same storage inside the candidate's first block.
    """
    for index in sorted(range(len(parts)), key=lambda i: -sizes[i]):
        candidate, size = parts[index], sizes[index]
        if page % size or candidate.shape[0] < num_blocks * (page // size):
            continue
        start, key = candidate.data_ptr(), tensor_storage_key(candidate)
        inside = all(
            tensor_storage_key(other) == key
            and start <= other.data_ptr()
            and other.data_ptr() + sizes[j] <= start + size
            for j, other in enumerate(parts)
            if j != index
        )
        if inside:
            return index
    return None


def _payload_is_contiguous(part: torch.Tensor) -> bool:
    """True when the dims after dim 0 are row-major contiguous (dims of size 1 may have any stride)."""
    expected = 1
    for dim in range(part.dim() - 1, 0, -1):
        if part.shape[dim] > 1 and part.stride(dim) != expected:
            return False
        expected *= part.shape[dim]
    return True


def _byte_view(index: int, part: torch.Tensor, size: int, factor: int, num_blocks: int) -> torch.Tensor:
    """Shape and byte-size checks, then the int8 ``(num_blocks, size * factor)`` view over raw storage."""
    import torch

    field = f"parts[{index}]"
    rows = num_blocks * factor
    if part.shape[0] < rows:
        raise LayoutError(field, tuple(part.shape), f"dim 0 >= num_blocks*f = {rows}: too few physical blocks")
    if not _payload_is_contiguous(part):
        strides = tuple(part.stride())
        raise LayoutError(field, strides, "row-major inner dims: block payload is non-contiguous")
    elt = part.element_size()
    stride = part.stride(0) * elt
    if stride < size:
        raise LayoutError(field, stride, f"a row stride >= block bytes {size}: blocks overlap")
    if factor > 1 and stride != size:
        expected = f"row stride == block bytes {size} when f={factor}: cannot coalesce non-contiguous layout"
        raise LayoutError(field, stride, expected)
    raw = torch.empty(0, dtype=torch.int8, device=part.device).set_(part.untyped_storage())
    # as_strided checks the view against the storage's bounds (set_ with a geometry would grow it).
    return raw.as_strided((num_blocks, size * factor), (stride * factor, 1), part.storage_offset() * elt)


def canonical_block_views(parts: Sequence[torch.Tensor], num_blocks: int, unpadded_page_bytes: int) -> list[BlockView]:
    """Build the canonical block views of one layer.

    1. ``L_i = prod(shape[1:]) * element_size`` per part.
    2. Full-view preference: in decreasing ``L_i``, the first part p with ``U % L_p == 0`` whose
       storage holds every other part's first block inside ``[ptr(p), ptr(p) + L_p)`` and with
       ``shape[0] >= num_blocks * U / L_p`` is used alone.
    3. Otherwise all parts, with ``f = U / sum(L_i)`` (must divide exactly).
    4. One view per selected part: ``(num_blocks, L * f)`` with row stride ``S * f``; copy ``L * f``.

    Args:
        parts: the layer's cache tensors in tuple order (K, V, scales, states...).
        num_blocks: logical blocks managed by the KV-cache manager (extra physical rows are ignored).
        unpadded_page_bytes: the KV-cache spec's page size without padding (Mamba: the sum of state bytes).

    Returns:
        The views, in part order.

    Raises:
        ConfigError: `num_blocks` or `unpadded_page_bytes` is not positive.
        LayoutError: no part, a part with empty blocks, a page size that is not a multiple of the
            parts' block bytes, "too few physical blocks", "block payload is non-contiguous",
            "blocks overlap" or "cannot coalesce non-contiguous layout".
    """
    sizes = _check_args(parts, num_blocks, unpadded_page_bytes)
    full = _full_view_index(parts, sizes, num_blocks, unpadded_page_bytes)
    if full is not None:
        selected = [full]
        factor = unpadded_page_bytes // sizes[full]
    else:
        total = sum(sizes)
        if unpadded_page_bytes % total:
            expected = f"a multiple of the parts' block bytes {sizes} (sum {total})"
            raise LayoutError("unpadded_page_bytes", unpadded_page_bytes, expected)
        selected = list(range(len(parts)))
        factor = unpadded_page_bytes // total
    views = []
    for index in selected:
        view = _byte_view(index, parts[index], sizes[index], factor, num_blocks)
        views.append(BlockView(view, sizes[index] * factor, int(view.stride(0)), view.data_ptr()))
    return views


def generic_block_view(tensor: torch.Tensor, num_blocks: int, unpadded_page_bytes: int) -> BlockView:
    """The upstream single-tensor path: one row per block, copying only the unpadded page.

    The row stride is the tensor's own dim-0 stride, which exceeds the row width when the tensor is
    "packed" (padded pages).

    Args:
        tensor: ``[num_blocks, ...]`` cache tensor (extra physical rows allowed).
        num_blocks: logical blocks.
        unpadded_page_bytes: bytes to copy per block (``<=`` the row width).

    Returns:
        The view with ``copy_bytes = unpadded_page_bytes``.

    Raises:
        ConfigError: `num_blocks` or `unpadded_page_bytes` is not positive.
        LayoutError: the page exceeds the row width, or a check of `canonical_block_views` fails.
    """
    (size,) = _check_args([tensor], num_blocks, unpadded_page_bytes)
    if unpadded_page_bytes > size:
        raise LayoutError("unpadded_page_bytes", unpadded_page_bytes, f"at most the row width {size}")
    view = _byte_view(0, tensor, size, 1, num_blocks)
    return BlockView(view, unpadded_page_bytes, int(view.stride(0)), view.data_ptr())


def dedup_views(views: Iterable[BlockView]) -> list[BlockView]:
    """Drop views of bytes already covered, keyed by (data pointer, row stride, row bytes).

    Layers that share KV (aliasing the same bytes) then register and copy once. Keying by storage
    pointer instead would lose sibling tensors of one allocation (an upstream defect of simple offload).

    Args:
        views: views in registration order.

    Returns:
        The first view of each key, in order.
    """
    seen: set[tuple[int, int, int]] = set()
    unique: list[BlockView] = []
    for view in views:
        if view.dedup_key not in seen:
            seen.add(view.dedup_key)
            unique.append(view)
    return unique
